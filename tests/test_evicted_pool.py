"""One buffer for a layer's evicted rows: same rows, bytes and attention; one attention call over them."""

from __future__ import annotations

import torch

from unicache_core.kv import evicted_pool
from unicache_core.kv.cache import unique_nbytes
from unicache_core.kv.segmented_cache import SegmentedLayer
from unicache_core.kv.stores import EvictedStore
from unicache_core.kv.token_types import TokenType

HKV, HQ, D = 2, 4, 16


def _layer(seed: int = 0) -> tuple[SegmentedLayer, torch.Tensor]:
    """A layer of three images' ViT rows and an instruction, each evicted to part of its rows, and a boundary."""
    gen = torch.Generator().manual_seed(seed)
    layer = SegmentedLayer()
    for image in range(3):
        n = 12 + image
        types = torch.full((n,), int(TokenType.SOURCE_VIT))
        layer.append(torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen), types, image)
        layer.append(torch.randn(1, HKV, D, generator=gen), torch.randn(1, HKV, D, generator=gen),
                     torch.full((1,), int(TokenType.BOUNDARY)))  # fmt: skip
    text = torch.full((7,), int(TokenType.INSTRUCTION))
    layer.append(torch.randn(7, HKV, D, generator=gen), torch.randn(7, HKV, D, generator=gen), text)
    for i, store in enumerate(list(layer.stores)):
        if store.token_type in (TokenType.SOURCE_VIT, TokenType.INSTRUCTION):
            keep = torch.stack([torch.randperm(store.num_tokens, generator=gen)[: store.num_tokens // 2]] * HKV)
            layer.replace(i, EvictedStore.from_selection(store.keys, store.values, store.token_index, keep,
                                                         store.token_type))  # fmt: skip
    return layer, torch.randn(1, HQ, D, generator=gen)


def test_pooled_stores_keep_rows_bytes_and_attention() -> None:
    layer, q = _layer()
    before = [(s.token_type, s.image, s.num_tokens, s.nbytes()) for s in layer.stores]
    rows_before = [s.keep_idx.clone() for s in layer.stores if isinstance(s, EvictedStore)]
    out_before, lse_before = layer.attend(q, fused=True)
    held_before = unique_nbytes(layer.tensors())
    swaps = layer.pool_evicted()
    assert len(swaps) == 4  # three images' ViT rows and the instruction
    assert [(s.token_type, s.image, s.num_tokens, s.nbytes()) for s in layer.stores] == before
    assert all(
        torch.equal(a, s.keep_idx)
        for a, s in zip(rows_before, (s for s in layer.stores if isinstance(s, EvictedStore)))
    )
    assert unique_nbytes(layer.tensors()) == held_before  # one buffer of the same rows, nothing held twice
    evicted = [s for s in layer.stores if isinstance(s, EvictedStore)]
    assert len({s.keys.untyped_storage().data_ptr() for s in evicted}) == 1
    out, lse = layer.attend(q, fused=True)
    torch.testing.assert_close(out, out_before, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, lse_before, rtol=1e-5, atol=1e-6)
    per_store = layer.attend_parts(q)  # the statistics path still sees every store
    torch.testing.assert_close(per_store.out, out, rtol=1e-5, atol=1e-6)
    assert len(per_store.store_lse) == len(layer.stores)
    assert layer.pool_evicted() == []  # already one buffer


def test_one_attention_call_reads_the_pooled_rows(monkeypatch) -> None:
    layer, q = _layer(1)
    layer.pool_evicted()
    parts = evicted_pool.attention_runs([s for s in layer.stores if s.num_tokens])
    assert sum(isinstance(p, evicted_pool.EvictedRun) for p in parts) == 1
    assert not any(isinstance(p, EvictedStore) for p in parts)
    calls = []
    original = EvictedStore.attend
    monkeypatch.setattr(EvictedStore, "attend", lambda self, *a, **k: calls.append(self) or original(self, *a, **k))
    layer.attend(q, fused=True)
    assert calls == []  # no store-by-store reads of evicted rows


def test_a_replaced_member_splits_the_run_and_frozen_rows_stay() -> None:
    layer, _ = _layer(2)
    frozen_store = layer.stores[0]
    frozen = frozenset({t.untyped_storage().data_ptr() for t in frozen_store.tensors()})
    layer.pool_evicted(frozen)
    assert layer.stores[0] is frozen_store  # rows another cache holds are not moved
    evicted = [i for i, s in enumerate(layer.stores) if isinstance(s, EvictedStore)]
    last = layer.stores[evicted[-1]]  # the pool holds images 1 and 2, then the instruction
    assert isinstance(last, EvictedStore)
    layer.replace(evicted[-1], last.shrink(torch.zeros(HKV, 1, dtype=torch.long)))
    parts = evicted_pool.attention_runs([s for s in layer.stores if s.num_tokens])
    assert sum(isinstance(p, evicted_pool.EvictedRun) for p in parts) == 1  # images 1 and 2, still side by side
    assert sum(isinstance(p, EvictedStore) for p in parts) == 2  # the frozen image 0 and the shrunk instruction
    layer.replace(evicted[1], layer.stores[evicted[1]].shrink(torch.zeros(HKV, 1, dtype=torch.long)))
    parts = evicted_pool.attention_runs([s for s in layer.stores if s.num_tokens])
    assert not any(isinstance(p, evicted_pool.EvictedRun) for p in parts)  # a lone pooled store is read as itself
