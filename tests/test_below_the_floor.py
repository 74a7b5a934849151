"""Below the 2-bit floor (docs/compression.md §11.13): 1-bit packed codes, keys grouped per token for segments of
fewer rows than channels, values at fewer bits than keys, the sensitivity model that chooses between them, and the
real bytes of the stores they make."""

from __future__ import annotations

import math

import pytest
import torch
from test_joint_family import _segment  # the same full-precision segment of n rows, H = 2, D = 32

from unicache_core.compression import unicache_allocation
from unicache_core.compression.family import (
    FULL_BITS,
    JointChoice,
    QuantGeometry,
    Segment,
    choice_error,
    choose,
    row_loss,
)
from unicache_core.compression.ops import compress_rows
from unicache_core.kv.quant import (
    StoreLayout,
    pack_bits,
    quantize_keys,
    quantize_values,
    quantized_kv_nbytes,
    unpack_bits,
)
from unicache_core.kv.quantized_store import QuantizedStore
from unicache_core.kv.segmented_cache import SegmentedLayer
from unicache_core.kv.token_types import TokenType as TT

H, D = 2, 32
GEOMETRY = QuantGeometry(groups=(8, 16, 32, 64, 128))


@pytest.mark.parametrize("n", [1, 7, 8, 9, 32, 33, 100])
def test_one_bit_codes_pack_eight_per_byte_and_round_trip(n: int) -> None:
    codes = torch.randint(0, 2, (3, 4, n), generator=torch.Generator().manual_seed(n)).to(torch.uint8)
    packed = pack_bits(codes, 1)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 4, math.ceil(n / 8))
    assert torch.equal(unpack_bits(packed, 1, n), codes)


def test_one_bit_codes_fill_a_byte_low_bit_first() -> None:
    codes = torch.tensor([1, 0, 1, 1, 0, 0, 0, 1], dtype=torch.uint8)
    assert pack_bits(codes, 1).tolist() == [0b10001101]


def test_one_bit_values_hold_their_real_bytes_and_fit_better_than_min_max() -> None:
    x = torch.randn(H, 50, D, generator=torch.Generator().manual_seed(0))
    fitted, minmax = quantize_values(x, 1, 32, fit=True), quantize_values(x, 1, 32)
    # per head: 50 rows x 32 one-bit codes = 4 bytes a row, one fp16 scale and zero per row
    assert fitted.packed.shape == (H, 50, 4)
    assert fitted.nbytes() == H * 50 * (4 + 4)
    err_fit = float((fitted.dequantize() - x).square().mean())
    err_minmax = float((minmax.dequantize() - x).square().mean())
    # 1-bit min-max rounds to the group's extremes: more error than the values hold (variance 1); fitted: about 1/3
    assert err_minmax > 1.0 and err_fit < 0.4


def test_a_store_with_one_bit_values_counts_what_it_holds() -> None:
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(40, H, D, generator=gen), torch.randn(40, H, D, generator=gen)
    store = QuantizedStore.from_kv(k, v, torch.arange(40), 2, 128, 0, TT.SOURCE_VIT, True, value_bits=1)
    assert (store.bits, store.value_bits) == (2, 1)
    assert store.nbytes() == quantized_kv_nbytes(40, H, D, 2, 128, 0, 4, layout=StoreLayout(value_bits=1)) + 4 * 40
    both = QuantizedStore.from_kv(k, v, torch.arange(40), 2, 128, 0, TT.SOURCE_VIT, True)
    assert both.nbytes() - store.nbytes() == H * 40 * 4  # 4 bytes fewer per value row and head
    keys, values = store.dequantize()
    assert keys.shape == values.shape == (40, H, D)


def test_per_token_keys_cost_a_scale_and_zero_per_row() -> None:
    keys = torch.randn(H, 5, D, generator=torch.Generator().manual_seed(2))
    per_token, per_channel = quantize_keys(keys, 2, 32, per_token=True), quantize_keys(keys, 2, 32)
    assert per_token.axis == "token" and per_token.scale.shape == (H, 5, 1)
    assert per_channel.scale.shape == (H, 1, D)
    assert per_token.nbytes() == H * (5 * 8 + 5 * 4)
    per_token_bytes = quantized_kv_nbytes(5, H, D, 2, 32, 0, 4, layout=StoreLayout(key_per_token=True))
    assert per_token_bytes == H * (5 * 16 + 5 * 4 + 5 * 4)
    store = QuantizedStore.from_kv(keys.transpose(0, 1), keys.transpose(0, 1), torch.arange(5), 2, 32, 0,
                                   TT.INSTRUCTION, key_per_token=True)  # fmt: skip
    assert store.key_per_token and store.nbytes() == H * (5 * 16 + 5 * 4 + 5 * 4) + 4 * 5


