"""Physical compression of candidate segments in one layer: pooled eviction and KIVI quantization.

These are the only operations that shrink a cache; every method (docs/compression.md §2-§8) is a rule
for WHICH stores, HOW MANY rows and WHICH scores. Rows are identified by their append index
(``token_index``). Eviction is monotonic by construction: a selection is always a subset of what the
stores hold. Budgets are bytes and round down; indices are charged (the rows of a store whose heads hold different
rows are named by a :class:`~unicache_core.kv.row_index.RowIndex` over the span they were chosen from).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..kv.quant import (
    SCALE_DTYPE,
    QuantizedTensor,
    quantize_keys,
    quantize_values,
    quantized_kv_nbytes,
)
from ..kv.quantized_store import QuantizedStore
from ..kv.row_index import RowIndex, bitmap_bytes, list_bytes, merge_spans, row_index_bytes
from ..kv.segmented_cache import SegmentedLayer
from ..kv.stores import EvictedStore, FullStore, KVStore
from ..kv.token_types import TokenType
from .family import FULL_BITS, JointChoice
from .merging import merge_rows
from .selection import residual_last, select_rows

#: UniCache's bits/group lookup (docs/compression.md §8.6): (nominal retained ratio, bits, group size).
KIVI_LOOKUP: tuple[tuple[float, int, int], ...] = (
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


def evicted_bytes(rows: int, span: int, num_kv_heads: int, head_dim: int, elem: int) -> int:
    """Bytes of an :class:`EvictedStore` keeping ``rows`` rows per KV head out of a ``span``-row span: K + V and
    its row index (:func:`~unicache_core.kv.row_index.row_index_bytes`)."""
    return rows * num_kv_heads * 2 * head_dim * elem + row_index_bytes(num_kv_heads, rows, span)


def rows_for_bytes(budget: int, span: int, num_kv_heads: int, head_dim: int, elem: int) -> int:
    """Most rows per KV head an :class:`EvictedStore` over a ``span``-row span can keep within ``budget`` bytes
    (rounds down): the more of what each encoding of its index allows."""
    budget = int(budget)
    kv = num_kv_heads * 2 * head_dim * elem
    listed = budget // (kv + list_bytes(num_kv_heads, 1))
    bitmap = (budget - bitmap_bytes(num_kv_heads, 0, span)) // kv
    return max(0, listed, bitmap)


def quantized_bytes(
    num_tokens: int, num_kv_heads: int, head_dim: int, bits: int, group: int, residual: int, elem: int,
    span: int | None = None,
) -> int:  # fmt: skip
    """Bytes a :class:`QuantizedStore` of ``num_tokens`` rows holds (fp16 scale/zero): its heads sharing their rows
    (``span`` None: an int32 index per row) or holding different rows out of a ``span``-row span (their row index)."""
    nbytes = quantized_kv_nbytes(num_tokens, num_kv_heads, head_dim, bits, group, residual, elem)
    if span is None:
        return nbytes + 4 * num_tokens
    return nbytes + row_index_bytes(num_kv_heads, num_tokens, span, min(residual, num_tokens))


def _per_head_rows(store: KVStore) -> tuple[Tensor, Tensor, Tensor]:
    """``(keys [Hkv, n, d], values [Hkv, n, d], token_index [Hkv, n])`` of a store (quantized rows dequantized)."""
    h = store.num_kv_heads
    if isinstance(store, FullStore):
        return (
            store.keys.transpose(0, 1),
            store.values.transpose(0, 1),
            store.token_index.long().unsqueeze(0).expand(h, -1),
        )
    if isinstance(store, EvictedStore):
        return store.keys, store.values, store.token_index.long()
    if isinstance(store, QuantizedStore):
        k, v = store.dequantize()
        index = store.token_index.long()
        return k.transpose(0, 1), v.transpose(0, 1), index if index.dim() == 2 else index.unsqueeze(0).expand(h, -1)
    raise ValueError(f"a {store.kind} store cannot be pooled")


def shared_rows(stores: list[KVStore]) -> bool:
    """Every KV head of ``stores`` holds the same rows (uncompressed or wholly quantized segments)."""
    return all(isinstance(s, FullStore) or (isinstance(s, QuantizedStore) and not s.per_head_rows) for s in stores)


def pool_rows(stores: list[KVStore]) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of several stores, per KV head, sorted by append index: ``[Hkv, N, d]`` x2, ``[Hkv, N]``."""
    parts = [_per_head_rows(s) for s in stores]
    keys = torch.cat([p[0] for p in parts], dim=1)
    values = torch.cat([p[1] for p in parts], dim=1)
    index = torch.cat([p[2] for p in parts], dim=1)
    order = torch.argsort(index, dim=1)
    d = keys.shape[2]
    gather = order.unsqueeze(-1).expand(-1, -1, d)
    return torch.gather(keys, 1, gather), torch.gather(values, 1, gather), torch.gather(index, 1, order)


