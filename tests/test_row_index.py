"""The row index of stores whose KV heads hold different rows (unicache_core/kv/row_index.py): a packed bitmap of each
head's rows over the span they were chosen from, or an int32 list where that is cheaper; the bytes are the real
tensors' bytes, the byte models agree with them, and the indices decode to what the stores named before."""

from __future__ import annotations

import pytest
import torch

from unicache_core.compression.family import FULL_BITS, JointChoice, QuantGeometry, Segment
from unicache_core.compression.ops import compress_rows, evict, evicted_bytes, quantized_bytes, rows_for_bytes
from unicache_core.kv.index_runs import runs_index
from unicache_core.kv.quantized_store import QuantizedStore
from unicache_core.kv.row_index import (
    RowIndex,
    bitmap_bytes,
    list_bytes,
    merge_spans,
    pack_bits,
    row_index_bytes,
    span_positions,
    unpack_bits,
)
from unicache_core.kv.segmented_cache import SegmentedLayer
from unicache_core.kv.stores import EvictedStore, FullStore
from unicache_core.kv.token_types import TokenType as TT

H, D = 2, 32
#: A span of three runs (rows of other types appended in between): 300 rows.
SPAN = ((10, 100), (150, 50), (400, 150))


def _selection(span, n: int, seed: int, heads: int = H) -> torch.Tensor:
    """``[heads, n]`` distinct append indices per head inside ``span``, ascending."""
    rows = runs_index(span).long()
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.sort(rows[torch.randperm(rows.numel(), generator=gen)[:n]]).values for _ in range(heads)])


def _real_bytes(index: RowIndex) -> int:
    return sum(t.numel() * t.element_size() for t in index.tensors())


@pytest.mark.parametrize("n", [0, 1, 7, 64, 150, 299, 300])
@pytest.mark.parametrize("seed", [0, 1])
def test_round_trip_of_random_per_head_selections(n: int, seed: int) -> None:
    index = _selection(SPAN, n, seed)
    rows = RowIndex.encode(index, SPAN)
    assert rows.decode().dtype == torch.int32 and torch.equal(rows.decode().long(), index)
    assert (rows.num_heads, rows.rows, rows.span) == (H, n, SPAN)
    assert rows.nbytes() == _real_bytes(rows) == rows.nominal_bytes() == row_index_bytes(H, n, 300)
    if 0 < n and 2 * 38 <= list_bytes(H, n):  # 300 rows: a 38 B bitmap per head
        assert rows.encoding == "bitmap" and rows.bitmap is not None and rows.bitmap.dtype == torch.uint8
        assert tuple(rows.bitmap.shape) == (H, 38) and rows.listed is None


def test_the_bitmap_is_the_rows_bits_little_endian() -> None:
    rows = RowIndex.encode(torch.tensor([[10, 12, 159], [11, 12, 13]]), ((10, 8), (150, 10)))
    assert rows.encoding == "bitmap"
    assert rows.bitmap.tolist() == [[0b00000101, 0, 0b00000010], [0b00001110, 0, 0]]  # 18 bits, 3 bytes
    mask = torch.rand(3, 21) > 0.5
    assert torch.equal(unpack_bits(pack_bits(mask), 21), mask)
    assert span_positions(((10, 8), (150, 10)), torch.tensor([10, 17, 18, 150, 159, 160])).tolist() == [
        0, 7, -1, 8, 17, -1,
    ]  # fmt: skip


def test_every_row_one_row_and_no_row() -> None:
    span = ((0, 20), (30, 5))
    every = RowIndex.encode(runs_index(span).long().expand(H, -1), span)
    assert every.encoding == "bitmap" and every.nbytes() == H * 4 and torch.equal(every.decode()[1], runs_index(span))
    one = RowIndex.encode(torch.tensor([[34], [0]]), span)  # 4 B either way: the bitmap
    assert one.encoding == "bitmap" and one.nbytes() == H * 4 and one.decode().tolist() == [[34], [0]]
    one = RowIndex.encode(torch.tensor([[549], [10]]), SPAN)  # a 300-row span: the list
    assert one.encoding == "list" and one.nbytes() == H * 4 and one.decode().tolist() == [[549], [10]]
    none = RowIndex.encode(torch.zeros(H, 0, dtype=torch.long), span)
    assert none.nbytes() == 0 and tuple(none.decode().shape) == (H, 0)


