"""A KV cache made of typed segments, each held by its own physical store (kv-compression.md §8.8).

Attention over a layer = exact LSE-merge of every store's attention plus the new block's
(causal or bidirectional) self-attention. Compression replaces one segment's :class:`FullStore` by an
:class:`EvictedStore` or :class:`QuantizedStore`; the full-precision tensors are then released.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from .attention import attention_with_lse, merge_attention
from .kvcache import AttentionCall, Branch, KVCache, Task
from .segments import TokenType
from .stores import EvictedStore, FullStore, QuantizedStore, Store

logger = logging.getLogger(__name__)


def _kv_heads_dim(store: Store) -> tuple[int, int]:
    if isinstance(store, FullStore):
        return int(store.keys.shape[1]), int(store.keys.shape[2])
    if isinstance(store, EvictedStore):
        return int(store.keys.shape[0]), int(store.keys.shape[2])
    return int(store.res_keys.shape[0]), int(store.res_keys.shape[2])


class SegmentedLayer:
    """Ordered list of stores for one layer.

    Uncompressed rows of one token type live in one :class:`FullStore`: every append of that type is
    coalesced into it, even when other types were appended in between (positions keep the true order).
    Compressed stores are never appended to; new rows of a compressed type open a new FullStore.
    """

    def __init__(self) -> None:
        self.stores: list[Store] = []
        self.appended_tokens = 0  # tokens ever appended (uncompressed size of this layer)
        self._kv_meta: tuple[int, int, int] | None = None  # (Hkv, d, element size)

    def attend(
        self, q: Tensor, k_new: Tensor | None = None, v_new: Tensor | None = None, causal: bool = False,
        scale: float | None = None, fused: bool = False, new_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Attention of ``q [Tq, Hq, d]`` over every store plus the new block ``k_new/v_new [Tq, Hkv, d]``.

        ``causal`` applies only to the new block (bottom-right aligned); cached rows are fully visible.
        ``new_mask`` ``[Tq, Tq]`` bool: explicit visibility inside the new block (block-causal packing);
        it replaces ``causal``.
        ``fused``: ``True`` gathers every resident row (and a non-causal new block) into one temporary
        head-major workspace and makes one attention call; ``False`` (default) attends store by store
        and merges by LSE. Both are exact (same keys, same softmax; outputs differ only by rounding).
        On the BAGEL-7B editing branch (benchmarks/kv_attention.py, bf16, 1 thread) the two measured
        within noise (+-2%), so the default keeps the per-store path and its numerics.
        Returns ``(out [Tq, Hq, d], lse [Tq, Hq])``.
        """
        stores = [store for store in self.stores if store.num_tokens > 0]
        if not stores and k_new is None:
            raise ValueError("nothing to attend to: the layer is empty and no new block was given")
        if fused and stores and new_mask is None:
            return self._attend_fused(q, stores, k_new, v_new, causal, scale)
        parts = [store.attend(q, scale) for store in stores]
        if k_new is not None:
            if new_mask is not None:
                parts.append(attention_with_lse(q, k_new, v_new, scale=scale, mask=new_mask))
            else:
                parts.append(attention_with_lse(q, k_new, v_new, scale=scale, causal=causal))
        return merge_attention(parts)

    @staticmethod
    def _attend_fused(
        q: Tensor, stores: list[Store], k_new: Tensor | None, v_new: Tensor | None, causal: bool,
        scale: float | None,
    ) -> tuple[Tensor, Tensor]:
        """One attention call over a per-step workspace ``[Hkv, T_resident (+ Tq), d]`` in ``q.dtype``.

        Row order inside a head does not matter (cached rows are all visible), so evicted stores with
        per-head rows fit in. The workspace is a temporary: nothing dequantized outlives the call.
        """
        h, d = _kv_heads_dim(stores[0])
        rows = [store.num_tokens for store in stores]
        append_new = k_new is not None and not causal
        total = sum(rows) + (k_new.shape[0] if append_new else 0)
        k_ws = torch.empty(h, total, d, dtype=q.dtype, device=q.device)
        v_ws = torch.empty_like(k_ws)
        off = 0
        for store, n in zip(stores, rows):
            store.write_kv(k_ws[:, off : off + n], v_ws[:, off : off + n])
            off += n
        if append_new:
            k_ws[:, off:] = k_new.transpose(0, 1)
            v_ws[:, off:] = v_new.transpose(0, 1)
        out = attention_with_lse(q, k_ws.transpose(0, 1), v_ws.transpose(0, 1), scale=scale)
        if k_new is None or append_new:
            return out
        return merge_attention([out, attention_with_lse(q, k_new, v_new, scale=scale, causal=True)])

    def append(self, keys: Tensor, values: Tensor, token_types: Tensor) -> None:
        """Append ``[Tn, Hkv, d]`` rows with ``[Tn]`` types; their positions are the next context indices."""
        tn = keys.shape[0]
        if token_types.shape != (tn,):
            raise ValueError(f"`token_types` must be [{tn}], got shape {tuple(token_types.shape)}")
        if self._kv_meta is None:
            self._kv_meta = (keys.shape[1], keys.shape[2], keys.element_size())
        positions = torch.arange(self.appended_tokens, self.appended_tokens + tn, dtype=torch.int32,
                                 device=keys.device)
        self.appended_tokens += tn
        types = token_types.to(torch.int64)
        for t in torch.unique(types).tolist():
            sel = (types == t).nonzero().squeeze(1)
            k, v, p = keys.index_select(0, sel).detach(), values.index_select(0, sel).detach(), positions[sel]
            open_stores = self.find(TokenType(t), FullStore)
            if open_stores:
                self.stores[open_stores[-1]].append(k, v, p)
                continue
            self.stores.append(FullStore(k.clone(), v.clone(), p, TokenType(t)))

    def segments(self) -> list[tuple[TokenType, str, int]]:
        """``(token_type, store class name, num_tokens)`` per store, in order."""
        return [(s.token_type, type(s).__name__, s.num_tokens) for s in self.stores]

    def find(self, token_type: TokenType, kind: type | tuple[type, ...] = FullStore) -> list[int]:
        """Indices of the stores of ``token_type`` that are instances of ``kind``."""
        token_type = TokenType.parse(token_type)
        return [i for i, s in enumerate(self.stores) if s.token_type == token_type and isinstance(s, kind)]

    def replace(self, index: int, store: Store) -> Store:
        """Swap store ``index`` for ``store`` (same token type); returns the old store."""
        if not 0 <= index < len(self.stores):
            raise ValueError(f"`index` must be in [0, {len(self.stores)}), got {index}")
        old = self.stores[index]
        if store.token_type != old.token_type:
            raise ValueError(f"`store` has type {store.token_type.name}, segment {index} is {old.token_type.name}")
        if store.num_tokens > old.num_tokens:
            raise ValueError(f"`store` holds {store.num_tokens} rows, more than segment {index} ({old.num_tokens})")
        self.stores[index] = store
        return old

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.stores)

    def full_bytes(self) -> int:
        """Bytes of K+V if every appended token were held uncompressed (no index tensors)."""
        if self._kv_meta is None:
            return 0
        h, d, e = self._kv_meta
        return 2 * self.appended_tokens * h * d * e

    @property
    def num_tokens(self) -> int:
        """Rows held (per KV head for evicted stores)."""
        return sum(s.num_tokens for s in self.stores)