def test_the_choice_oracle_on_a_hand_worked_instruction() -> None:
    """A 5-row instruction (2 KV heads, d 32, fp32: 2,560 B uncompressed) with a budget of 260 B.

    - Per-channel 2-bit keys, every row: per head 5 x 16 payload + 32 key channels x 4 B + 5 x 4 value scales = 228,
      x 2 heads + 20 B of index = 476 B: over.
    - Subsets: 2-bit rows r cost 2 x (20 r + 128) + 8 r (a per-head index) = 256 + 48 r: none fits; a full-precision
      row 2 x (256 + 4) = 520 B: none fits. The paper's rule keeps nothing.
    - Per-token keys at 2 bits, one group of 32 channels a row: per head 5 x 16 + 5 x 4 + 5 x 4 = 120, x 2 + 20 = 260.
    """
    seg = _segment(5)
    assert seg.full_bytes == 2560
    assert choose(seg, "quantize", 260, GEOMETRY).rows == 0  # without per-token keys
    got = choose(seg, "quantize", 260, GEOMETRY, per_token_keys=True)
    assert got == JointChoice(5, 2, 32, 0, key_per_token=True)
    assert seg.choice_bytes(got) == 260
    assert choose(seg, "quantize", 259, GEOMETRY, per_token_keys=True).rows == 4  # then the most that fit
    # at the per-channel floor the lookup's choice stands
    assert not choose(seg, "quantize", 476, GEOMETRY, per_token_keys=True).key_per_token
    # a segment of as many rows as channels never takes per-token keys
    assert not choose(_segment(D), "quantize", 100, GEOMETRY, per_token_keys=True).key_per_token


def test_the_sensitivity_model_for_fewer_value_bits() -> None:
    """70 rows (a ViT image and a question), fp32, at 5% of their bytes (1,792 B), each head's rows named by a bitmap
    over the 70 rows (2 x 9 B): at 2/2 bits 37 rows fit (2 x (20 r + 128) + 18 = 1,754 <= 1,792); at 2-bit keys and
    1-bit values 47 (2 x (16 r + 128) + 18 = 1,778). Rows alike: 1 - 37/70 + 37/70 / 16 = 0.505 against
    1 - 47/70 + 47/70 x (1/16 + 1/4) / 2 = 0.434."""
    seg = _segment(70)
    assert row_loss(1) == 0.25 and row_loss(FULL_BITS) == 0.0
    two = choose(seg, "quantize", 1792, GEOMETRY)
    assert (two.rows, two.bits, two.vbits) == (37, 2, 2) and seg.choice_bytes(two) == 1754
    one = choose(seg, "quantize", 1792, GEOMETRY, value_floor=1)
    assert (one.rows, one.bits, one.vbits) == (47, 2, 1) and seg.choice_bytes(one) == 1778
    assert choice_error(seg, two) == pytest.approx(1 - 37 / 70 + 37 / 70 / 16)
    assert choice_error(seg, one) == pytest.approx(1 - 47 / 70 + 47 / 70 * (1 / 16 + 1 / 4) / 2)
    # weighted by attention mass: when the best 37 rows draw 95% of it, dropping the rest costs less than 1-bit values
    mass = tuple([0.0] + [0.95 * (k + 1) / 37 for k in range(37)] + [0.95 + 0.05 * (k + 1) / 33 for k in range(33)])
    focused = choose(Segment(**{**seg.__dict__, "kept_mass": mass}), "quantize", 1792, GEOMETRY, value_floor=1)
    assert (focused.rows, focused.vbits) == (37, 2)


def test_held_value_bits_never_rise() -> None:
    held = Segment(
        full_rows=70, held_rows=38, held_bits=2, held_bytes=10**6, shared_rows=False, num_kv_heads=H, head_dim=D,
        elem=4, held_value_bits=1,
    )  # fmt: skip
    for kind in ("quantize", "evict"):
        choice = choose(held, kind, 1000, GEOMETRY, value_floor=2)
        assert choice.bits <= 2 and choice.vbits <= 1 and choice.rows <= 38, (kind, choice)


@pytest.mark.parametrize("value_bits, per_token", [(1, False), (2, True), (1, True)])
def test_compress_rows_makes_the_store_the_choice_counted(value_bits: int, per_token: bool) -> None:
    gen = torch.Generator().manual_seed(value_bits + 2 * per_token)
    layer = SegmentedLayer()
    n = 20
    layer.append(torch.randn(n, H, D, generator=gen), torch.randn(n, H, D, generator=gen),
                 torch.full((n,), int(TT.INSTRUCTION), dtype=torch.int8))  # fmt: skip
    seg = _segment(n)
    scores = torch.rand(n, H, generator=gen)
    for keep in (n, 12):  # every row (one shared index), then a per-head subset of the held store
        choice = JointChoice(keep, 2, 16, 0, None if value_bits == 2 else value_bits, per_token)
        store = compress_rows(layer, [0], choice, scores, fit_values=True)
        assert isinstance(store, QuantizedStore)
        assert (store.value_bits, store.key_per_token, store.num_tokens) == (value_bits, per_token, keep)
        if keep == n:
            assert store.nbytes() == seg.choice_bytes(choice)
        assert store.nbytes() < seg.full_bytes


def test_the_allocation_offers_fewer_value_bits_only_with_fitted_ranges(monkeypatch) -> None:
    settings = unicache_allocation.AllocationSettings(None, GEOMETRY, 0.25, True)  # type: ignore[arg-type]
    assert settings.value_floor == 2  # the default: measured, fewer value bits lose on the bundled model (§11.13)
    monkeypatch.setattr(unicache_allocation, "VALUE_FLOOR_BITS", 1)
    assert settings.value_floor == 1
    assert unicache_allocation.AllocationSettings(None, GEOMETRY, 0.25, False).value_floor == 2  # type: ignore[arg-type]