def test_the_cheaper_encoding_is_kept() -> None:
    """1% of a 20K-row span: the list (80 B per head) is cheaper than the bitmap (2,500 B); 20%: the bitmap."""
    span = ((0, 20000),)
    sparse = RowIndex.encode(_selection(span, 200, 3), span)
    assert sparse.encoding == "list" and sparse.nbytes() == list_bytes(H, 200) == 1600 < bitmap_bytes(H, 200, 20000)
    dense = RowIndex.encode(_selection(span, 4000, 3), span)
    assert dense.encoding == "bitmap" and dense.nbytes() == bitmap_bytes(H, 4000, 20000) == 5000 < list_bytes(H, 4000)
    # at the boundary (625 rows: 2,500 B either way) the bitmap
    assert RowIndex.encode(_selection(span, 625, 4), span).encoding == "bitmap"
    assert RowIndex.encode(_selection(span, 624, 4), span).encoding == "list"


def test_a_residual_is_flagged_and_its_order_kept() -> None:
    """A quantized store's order: its quantized rows ascending, then its residual rows ascending."""
    index = _selection(SPAN, 40, 5)
    order = torch.stack([torch.cat([index[h, 3:], index[h, :3]]) for h in range(H)])  # the 3 first rows last
    rows = RowIndex.encode(order, SPAN, residual=3)
    assert rows.encoding == "bitmap" and rows.flags is not None and tuple(rows.flags.shape) == (H, 5)
    assert torch.equal(rows.decode().long(), order)
    assert rows.nbytes() == _real_bytes(rows) == H * (38 + 5) == row_index_bytes(H, 40, 300, 3)
    unordered = torch.flip(index, dims=[1])  # not ascending in either part: only a list names it
    assert RowIndex.encode(unordered, SPAN).encoding == "list"
    assert torch.equal(RowIndex.encode(unordered, SPAN).decode().long(), unordered)


def test_spans_merge_and_rows_outside_are_refused() -> None:
    assert merge_spans([((10, 5),), ((0, 10), (20, 3)), ((15, 5),)]) == ((0, 23),)
    assert merge_spans([((30, 2),), ((0, 1),)]) == ((0, 1), (30, 2))
    with pytest.raises(ValueError, match="not all inside the span"):
        RowIndex.encode(torch.tensor([[10], [149]]), SPAN)


