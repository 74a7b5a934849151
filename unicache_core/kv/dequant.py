"""Reading packed KIVI codes back (docs/compression.md §1, §6): unpacking the codes and ``x_hat = q * s + z``.

The layout is :mod:`.quant`'s: codes packed ``8 // b`` per byte along the channel axis (first code in the low bits),
head-major ``[Hkv, T, nb]``; keys per channel (scales ``[Hkv, ceil(T/G), d]``), values and per-token keys per token
(scales ``[Hkv, T, ceil(d/G)]``).

Unpacking spreads each byte's codes into bytes of a wider integer with shifts and one mask (2 bits: ``b | b << 6``,
then ``| << 12``, masked by ``0x03030303``, gives the four codes as the four bytes of an int32 in order on a
little-endian machine), then converts those bytes to floats: a few vectorised passes over all heads at once, with no
gather. Dequantization works in blocks of :data:`BLOCK_CODES` codes (all heads of a run of rows), so the
temporaries stay in the CPU's caches; one rounding of ``q * s + z`` computed in fp32 (``q * s`` is exact: an 8-bit code
times an fp16 scale fits fp32's mantissa), so a bf16 or fp16 output is that fp32 value rounded once. Buffers come
from :mod:`.scratch`.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from .scratch import scratch

#: Codes (all heads of a run of rows) dequantized per block: 1M codes, 4 MiB of fp32 (in the last-level cache; a
#: smaller block pays each of its dozen tensor operations' fixed cost more often).
BLOCK_CODES = 1 << 20

#: bits -> (integer dtype holding one byte's codes, shifts doubling the spread, mask of the codes' bits).
_SPREAD: dict[int, tuple[torch.dtype, tuple[int, ...], int]] = {
    1: (torch.int64, (7, 14, 28), 0x0101010101010101),
    2: (torch.int32, (6, 12), 0x03030303),
    4: (torch.int16, (4,), 0x0F0F),
}
_LITTLE_ENDIAN = sys.byteorder == "little"


def unpack_codes(packed: Tensor, bits: int, out: Tensor) -> Tensor:
    """Unpack ``packed [..., nb]`` uint8 into ``out [..., nb * 8 // bits]`` (a float dtype, any strides).

    Equals ``unpack_bits(packed, bits, n).to(out.dtype)`` of :mod:`.quant` (codes below 256 are exact in every float
    dtype). ``bits`` in {1, 2, 4, 8}; ``n * bits`` must fill whole bytes.
    """
    per = 8 // bits
    shape = (*packed.shape[:-1], packed.shape[-1] * per)
    if tuple(out.shape) != shape:
        raise ValueError(f"`out` must have shape {shape}, got {tuple(out.shape)}")
    if bits == 8:
        return out.copy_(packed)
    wide, shifts, mask = _SPREAD[bits]
    if not _LITTLE_ENDIAN:  # the spread bytes come out in reverse order: shift each code out instead
        offsets = torch.arange(per, dtype=torch.uint8, device=packed.device) * bits
        codes = (packed.unsqueeze(-1) >> offsets) & ((1 << bits) - 1)
        return out.copy_(codes.view(out.shape))
    spread = scratch("dequant.spread", tuple(packed.shape), wide, packed.device)
    spread.copy_(packed)
    moved = scratch("dequant.moved", tuple(packed.shape), wide, packed.device)
    for shift in shifts:  # each step doubles the codes already in place, in bytes of their own
        torch.mul(spread, 1 << shift, out=moved)
        spread.bitwise_or_(moved)
    spread.bitwise_and_(mask)
    return out.copy_(spread.view(torch.uint8).view(out.shape))


def block_rows(heads: int, head_dim: int, multiple: int = 1) -> int:
    """Rows per dequantization block of ``heads`` heads of ``head_dim`` codes (:data:`BLOCK_CODES`), a multiple of
    ``multiple`` (a key group: blocks never split one)."""
    rows = max(1, BLOCK_CODES // max(1, heads * head_dim))
    return max(multiple, rows // multiple * multiple)


def dequantize_channel(
    out: Tensor, packed: Tensor, scale: Tensor, zero: Tensor, bits: int, group: int, first_group: int
) -> None:
    """Per-channel (key) codes into ``out [Hkv, n, d]`` (any float dtype, each head's rows contiguous): ``packed [Hkv,
    n, nb]`` uint8 starting at a group boundary, ``scale``/``zero`` ``[Hkv, groups, d]``, group ``first_group`` first
    (the last group of ``packed`` may be short). The codes are exact in ``out``'s dtype, and ``addcmul`` computes
    ``q * s + z`` in fp32 and rounds it once, so ``out`` takes it directly."""
    h, n, d = out.shape
    step = block_rows(h, d, group)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        dst = out[:, r0:r1]
        unpack_codes(packed[:, r0:r1], bits, dst)
        g0 = first_group + r0 // group
        full = (r1 - r0) // group
        if full:
            s = scale[:, g0 : g0 + full].to(out.dtype).unsqueeze(2)  # [H, full, 1, d]
            z = zero[:, g0 : g0 + full].to(out.dtype).unsqueeze(2)
            body = dst[:, : full * group].view(h, full, group, d)
            torch.addcmul(z, body, s, out=body)
        if r1 - r0 > full * group:
            s = scale[:, g0 + full].to(out.dtype).unsqueeze(1)  # [H, 1, d]
            z = zero[:, g0 + full].to(out.dtype).unsqueeze(1)
            tail = dst[:, full * group :]
            torch.addcmul(z, tail, s, out=tail)


def dequantize_token(out: Tensor, packed: Tensor, scale: Tensor, zero: Tensor, bits: int, group: int) -> None:
    """Per-token (value) codes into ``out [Hkv, n, d]`` (any float dtype, each head's rows contiguous): ``packed [Hkv,
    n, nb]`` uint8, ``scale``/``zero`` ``[Hkv, n, ceil(d/G)]`` of the same rows."""
    h, n, d = out.shape
    groups = scale.shape[-1]
    ragged = d % group != 0 and groups > 1
    width = d if ragged else d // groups
    channel_group = torch.arange(d, device=out.device) // group if ragged else None
    step = block_rows(h, d)
    work = torch.float32  # in place, a scale broadcast over the channels is fastest as a mul and an add, in fp32
    buffer = None if out.dtype == work else scratch("dequant.work", (h, min(step, n), d), work, out.device)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        rows = r1 - r0
        dst = out[:, r0:r1] if buffer is None else buffer[:, :rows]
        unpack_codes(packed[:, r0:r1], bits, dst)
        s = scale[:, r0:r1].to(out.dtype).to(work)  # [H, rows, groups], rounded as out
        z = zero[:, r0:r1].to(out.dtype).to(work)
        if channel_group is not None:  # ragged channel groups: each channel its group's scale
            dst.mul_(s[..., channel_group]).add_(z[..., channel_group])
        else:
            grouped = dst.view(h, rows, groups, width)
            grouped.mul_(s.unsqueeze(-1)).add_(z.unsqueeze(-1))
        if buffer is not None:
            out[:, r0:r1].copy_(dst)


__all__ = ["BLOCK_CODES", "block_rows", "dequantize_channel", "dequantize_token", "unpack_codes"]
