"""Reference KIVI (tuning-free asymmetric 2-bit KV quantization, https://arxiv.org/abs/2402.02750), written from the
paper's formulas (docs/compression.md §6) and the byte count of docs/compression.md §1, importing nothing of the
library's quantizer, so that the library's packed stores can be checked against it.

The storage convention both follow (docs/compression.md §1: one convention for every method): scales and zeros are
held in fp16, the zero rounded down and the scale rounded up to the next fp16 value, so that every code stays in
range with the stored scale; a group whose values are all equal gets scale 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

#: UniCache's quantization lookup (docs/compression.md §8.6, from the paper's code): (nominal retained ratio,
#: bits, group) rows; the highest row at or below a target is taken, 2 bits being the floor of the family.
LOOKUP: tuple[tuple[float, int, int], ...] = (
    (0.125, 2, 128),
    (0.200, 2, 64),
    (0.250, 2, 32),
    (0.375, 4, 128),
    (0.450, 4, 64),
    (0.500, 4, 32),
    (0.625, 8, 128),
    (0.700, 8, 64),
    (0.800, 8, 32),
)

#: The residual the lookup's rows keep in the cache dtype (docs/compression.md §8.6).
LOOKUP_RESIDUAL = 32

#: Bytes of one group's scale and zero-point (two fp16 values).
GROUP_META_BYTES = 4

#: Bytes of one row's position index (int32), which a store keeps beside the rows (docs/compression.md §1).
INDEX_BYTES = 4


def _fp16_at_most(value: float) -> float:
    """The largest fp16 value that is <= ``value``."""
    half = torch.tensor(value, dtype=torch.float16)
    if float(half) > value:
        half = torch.nextafter(half, torch.tensor(-math.inf, dtype=torch.float16))
    return float(half)


def _fp16_at_least(value: float) -> float:
    """The smallest fp16 value that is >= ``value``."""
    half = torch.tensor(value, dtype=torch.float16)
    if float(half) < value:
        half = torch.nextafter(half, torch.tensor(math.inf, dtype=torch.float16))
    return float(half)


def fake_quantize_group(group: Tensor, bits: int) -> Tensor:
    """One group's round trip: ``s = (max - min) / (2^b - 1)``, ``z = min``, ``q = clamp(round((x - z) / s))``,
    ``x_hat = q s + z`` (fp32), with ``s`` and ``z`` stored as the module docstring says. ``group``: any shape."""
    x = group.float()
    zero = _fp16_at_most(float(x.min()))
    scale = _fp16_at_least((float(x.max()) - zero) / ((1 << bits) - 1)) or 1.0
    codes = torch.clamp(torch.round((x - zero) / scale), 0, (1 << bits) - 1)
    return codes * scale + zero


@dataclass(frozen=True)
class KIVIPolicy:
    """Quantize a segment's keys per channel and values per token, keeping the newest rows exact.

    Parameters
    ----------
    bits : int, default 2
        Code width: 2, 4 or 8.
    group_size : int, default 32
        ``G``: tokens per key group (per channel) and channels per value group (per token).
    residual : int, default 128
        ``R``: the last ``R`` rows of the segment stay in the cache dtype.
    """

    bits: int = 2
    group_size: int = 32
    residual: int = 128

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or self.bits not in (2, 4, 8):
            raise ValueError(f"`bits` must be one of (2, 4, 8), got {self.bits!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size <= 0:
            raise ValueError(f"`group_size` must be a positive int, got {self.group_size!r}")
        if isinstance(self.residual, bool) or not isinstance(self.residual, int) or self.residual < 0:
            raise ValueError(f"`residual` must be an int >= 0, got {self.residual!r}")

    def round_trip(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """What a KIVI cache gives back for ``keys/values [T, Hkv, d]``: the first ``T - R`` rows quantized and
        dequantized (fp32), the last ``R`` rows unchanged; both ``[T, Hkv, d]``."""
        t, hkv, d = keys.shape
        n = max(0, t - self.residual)
        k_hat, v_hat = keys.float().clone(), values.float().clone()
        g = self.group_size
        for head in range(hkv):
            for start in range(0, n, g):  # keys: per channel, over G consecutive tokens
                rows = slice(start, min(start + g, n))
                for channel in range(d):
                    k_hat[rows, head, channel] = fake_quantize_group(keys[rows, head, channel], self.bits)
            for row in range(n):  # values: per token, over G consecutive channels
                for start in range(0, d, g):
                    cols = slice(start, min(start + g, d))
                    v_hat[row, head, cols] = fake_quantize_group(values[row, head, cols], self.bits)
        return k_hat, v_hat

    def nbytes(self, num_tokens: int, num_kv_heads: int, head_dim: int, elem_bytes: int) -> int:
        """Bytes a store of ``num_tokens`` rows holds (docs/compression.md §1): packed codes (each row's ``d`` codes
        padded to whole bytes), key groups ``ceil((T - R) / G) * d`` and value groups ``(T - R) * ceil(d / G)`` of
        :data:`GROUP_META_BYTES`, the residual at ``elem_bytes``, and an int32 index per row."""
        r = min(self.residual, num_tokens)
        n = num_tokens - r
        payload = 2 * n * math.ceil(head_dim * self.bits / 8)
        groups = math.ceil(n / self.group_size) * head_dim + n * math.ceil(head_dim / self.group_size)
        per_head = payload + groups * GROUP_META_BYTES + r * head_dim * 2 * elem_bytes
        return num_kv_heads * per_head + num_tokens * INDEX_BYTES

    def nominal_ratio(self, num_tokens: int, head_dim: int) -> float:
        """Shape-aware §1 ratio (payload + fp16 scale/zero + fp16 residual) / fp16 K+V, positions excluded."""
        if num_tokens <= 0:
            raise ValueError(f"`num_tokens` must be > 0, got {num_tokens}")
        if head_dim <= 0:
            raise ValueError(f"`head_dim` must be > 0, got {head_dim}")
        held = self.nbytes(num_tokens, 1, head_dim, 2) - num_tokens * INDEX_BYTES
        return held / (num_tokens * head_dim * 2 * 2)

    @classmethod
    def for_ratio(cls, target: float) -> KIVIPolicy | None:
        """Lookup of §8.6: the highest row whose nominal ratio is <= ``target``, residual 32.

        ``target >= 1`` means no quantization (returns ``None``). Below the first row (0.125) the
        most compressed row is returned: 2 bits is the floor of this family.
        """
        target = float(target)
        if not target >= 0.0:  # also rejects NaN
            raise ValueError(f"`target` must be a ratio >= 0, got {target}")
        if target >= 1.0:
            return None
        chosen = LOOKUP[0]
        for row in LOOKUP:
            if row[0] <= target:
                chosen = row
        return cls(bits=chosen[1], group_size=chosen[2], residual=LOOKUP_RESIDUAL)


__all__ = ["GROUP_META_BYTES", "INDEX_BYTES", "KIVIPolicy", "LOOKUP", "LOOKUP_RESIDUAL", "fake_quantize_group"]
