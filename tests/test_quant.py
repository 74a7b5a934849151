"""Bit packing and KIVI-style quantization (unicache_core.kv.quant, the lookup of unicache_core.compression.ops
and the reference KIVI policy of tests/oracles)."""

from __future__ import annotations

import math

import pytest
import torch
from oracles import KIVIPolicy
from oracles.kivi import LOOKUP

import unicache_core.kv.dequant as dequant_module
from unicache_core.compression.ops import KIVI_LOOKUP
from unicache_core.kv.quant import (
    pack_bits,
    quantize_keys,
    quantize_values,
    quantized_kv_nbytes,
    unpack_bits,
    unpack_into,
)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", [1, 3, 7, 8, 13, 128])
def test_pack_unpack_roundtrip(bits: int, n: int) -> None:
    gen = torch.Generator().manual_seed(bits * 1000 + n)
    codes = torch.randint(0, 2**bits, (2, 5, n), generator=gen).to(torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (2, 5, math.ceil(n * bits / 8))
    assert torch.equal(unpack_bits(packed, bits, n), codes)


def test_pack_is_dense() -> None:
    # 4 two-bit codes 1,2,3,0 -> 0b00_11_10_01 (first code in the low bits)
    packed = pack_bits(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2)
    assert packed.tolist() == [0b00111001]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_key_error_bounded_by_half_scale(bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    g = 32
    keys = torch.randn(3, 100, 64, generator=gen) * torch.linspace(0.1, 5.0, 64)  # ragged last group (100 % 32)
    q = quantize_keys(keys, bits, g)
    assert q.scale.shape == (3, 4, 64)
    err = (q.dequantize(torch.float32) - keys).abs()
    group_of_token = torch.arange(100) // g
    bound = q.scale.float()[:, group_of_token, :] / 2  # [H, T, d]
    assert bool((err <= bound * (1 + 1e-4) + 1e-6).all())
    # the bound is tight-ish: codes use the whole range, so the error is not trivially zero
    assert err.max() > bound.max() * 0.2


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [16, 48, 200])
def test_value_error_bounded_by_half_scale(bits: int, group: int) -> None:
    gen = torch.Generator().manual_seed(bits + group)
    values = torch.randn(2, 37, 64, generator=gen) * 3
    q = quantize_values(values, bits, group)
    ng = math.ceil(64 / group)
    assert q.scale.shape == (2, 37, ng)
    err = (q.dequantize(torch.float32) - values).abs()
    group_of_channel = torch.arange(64) // group
    bound = q.scale.float()[:, :, group_of_channel] / 2
    assert bool((err <= bound * (1 + 1e-4) + 1e-6).all())


def _group_sq_error(q, x: torch.Tensor, group: int) -> torch.Tensor:
    """Squared error per (head, row, channel group) of per-token quantized ``x [H, T, d]``."""
    err = (q.dequantize(torch.float32) - x).square()
    d = x.shape[-1]
    pad = (-d) % group if math.ceil(d / group) > 1 else 0
    err = torch.nn.functional.pad(err, (0, pad))
    return err.view(*x.shape[:2], -1, group if pad or d > group else d).sum(-1)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [16, 48, 64, 200])
def test_fitted_value_ranges_never_lose_to_min_max(bits: int, group: int) -> None:
    gen = torch.Generator().manual_seed(10 * bits + group)
    values = torch.randn(2, 41, 64, generator=gen) * torch.linspace(0.5, 4.0, 64)  # uneven channel scales
    values[0, 3, 5] = 40.0  # an outlier row
    minmax, fitted = quantize_values(values, bits, group), quantize_values(values, bits, group, fit=True)
    # the same layout and bytes: only the ranges (and so the codes) differ
    assert fitted.nbytes() == minmax.nbytes() and fitted.packed.shape == minmax.packed.shape
    assert fitted.scale.dtype == minmax.scale.dtype == torch.float16 and fitted.scale.shape == minmax.scale.shape
    e_minmax, e_fitted = _group_sq_error(minmax, values, group), _group_sq_error(fitted, values, group)
    assert bool((e_fitted <= e_minmax * (1 + 1e-6) + 1e-9).all())  # no group is worse off
    if bits == 2:  # and at 2 bits the total falls by a quarter or more (here 25-32%)
        assert float(e_fitted.sum()) < 0.75 * float(e_minmax.sum())


