"""Physical per-segment KV storage: uncompressed, evicted (compacted per KV head) and KIVI-quantized.

Every store answers exact attention of new queries over what it really holds and returns the
log-sum-exp, so the stores of one layer can be merged with
:func:`unicache_core.attention.merge_attention` (kv-compression.md §8.8, physical path). Cached keys
are always fully visible, so no store takes a mask.

``positions`` are ORIGINAL token indices in the packed context (int32), not RoPE ids. ``nbytes()`` is
the sum of ``.nbytes`` of every tensor a store holds (payload, scales/zeros, residual and index
tensors); ``nominal_bytes()`` is the same quantity from the closed-form formula of §1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .attention import attention_with_lse, merge_attention
from .quant import QuantizedTensor, quantize_keys, quantize_values, quantized_kv_nbytes
from .segments import TokenType

#: Largest number of quantized tokens dequantized at once in :meth:`QuantizedStore.attend`.
DEQUANT_CHUNK = 8192


def _check_kv(keys: Tensor, values: Tensor, positions: Tensor) -> None:
    if keys.dim() != 3 or keys.shape != values.shape:
        raise ValueError(
            f"`keys`/`values` must both be [T, Hkv, d]; got {tuple(keys.shape)} and {tuple(values.shape)}"
        )
    if positions.dim() != 1 or positions.shape[0] != keys.shape[0]:
        raise ValueError(f"`positions` must be [T] with T={keys.shape[0]}, got shape {tuple(positions.shape)}")


@dataclass
class FullStore:
    """Uncompressed (protected or not yet compressed) rows.

    Attributes:
        keys, values: ``[T, Hkv, d]`` in the cache dtype.
        positions: ``[T]`` int32 original token indices.
        token_type: type of every row.
    """

    keys: Tensor
    values: Tensor
    positions: Tensor
    token_type: TokenType

    def __post_init__(self) -> None:
        _check_kv(self.keys, self.values, self.positions)
        self.positions = self.positions.to(torch.int32)
        self.token_type = TokenType(self.token_type)

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[0])

    def attend(self, q: Tensor, scale: float | None = None) -> tuple[Tensor, Tensor]:
        """``q [Tq, Hq, d]`` → ``(out [Tq, Hq, d], lse [Tq, Hq])`` over all rows."""
        return attention_with_lse(q, self.keys.to(q.dtype), self.values.to(q.dtype), scale=scale)

    def write_kv(self, k_out: Tensor, v_out: Tensor) -> None:
        """Copy the rows head-major into ``k_out/v_out [Hkv, T, d]`` (any float dtype)."""
        k_out.copy_(self.keys.transpose(0, 1))
        v_out.copy_(self.values.transpose(0, 1))

    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.positions.nbytes

    def nominal_bytes(self) -> int:
        t, h, d = self.keys.shape
        return 2 * t * h * d * self.keys.element_size() + 4 * t

    def append(self, keys: Tensor, values: Tensor, positions: Tensor) -> None:
        """Append ``[Tn, Hkv, d]`` rows (copies; the old tensors are released)."""
        _check_kv(keys, values, positions)
        self.keys = torch.cat([self.keys, keys.to(self.keys.dtype)])
        self.values = torch.cat([self.values, values.to(self.values.dtype)])
        self.positions = torch.cat([self.positions, positions.to(torch.int32)])


@dataclass
class EvictedStore:
    """Rows kept by an eviction policy, compacted per KV head (heads may keep different tokens).

    Attributes:
        keys, values: ``[Hkv, n_keep, d]``; a new tensor (the dropped rows are really gone).
        keep_idx: ``[Hkv, n_keep]`` int32 original positions of the kept rows, ascending per head.
        token_type: type of the rows.
    """

    keys: Tensor
    values: Tensor
    keep_idx: Tensor
    token_type: TokenType

    def __post_init__(self) -> None:
        if self.keys.dim() != 3 or self.keys.shape != self.values.shape:
            raise ValueError(
                f"`keys`/`values` must both be [Hkv, n_keep, d]; got {tuple(self.keys.shape)}, "
                f"{tuple(self.values.shape)}"
            )
        if tuple(self.keep_idx.shape) != tuple(self.keys.shape[:2]):
            raise ValueError(f"`keep_idx` must be [Hkv, n_keep]={tuple(self.keys.shape[:2])}, got "
                             f"{tuple(self.keep_idx.shape)}")
        self.keep_idx = self.keep_idx.to(torch.int32)
        self.token_type = TokenType(self.token_type)

    @classmethod
    def from_selection(
        cls, keys: Tensor, values: Tensor, positions: Tensor, keep: Tensor, token_type: TokenType
    ) -> "EvictedStore":
        """Compact ``keys/values [T, Hkv, d]`` to the rows ``keep [Hkv, n_keep]`` (indices into T) per head."""
        _check_kv(keys, values, positions)
        t, h, d = keys.shape
        if keep.dim() != 2 or keep.shape[0] != h:
            raise ValueError(f"`keep` must be [Hkv={h}, n_keep], got shape {tuple(keep.shape)}")
        keep = torch.sort(keep.long(), dim=1).values
        if keep.numel() and (keep.min() < 0 or keep.max() >= t):
            raise ValueError(f"`keep` indices must lie in [0, {t}), got range [{keep.min()}, {keep.max()}]")
        if keep.shape[1] > 1 and bool((keep[:, 1:] == keep[:, :-1]).any()):
            raise ValueError("`keep` must not repeat an index within a head")
        idx = keep.unsqueeze(-1).expand(h, keep.shape[1], d)
        k = torch.gather(keys.transpose(0, 1), 1, idx)  # new [Hkv, n_keep, d] tensor
        v = torch.gather(values.transpose(0, 1), 1, idx)
        return cls(k, v, positions.long()[keep].to(torch.int32), token_type)

    @property
    def num_tokens(self) -> int:
        """Kept rows per KV head."""
        return int(self.keys.shape[1])

    @property
    def positions(self) -> Tensor:
        """``[Hkv, n_keep]`` original positions (per head)."""
        return self.keep_idx

    def attend(self, q: Tensor, scale: float | None = None) -> tuple[Tensor, Tensor]:
        """``q [Tq, Hq, d]`` → ``(out, lse)``; query head ``h`` only sees the rows of KV head ``h // g``."""
        # Row i of every head is an arbitrary (per-head) token; attention never needs the token identity,
        # so the head-major store is handed over as a [n_keep, Hkv, d] view (no copy).
        return attention_with_lse(
            q, self.keys.transpose(0, 1).to(q.dtype), self.values.transpose(0, 1).to(q.dtype), scale=scale
        )

    def write_kv(self, k_out: Tensor, v_out: Tensor) -> None:
        """Copy the kept rows into ``k_out/v_out [Hkv, n_keep, d]`` (row ``i`` of head ``h`` = ``keep_idx[h, i]``)."""
        k_out.copy_(self.keys)
        v_out.copy_(self.values)

    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.keep_idx.nbytes

    def nominal_bytes(self) -> int:
        h, n, d = self.keys.shape
        return h * n * (2 * d * self.keys.element_size() + 4)

    def shrink(self, keep_sub: Tensor) -> "EvictedStore":
        """A new store keeping rows ``keep_sub [Hkv, n_new]`` (indices into this store's rows, n_new <= n_keep).

        Eviction is monotonic: rows can only be dropped, never added back.
        """
        h, n, d = self.keys.shape
        if keep_sub.dim() != 2 or keep_sub.shape[0] != h:
            raise ValueError(f"`keep_sub` must be [Hkv={h}, n_new], got shape {tuple(keep_sub.shape)}")
        if keep_sub.shape[1] > n:
            raise ValueError(f"`keep_sub` asks for {keep_sub.shape[1]} rows but the store holds {n}; "
                             "eviction never adds rows")
        if keep_sub.numel() and (keep_sub.min() < 0 or keep_sub.max() >= n):
            raise ValueError(f"`keep_sub` indices must lie in [0, {n}) (rows of this store), "
                             f"got range [{keep_sub.min()}, {keep_sub.max()}]")
        keep_sub = torch.sort(keep_sub.long(), dim=1).values
        if keep_sub.shape[1] > 1 and bool((keep_sub[:, 1:] == keep_sub[:, :-1]).any()):
            raise ValueError("`keep_sub` must not repeat a row within a head")
        idx = keep_sub.unsqueeze(-1).expand(h, keep_sub.shape[1], d)
        return EvictedStore(
            torch.gather(self.keys, 1, idx), torch.gather(self.values, 1, idx),
            torch.gather(self.keep_idx, 1, keep_sub), self.token_type,
        )