def _old_keep_idx(token_index: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """What an evicted store named before the row index: ``token_index[keep]`` per head, ascending, int32."""
    return token_index.long()[torch.sort(keep.long(), dim=1).values].to(torch.int32)


def test_evicted_stores_name_the_rows_they_named_before() -> None:
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(300, H, D, generator=gen), torch.randn(300, H, D, generator=gen)
    token_index = runs_index(SPAN)
    keep = torch.stack([torch.randperm(300, generator=gen)[:90] for _ in range(H)])
    store = EvictedStore.from_selection(k, v, token_index, keep, TT.SOURCE_VIT)
    assert store.span == SPAN and store.rows.encoding == "bitmap"
    assert torch.equal(store.token_index, _old_keep_idx(token_index, keep))
    assert torch.equal(store.keep_idx, store.token_index)
    assert store.nbytes() == store.nominal_bytes() == H * 90 * 2 * D * 4 + H * 38 == evicted_bytes(90, 300, H, D, 4)
    shared = store.share()
    assert shared.rows is store.rows and torch.equal(shared.token_index, store.token_index)
    sub = torch.stack([torch.randperm(90, generator=gen)[:20] for _ in range(H)])
    small = store.shrink(sub)
    expected = torch.gather(store.token_index, 1, torch.sort(sub, dim=1).values)
    assert small.span == SPAN and torch.equal(small.token_index, expected)
    assert small.nbytes() == small.nominal_bytes() == evicted_bytes(20, 300, H, D, 4)


def _layer(types: list[tuple[int, TT]], seed: int = 0) -> tuple[SegmentedLayer, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    layer = SegmentedLayer()
    keys, values = [], []
    for n, t in types:
        k, v = torch.randn(n, H, D, generator=gen), torch.randn(n, H, D, generator=gen)
        layer.append(k, v, torch.full((n,), int(t), dtype=torch.int8))
        keys.append(k)
        values.append(v)
    return layer, torch.cat(keys), torch.cat(values)


def test_an_eviction_over_several_runs_names_its_rows_within_them() -> None:
    """Image rows in two runs around an instruction: the pooled eviction's span is the two runs, its rows are
    those the scores choose (as the int32 index named them), and its bytes are the real tensors'."""
    layer, _, _ = _layer([(120, TT.SOURCE_VIT), (30, TT.INSTRUCTION), (80, TT.SOURCE_VIT)])
    vit = [i for i, s in enumerate(layer.stores) if s.token_type == TT.SOURCE_VIT]
    assert len(vit) == 1 and layer.stores[vit[0]].span == ((0, 120), (150, 80))
    scores = torch.rand(230, H, generator=torch.Generator().manual_seed(1))
    store = evict(layer, vit, 50, scores)
    assert isinstance(store, EvictedStore) and store.span == ((0, 120), (150, 80))
    pool = torch.cat([torch.arange(120), torch.arange(150, 230)])
    expected = torch.stack([torch.sort(pool[torch.topk(scores[pool, h], 50).indices]).values for h in range(H)])
    assert torch.equal(store.token_index.long(), expected)
    assert store.nbytes() == evicted_bytes(50, 200, H, D, 4) == H * 50 * 2 * D * 4 + H * 25


@pytest.mark.parametrize("residual", [0, 4])
def test_per_head_quantized_stores_keep_their_order_and_the_bytes_counted(residual: int) -> None:
    """compress_rows keeps rows per head at 2 bits (its residual best-scored rows last), then again a subset of that
    store at its own bits: each time the same rows and order as the int32 index named, and the bytes the segment's
    choice counted."""
    layer, _, _ = _layer([(160, TT.SOURCE_VAE)], seed=2)
    scores = torch.rand(160, H, generator=torch.Generator().manual_seed(3))
    segment = Segment(160, 160, FULL_BITS, 160 * H * 2 * D * 4, True, H, D, 4)
    for keep in (100, 60):
        store = compress_rows(layer, [0], JointChoice(keep, 2, 32, residual), scores)
        assert isinstance(store, QuantizedStore) and store.per_head_rows and store.span == ((0, 160),)
        index = store.token_index.long()
        for h in range(H):
            chosen = torch.sort(torch.topk(scores[:, h], keep).indices).values  # the best `keep` rows of the head
            best = torch.sort(torch.topk(scores[chosen, h], residual).indices).values if residual else chosen[:0]
            tail = chosen[best]
            body = chosen[~torch.isin(chosen, tail)]
            assert index[h].tolist() == torch.cat([body, tail]).tolist()
        counted = segment.choice_bytes(JointChoice(keep, 2, 32, residual))
        assert store.nbytes() == store.nominal_bytes() == counted
        assert counted == quantized_bytes(keep, H, D, 2, 32, residual, 4, span=160)
        assert store.index.encoding == "bitmap"  # 20 B per head against 4 B per row and head
        segment = Segment(160, keep, 2, store.nbytes(), False, H, D, 4)


def test_the_allocator_keeps_more_rows_within_the_same_budget() -> None:
    """A 2-bit row costs 2 x 20 B of codes and scales over 2 heads; the int32 index added 8 B per row, the bitmap of a
    400-row span costs 100 B per segment: at 5% of 400 fp32 rows (10,240 B) the family keeps more rows, never more
    bytes than the budget, and the store it builds holds exactly them."""
    segment = Segment(400, 400, FULL_BITS, 400 * H * 2 * D * 4, True, H, D, 4)
    geometry = QuantGeometry()
    for budget in (1000, 5120, 10240, 40960):
        for bits in (2, 4, FULL_BITS):
            choice = segment.most_rows(bits, budget, geometry, 400)
            assert segment.choice_bytes(choice) <= budget
            if choice.rows < 400:  # one more row would not fit
                more = segment.choice_bytes(JointChoice(choice.rows + 1, bits, choice.group, 0))
                assert more > budget
    two = segment.most_rows(2, 10240, geometry, 400)
    old = max(r for r in range(401) if segment.choice_bytes(JointChoice(r, 2, 128, 0)) - 100 + 8 * r <= 10240)
    assert two.rows > old
    assert rows_for_bytes(40960, 400, H, D, 4) == (40960 - 100) // (H * 2 * D * 4) > 40960 // (H * (2 * D * 4 + 4))
    layer, _, _ = _layer([(400, TT.SOURCE_VIT)], seed=4)
    store = compress_rows(layer, [0], JointChoice(two.rows, 2, two.group, two.residual), torch.rand(400, H))
    assert store.nbytes() == segment.choice_bytes(two) <= 10240


def test_a_full_store_spans_its_runs() -> None:
    store = FullStore(torch.zeros(5, H, D), torch.zeros(5, H, D), torch.tensor([3, 4, 5, 9, 10]), TT.SOURCE_VIT)
    assert store.span == ((3, 3), (9, 2))


@pytest.mark.parametrize("elem", [2, 4])
def test_rows_for_bytes_is_the_most_rows_within_the_budget(elem: int) -> None:
    """For spans from 1 to 20K rows and budgets from nothing to the whole span: the rows it gives hold at most the
    budget (the cheaper index counted), and one more row would not."""
    gen = torch.Generator().manual_seed(elem)
    for _ in range(300):
        span = int(torch.randint(1, 20000, (1,), generator=gen))
        budget = int(torch.randint(0, span * H * 2 * D * elem + 1, (1,), generator=gen))
        rows = rows_for_bytes(budget, span, H, D, elem)
        assert evicted_bytes(rows, span, H, D, elem) <= budget < evicted_bytes(rows + 1, span, H, D, elem)
