"""KIVI-style asymmetric quantization of KV tensors with real bit packing.

KIVI (https://arxiv.org/abs/2402.02750) quantizes keys **per channel** (a group of ``G`` consecutive
tokens shares one scale/zero per channel) and values **per token** (each token's ``d`` channels are
split into groups of ``G`` channels). Both use asymmetric min-max quantization::

    s = (max - min) / (2^b - 1),  z = min,  q = clamp(round((x - z) / s), 0, 2^b - 1),  x_hat = q * s + z

Values may instead be quantized with **fitted ranges** (``quantize_values(..., fit=True)``, UniCache's choice):
each group's ``(s, z)`` is fitted to its values by least squares (:mod:`.ranges`, docs/compression.md §11.10).

Storage convention (used by every byte formula in this project):

* codes are packed ``8 // b`` per byte along the channel axis (``b`` in {1, 2, 4, 8}; 1 bit: UniCache's values below
  the 2-bit floor, docs/compression.md §11.13; KIVI's lookup uses 2, 4 and 8, :data:`SUPPORTED_BITS`);
* scales and zero-points are **fp16** (2 + 2 bytes per group, docs/compression.md §1). They are rounded
  *before* the codes are computed (zero rounded down, scale rounded up), so the error bound
  ``|x - x_hat| <= s/2`` holds with the stored fp16 scale. A tensor whose values (or ranges) would not
  fit fp16 (|x| beyond ~32K, possible in bf16/fp32 models) keeps fp32 scales instead (8 bytes per
  group); every byte count reads the dtype actually stored, so this is never silent in the accounting;
* a ragged last key group (fewer than ``G`` tokens) is stored as is: no padding, no wasted bytes.

Layout is head-major: codes ``[Hkv, T, ceil(d*b/8)]``; key scales ``[Hkv, ceil(T/G), d]``; value scales
``[Hkv, T, ceil(d/G)]``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import NonFiniteKVError
from ..validation import check_int
from .dequant import dequantize_channel, dequantize_token, unpack_codes
from .ranges import codes_for, fit_ranges, minmax_ranges

#: The bit widths of KIVI's lookup (docs/compression.md §8.6).
SUPPORTED_BITS = (2, 4, 8)
#: Every bit width a tensor can be packed at: the lookup's and 1 bit (8 codes per byte, §11.13).
PACKED_BITS = (1, *SUPPORTED_BITS)
SCALE_DTYPE = torch.float16
#: Bytes of metadata per quantization group (fp16 scale + fp16 zero-point).
BYTES_PER_GROUP = 4
#: Values beyond this magnitude switch a tensor's scales/zeros to fp32 (half of fp16's max leaves room
#: for the range ``max - min`` and the upward rounding of the scale).
_FP16_SAFE = torch.finfo(torch.float16).max / 2


def scale_dtype_for(x: Tensor) -> torch.dtype:
    """fp16 (the convention) unless ``x`` holds magnitudes fp16 scales/zeros could not represent."""
    return _scale_dtype_for_largest(float(x.abs().max())) if x.numel() else SCALE_DTYPE


def _scale_dtype_for_largest(largest: float) -> torch.dtype:
    """The scale/zero dtype for values whose largest magnitude is ``largest``: fp16 unless it cannot hold them."""
    return torch.float32 if largest > _FP16_SAFE else SCALE_DTYPE


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or bits not in PACKED_BITS:
        raise ValueError(f"`bits` must be one of {PACKED_BITS}, got {bits!r}")
    return int(bits)


def _check_group(group_size: int) -> int:
    return check_int("group_size", group_size, 1)


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack ``b``-bit codes along the last axis, ``8 // b`` codes per byte (first code in the low bits).

    Args:
        codes: ``[..., n]`` uint8, every value ``< 2**bits``.
        bits: 1, 2, 4 or 8.

    Returns:
        ``[..., ceil(n * bits / 8)]`` uint8.
    """
    bits = _check_bits(bits)
    if codes.dtype != torch.uint8:
        raise ValueError(f"`codes` must be uint8, got {codes.dtype}")
    if bits == 8:
        return codes.clone()
    per = 8 // bits
    n = codes.shape[-1]
    pad = (-n) % per
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    grouped = codes.reshape(*codes.shape[:-1], (n + pad) // per, per)
    # the codes of one byte occupy disjoint bits, so their sum is their bitwise or (and stays below 256)
    return (grouped << _shifts(bits, codes.device)).sum(dim=-1, dtype=torch.uint8)


@functools.lru_cache(maxsize=16)
def _shifts(bits: int, device: torch.device) -> Tensor:
    """``[8 // bits]`` uint8 bit offsets of the codes packed in one byte (first code in the low bits)."""
    return torch.arange(8 // bits, dtype=torch.uint8, device=device) * bits


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    """Exact inverse of :func:`pack_bits`.

    Args:
        packed: ``[..., ceil(n * bits / 8)]`` uint8.
        bits: 1, 2, 4 or 8.
        n: number of codes per row before packing.

    Returns:
        ``[..., n]`` uint8 codes.
    """
    bits = _check_bits(bits)
    per = 8 // bits
    if packed.shape[-1] != -(-n // per):
        raise ValueError(f"`packed` last dim {packed.shape[-1]} does not hold n={n} codes of {bits} bits")
    if bits == 8:
        return packed.clone()
    shifts = _shifts(bits, packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :n]


def _unpack(packed: Tensor, bits: int, n: int) -> Tensor:
    """:func:`unpack_bits` without validation or copies when ``n`` fills the bytes (hot path)."""
    if bits == 8:
        return packed
    shifts = _shifts(bits, packed.device)
    codes = ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).view(*packed.shape[:-1], -1)
    return codes if codes.shape[-1] == n else codes[..., :n].contiguous()


def unpack_into(packed: Tensor, bits: int, out: Tensor) -> Tensor:
    """Unpack ``packed [..., n * bits / 8]`` uint8 straight into ``out [..., n]`` (a float dtype): equals
    ``unpack_bits(packed, bits, n).to(out.dtype)`` (:func:`.dequant.unpack_codes`; ``n * bits`` a multiple of 8)."""
    return unpack_codes(packed, _check_bits(bits), out)


@dataclass(frozen=True)
class StoreLayout:
    """How a quantized store departs from KIVI's layout below the 2-bit floor (docs/compression.md §11.13): the values'
    bits when fewer than the keys' (``value_bits``, ``None``: the keys'), keys grouped per token (``key_per_token``: a
    row's channels share a scale and zero) instead of per channel."""

    value_bits: int | None = None
    key_per_token: bool = False

    def values(self, bits: int) -> int:
        """The values' bits of a store whose keys have ``bits``."""
        return bits if self.value_bits is None else self.value_bits


#: KIVI's own layout: values at the keys' bits, keys per channel.
KIVI_LAYOUT = StoreLayout()


@dataclass
class QuantizedTensor:
    """Packed KIVI codes of one K or V tensor plus fp16 scales and zero-points.

    Attributes:
        packed: ``[Hkv, T, ceil(d*bits/8)]`` uint8.
        scale, zero: fp16; keys (``axis="channel"``) ``[Hkv, ceil(T/G), d]``, values (``axis="token"``)
            ``[Hkv, T, ceil(d/G)]``.
        bits, group_size, head_dim, axis: how to read the codes.
    """

    packed: Tensor
    scale: Tensor
    zero: Tensor
    bits: int
    group_size: int
    head_dim: int
    axis: str  # "channel" (keys: groups of tokens) or "token" (values: groups of channels)

    @property
    def num_tokens(self) -> int:
        return int(self.packed.shape[1])

    def nbytes(self) -> int:
        """Bytes really held: packed codes + scales + zero-points."""
        return self.packed.nbytes + self.scale.nbytes + self.zero.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32, start: int = 0, stop: int | None = None) -> Tensor:
        """Dequantized tokens ``[start, stop)`` as head-major ``[Hkv, stop - start, d]`` in ``dtype``.

        For keys ``start`` must be a multiple of ``group_size`` (chunks never split a key group).
        """
        start, stop = self._span(start, stop)
        out = torch.empty(self.packed.shape[0], stop - start, self.head_dim, dtype=dtype, device=self.packed.device)
        self.dequantize_into(out, start, stop)
        return out

    def select_tokens(self, rows: Tensor, group_size: int | None = None) -> QuantizedTensor:
        """The rows ``rows [Hkv, m]`` (positions per head) of a per-token tensor (values), codes and scales as they
        are: dropping rows of a per-token tensor needs no re-quantization. ``group_size`` relabels the channel
        groups when the new size groups the channels the same way (one group per row: any size >= d)."""
        if self.axis != "token":
            raise ValueError(
                "only per-token (value) rows can be selected without re-quantizing; key groups span several rows"
            )
        group = self.group_size if group_size is None else group_size
        if -(-self.head_dim // group) != self.scale.shape[-1] or (
            self.scale.shape[-1] > 1 and group != self.group_size
        ):
            raise ValueError(f"channel groups of {group} do not match the stored groups of {self.group_size}")
        rows = rows.long()

        def pick(t: Tensor) -> Tensor:
            return torch.gather(t, 1, rows.unsqueeze(-1).expand(-1, -1, t.shape[-1]))

        return QuantizedTensor(
            pick(self.packed), pick(self.scale), pick(self.zero), self.bits, group, self.head_dim, self.axis
        )

    def _span(self, start: int, stop: int | None) -> tuple[int, int]:
        t = self.num_tokens
        stop = t if stop is None else min(stop, t)
        if not 0 <= start <= stop:
            raise ValueError(f"`start`/`stop` must satisfy 0 <= start <= stop <= {t}, got {start}, {stop}")
        if self.axis == "channel" and start % self.group_size:
            raise ValueError(f"`start` must be a multiple of group_size={self.group_size} for keys, got {start}")
        return start, stop

    def dequantize_into(self, out: Tensor, start: int = 0, stop: int | None = None) -> Tensor:
        """Write tokens ``[start, stop)`` into ``out [Hkv, stop - start, d]`` (any float dtype; last dim contiguous).

        ``x_hat = q * s + z`` is one fused multiply-add per element reading the uint8 codes directly.
        """
        start, stop = self._span(start, stop)
        g, d = self.group_size, self.head_dim
        h, n = self.packed.shape[0], stop - start
        if tuple(out.shape) != (h, n, d):
            raise ValueError(f"`out` must be [{h}, {n}, {d}], got {tuple(out.shape)}")
        packed = self.packed[:, start:stop]
        if n == 0:
            return out
        if d * self.bits % 8 == 0 and out[0].is_contiguous() and out.dtype.is_floating_point:
            if self.axis == "channel":
                dequantize_channel(out, packed, self.scale, self.zero, self.bits, g, start // g)
            else:
                s, z = self.scale[:, start:stop], self.zero[:, start:stop]
                dequantize_token(out, packed, s, z, self.bits, g)
            return out
        codes = _unpack(packed, self.bits, d)  # [H, n, d] uint8 (ragged bytes / strided out)
        work = out.dtype
        if self.axis == "channel":
            g0 = start // g
            full = n // g
            if full:
                s = self.scale[:, g0 : g0 + full].to(work).unsqueeze(2)  # [H, full, 1, d]
                z = self.zero[:, g0 : g0 + full].to(work).unsqueeze(2)
                torch.addcmul(
                    z, codes[:, : full * g].view(h, full, g, d), s, out=out[:, : full * g].view(h, full, g, d)
                )
            if n > full * g:
                s = self.scale[:, g0 + full].to(work).unsqueeze(1)  # [H, 1, d]
                z = self.zero[:, g0 + full].to(work).unsqueeze(1)
                out[:, full * g :] = torch.addcmul(z, codes[:, full * g :].to(work), s)
        else:
            ng = self.scale.shape[-1]
            s = self.scale[:, start:stop].to(work)  # [H, n, ng]
            z = self.zero[:, start:stop].to(work)
            if d % g == 0 or ng == 1:
                gc = d // ng
                torch.addcmul(z.unsqueeze(-1), codes.view(h, n, ng, gc), s.unsqueeze(-1), out=out.view(h, n, ng, gc))
            else:  # ragged channel groups: expand the scales per channel
                cmap = torch.arange(d, device=codes.device) // g
                out.copy_(torch.addcmul(z[..., cmap], codes.to(work), s[..., cmap]))
        return out


def _checked_scale_dtype(name: str, x: Tensor) -> torch.dtype:
    """:func:`scale_dtype_for` ``x``, refusing non-finite input in the same pass (one reduction, one host sync):
    min-max quantization spreads one NaN/inf over its whole group. ``max`` of ``|x|`` is NaN or inf exactly when
    ``x`` holds one."""
    if not x.numel():
        return SCALE_DTYPE
    largest = float(x.abs().max())
    if not math.isfinite(largest):
        bad = int((~torch.isfinite(x)).sum())
        raise NonFiniteKVError(
            f"the {name} to cache hold {bad} non-finite (NaN/inf) values: the model's computation overflowed before "
            f"the KV cache (in fp16, whose range is ±65504, use bf16 or fp32)",
            bad,
        )
    return _scale_dtype_for_largest(largest)


def quantize_keys(keys: Tensor, bits: int, group_size: int, per_token: bool = False) -> QuantizedTensor:
    """Per-channel quantization of ``[Hkv, T, d]`` keys: groups of ``group_size`` tokens (last may be short);
    ``per_token``: each key's channels in groups of ``group_size`` instead, min-max (a segment of fewer rows than
    channels pays less for them, docs/compression.md §11.13)."""
    if per_token:
        return quantize_values(keys, bits, group_size)
    bits, g = _check_bits(bits), _check_group(group_size)
    if keys.dim() != 3:
        raise ValueError(f"`keys` must be [Hkv, T, d], got shape {tuple(keys.shape)}")
    h, t, d = keys.shape
    x = keys.float()
    meta_dtype = _checked_scale_dtype("keys", x)
    if not t:
        empty = torch.empty(h, 0, d, dtype=meta_dtype, device=keys.device)
        return QuantizedTensor(
            pack_bits(torch.empty(h, 0, d, dtype=torch.uint8, device=keys.device), bits),
            empty,
            empty.clone(),
            bits,
            g,
            d,
            "channel",
        )
    groups = -(-t // g)
    pad = groups * g - t
    if pad:  # the short last group is padded with copies of its last row: its min and max are unchanged
        x = torch.cat([x, x[:, -1:].expand(h, pad, d)], dim=1)
    grouped = x.reshape(h, groups, g, d)
    s, z = minmax_ranges(grouped.amin(dim=2), grouped.amax(dim=2), bits, meta_dtype)  # [H, groups, d]
    codes = codes_for(grouped, s.unsqueeze(2), z.unsqueeze(2), bits).reshape(h, groups * g, d)
    return QuantizedTensor(pack_bits(codes[:, :t] if pad else codes, bits), s, z, bits, g, d, "channel")


def quantize_values(values: Tensor, bits: int, group_size: int, fit: bool = False) -> QuantizedTensor:
    """Per-token quantization of ``[Hkv, T, d]`` values: each token's channels in groups of ``group_size``;
    ``fit``: least-squares ranges (module docstring) instead of min-max."""
    bits, g = _check_bits(bits), _check_group(group_size)
    if values.dim() != 3:
        raise ValueError(f"`values` must be [Hkv, T, d], got shape {tuple(values.shape)}")
    h, t, d = values.shape
    x = values.float()
    meta_dtype = _checked_scale_dtype("values", x)
    ng = -(-d // g)
    span = d if ng == 1 else g  # one group per row: its min and max are the row's (nothing to pad)
    pad = ng * span - d
    if pad:  # pad with a copy of the last channel so min/max of the short group are unchanged
        xp = torch.cat([x, x[..., -1:].expand(h, t, pad)], dim=-1)
    else:
        xp = x
    grouped = xp.reshape(h, t, ng, span) if t else xp.new_zeros(h, 0, ng, span)
    s, z = minmax_ranges(grouped.amin(dim=-1), grouped.amax(dim=-1), bits, meta_dtype)  # [H, T, ng]
    if fit and grouped.numel():
        real = None
        if pad:  # the padding channels must not pull the fit towards the last channel
            real = (torch.arange(ng * span, device=x.device) < d).to(x.dtype).view(1, 1, ng, span)
        s, z, codes = fit_ranges(grouped, -1, s, z, bits, real)
    else:
        codes = codes_for(grouped, s.unsqueeze(-1), z.unsqueeze(-1), bits)
    codes = codes.reshape(h, t, ng * span)[..., :d]
    return QuantizedTensor(pack_bits(codes.contiguous(), bits), s, z, bits, g, d, "token")


def quantized_kv_nbytes(
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    bits: int,
    group_size: int,
    residual: int,
    elem_bytes: int,
    key_group_bytes: int = BYTES_PER_GROUP,
    value_group_bytes: int = BYTES_PER_GROUP,
    layout: StoreLayout = KIVI_LAYOUT,
) -> int:
    """Bytes of packed KIVI K+V for ``num_tokens`` tokens (docs/compression.md §1, fp16 scale/zero): keys at
    ``bits``, values and key groups as ``layout`` says (KIVI's: values at ``bits``, keys per channel; §11.13).

    The last ``min(residual, num_tokens)`` tokens are counted at ``elem_bytes`` (the cache dtype).
    ``key_group_bytes`` / ``value_group_bytes``: scale + zero bytes per group (8 where fp32 scales were
    needed, see :func:`scale_dtype_for`). Token positions are not included.
    """
    r = min(residual, num_tokens)
    n = num_tokens - r
    vbits = layout.values(bits)
    payload = n * (-(-head_dim * bits // 8) + -(-head_dim * vbits // 8))
    key_groups = n * (-(-head_dim // group_size)) if layout.key_per_token else -(-n // group_size) * head_dim
    key_meta = key_groups * key_group_bytes
    value_meta = n * (-(-head_dim // group_size)) * value_group_bytes
    res = r * head_dim * 2 * elem_bytes
    return num_kv_heads * (payload + key_meta + value_meta + res)


__all__ = [
    "BYTES_PER_GROUP",
    "PACKED_BITS",
    "QuantizedTensor",
    "KIVI_LAYOUT",
    "SCALE_DTYPE",
    "StoreLayout",
    "SUPPORTED_BITS",
    "pack_bits",
    "quantize_keys",
    "quantize_values",
    "quantized_kv_nbytes",
    "scale_dtype_for",
    "unpack_bits",
    "unpack_into",
]