@dataclass
class QuantizedStore:
    """KIVI store: keys per-channel, values per-token, ``bits``-bit packed; the last ``residual`` rows in full precision.

    Attributes:
        qkeys, qvalues: quantized rows ``[0, T - R)`` (head-major, see :mod:`unicache_core.quant`).
        res_keys, res_values: ``[Hkv, R, d]`` residual rows in the cache dtype.
        positions: ``[T]`` int32 original positions (quantized rows first, then the residual).
        dtype: the cache dtype (dequantization target and residual dtype).
    """

    qkeys: QuantizedTensor
    qvalues: QuantizedTensor
    res_keys: Tensor
    res_values: Tensor
    positions: Tensor
    token_type: TokenType
    bits: int
    group_size: int
    residual: int
    dtype: torch.dtype

    @classmethod
    def from_kv(
        cls, keys: Tensor, values: Tensor, positions: Tensor, bits: int = 2, group_size: int = 32,
        residual: int = 128, token_type: TokenType = TokenType.SOURCE_VAE,
    ) -> "QuantizedStore":
        """Quantize ``keys/values [T, Hkv, d]``; the last ``min(residual, T)`` rows stay exact."""
        _check_kv(keys, values, positions)
        if isinstance(residual, bool) or not isinstance(residual, int) or residual < 0:
            raise ValueError(f"`residual` must be an int >= 0, got {residual!r}")
        t = keys.shape[0]
        r = min(residual, t)
        kh, vh = keys.transpose(0, 1), values.transpose(0, 1)  # [Hkv, T, d]
        return cls(
            quantize_keys(kh[:, : t - r], bits, group_size), quantize_values(vh[:, : t - r], bits, group_size),
            kh[:, t - r :].clone(memory_format=torch.contiguous_format),
            vh[:, t - r :].clone(memory_format=torch.contiguous_format), positions.to(torch.int32).clone(),
            TokenType(token_type), bits, group_size, residual, keys.dtype,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def num_quantized(self) -> int:
        return self.qkeys.num_tokens

    def dequantize(self, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """All rows as ``(keys, values)`` ``[T, Hkv, d]`` in ``dtype`` (default: the cache dtype), in ``positions`` order."""
        dtype = self.dtype if dtype is None else dtype
        k = torch.cat([self.qkeys.dequantize(dtype), self.res_keys.to(dtype)], dim=1)
        v = torch.cat([self.qvalues.dequantize(dtype), self.res_values.to(dtype)], dim=1)
        return k.transpose(0, 1), v.transpose(0, 1)

    def attend(self, q: Tensor, scale: float | None = None) -> tuple[Tensor, Tensor]:
        """Dequantize in chunks of <= :data:`DEQUANT_CHUNK` tokens and attend; ``q [Tq, Hq, d]``."""
        n = self.num_quantized
        h, r, d = self.res_keys.shape
        # Key groups must not straddle chunks.
        chunk = max(self.group_size, DEQUANT_CHUNK // self.group_size * self.group_size)
        parts = []
        start = 0
        while start < n or (start == 0 and r):
            stop = min(n, start + chunk)
            last = stop >= n
            extra = r if last else 0
            k = torch.empty(h, stop - start + extra, d, dtype=q.dtype, device=q.device)
            v = torch.empty_like(k)
            if stop > start:
                self.qkeys.dequantize_into(k[:, : stop - start], start, stop)
                self.qvalues.dequantize_into(v[:, : stop - start], start, stop)
            if extra:
                k[:, stop - start :] = self.res_keys
                v[:, stop - start :] = self.res_values
            parts.append(attention_with_lse(q, k.transpose(0, 1), v.transpose(0, 1), scale=scale))
            if last:
                break
            start = stop
        if not parts:
            return attention_with_lse(q, q.new_zeros(0, h, d), q.new_zeros(0, h, d), scale=scale)
        return merge_attention(parts)

    def write_kv(self, k_out: Tensor, v_out: Tensor) -> None:
        """Dequantize every row (quantized, then residual) into ``k_out/v_out [Hkv, T, d]`` (any float dtype).

        For the fast path each head's slice ``k_out[h]`` should be contiguous (e.g. a token range of a
        contiguous ``[Hkv, T_total, d]`` workspace).
        """
        n = self.num_quantized
        if n:
            self.qkeys.dequantize_into(k_out[:, :n])
            self.qvalues.dequantize_into(v_out[:, :n])
        if self.res_keys.shape[1]:
            k_out[:, n:] = self.res_keys
            v_out[:, n:] = self.res_values

    def nbytes(self) -> int:
        return (self.qkeys.nbytes() + self.qvalues.nbytes() + self.res_keys.nbytes + self.res_values.nbytes
                + self.positions.nbytes)

    def nominal_bytes(self) -> int:
        h, _, d = self.res_keys.shape
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return quantized_kv_nbytes(
            self.num_tokens, h, d, self.bits, self.group_size, self.residual, elem,
            key_group_bytes=2 * self.qkeys.scale.element_size(),
            value_group_bytes=2 * self.qvalues.scale.element_size(),
        ) + 4 * self.num_tokens


Store = FullStore | EvictedStore | QuantizedStore

__all__ = ["DEQUANT_CHUNK", "EvictedStore", "FullStore", "QuantizedStore", "Store"]
