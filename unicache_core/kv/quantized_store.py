"""The KIVI-quantized KV store (:class:`QuantizedStore`): keys per channel, values per token, packed at 2, 4 or 8 bits
(values also at 1 bit, keys also per token: docs/compression.md §11.13), the last rows in full precision; the same
:class:`~unicache_core.kv.stores.KVStore` interface as the full and evicted stores of :mod:`unicache_core.kv.stores`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ..validation import check_int
from .attention import attention_with_lse, merge_attention
from .index_runs import index_runs
from .packed_attention_triton import packed_attention_kernel
from .quant import QuantizedTensor, StoreLayout, quantize_keys, quantize_values, quantized_kv_nbytes
from .row_index import RowIndex, Runs
from .scratch import scratch
from .stores import KVStore, StoreKind, check_kv
from .token_types import TokenType

#: Most quantized rows :meth:`QuantizedStore.attend` dequantizes at once for a call of many queries (the
#: dequantization is then a small share of the attention, and one large chunk attends fastest).
DEQUANT_CHUNK = 8192
#: Queries per KV head (query heads of a group times the call's queries) from which a call counts as one of many.
MANY_QUERIES = 64
#: Codes (rows x KV heads x channels) a chunk holds for a call of few queries: its K and V stay in the CPU's caches
#: between the dequantization and the attention that reads them.
FEW_QUERY_CHUNK_CODES = 1 << 20


def _workspace(shape: tuple[int, int, int], q: Tensor, reuse: bool) -> tuple[Tensor, Tensor]:
    """K and V workspaces of ``shape`` in ``q``'s dtype: scratch buffers (:mod:`.scratch`) for the cache-sized chunks
    of a call of few queries, where mapping a fresh one costs a visible share of the call; else for this call alone
    (a large workspace kept between calls would add to the peak of the next ones)."""
    if reuse:
        return scratch("packed.keys", shape, q.dtype, q.device), scratch("packed.values", shape, q.dtype, q.device)
    keys = torch.empty(shape, dtype=q.dtype, device=q.device)
    return keys, torch.empty_like(keys)


def chunk_rows(queries_per_head: int, heads: int, head_dim: int, multiple: int) -> int:
    """Rows of packed K/V dequantized and attended at once by a call of ``queries_per_head`` queries per KV head, a
    multiple of ``multiple`` (a key group: chunks never split one)."""
    if queries_per_head >= MANY_QUERIES:
        rows = DEQUANT_CHUNK
    else:
        rows = FEW_QUERY_CHUNK_CODES // max(1, heads * head_dim)
    return max(multiple, rows // multiple * multiple)


@dataclass(eq=False)
class QuantizedStore(KVStore):
    """KIVI store: keys per-channel at ``bits``, values per-token at :attr:`value_bits` (``bits`` unless the store was
    made with fewer value bits, §11.13), packed; the last ``residual`` rows in full precision.

    The rows are the same for every KV head (``index``: a ``[T]`` int32 tensor, a whole segment quantized) or
    chosen per KV head (``index``: a :class:`~unicache_core.kv.row_index.RowIndex`, the rows a joint eviction
    kept, then quantized; row ``i`` of head ``h`` is ``token_index[h, i]``). The layout is head-major either way.
    ``token_index`` is ``[T]`` or ``[Hkv, T]`` int32 append indices in store order: the quantized rows first,
    then the residual; each part ascending where the heads hold different rows (the order :func:`from_head_rows`'
    callers build, which the row index's bitmap keeps with one residual flag per row).

    Attributes:
        qkeys, qvalues: quantized rows ``[0, T - R)`` (head-major, see :mod:`unicache_core.kv.quant`).
        res_keys, res_values: ``[Hkv, R, d]`` residual rows in the cache dtype.
        index: ``[T]`` int32 append indices (heads share their rows) or the per-head :class:`RowIndex`.
        cache_dtype: the cache dtype (dequantization target and residual dtype).
    """

    qkeys: QuantizedTensor
    qvalues: QuantizedTensor
    res_keys: Tensor
    res_values: Tensor
    index: Tensor | RowIndex
    token_type: TokenType
    bits: int
    group_size: int
    residual: int
    cache_dtype: torch.dtype
    kind: ClassVar[StoreKind] = "quantized"

    @classmethod
    def from_kv(
        cls,
        keys: Tensor,
        values: Tensor,
        token_index: Tensor,
        bits: int = 2,
        group_size: int = 32,
        residual: int = 128,
        token_type: TokenType = TokenType.SOURCE_VAE,
        fit_values: bool = False,
        value_bits: int | None = None,
        key_per_token: bool = False,
    ) -> QuantizedStore:
        """Quantize ``keys/values [T, Hkv, d]``; the last ``min(residual, T)`` rows stay exact."""
        check_kv(keys, values, token_index)
        return cls.from_head_rows(
            keys.transpose(0, 1),
            values.transpose(0, 1),
            token_index,
            bits,
            group_size,
            residual,
            token_type,
            fit_values,
            value_bits,
            key_per_token,
        )

    @classmethod
    def from_head_rows(
        cls,
        keys: Tensor,
        values: Tensor,
        token_index: Tensor | RowIndex,
        bits: int,
        group_size: int,
        residual: int,
        token_type: TokenType,
        fit_values: bool = False,
        value_bits: int | None = None,
        key_per_token: bool = False,
    ) -> QuantizedStore:
        """Quantize head-major ``keys/values [Hkv, T, d]``, rows ``token_index`` (``[T]`` shared; ``[Hkv, T]`` per head,
        or their :class:`RowIndex`, whose residual must be the store's); each head's last ``min(residual, T)`` rows
        stay exact; ``fit_values``: :mod:`.ranges`;
        ``value_bits``: the values' bits (``None``: ``bits``); ``key_per_token``: keys grouped per token (§11.13)."""
        if keys.dim() != 3 or keys.shape != values.shape:
            raise ValueError(
                f"`keys`/`values` must both be [Hkv, T, d]; got {tuple(keys.shape)}, {tuple(values.shape)}"
            )
        if keys.dtype != values.dtype or not keys.dtype.is_floating_point or keys.device != values.device:
            raise ValueError(
                f"`keys` ({keys.dtype}, {keys.device}) and `values` ({values.dtype}, {values.device}) "
                "must share one floating dtype and device"
            )
        h, t, _ = keys.shape
        shape = (token_index.num_heads, token_index.rows) if isinstance(token_index, RowIndex) else token_index.shape
        if tuple(shape) not in ((t,), (h, t)):
            raise ValueError(f"`token_index` must be [T]=({t},) or [Hkv, T]=({h}, {t}), got {tuple(shape)}")
        r = min(check_int("residual", residual, 0), t)
        index: Tensor | RowIndex
        if isinstance(token_index, RowIndex):
            if token_index.encoding == "bitmap" and token_index.residual != (r if 0 < r < t else 0):
                raise ValueError(f"the row index flags {token_index.residual} residual rows, the store keeps {r}")
            index = token_index
        elif token_index.dim() == 2:
            index = RowIndex.encode(token_index.to(keys.device), residual=r)
        else:
            index = token_index.to(device=keys.device, dtype=torch.int32).clone()
        vbits = bits if value_bits is None else value_bits
        qvalues = quantize_values(values[:, : t - r], vbits, group_size, fit_values)
        return cls(
            quantize_keys(keys[:, : t - r], bits, group_size, key_per_token),
            qvalues,
            keys[:, t - r :].clone(memory_format=torch.contiguous_format),
            values[:, t - r :].clone(memory_format=torch.contiguous_format),
            index,
            TokenType(token_type),
            bits,
            group_size,
            residual,
            keys.dtype,
        )

    @property
    def per_head_rows(self) -> bool:
        """The KV heads hold different rows (``token_index [Hkv, T]``, named by a :class:`RowIndex`)."""
        return isinstance(self.index, RowIndex)

    @property
    def token_index(self) -> Tensor:  # type: ignore[override]
        """``[T]`` or ``[Hkv, T]`` int32 append indices in store order (the per-head ones decoded)."""
        return self.index.decode() if isinstance(self.index, RowIndex) else self.index

    @property
    def span(self) -> Runs:
        if isinstance(self.index, RowIndex):
            return self.index.span
        return index_runs(torch.sort(self.index).values)

    @property
    def num_tokens(self) -> int:
        """Rows held (per KV head)."""
        return self.index.rows if isinstance(self.index, RowIndex) else int(self.index.shape[-1])

    @property
    def value_bits(self) -> int:
        """Bits of the quantized values (``bits`` unless fewer, §11.13)."""
        return self.qvalues.bits

    @property
    def key_per_token(self) -> bool:
        """The keys are grouped per token (channels in groups) rather than per channel (§11.13)."""
        return self.qkeys.axis == "token"

    @property
    def num_quantized(self) -> int:
        return self.qkeys.num_tokens

    @property
    def num_kv_heads(self) -> int:
        return int(self.res_keys.shape[0])

    @property
    def head_dim(self) -> int:
        return int(self.res_keys.shape[2])

    @property
    def dtype(self) -> torch.dtype:
        return self.cache_dtype

    @property
    def device(self) -> torch.device:
        return self.res_keys.device

    def dequantize(self, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """All rows as ``(keys, values)`` ``[T, Hkv, d]`` in ``dtype`` (default: the cache dtype): row ``i`` of head
        ``h`` is ``token_index[i]`` (or ``token_index[h, i]`` when the heads hold different rows)."""
        dtype = self.cache_dtype if dtype is None else dtype
        k = torch.cat([self.qkeys.dequantize(dtype), self.res_keys.to(dtype)], dim=1)
        v = torch.cat([self.qvalues.dequantize(dtype), self.res_values.to(dtype)], dim=1)
        return k.transpose(0, 1), v.transpose(0, 1)

    def attend(self, q: Tensor, scale: float | None = None) -> tuple[Tensor, Tensor]:
        """Dequantize a chunk of rows at a time into a workspace in ``q.dtype`` and attend it (the residual rows are
        attended where they are), merged by log-sum-exp; ``q [Tq, Hq, d]``. A call of few queries reads each chunk
        while it is in the CPU's caches (:func:`chunk_rows`); no dequantized copy outlives the call."""
        # CUDA queries with Triton: the kernel that reads the packed rows (packed_attention_triton.py)
        if (kernel := packed_attention_kernel(self, q)) is not None:
            return kernel(self, q, scale)
        n = self.num_quantized
        h, r, d = self.res_keys.shape
        parts = []
        if n:
            group = 1 if self.key_per_token else self.qkeys.group_size
            step = chunk_rows(q.shape[0] * q.shape[1] // h, h, d, group)
            k, v = _workspace((h, min(step, n), d), q, reuse=step < DEQUANT_CHUNK)
            for start in range(0, n, step):
                stop = min(n, start + step)
                kc, vc = k[:, : stop - start], v[:, : stop - start]
                self.qkeys.dequantize_into(kc, start, stop)
                self.qvalues.dequantize_into(vc, start, stop)
                parts.append(attention_with_lse(q, kc.transpose(0, 1), vc.transpose(0, 1), scale=scale))
        if r or not parts:
            res_k, res_v = self.res_keys.to(q.dtype), self.res_values.to(q.dtype)
            parts.append(attention_with_lse(q, res_k.transpose(0, 1), res_v.transpose(0, 1), scale=scale))
        return merge_attention(parts)

    def write_kv(self, k_out: Tensor, v_out: Tensor) -> None:
        """Dequantize every row (quantized, then residual); each head's slice ``k_out[h]`` should be contiguous."""
        n = self.num_quantized
        if n:
            self.qkeys.dequantize_into(k_out[:, :n])
            self.qvalues.dequantize_into(v_out[:, :n])
        if self.res_keys.shape[1]:
            k_out[:, n:] = self.res_keys
            v_out[:, n:] = self.res_values

    def tensors(self) -> list[Tensor]:
        return [
            self.qkeys.packed,
            self.qkeys.scale,
            self.qkeys.zero,
            self.qvalues.packed,
            self.qvalues.scale,
            self.qvalues.zero,
            self.res_keys,
            self.res_values,
            *(self.index.tensors() if isinstance(self.index, RowIndex) else [self.index]),
        ]

    def nominal_bytes(self) -> int:
        h, _, d = self.res_keys.shape
        elem = torch.empty(0, dtype=self.cache_dtype).element_size()
        return quantized_kv_nbytes(
            self.num_tokens,
            h,
            d,
            self.bits,
            self.group_size,
            self.residual,
            elem,
            key_group_bytes=2 * self.qkeys.scale.element_size(),
            value_group_bytes=2 * self.qvalues.scale.element_size(),
            layout=StoreLayout(self.value_bits, self.key_per_token),
        ) + (self.index.nominal_bytes() if isinstance(self.index, RowIndex) else 4 * self.index.numel())

    def share(self) -> QuantizedStore:
        return QuantizedStore(
            self.qkeys,
            self.qvalues,
            self.res_keys,
            self.res_values,
            self.index,
            self.token_type,
            self.bits,
            self.group_size,
            self.residual,
            self.cache_dtype,
        )


__all__ = ["DEQUANT_CHUNK", "FEW_QUERY_CHUNK_CODES", "MANY_QUERIES", "QuantizedStore", "chunk_rows"]