def test_fitted_ranges_of_gaussian_rows_halve_the_2_bit_error() -> None:
    values = torch.randn(2, 300, 64, generator=torch.Generator().manual_seed(0))
    errors = [
        float((quantize_values(values, 2, 64, fit=fit).dequantize() - values).square().sum()) for fit in (False, True)
    ]
    assert errors[1] < 0.6 * errors[0]  # the module docstring's "about 45%"


def test_fitted_ranges_keep_constant_rows_exact_and_refit_nothing() -> None:
    x = torch.full((1, 5, 8), 0.3)
    assert torch.allclose(quantize_values(x, 2, 8, fit=True).dequantize(), x, atol=1e-3)
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(2, 9, 32, generator=gen)
    once = quantize_values(values, 2, 32, fit=True)
    twice = quantize_values(once.dequantize(torch.float32), 2, 32, fit=True)  # already on its grid
    assert torch.equal(twice.dequantize(torch.float32), once.dequantize(torch.float32))
    empty = quantize_values(torch.zeros(2, 0, 32), 2, 32, fit=True)
    assert empty.num_tokens == 0 and empty.nbytes() == 0


def test_more_bits_less_error() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64, 32, generator=gen)
    errs = [(quantize_keys(x, b, 32).dequantize() - x).abs().mean().item() for b in (2, 4, 8)]
    assert errs[0] > errs[1] > errs[2]


def test_constant_group_is_exact() -> None:
    x = torch.full((1, 32, 8), 0.3)
    assert torch.allclose(quantize_keys(x, 2, 32).dequantize(), x, atol=1e-3)
    assert torch.allclose(quantize_values(x, 2, 8).dequantize(), x, atol=1e-3)


def test_dequantize_chunk_matches_whole() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 70, 16, generator=gen)
    q = quantize_keys(x, 4, 16)
    whole = q.dequantize()
    assert torch.equal(q.dequantize(torch.float32, 16, 70), whole[:, 16:])
    with pytest.raises(ValueError, match="start"):
        q.dequantize(torch.float32, 5, 20)


def test_quantized_nbytes_formula() -> None:
    # hand count: 2 heads, 100 tokens, R 10 -> 90 quantized, d 64, 2 bits, G 32
    n = quantized_kv_nbytes(100, 2, 64, 2, 32, 10, 2)
    payload = 2 * 90 * 64 * 2 // 8
    key_meta = math.ceil(90 / 32) * 64 * 4
    value_meta = 90 * 2 * 4
    residual = 10 * 64 * 2 * 2
    assert n == 2 * (payload + key_meta + value_meta + residual)