class SegmentedKVCache(KVCache):
    """:class:`KVCache` whose layers are :class:`SegmentedLayer` s; compression swaps typed segments."""

    def __init__(self, num_layers: int, *, task: Task | None = None, branch: Branch | None = None):
        super().__init__(num_layers, task=task, branch=branch)
        self.layers = [SegmentedLayer() for _ in range(num_layers)]

    def layer(self, layer: int) -> SegmentedLayer:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"`layer` must be in [0, {self.num_layers}), got {layer}")
        return self.layers[layer]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tensor:
        """``q [Tn, Hq, d]`` over every store of ``layer`` plus the new block ``k/v [Tn, Hkv, d]`` → ``[Tn, Hq, d]``.

        The new rows are appended (coalesced per token type) when ``call.update``.
        """
        state = self.layer(layer)
        out, _ = state.attend(q, k, v, causal=call.causal, new_mask=call.new_block_mask)
        if call.update:
            state.append(k, v, call.token_types)
        return out

    def replace_segment(self, layer: int, token_type: TokenType | str | int, store: Store,
                        index: int | None = None) -> Store:
        """Replace the uncompressed segment of ``token_type`` in ``layer`` by ``store``; returns the old store.

        With ``index`` (position in :meth:`segments`) any store of that type may be replaced, e.g. an
        evicted store by a shrunk one.
        """
        state = self.layer(layer)
        token_type = TokenType.parse(token_type)
        if index is None:
            found = state.find(token_type, FullStore)
            if len(found) != 1:
                raise ValueError(
                    f"layer {layer} has {len(found)} uncompressed segments of type {token_type.name}; "
                    "pass `index` to choose one"
                )
            index = found[0]
        old = state.replace(index, store)
        logger.debug("layer %d: %s segment %s -> %s", layer, token_type.name, type(old).__name__,
                     type(store).__name__)
        return old

    def segments(self, layer: int) -> list[tuple[TokenType, str, int]]:
        """``(token_type, store kind, num_tokens)`` of every store of ``layer``."""
        return self.layer(layer).segments()

    def stores(self, layer: int) -> list[Store]:
        """The store objects of ``layer`` (read them; use :meth:`replace_segment` to change them)."""
        return list(self.layer(layer).stores)

    def segment_kv(self, layer: int, token_type: TokenType | str | int) -> FullStore:
        """The single uncompressed :class:`FullStore` of ``token_type`` in ``layer``."""
        state = self.layer(layer)
        found = state.find(TokenType.parse(token_type), FullStore)
        if len(found) != 1:
            raise ValueError(f"layer {layer} has {len(found)} uncompressed segments of type {token_type!r}")
        return state.stores[found[0]]

    @property
    def num_tokens(self) -> int:
        return self.layers[0].num_tokens

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def full_bytes(self) -> int:
        """Bytes the uncompressed cache would hold (K+V of every appended token, all layers)."""
        return sum(layer.full_bytes() for layer in self.layers)


__all__ = ["EvictedStore", "FullStore", "QuantizedStore", "SegmentedKVCache", "SegmentedLayer"]