def pooled_type(stores: list[KVStore]) -> TokenType:
    """The common type of ``stores``, or ``UNKNOWN`` for a pool of several candidate types."""
    types = {s.token_type for s in stores}
    return types.pop() if len(types) == 1 else TokenType.UNKNOWN


def evict(
    layer: SegmentedLayer,
    indices: list[int],
    keep: int,
    scores: Tensor,
    *,
    recent: int = 0,
    forced: Tensor | None = None,
    smooth_kernel: int = 1,
    merge: str = "none",
) -> KVStore:
    """Keep ``keep`` rows per KV head of the stores at ``indices`` (pooled), drop the rest for real.

    Args:
        scores: ``[T_appended, Hkv]`` per append index (higher = keep); NaN ranks lowest.
        recent: the ``recent`` most recent rows of each head are always kept (H2O's window).
        forced: optional ``[T_appended]`` bool: rows always kept (SnapKV's observation window).
        smooth_kernel: SnapKV's 1-D average pooling of the pooled scores along the append order.
        merge: how the dropped rows are merged into the kept ones (:func:`~.merging.merge_rows`; ``none``: dropped).

    Returns:
        The new store (one :class:`EvictedStore`, typed when all pooled stores share a type).
    """
    stores = [layer.stores[i] for i in indices]
    if (
        len(stores) == 1
        and isinstance(stores[0], EvictedStore)
        and forced is None
        and smooth_kernel == 1
        and merge == "none"
    ):
        # one evicted store (a later re-allocation): its rows are already per head in append order
        store = stores[0]
        index = store.token_index.long()
        pooled_scores = torch.gather(scores.float().t().to(index.device), 1, index)  # [Hkv, n]
        store = store.take(select_rows(pooled_scores, keep, recent=recent))  # [Hkv, keep], ascending
        layer.replace_many(list(indices), store)
        return store
    keys, values, index = pool_rows(stores)
    pooled_scores = torch.gather(scores.float().t().to(index.device), 1, index)  # [Hkv, N]
    pooled_forced = None if forced is None else forced.to(index.device)[index]
    rows = select_rows(
        pooled_scores, keep, recent=recent, forced=pooled_forced, smooth_kernel=smooth_kernel
    )  # [Hkv, keep], ascending = append order
    kept_keys, kept_values = merge_rows(keys, values, rows, merge, pooled_scores)  # [Hkv, keep, d] each
    store = EvictedStore(
        kept_keys.contiguous(),
        kept_values.contiguous(),
        RowIndex.encode(torch.gather(index, 1, rows), merge_spans(s.span for s in stores)),
        pooled_type(stores),
    )
    layer.replace_many(list(indices), store)
    return store


