"""What the compression library's parts assume is checked, not silently wrong."""

from __future__ import annotations

import pytest
import torch

from unicache_core.compression.allocator import allocate
from unicache_core.compression.selection import topk_per_head
from unicache_core.compression.stats import ChunkedAttentionStats
from unicache_core.kv.quantized_store import QuantizedStore
from unicache_core.kv.segmented_cache import SegmentedLayer
from unicache_core.kv.stores import EvictedStore, FullStore
from unicache_core.kv.token_types import TokenType as TT


def _kv(t=6, h=2, d=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return torch.randn(t, h, d, generator=g).to(dtype), torch.randn(t, h, d, generator=g).to(dtype), torch.arange(t)


def test_keys_and_values_must_share_device_and_dtype():
    k, v, idx = _kv()
    with pytest.raises(ValueError, match="on meta"):
        FullStore(k, v.to("meta"), idx, TT.SOURCE_VIT)
    with pytest.raises(ValueError, match="one floating dtype"):
        FullStore(k, v.half(), idx, TT.SOURCE_VIT)
    with pytest.raises(ValueError, match="dtype and device"):
        EvictedStore(k.transpose(0, 1), v.transpose(0, 1).half(), torch.zeros(2, 6, dtype=torch.int32), TT.SOURCE_VIT)


def test_stores_of_one_layer_agree_on_heads_dim_dtype_and_device():
    layer = SegmentedLayer()
    k, v, _ = _kv()
    layer.append(k, v, torch.full((6,), int(TT.SOURCE_VIT), dtype=torch.int8))
    k3, v3, _ = _kv(h=3)
    with pytest.raises(ValueError, match="3 KV heads"):
        layer.append(k3, v3, torch.full((6,), int(TT.SOURCE_VIT), dtype=torch.int8))
    kd, vd, _ = _kv(d=4)
    with pytest.raises(ValueError, match="head dim 4"):
        layer.append(kd, vd, torch.full((6,), int(TT.INSTRUCTION), dtype=torch.int8))
    kh, vh, idx = _kv(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        layer.replace(0, FullStore(kh[:3], vh[:3], idx[:3], TT.SOURCE_VIT))
    with pytest.raises(ValueError, match="more than segment"):
        layer.replace(0, FullStore(*_kv(t=7)[:2], torch.arange(7), TT.SOURCE_VIT))
    with pytest.raises(ValueError, match="type INSTRUCTION"):
        layer.replace(0, FullStore(k[:2], v[:2], idx[:2], TT.INSTRUCTION))
    assert layer.stores[0].num_tokens == 6  # nothing was half-applied


def test_byte_accounting_holds_for_every_dtype_and_fp32_scales():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        k, v, idx = _kv(t=70, dtype=dtype)
        for store in (
            FullStore(k, v, idx, TT.SOURCE_VAE),
            EvictedStore.from_selection(k, v, idx, torch.tensor([[0, 5, 9]] * 2), TT.SOURCE_VIT),
            QuantizedStore.from_kv(k, v, idx, 2, 32, 8),
        ):
            assert store.nbytes() == store.nominal_bytes(), (dtype, store.kind)
    big = QuantizedStore.from_kv(*(_kv(t=70)[0] * 1e5,) * 2, torch.arange(70), 4, 32, 8)  # beyond fp16 scales
    assert big.qkeys.scale.dtype == torch.float32 and big.nbytes() == big.nominal_bytes()


def test_nan_rules_scores_rank_lowest_masses_and_weights_raise():
    scores = torch.tensor([[0.5], [float("nan")], [0.9], [0.1]])
    assert topk_per_head(scores, 2).tolist() == [[0, 2]]  # documented: NaN ranks lowest, never selected first
    with pytest.raises(ValueError, match="weights"):
        allocate([10, 10], [float("nan"), 1.0], 5)
    stats = ChunkedAttentionStats.for_task("edit")
    with pytest.raises(ValueError, match="non-finite"):
        stats.update(0, 1, {TT.SOURCE_VIT: float("nan")})
    with pytest.raises(ValueError, match="non-finite|NaN"):
        QuantizedStore.from_kv(torch.full((4, 2, 8), float("nan")), torch.zeros(4, 2, 8), torch.arange(4), 2, 32, 0)
