"""Reference KIVI (tuning-free asymmetric 2-bit KV quantization, https://arxiv.org/abs/2402.02750) as a
segment-level policy."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from unicache_core.compression.defaults import KIVI_RESIDUAL
from unicache_core.compression.ops import KIVI_LOOKUP
from unicache_core.kv.quant import SUPPORTED_BITS, quantized_kv_nbytes
from unicache_core.kv.stores import QuantizedStore
from unicache_core.kv.token_types import TokenType


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
        if isinstance(self.bits, bool) or self.bits not in SUPPORTED_BITS:
            raise ValueError(f"`bits` must be one of {SUPPORTED_BITS}, got {self.bits!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size <= 0:
            raise ValueError(f"`group_size` must be a positive int, got {self.group_size!r}")
        if isinstance(self.residual, bool) or not isinstance(self.residual, int) or self.residual < 0:
            raise ValueError(f"`residual` must be an int >= 0, got {self.residual!r}")

    def compress(
        self, keys: Tensor, values: Tensor, positions: Tensor, token_type: TokenType = TokenType.SOURCE_VAE
    ) -> QuantizedStore:
        """Quantize ``keys/values [T, Hkv, d]`` with original ``positions [T]`` into a packed store."""
        return QuantizedStore.from_kv(keys, values, positions, self.bits, self.group_size, self.residual, token_type)

    def nominal_ratio(self, num_tokens: int, head_dim: int) -> float:
        """Shape-aware §1 ratio (payload + fp16 scale/zero + fp16 residual) / fp16 K+V, positions excluded."""
        if num_tokens <= 0:
            raise ValueError(f"`num_tokens` must be > 0, got {num_tokens}")
        if head_dim <= 0:
            raise ValueError(f"`head_dim` must be > 0, got {head_dim}")
        held = quantized_kv_nbytes(num_tokens, 1, head_dim, self.bits, self.group_size, self.residual, 2)
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
        chosen = KIVI_LOOKUP[0]
        for row in KIVI_LOOKUP:
            if row[0] <= target:
                chosen = row
        return cls(bits=chosen[1], group_size=chosen[2], residual=KIVI_RESIDUAL)


__all__ = ["KIVIPolicy"]