def compress_rows(
    layer: SegmentedLayer,
    indices: list[int],
    choice: JointChoice,
    scores: Tensor | None,
    *,
    recent: int = 0,
    fit_values: bool = False,
    merge: str = "none",
) -> KVStore:
    """Keep ``choice.rows`` rows per KV head of the pooled stores at ``indices`` (chosen by ``scores``, as
    :func:`evict`) at ``choice.bits`` (:data:`~unicache_core.compression.family.FULL_BITS`: an :class:`EvictedStore`;
    else a :class:`QuantizedStore` of those rows with ``choice.group``, its values' bits and key groups as
    ``choice.layout`` says (docs/compression.md §11.13), whose ``choice.residual`` best-scored rows per head stay in
    full precision, or the newest ones without scores).

    Every row of a pool whose heads share their rows is quantized as one segment (one ``[T]`` index).
    ``scores``: ``[T_appended, Hkv]`` (needed only when rows are dropped). ``fit_values``: values quantized from here on
    get least-squares ranges (:func:`~unicache_core.kv.quant.quantize_values`); codes kept stay as they are.
    ``merge``: how rows dropped here are merged into the kept ones before these are quantized
    (:func:`~.merging.merge_rows`, weighted by ``scores``); rows dropped from a store quantized at these bits already
    (its codes kept) are only dropped.
    """
    keep, bits, group, residual, layout = choice.rows, choice.bits, choice.group, choice.residual, choice.layout
    stores = [layer.stores[i] for i in indices]
    total = sum(s.num_tokens for s in stores)
    if bits == FULL_BITS:
        if scores is None:
            raise ValueError("evicting rows needs their scores")
        return evict(layer, indices, keep, scores, recent=recent, merge=merge)
    vbits, key_per_token = layout.values(bits), layout.key_per_token
    if keep >= total and len(stores) == 1 and shared_rows(stores) and keeps_value_codes(stores[0], bits, group, vbits):
        return _requantize_shared(layer, indices[0], group, residual, scores, fit_values, key_per_token)
    if keep >= total and shared_rows(stores):
        return quantize(
            layer, indices, bits, group, residual, scores, fit_values=fit_values, value_bits=vbits,
            key_per_token=key_per_token,
        )  # fmt: skip
    if len(stores) == 1 and keeps_value_codes(stores[0], bits, group, vbits):
        return _shrink_quantized(
            layer, indices[0], keep, group, residual, scores, recent=recent, fit_values=fit_values,
            key_per_token=key_per_token,
        )  # fmt: skip
    keys, values, index = pool_rows(stores)
    pooled_scores = None if scores is None else torch.gather(scores.float().t().to(index.device), 1, index)
    position = _kept_positions(pooled_scores, keep, total, residual, recent)
    if position is not None:
        keys, values = merge_rows(keys, values, position, merge, pooled_scores)  # nothing dropped: only gathered
        index = torch.gather(index, 1, position)
    rows = RowIndex.encode(index, merge_spans(s.span for s in stores), min(residual, index.shape[1]))
    store = QuantizedStore.from_head_rows(
        keys.contiguous(), values.contiguous(), rows, bits, group, residual, pooled_type(stores), fit_values, vbits,
        key_per_token,
    )  # fmt: skip
    layer.replace_many(list(indices), store)
    return store


def _kept_positions(pooled_scores: Tensor | None, keep: int, total: int, residual: int, recent: int) -> Tensor | None:
    """``[Hkv, n]`` positions (into ``total`` pooled rows in append order) of the rows a re-laid-out store holds, in
    store order: the ``keep`` best by ``pooled_scores [Hkv, total]`` (:func:`select_rows`), then its ``residual``
    best-scored rows last (:func:`residual_last`); ``None``: every row, in append order."""
    position = None
    if keep < total:
        if pooled_scores is None:
            raise ValueError("dropping rows needs their scores")
        position = select_rows(pooled_scores, keep, recent=recent)  # [Hkv, keep], ascending = append order
        pooled_scores = torch.gather(pooled_scores, 1, position)
    if residual and pooled_scores is not None:
        order = residual_last(pooled_scores, residual)
        position = order if position is None else torch.gather(position, 1, order)
    return position