@pytest.mark.parametrize("bad, match", [(pack_bits, "bits"), (unpack_bits, "bits")])
def test_bad_bits(bad, match) -> None:
    with pytest.raises(ValueError, match=match):
        if bad is pack_bits:
            bad(torch.zeros(4, dtype=torch.uint8), 3)
        else:
            bad(torch.zeros(1, dtype=torch.uint8), 3, 4)


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="group_size"):
        quantize_keys(torch.zeros(1, 4, 4), 2, 0)
    with pytest.raises(ValueError, match="codes"):
        pack_bits(torch.zeros(4, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="bits"):
        KIVIPolicy(bits=3)
    with pytest.raises(ValueError, match="group_size"):
        KIVIPolicy(group_size=0)
    with pytest.raises(ValueError, match="residual"):
        KIVIPolicy(residual=-1)
    with pytest.raises(ValueError, match="target"):
        KIVIPolicy.for_ratio(-0.1)
    # bool is an int subclass in Python: True must not pass as group size 1 / residual 1
    for field in ("bits", "group_size", "residual"):
        with pytest.raises(ValueError, match=field):
            KIVIPolicy(**{field: True})
    with pytest.raises(ValueError, match="group_size"):
        quantize_values(torch.zeros(1, 4, 4), 2, True)


def test_kivi_defaults_and_nominal_ratio() -> None:
    p = KIVIPolicy()
    assert (p.bits, p.group_size, p.residual) == (2, 32, 128)
    # §1 rule of thumb: 4 bits, G=32 -> 0.25 + metadata (~0.31 with fp16 scale/zero), residual negligible
    r = KIVIPolicy(bits=4, group_size=32, residual=0).nominal_ratio(4096, 128)
    assert 0.30 < r < 0.32
    r2 = KIVIPolicy(bits=2, group_size=128, residual=0).nominal_ratio(4096, 128)
    assert 0.125 < r2 < 0.15


@pytest.mark.parametrize(
    "target, expected",
    [
        (0.05, (2, 128)),
        (0.125, (2, 128)),
        (0.2, (2, 64)),
        (0.3, (2, 32)),
        (0.4, (4, 128)),
        (0.49, (4, 64)),
        (0.5, (4, 32)),
        (0.99, (8, 32)),
    ],
)
def test_for_ratio_lookup(target: float, expected: tuple[int, int]) -> None:
    p = KIVIPolicy.for_ratio(target)
    assert (p.bits, p.group_size, p.residual) == (*expected, 32)
    rows_below = [row for row in KIVI_LOOKUP if row[0] <= target]
    if rows_below:
        assert rows_below[-1][1:] == expected


def test_library_lookup_is_the_papers() -> None:
    assert KIVI_LOOKUP == LOOKUP


def test_for_ratio_bypass() -> None:
    assert KIVIPolicy.for_ratio(1.0) is None


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_spread_unpack_equals_shift_unpack(bits: int) -> None:
    gen = torch.Generator().manual_seed(40 + bits)
    codes = torch.randint(0, 2**bits, (3, 7, 64), generator=gen).to(torch.uint8)
    packed = pack_bits(codes, bits)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = torch.full((3, 7, 64), -1.0, dtype=dtype)
        unpack_into(packed, bits, out)
        assert torch.equal(out, unpack_bits(packed, bits, 64).to(dtype))
    byte = torch.tensor([[0b11100100]], dtype=torch.uint8)
    one = torch.empty(1, 8 // bits)
    unpack_into(byte, bits, one)
    assert one[0].tolist() == [(0b11100100 >> (i * bits)) & (2**bits - 1) for i in range(8 // bits)]
    with pytest.raises(ValueError, match="out"):
        unpack_into(packed, bits, torch.empty(3, 7, 63))


def _reference_dequant(q, dtype: torch.dtype, start: int, stop: int) -> torch.Tensor:
    """Independent formula: unpack, look up each element's group, one rounding of code*s+z into ``dtype``."""
    codes = unpack_bits(q.packed[:, start:stop], q.bits, q.head_dim).float()
    s, z = q.scale.to(dtype).float(), q.zero.to(dtype).float()  # scales rounded to the target dtype first
    if q.axis == "channel":
        grp = torch.arange(start, stop) // q.group_size
        s, z = s[:, grp, :], z[:, grp, :]
    else:
        ch = torch.arange(q.head_dim) // q.group_size
        s, z = s[:, start:stop][..., ch], z[:, start:stop][..., ch]
    return (codes * s + z).to(dtype)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [16, 48, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fast_dequantize_equals_reference(bits: int, group: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(bits * 7 + group)
    x = torch.randn(2, 150, 64, generator=gen) * 3 + 0.5
    for q in (quantize_keys(x, bits, group), quantize_values(x, bits, group)):
        start = group if q.axis == "channel" else 9
        for lo, hi in ((0, 150), (start, 150), (0, 100)):
            ref = _reference_dequant(q, dtype, lo, hi)
            assert torch.equal(q.dequantize(dtype, lo, hi), ref)
            # a workspace slice (each head contiguous) takes the fast path; a strided view the generic one
            ws = torch.zeros(2, hi - lo + 5, 64, dtype=dtype)
            q.dequantize_into(ws[:, 3 : 3 + hi - lo], lo, hi)
            assert torch.equal(ws[:, 3 : 3 + hi - lo], ref)
            assert bool((ws[:, :3] == 0).all()) and bool((ws[:, 3 + hi - lo :] == 0).all())
            strided = torch.zeros(hi - lo, 2, 64, dtype=dtype).transpose(0, 1)
            q.dequantize_into(strided, lo, hi)
            assert torch.equal(strided, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_dequantize_blocks(monkeypatch, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 37, 32, generator=gen)
    for q in (quantize_values(x, 2, 32), quantize_keys(x, 4, 4)):
        whole = q.dequantize(dtype)
        # blocks of 5 rows (values; keys: one group of 4): a ragged last block, key groups never split
        monkeypatch.setattr(dequant_module, "BLOCK_CODES", 5 * 2 * 32)
        assert dequant_module.block_rows(2, 32, q.group_size if q.axis == "channel" else 1) < 37
        assert torch.equal(q.dequantize(dtype), whole)
        assert torch.equal(whole, _reference_dequant(q, dtype, 0, 37))
        monkeypatch.undo()
