"""Physical stores: exact attention over what they hold, measured bytes == formula, bytes really fall."""

from __future__ import annotations

import pytest
import torch
from oracles import KIVIPolicy

import unicache_core.kv.quantized_store as quantized_store_module
from unicache_core.kv.attention import attention_with_lse
from unicache_core.kv.quant import quantized_kv_nbytes
from unicache_core.kv.quantized_store import QuantizedStore
from unicache_core.kv.stores import EvictedStore, FullStore
from unicache_core.kv.token_types import TokenType

T, HKV, HQ, D = 200, 2, 6, 32


def _kv(dtype: torch.dtype = torch.float32, t: int = T, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(t, HKV, D, generator=gen).to(dtype)
    v = torch.randn(t, HKV, D, generator=gen).to(dtype)
    q = torch.randn(9, HQ, D, generator=gen).to(dtype)
    pos = torch.arange(100, 100 + t)
    return q, k, v, pos


def _masked_reference(q, k, v, keep_mask):
    """fp32 attention where query head h sees key t iff keep_mask[h // g, t]; out [Tq, Hq, d]."""
    g = q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,thd->hqt", q.float(), k.float().repeat_interleave(g, 1)) / D**0.5
    scores = scores.masked_fill(~keep_mask.repeat_interleave(g, 0).unsqueeze(1), float("-inf"))
    probs = scores.softmax(-1)
    return torch.einsum("hqt,thd->qhd", probs, v.float().repeat_interleave(g, 1))


def test_full_store_attention_and_bytes() -> None:
    q, k, v, pos = _kv()
    store = FullStore(k, v, pos, TokenType.INSTRUCTION)
    out, lse = store.attend(q)
    ref, ref_lse = attention_with_lse(q, k, v)
    assert torch.allclose(out, ref) and torch.allclose(lse, ref_lse)
    # an uncompressed store holds exactly its K and V: its rows are named by runs of append indices
    assert store.nbytes() == store.nominal_bytes() == 2 * T * HKV * D * 4
    assert store.runs == ((100, T),) and store.token_index.dtype == torch.int32
    assert torch.equal(store.token_index.long(), pos)


def test_full_store_runs_follow_interleaved_appends() -> None:
    _, k, v, _ = _kv(t=12)
    store = FullStore(k[:3], v[:3], torch.tensor([0, 1, 2]), TokenType.INSTRUCTION)
    store.append(k[3:5], v[3:5], torch.tensor([3, 4]))  # continues the run
    store.append(k[5:9], v[5:9], torch.tensor([9, 10, 20, 21]))  # two new runs
    assert store.runs == ((0, 5), (9, 2), (20, 2))
    assert store.token_index.tolist() == [0, 1, 2, 3, 4, 9, 10, 20, 21]
    shared = store.share()
    assert shared.runs == store.runs and shared.keys is store.keys
    assert store.nbytes() == 2 * 9 * HKV * D * 4
    with pytest.raises(ValueError, match="runs"):
        FullStore.from_runs(k[:3], v[:3], ((0, 4),), TokenType.INSTRUCTION)


def test_evicted_store_per_head_selection_is_honoured() -> None:
    q, k, v, pos = _kv()
    gen = torch.Generator().manual_seed(5)
    keep = torch.stack([torch.randperm(T, generator=gen)[:40] for _ in range(HKV)])  # different per head
    store = EvictedStore.from_selection(k, v, pos, keep, TokenType.SOURCE_VIT)
    assert store.keys.shape == (HKV, 40, D)
    assert not torch.equal(store.keep_idx[0], store.keep_idx[1])
    for h in range(HKV):
        assert torch.equal(store.keep_idx[h].long(), torch.sort(pos[keep[h]]).values)
    mask = torch.zeros(HKV, T, dtype=torch.bool)
    mask.scatter_(1, keep, True)
    out, _ = store.attend(q)
    assert torch.allclose(out, _masked_reference(q, k, v, mask), atol=1e-5)
    # a head's rows must differ from the other head's selection: using head 0's set for all heads is wrong
    wrong = _masked_reference(q, k, v, mask[:1].expand(HKV, T))
    assert not torch.allclose(out, wrong, atol=1e-3)


def test_evicted_store_drops_rows_for_real_and_bytes_scale() -> None:
    _, k, v, pos = _kv(torch.bfloat16)
    sizes = []
    for n in (10, 20, 40):
        keep = torch.arange(n).repeat(HKV, 1)
        store = EvictedStore.from_selection(k, v, pos, keep, TokenType.SOURCE_VIT)
        assert store.keys.untyped_storage().nbytes() == HKV * n * D * 2  # not a view of the full tensor
        # K and V, and the kept rows as a bitmap over the 200-row span (50 B, under 4 B per row and head)
        assert store.rows.encoding == "bitmap" and store.rows.bitmap is not None
        assert store.nbytes() == store.nominal_bytes() == HKV * n * 2 * D * 2 + HKV * (T // 8)
        sizes.append(store.nbytes() - HKV * (T // 8))
    assert sizes[1] == 2 * sizes[0] and sizes[2] == 4 * sizes[0]


def test_evicted_shrink_is_monotonic() -> None:
    q, k, v, pos = _kv()
    keep = torch.stack([torch.arange(0, 60, 2), torch.arange(1, 61, 2)])
    store = EvictedStore.from_selection(k, v, pos, keep, TokenType.INSTRUCTION)
    small = store.shrink(torch.tensor([[0, 5, 9], [1, 2, 29]]))
    assert small.num_tokens == 3
    assert small.keep_idx.tolist() == [[100, 110, 118], [103, 105, 159]]
    mask = torch.zeros(HKV, T, dtype=torch.bool)
    mask.scatter_(1, small.keep_idx.long() - 100, True)
    assert torch.allclose(small.attend(q)[0], _masked_reference(q, k, v, mask), atol=1e-5)
    with pytest.raises(ValueError, match="keep_sub"):
        store.shrink(torch.arange(31).repeat(HKV, 1))
    with pytest.raises(ValueError, match="keep_sub"):
        store.shrink(torch.tensor([[0, 30], [1, 2]]))


def test_evicted_bad_selection() -> None:
    _, k, v, pos = _kv()
    with pytest.raises(ValueError, match="keep"):
        EvictedStore.from_selection(k, v, pos, torch.tensor([[0, T]] * HKV), TokenType.SOURCE_VIT)
    with pytest.raises(ValueError, match="keep"):
        EvictedStore.from_selection(k, v, pos, torch.tensor([[1, 1]] * HKV), TokenType.SOURCE_VIT)
    with pytest.raises(ValueError, match="keep"):
        EvictedStore.from_selection(k, v, pos, torch.tensor([[1, 2]]), TokenType.SOURCE_VIT)
    with pytest.raises(ValueError, match="token_index"):
        EvictedStore.from_selection(k, v, pos[:5], torch.tensor([[1, 2]] * HKV), TokenType.SOURCE_VIT)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantized_store_attention_equals_dequantized(bits: int) -> None:
    q, k, v, pos = _kv()
    store = QuantizedStore.from_kv(k, v, pos, bits=bits, group_size=32, residual=24)
    dk, dv = store.dequantize()
    assert dk.shape == k.shape
    assert torch.equal(store.token_index.long(), pos)
    out, lse = store.attend(q)
    ref, ref_lse = attention_with_lse(q, dk, dv)
    assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5)


def test_quantized_residual_rows_exact() -> None:
    _, k, v, pos = _kv(torch.bfloat16)
    store = QuantizedStore.from_kv(k, v, pos, bits=2, group_size=32, residual=24)
    dk, dv = store.dequantize()
    assert torch.equal(dk[-24:], k[-24:]) and torch.equal(dv[-24:], v[-24:])
    assert not torch.equal(dk[:-24], k[:-24])
    assert store.res_keys.dtype == torch.bfloat16


def test_quantized_chunked_attention(monkeypatch) -> None:
    q, k, v, pos = _kv()
    store = QuantizedStore.from_kv(k, v, pos, bits=4, group_size=16, residual=8)
    whole, whole_lse = store.attend(q)
    monkeypatch.setattr(quantized_store_module, "DEQUANT_CHUNK", 40)  # -> chunks of 32 tokens
    chunked, chunked_lse = store.attend(q)
    assert torch.allclose(whole, chunked, atol=1e-5) and torch.allclose(whole_lse, chunked_lse, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_bytes_match_formula_and_fall(dtype: torch.dtype) -> None:
    _, k, v, pos = _kv(dtype, t=300)
    full = FullStore(k, v, pos, TokenType.SOURCE_VAE)
    sizes = {}
    for bits in (2, 4, 8):
        store = QuantizedStore.from_kv(k, v, pos, bits=bits, group_size=32, residual=16)
        assert store.nbytes() == store.nominal_bytes()
        # the bytes of docs/compression.md §1, counted by the paper-formula oracle (tests/oracles/kivi.py)
        oracle = KIVIPolicy(bits=bits, group_size=32, residual=16)
        assert store.nbytes() == oracle.nbytes(300, HKV, D, k.element_size())
        # the §1 ratio (fp16 residual, no positions) reproduces the measured bytes for a 2-byte cache dtype
        if dtype == torch.bfloat16:
            kv_bytes = store.nbytes() - store.token_index.nbytes
            ratio = KIVIPolicy(bits=bits, group_size=32, residual=16).nominal_ratio(300, D)
            assert kv_bytes == pytest.approx(ratio * 300 * D * 2 * 2 * HKV)
        sizes[bits] = store.nbytes()
    assert sizes[2] < sizes[4] < sizes[8] < full.nbytes()


def test_quantized_store_bad_args() -> None:
    _, k, v, pos = _kv()
    with pytest.raises(ValueError, match="residual"):
        QuantizedStore.from_kv(k, v, pos, residual=-2)
    with pytest.raises(ValueError, match="bits"):
        QuantizedStore.from_kv(k, v, pos, bits=3)
    with pytest.raises(ValueError, match="values"):
        QuantizedStore.from_kv(k, v[:10], pos)


def test_write_kv_matches_store_contents() -> None:
    q, k, v, pos = _kv(torch.bfloat16)
    full = FullStore(k, v, pos, TokenType.INSTRUCTION)
    keep = torch.stack([torch.arange(0, T, 3), torch.arange(1, T, 3)])
    ev = EvictedStore.from_selection(k, v, pos, keep, TokenType.SOURCE_VIT)
    qs = QuantizedStore.from_kv(k, v, pos, bits=2, group_size=32, residual=24)
    for store, (ek, ev_) in (
        (full, (k.transpose(0, 1), v.transpose(0, 1))),
        (ev, (ev.keys, ev.values)),
        (qs, tuple(x.transpose(0, 1) for x in qs.dequantize())),
    ):
        n = store.num_tokens
        kw = torch.zeros(HKV, n + 4, D, dtype=torch.bfloat16)
        vw = torch.zeros_like(kw)
        store.write_kv(kw[:, 2 : 2 + n], vw[:, 2 : 2 + n])
        assert torch.equal(kw[:, 2 : 2 + n], ek) and torch.equal(vw[:, 2 : 2 + n], ev_)
        assert bool((kw[:, :2] == 0).all()) and bool((kw[:, 2 + n :] == 0).all())
        # attention over the written rows is the store's own attention
        out, lse = store.attend(q)
        ref_out, ref_lse = attention_with_lse(q, kw[:, 2 : 2 + n].transpose(0, 1), vw[:, 2 : 2 + n].transpose(0, 1))
        assert torch.allclose(out.float(), ref_out.float(), atol=2e-2)
        assert torch.allclose(lse, ref_lse, atol=1e-3)


@pytest.mark.parametrize("num_tokens,residual", [(0, 4), (1, 0), (3, 2), (10, 20), (10, 0)])
def test_quantized_store_edge_lengths(num_tokens, residual):
    """Empty segments, segments shorter than a group or than the residual all quantize and attend exactly."""
    torch.manual_seed(0)
    keys, values = torch.randn(num_tokens, 2, 8), torch.randn(num_tokens, 2, 8)
    store = QuantizedStore.from_kv(keys, values, torch.arange(num_tokens), 2, 4, residual, TokenType.SOURCE_VAE)
    assert store.num_tokens == num_tokens
    assert store.nbytes() == store.nominal_bytes()
    q = torch.randn(3, 4, 8)
    out, lse = store.attend(q)
    if num_tokens == 0:
        assert torch.isneginf(lse).all()
    else:
        k_hat, v_hat = store.dequantize()
        ref_out, ref_lse = attention_with_lse(q, k_hat, v_hat)
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(lse, ref_lse)
    if num_tokens <= residual:  # everything is residual: exact
        k_hat, v_hat = store.dequantize()
        assert torch.equal(k_hat, keys) and torch.equal(v_hat, values)


@pytest.mark.parametrize("which", ["keys", "values"])
def test_quantized_store_rejects_non_finite(which):
    keys, values = torch.randn(40, 2, 8), torch.randn(40, 2, 8)
    (keys if which == "keys" else values)[5, 1, 3] = float("nan")
    with pytest.raises(ValueError, match=f"the {which} to cache hold 1 non-finite"):
        QuantizedStore.from_kv(keys, values, torch.arange(40), 2, 8, 4, TokenType.SOURCE_VAE)


def test_quantized_store_holds_no_reference_to_the_full_tensor():
    """With one KV head a contiguous slice is a view; the store must still own only its own bytes."""
    keys, values = torch.randn(4096, 1, 64), torch.randn(4096, 1, 64)
    store = QuantizedStore.from_kv(keys, values, torch.arange(4096), 2, 32, 16, TokenType.SOURCE_VAE)
    for t in (store.res_keys, store.res_values):
        assert t.untyped_storage().nbytes() == t.nbytes  # not a view into the 1 MB input
        assert t.untyped_storage().data_ptr() not in (
            keys.untyped_storage().data_ptr(),
            values.untyped_storage().data_ptr(),
        )


def test_large_magnitudes_switch_scales_to_fp32_and_stay_exactly_accounted():
    """|x| beyond fp16 range: fp32 scales/zeros (8 B/group), no inf/NaN, bytes still equal the formula."""
    torch.manual_seed(1)
    keys, values = torch.randn(96, 2, 16), torch.randn(96, 2, 16)
    keys[10, 0, 3] = -7.0e4
    values[20, 1, 5] = 1.0e5
    store = QuantizedStore.from_kv(keys, values, torch.arange(96), 4, 32, 8, TokenType.SOURCE_VAE)
    assert store.qkeys.scale.dtype == torch.float32 and store.qvalues.scale.dtype == torch.float32
    k_hat, v_hat = store.dequantize()
    assert torch.isfinite(k_hat).all() and torch.isfinite(v_hat).all()
    assert store.nbytes() == store.nominal_bytes()
    small = QuantizedStore.from_kv(
        keys.clamp(-10, 10), values.clamp(-10, 10), torch.arange(96), 4, 32, 8, TokenType.SOURCE_VAE
    )
    assert small.qkeys.scale.dtype == torch.float16  # the fp16 convention otherwise
    assert small.nbytes() < store.nbytes()


def test_quantized_store_from_head_rows_per_head_and_shared() -> None:
    """Rows chosen per KV head (``token_index [Hkv, T]``) are quantized head by head, charged their row index (a
    bitmap over the 40-row span and a residual flag per row: 2 x (5 + 3) B, not 4 B per row and head), and attended
    as their dequantized rows; a shared ``[T]`` index gives the store from_kv makes."""
    q, k, v, _ = _kv(t=40)
    chosen = torch.stack([torch.arange(0, 40, 2), torch.arange(1, 40, 2)])  # head 0 even rows, head 1 odd
    hk = torch.stack([k[chosen[h], h] for h in range(HKV)])  # [Hkv, 20, d]
    hv = torch.stack([v[chosen[h], h] for h in range(HKV)])
    store = QuantizedStore.from_head_rows(hk, hv, chosen, 4, 32, 3, TokenType.SOURCE_VIT)
    assert store.per_head_rows and store.num_tokens == 20 and store.num_quantized == 17
    assert torch.equal(store.token_index.long(), chosen)
    assert store.nbytes() == store.nominal_bytes() == quantized_kv_nbytes(20, HKV, D, 4, 32, 3, 4) + HKV * (5 + 3)
    dk, dv = store.dequantize()  # [T, Hkv, d]: row i of head h is chosen[h, i]
    for h in range(HKV):
        assert torch.equal(dk[-3:, h], k[chosen[h, -3:], h])  # the residual rows are exact
        assert torch.allclose(dk[:, h], k[chosen[h], h], atol=0.3) and not torch.equal(dk[:-3, h], k[chosen[h, :-3], h])
    out, lse = store.attend(q)
    g = HQ // HKV
    for h in range(HKV):  # each query head attends to its KV head's own rows
        ref, ref_lse = attention_with_lse(q[:, h * g : (h + 1) * g], dk[:, h : h + 1], dv[:, h : h + 1])
        assert torch.allclose(out[:, h * g : (h + 1) * g], ref, atol=1e-5)
        assert torch.allclose(lse[:, h * g : (h + 1) * g], ref_lse, atol=1e-5)
    shared = QuantizedStore.from_head_rows(
        k.transpose(0, 1), v.transpose(0, 1), torch.arange(40), 2, 128, 0, TokenType.SOURCE_VAE
    )
    ref_store = QuantizedStore.from_kv(k, v, torch.arange(40), 2, 128, 0, TokenType.SOURCE_VAE)
    assert not shared.per_head_rows and shared.nbytes() == ref_store.nbytes()
    assert all(torch.equal(a, b) for a, b in zip(shared.dequantize(), ref_store.dequantize()))


def test_a_segment_shorter_than_its_group_is_one_group_of_its_own_length() -> None:
    """A 25-row instruction at G=128: one key group per channel over its 25 rows (nothing padded), value groups
    over the channels; the bytes are the formula's and less than the rows uncompressed even in bf16."""
    _, k, v, _ = _kv(torch.bfloat16, t=25)
    store = QuantizedStore.from_kv(k, v, torch.arange(25), 2, 128, 0, TokenType.INSTRUCTION)
    assert store.nbytes() == quantized_kv_nbytes(25, HKV, D, 2, 128, 0, 2) + 4 * 25
    key_meta = HKV * 1 * D * 4  # one group per channel and head, fp16 scale + zero
    value_meta = HKV * 25 * 1 * 4  # one group per row and head (d = 32 <= G)
    assert store.nbytes() == HKV * 2 * 25 * D * 2 // 8 + key_meta + value_meta + 4 * 25
    assert store.nbytes() < 2 * 25 * HKV * D * 2


def test_from_head_rows_bad_arguments() -> None:
    _, k, v, _ = _kv(t=8)
    hk, hv = k.transpose(0, 1), v.transpose(0, 1)
    with pytest.raises(ValueError, match=r"token_index.*\[Hkv, T\]"):
        QuantizedStore.from_head_rows(hk, hv, torch.zeros(3, 8, dtype=torch.long), 2, 32, 0, TokenType.SOURCE_VIT)
    with pytest.raises(ValueError, match="residual"):
        QuantizedStore.from_head_rows(hk, hv, torch.arange(8), 2, 32, -1, TokenType.SOURCE_VIT)
    with pytest.raises(ValueError, match=r"\[Hkv, T, d\]"):
        QuantizedStore.from_head_rows(k, v[:4], torch.arange(8), 2, 32, 0, TokenType.SOURCE_VIT)
