"""Shrinking a quantized segment at its own bits keeps its value codes (docs/compression.md §8.7, the rule
against redundant work): the store equals the one a dequantize + re-quantize gives, and across a decaying
retention schedule values are quantized only when a segment's bits change or rows join the quantized part."""

from __future__ import annotations

import pytest
import torch

from unicache_core.compression import ops
from unicache_core.compression.family import JointChoice
from unicache_core.compression.ops import compress_rows
from unicache_core.kv import quant
from unicache_core.kv.quantized_store import QuantizedStore
from unicache_core.kv.segmented_cache import SegmentedLayer
from unicache_core.kv.token_types import TokenType as TT

H, D = 2, 32


def _layer(t: int, seed: int) -> tuple[SegmentedLayer, torch.Tensor]:
    """One layer holding ``t`` ViT rows ``[t, H, D]`` and their scores ``[t, H]``."""
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(t, H, D, generator=gen) * 2, torch.randn(t, H, D, generator=gen) * 3
    layer = SegmentedLayer()
    layer.append(k, v, torch.full((t,), int(TT.SOURCE_VIT), dtype=torch.int8))
    return layer, torch.rand(t, H, generator=gen)


def _count_value_quantizations(monkeypatch) -> list[int]:
    """Rows of every value quantization from now on (the store's own and the compression ops'), in call order."""
    calls = []
    real = quant.quantize_values

    def counting(values, bits, group, fit=False):
        calls.append(values.shape[1])
        return real(values, bits, group, fit=fit)

    monkeypatch.setattr(ops, "quantize_values", counting)
    monkeypatch.setattr("unicache_core.kv.quantized_store.quantize_values", counting)
    return calls


def _fields(store: QuantizedStore) -> list[torch.Tensor]:
    return [
        store.qkeys.packed,
        store.qkeys.scale,
        store.qkeys.zero,
        store.qvalues.packed,
        store.qvalues.scale,
        store.qvalues.zero,
        store.res_keys,
        store.res_values,
        store.token_index,
    ]


# (first: rows, bits, group, residual) -> (then: rows, group, residual), same bits
CASES = [
    ((80, 2, 64, 0), (40, 128, 0)),
    ((80, 4, 32, 6), (50, 64, 4)),
    ((96, 8, 32, 8), (96, 32, 2)),
    ((64, 2, 32, 3), (30, 128, 6)),
    ((120, 4, 128, 0), (7, 128, 0)),
    ((128, 4, 64, 4), (60, 64, 2)),
]


@pytest.mark.parametrize("first,then", CASES)
def test_shrinking_at_the_same_bits_equals_requantizing(first, then, monkeypatch):
    rows, bits, group, residual = first
    stores = []
    for reuse in (True, False):
        layer, scores = _layer(128, seed=rows + bits)
        compress_rows(layer, [0], JointChoice(rows, bits, group, residual), scores)
        scores = scores + torch.rand(scores.shape, generator=torch.Generator().manual_seed(1))  # later steps add
        if not reuse:
            monkeypatch.setattr(ops, "keeps_value_codes", lambda *a: False)  # the dequantize + quantize route
        assert ops.keeps_value_codes(layer.stores[0], bits, then[1]) is reuse
        stores.append(compress_rows(layer, [0], JointChoice(then[0], bits, then[1], then[2]), scores))
        monkeypatch.undo()
    fast, slow = stores
    assert (fast.bits, fast.group_size, fast.residual, fast.num_tokens) == (
        slow.bits,
        slow.group_size,
        slow.residual,
        then[0],
    )
    for a, b in zip(_fields(fast), _fields(slow)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert fast.nbytes() == slow.nbytes()


def test_values_are_not_requantized_as_rows_drop_at_the_same_bits(monkeypatch):
    calls = _count_value_quantizations(monkeypatch)
    layer, scores = _layer(128, seed=3)
    compress_rows(layer, [0], JointChoice(100, 2, 32, 0), scores)  # full rows -> quantized: one quantization
    assert calls == [100]
    for rows in (80, 61, 40, 22, 9):  # a decaying budget at the 2-bit floor: rows drop, bits stay
        store = compress_rows(layer, [0], JointChoice(rows, 2, 128, 0), scores)
        assert store.num_tokens == rows
    assert calls == [100]
    compress_rows(layer, [0], JointChoice(9, 2, 128, 2), scores)  # two quantized rows move to the residual: still none
    assert calls == [100]
    compress_rows(
        layer, [0], JointChoice(9, 2, 128, 0), scores
    )  # residual rows rejoin the quantized part: quantized again
    assert calls == [100, 9]


# a store every head of which holds all 128 rows: (bits, group, residual) -> (group, residual), same bits
SHARED_CASES = [
    ((2, 32, 1), (32, 0)),
    ((4, 64, 0), (128, 0)),
    ((4, 32, 6), (64, 2)),
    ((8, 128, 2), (128, 8)),
    ((2, 128, 8), (32, 3)),
]


@pytest.mark.parametrize("with_scores", [True, False])
@pytest.mark.parametrize("first,then", SHARED_CASES)
def test_requantizing_a_shared_store_at_its_bits_equals_quantize(first, then, with_scores, monkeypatch):
    bits, group, residual = first
    stores = []
    for reuse in (True, False):
        layer, scores = _layer(128, seed=bits + group)
        compress_rows(
            layer, [0], JointChoice(128, bits, group, residual), scores
        )  # every row kept: heads share their rows
        assert not layer.stores[0].per_head_rows
        scores = scores + torch.rand(scores.shape, generator=torch.Generator().manual_seed(2))
        if not reuse:
            monkeypatch.setattr(ops, "keeps_value_codes", lambda *a: False)  # the dequantize + quantize route
        stores.append(
            compress_rows(layer, [0], JointChoice(128, bits, then[0], then[1]), scores if with_scores else None)
        )
        monkeypatch.undo()
    fast, slow = stores
    assert not fast.per_head_rows and (fast.group_size, fast.residual) == (slow.group_size, slow.residual)
    for a, b in zip(_fields(fast), _fields(slow)):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_only_rows_leaving_the_residual_have_their_values_quantized(monkeypatch):
    calls = _count_value_quantizations(monkeypatch)
    layer, scores = _layer(96, seed=5)
    compress_rows(layer, [0], JointChoice(96, 4, 32, 6), scores)
    assert calls == [90]
    compress_rows(layer, [0], JointChoice(96, 4, 64, 2), scores)  # four residual rows join the quantized part
    assert calls == [90, 4] and layer.stores[0].num_quantized == 94
    compress_rows(layer, [0], JointChoice(96, 4, 128, 5), scores)  # rows move into the residual: no value is quantized
    assert calls == [90, 4]