def keeps_value_codes(store: KVStore, bits: int, group: int, value_bits: int | None = None) -> bool:
    """Re-laying ``store`` out at ``bits``/``group`` (values at ``value_bits``, ``None``: ``bits``) leaves its quantized
    value rows as they are: it is quantized at those bits already, its values' channel groups stay the same and its
    scales are fp16 (values are quantized per row, so re-quantizing a dequantized value row at its own bits returns
    its codes)."""
    vbits = bits if value_bits is None else value_bits
    if not isinstance(store, QuantizedStore) or store.bits != bits or store.value_bits != vbits:
        return False
    if store.num_quantized == 0:
        return False
    qv = store.qvalues
    same_groups = -(-qv.head_dim // group) == qv.scale.shape[-1] and (qv.scale.shape[-1] == 1 or group == qv.group_size)
    return same_groups and qv.scale.dtype == SCALE_DTYPE


def _shrink_quantized(
    layer: SegmentedLayer,
    index: int,
    keep: int,
    group: int,
    residual: int,
    scores: Tensor | None,
    *,
    recent: int = 0,
    fit_values: bool = False,
    key_per_token: bool = False,
) -> QuantizedStore:
    """:func:`compress_rows` of one quantized store at its own bits (:func:`keeps_value_codes`): the same rows, order
    and store, but the value rows that stay quantized keep their codes and scales (no dequantize + quantize);
    only the keys (whose groups span rows) are quantized again."""
    store = layer.stores[index]
    assert isinstance(store, QuantizedStore)
    h, d = store.num_kv_heads, store.head_dim
    held = store.token_index.long()
    held = held if held.dim() == 2 else held.unsqueeze(0).expand(h, -1)  # [Hkv, T] in store order
    position = torch.argsort(held, dim=1)  # [Hkv, T] store rows in append order (the pooled order)
    pooled_scores = (
        None if scores is None else torch.gather(scores.float().t().to(held.device), 1, torch.gather(held, 1, position))
    )
    kept = _kept_positions(pooled_scores, keep, store.num_tokens, residual, recent)
    if kept is not None:
        position = torch.gather(position, 1, kept)
    n = position.shape[1]
    body = n - min(residual, n)  # rows quantized in the new store; the rest is its residual
    keys = torch.gather(_head_keys(store), 1, position.unsqueeze(-1).expand(-1, -1, d))  # [Hkv, n, d]
    quantized = store.num_quantized
    kept_body = position[:, :body]
    if body and bool((kept_body < quantized).all()):
        qvalues = store.qvalues.select_tokens(kept_body, group)
    else:
        qvalues = quantize_values(_value_rows(store, kept_body), store.value_bits, group, fit=fit_values)
    new = QuantizedStore(
        quantize_keys(keys[:, :body], store.bits, group, key_per_token),
        qvalues,
        keys[:, body:].clone(memory_format=torch.contiguous_format),
        _value_rows(store, position[:, body:]).contiguous(),
        RowIndex.encode(torch.gather(held, 1, position), store.span, n - body),
        store.token_type,
        store.bits,
        group,
        residual,
        store.cache_dtype,
    )
    layer.replace_many([index], new)
    return new


def _requantize_shared(
    layer: SegmentedLayer, index: int, group: int, residual: int, scores: Tensor | None, fit_values: bool = False,
    key_per_token: bool = False,
) -> QuantizedStore:  # fmt: skip
    """:func:`quantize` of one quantized store whose heads share their rows, at its own bits
    (:func:`keeps_value_codes`): the same rows, order and store as :func:`quantize` gives, but the value rows that
    were quantized keep their codes and scales; only the keys (whose groups span rows) and the values of rows
    that leave the residual are quantized. Falls back to :func:`quantize` when those rows would need wider
    scales than the store's."""
    store = layer.stores[index]
    assert isinstance(store, QuantizedStore)
    h = store.num_kv_heads
    held = store.token_index.long()  # [T] store order: the quantized rows, then the residual
    order = torch.argsort(held)  # store positions in append order, as quantize() lays them out
    if residual and scores is not None:
        row_scores = scores.float().mean(dim=1).to(held.device)[held[order]]
        order = order[residual_last(row_scores, residual)]
    n = order.shape[0]
    body = n - min(residual, n)
    quantized = store.num_quantized
    kept = order[:body]
    joining = torch.sort(kept[kept >= quantized]).values  # store positions of residual rows entering the body
    qvalues = store.qvalues
    if joining.numel():  # residual rows that join the quantized part: their values alone are quantized
        rows = store.res_values[:, joining - quantized].to(store.cache_dtype)  # [Hkv, m, d]
        extra = quantize_values(rows, store.value_bits, group, fit=fit_values)
        if extra.scale.dtype != qvalues.scale.dtype:
            return quantize(
                layer, [index], store.bits, group, residual, scores, fit_values=fit_values,
                value_bits=store.value_bits, key_per_token=key_per_token,
            )  # fmt: skip
        qvalues = _append_rows(qvalues, extra, group)
        kept = torch.where(kept >= quantized, quantized + torch.searchsorted(joining, kept), kept)
    keys = _head_keys(store)[:, order]  # [Hkv, n, d]
    tail = order[body:].unsqueeze(0).expand(h, -1)
    new = QuantizedStore(
        quantize_keys(keys[:, :body], store.bits, group, key_per_token),
        qvalues.select_tokens(kept.unsqueeze(0).expand(h, -1), group),
        keys[:, body:].clone(memory_format=torch.contiguous_format),
        _value_rows(store, tail).contiguous(),
        held[order].to(torch.int32),
        store.token_type,
        store.bits,
        group,
        residual,
        store.cache_dtype,
    )
    layer.replace_many([index], new)
    return new


def _head_keys(store: QuantizedStore) -> Tensor:
    """``[Hkv, T, d]`` every key of ``store`` in store order (the quantized rows dequantized, then the residual), in
    its cache dtype."""
    return torch.cat([store.qkeys.dequantize(store.cache_dtype), store.res_keys.to(store.cache_dtype)], dim=1)


def _append_rows(first: QuantizedTensor, second: QuantizedTensor, group: int) -> QuantizedTensor:
    """Per-token quantized rows ``first`` then ``second`` (same bits and channel groups) as one tensor labelled
    with ``group``."""

    def rows(a: Tensor, b: Tensor) -> Tensor:
        return torch.cat([a, b], dim=1)

    return QuantizedTensor(
        rows(first.packed, second.packed),
        rows(first.scale, second.scale),
        rows(first.zero, second.zero),
        first.bits,
        group,
        first.head_dim,
        first.axis,
    )


def _value_rows(store: QuantizedStore, position: Tensor) -> Tensor:
    """``[Hkv, m, d]`` values (cache dtype) of the store rows ``position [Hkv, m]``: dequantized or residual."""
    quantized = store.num_quantized
    in_body = position < quantized  # [Hkv, m]
    if store.res_values.shape[1] == 0 or bool(in_body.all()):
        return store.qvalues.select_tokens(position).dequantize(store.cache_dtype)
    d = store.head_dim
    exact = torch.gather(
        store.res_values.to(store.cache_dtype), 1, (position - quantized).clamp(min=0).unsqueeze(-1).expand(-1, -1, d)
    )
    if not bool(in_body.any()):  # every row from the residual: nothing to dequantize
        return exact
    rows = store.qvalues.select_tokens(position.clamp(max=quantized - 1)).dequantize(store.cache_dtype)
    return torch.where(in_body.unsqueeze(-1), rows, exact)


def quantize(
    layer: SegmentedLayer,
    indices: list[int],
    bits: int,
    group: int,
    residual: int,
    scores: Tensor | None = None,
    *,
    fit_values: bool = False,
    value_bits: int | None = None,
    key_per_token: bool = False,
) -> QuantizedStore:
    """Quantize the (full or wholly quantized) stores at ``indices`` as one KIVI store, in append order; its
    ``residual`` full-precision rows are the best-scored ones (``scores [T_appended, Hkv]``, averaged over
    the KV heads) or, without scores, the newest. ``fit_values``: least-squares value ranges instead of min-max;
    ``value_bits``: the values' bits (``None``: ``bits``); ``key_per_token``: keys grouped per token."""
    stores = [layer.stores[i] for i in indices]
    ks, vs, idx = [], [], []
    for store in stores:
        if isinstance(store, FullStore):
            ks.append(store.keys)
            vs.append(store.values)
            idx.append(store.token_index.long())
        elif isinstance(store, QuantizedStore) and not store.per_head_rows:
            k, v = store.dequantize()
            ks.append(k)
            vs.append(v)
            idx.append(store.token_index.long())
        else:
            raise ValueError(
                "rows that differ per KV head cannot be quantized as one shared segment (use compress_rows)"
            )
    index = torch.cat(idx)
    order = torch.argsort(index)
    if residual and scores is not None:
        row_scores = scores.float().mean(dim=1).to(index.device)[index[order]]
        order = order[residual_last(row_scores, residual)]
    keys, values = torch.cat(ks)[order], torch.cat(vs)[order]
    store = QuantizedStore.from_kv(
        keys, values, index[order], bits, group, residual, pooled_type(stores), fit_values, value_bits, key_per_token
    )
    layer.replace_many(list(indices), store)
    return store


def floor_bytes(ratio: float, full_bytes: int) -> int:
    """``floor(ratio * full_bytes)``: budgets round down."""
    return int(math.floor(ratio * full_bytes + 1e-9))


__all__ = [
    "KIVI_LOOKUP",
    "compress_rows",
    "evict",
    "evicted_bytes",
    "floor_bytes",
    "keeps_value_codes",
    "pool_rows",
    "pooled_type",
    "quantize",
    "quantized_bytes",
    "rows_for_bytes",
    "shared_rows",
]
