"""SegmentedKVCache: equals FullKVCache when nothing is compressed; honours compressed segments exactly."""

from __future__ import annotations

import pytest
import torch
from oracles import KIVIPolicy

from unicache_core.kv.cache import AttentionCall, FullKVCache, KVCache
from unicache_core.kv.quantized_store import QuantizedStore
from unicache_core.kv.segmented_cache import SegmentedKVCache
from unicache_core.kv.stores import EvictedStore, FullStore
from unicache_core.kv.token_types import TokenType

HKV, HQ, D, LAYERS = 2, 4, 16, 2
TT = TokenType


def _call(types: list[TokenType], causal: bool, update: bool = True, phase: str = "prefill") -> AttentionCall:
    t = torch.tensor([int(x) for x in types], dtype=torch.int8)
    return AttentionCall(
        token_types=t, rope_positions=torch.arange(len(types)), causal=causal, update=update, phase=phase
    )


def _sequence() -> list[AttentionCall]:
    """Prefill text (causal), an image block (bidirectional), a VAE block, then decode steps."""
    text = [TT.BOUNDARY] + [TT.INSTRUCTION] * 11 + [TT.BOUNDARY]
    vit = [TT.BOUNDARY] + [TT.SOURCE_VIT] * 20 + [TT.BOUNDARY]
    vae = [TT.BOUNDARY] + [TT.SOURCE_VAE] * 16 + [TT.BOUNDARY]
    return [
        _call(text, causal=True),
        _call(vit, causal=False),
        _call(vae, causal=False),
        _call([TT.INSTRUCTION] * 5, causal=True),
        _call([TT.DECODED_TEXT], causal=True, phase="decode"),
        _call([TT.DECODED_TEXT], causal=True, phase="decode"),
        _call([TT.CURRENT_LATENT] * 6, causal=False, update=False, phase="denoise"),
    ]


def _qkv(n: int, gen: torch.Generator):
    return (
        torch.randn(n, HQ, D, generator=gen),
        torch.randn(n, HKV, D, generator=gen),
        torch.randn(n, HKV, D, generator=gen),
    )


def _run(caches: list[KVCache], calls: list[AttentionCall], seed: int = 0) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    outs: list[list[torch.Tensor]] = [[] for _ in caches]
    for call in calls:
        for layer in range(caches[0].num_layers):
            q, k, v = _qkv(call.token_types.shape[0], gen)
            for i, cache in enumerate(caches):
                outs[i].append(cache.attend(layer, q, k, v, call))
    return outs


def test_uncompressed_equals_full_cache() -> None:
    full, seg = FullKVCache(LAYERS), SegmentedKVCache(LAYERS)
    ref, got = _run([full, seg], _sequence())
    for a, b in zip(ref, got):
        assert torch.allclose(a, b, atol=1e-5)
    assert seg.num_tokens == full.num_tokens == 13 + 22 + 18 + 5 + 2
    assert seg.full_bytes() == full.nbytes()
    # one uncompressed store per type: appends of a type are coalesced
    kinds = seg.segments(0)
    assert sorted(t for t, _, _ in kinds) == sorted(
        {TT.BOUNDARY, TT.INSTRUCTION, TT.SOURCE_VIT, TT.SOURCE_VAE, TT.DECODED_TEXT}
    )
    assert dict((t, n) for t, _, n in kinds)[TT.INSTRUCTION] == 16
    # stored positions are the original context indices of each type
    keys, _, types, _ = full.layer_kv(0)
    for store in seg.stores(0):
        expected = (types == int(store.token_type)).nonzero().squeeze(1)
        assert torch.equal(store.token_index.long(), expected)


def test_evicted_segment_equals_masked_attention() -> None:
    full, seg = FullKVCache(LAYERS), SegmentedKVCache(LAYERS)
    _run([full, seg], _sequence()[:4])
    keys, values, types, _ = full.layer_kv(1)
    vit = seg.segment_kv(1, TT.SOURCE_VIT)
    keep = torch.stack([torch.arange(0, 20, 3), torch.arange(1, 20, 3)])  # different tokens per KV head
    store = EvictedStore.from_selection(vit.keys, vit.values, vit.token_index, keep, TT.SOURCE_VIT)
    old = seg.replace_segment(1, "source_vit", store)
    assert isinstance(old, FullStore)
    # reference: full attention with the dropped ViT rows masked per KV head, plus the new block
    mask = torch.ones(HKV, keys.shape[0], dtype=torch.bool)
    mask[:, vit.token_index.long()] = False
    mask.scatter_(1, store.keep_idx.long(), True)
    gen = torch.Generator().manual_seed(7)
    q, k, v = _qkv(6, gen)
    out = seg.attend(1, q, k, v, _call([TT.CURRENT_LATENT] * 6, causal=False, update=False))
    allk, allv = torch.cat([keys, k]), torch.cat([values, v])
    fullmask = torch.cat([mask, torch.ones(HKV, 6, dtype=torch.bool)], dim=1)
    g = HQ // HKV
    scores = torch.einsum("qhd,thd->hqt", q, allk.repeat_interleave(g, 1)) / D**0.5
    scores = scores.masked_fill(~fullmask.repeat_interleave(g, 0).unsqueeze(1), float("-inf"))
    ref = torch.einsum("hqt,thd->qhd", scores.softmax(-1), allv.repeat_interleave(g, 1))
    assert torch.allclose(out, ref, atol=1e-5)
    assert seg.nbytes() < full.nbytes()
    assert seg.full_bytes() == full.nbytes()


def test_quantized_segment_equals_dequantized_attention() -> None:
    full, seg = FullKVCache(LAYERS), SegmentedKVCache(LAYERS)
    _run([full, seg], _sequence()[:3])
    vae = seg.segment_kv(0, TT.SOURCE_VAE)
    store = QuantizedStore.from_kv(vae.keys, vae.values, vae.token_index, bits=2, group_size=8, residual=4)
    seg.replace_segment(0, TT.SOURCE_VAE, store)
    assert [s for s in seg.segments(0) if s[0] == TT.SOURCE_VAE][0][1] == "quantized"
    # reference: the full cache with the VAE rows replaced by KIVI's round trip (tests/oracles/kivi.py)
    keys, values, _, _ = full.layer_kv(0)
    dk, dv = KIVIPolicy(bits=2, group_size=8, residual=4).round_trip(vae.keys, vae.values)
    keys, values = keys.clone(), values.clone()
    keys[store.token_index.long()], values[store.token_index.long()] = dk, dv
    ref_cache = FullKVCache(1)
    ref_cache.append(0, keys, values, torch.zeros(keys.shape[0]), torch.arange(keys.shape[0]))
    gen = torch.Generator().manual_seed(3)
    q, k, v = _qkv(5, gen)
    call = _call([TT.INSTRUCTION] * 5, causal=True)
    out = seg.attend(0, q, k, v, call)
    assert torch.allclose(out, ref_cache.attend(0, q, k, v, call), atol=1e-5)
    # the new block was appended as a new INSTRUCTION rows of the existing uncompressed store
    assert seg.layer(0).appended_tokens == keys.shape[0] + 5


def test_appends_after_compression_open_a_new_store() -> None:
    seg = SegmentedKVCache(1)
    _run([seg], [_call([TT.INSTRUCTION] * 8, causal=True)])
    s = seg.segment_kv(0, TT.INSTRUCTION)
    seg.replace_segment(
        0,
        TT.INSTRUCTION,
        EvictedStore.from_selection(s.keys, s.values, s.token_index, torch.tensor([[0, 3]] * HKV), TT.INSTRUCTION),
    )
    _run([seg], [_call([TT.INSTRUCTION] * 3, causal=True)])
    kinds = seg.segments(0)
    assert [k for _, k, _ in kinds] == ["evicted", "full"]
    assert seg.segment_kv(0, TT.INSTRUCTION).token_index.tolist() == [8, 9, 10]
    assert seg.num_tokens == 5


def test_replace_segment_errors() -> None:
    seg = SegmentedKVCache(1)
    _run([seg], [_call([TT.INSTRUCTION] * 4, causal=True)])
    s = seg.segment_kv(0, TT.INSTRUCTION)
    with pytest.raises(ValueError, match="SOURCE_VAE"):
        seg.replace_segment(0, TT.SOURCE_VAE, s)
    wrong = FullStore(s.keys, s.values, s.token_index, TT.SOURCE_VIT)
    with pytest.raises(ValueError, match="store"):
        seg.replace_segment(0, TT.INSTRUCTION, wrong)
    with pytest.raises(ValueError, match="layer"):
        seg.replace_segment(3, TT.INSTRUCTION, s)
    assert isinstance(seg.stores(0)[0], FullStore) and not isinstance(seg.stores(0)[0], QuantizedStore)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_path_equals_per_store_merge(causal: bool, dtype: torch.dtype) -> None:
    from unicache_core.kv.segmented_cache import SegmentedLayer

    gen = torch.Generator().manual_seed(11)
    t, tq = 90, 7
    k = (torch.randn(t, HKV, D, generator=gen) * 2).to(dtype)
    v = torch.randn(t, HKV, D, generator=gen).to(dtype)
    q = torch.randn(tq, HQ, D, generator=gen).to(dtype)
    kn, vn = torch.randn(tq, HKV, D, generator=gen).to(dtype), torch.randn(tq, HKV, D, generator=gen).to(dtype)
    pos = torch.arange(t)
    keep = torch.stack([torch.arange(0, 30, 2), torch.arange(1, 30, 2)])  # per-head rows of k[30:60]
    layer = SegmentedLayer()
    layer.stores = [
        FullStore(k[:30], v[:30], pos[:30], TT.BOUNDARY),
        EvictedStore.from_selection(k[30:60], v[30:60], pos[30:60], keep, TT.SOURCE_VIT),
        QuantizedStore.from_kv(k[60:], v[60:], pos[60:], bits=2, group_size=8, residual=4, token_type=TT.SOURCE_VAE),
        FullStore(k[:0], v[:0], pos[:0], TT.INSTRUCTION),  # empty stores are skipped by both paths
    ]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for kw in ({"k_new": kn, "v_new": vn, "causal": causal}, {}):
        ref_out, ref_lse = layer.attend(q, **kw)
        out, lse = layer.attend(q, fused=True, **kw)
        assert out.dtype == dtype and out.shape == (tq, HQ, D)
        assert torch.allclose(out.float(), ref_out.float(), atol=tol, rtol=tol)
        assert torch.allclose(lse, ref_lse, atol=1e-4)
    # the fused path changes nothing in the stores (no dequantized copy is kept)
    assert [type(s).__name__ for s in layer.stores] == ["FullStore", "EvictedStore", "QuantizedStore", "FullStore"]
    with pytest.raises(ValueError, match="nothing to attend"):
        SegmentedLayer().attend(q, fused=True)
