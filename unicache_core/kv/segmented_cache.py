"""A KV cache made of typed segments, each held by its own physical store (docs/compression.md §8.8).

Attention over a layer = exact LSE-merge of every store's attention plus the new block's
(causal or bidirectional) self-attention. Compression replaces one segment's :class:`FullStore` by an
:class:`EvictedStore` or :class:`QuantizedStore`; the full-precision tensors are then released.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from ..validation import check_int
from .attention import attention_with_lse, merge_attention
from .cache import AttentionCall, KVCache, Task
from .evicted_pool import attention_runs, pool_evicted
from .packed_attention_triton import packed_attention_kernel
from .quantized_store import MANY_QUERIES, QuantizedStore
from .stores import EvictedStore, FullStore, KVStore, StoreKind
from .token_types import CANDIDATE_TYPES, TokenType

logger = logging.getLogger(__name__)


@dataclass
class LayerAttention:
    """Result of :meth:`SegmentedLayer.attend_parts`.

    Attributes:
        out: ``[Tq, Hq, d]`` attention output.
        lse: ``[Tq, Hq]`` fp32 log-sum-exp over every resident key and the new block.
        store_lse: one ``[Tq, Hq]`` LSE per store of the layer (same order as ``stores``; ``-inf`` rows
            for empty stores), so the attention mass on store ``i`` is ``exp(store_lse[i] - lse)``.
        new_lse: ``[Tq, Hq]`` LSE of the new block, or ``None``.
    """

    out: Tensor
    lse: Tensor
    store_lse: list[Tensor]
    new_lse: Tensor | None


class SegmentedLayer:
    """Ordered list of stores for one layer.

    Uncompressed rows of one token type live in one :class:`FullStore`: every append of that type is
    coalesced into it, even when other types were appended in between (``token_index`` keeps the true
    order). Compressed stores are never appended to; new rows of a compressed type open a new FullStore.
    Every store of a layer has the same KV heads, head dim, dtype and device (checked on append and
    replace).
    """

    def __init__(self) -> None:
        self.stores: list[KVStore] = []
        self.appended_tokens = 0  # tokens ever appended (uncompressed size of this layer)
        self._kv_meta: tuple[int, int, torch.dtype, torch.device] | None = None  # (Hkv, d, dtype, device)

    # ------------------------------------------------------------------ attention

    def attend(
        self,
        q: Tensor,
        k_new: Tensor | None = None,
        v_new: Tensor | None = None,
        causal: bool = False,
        scale: float | None = None,
        fused: bool = False,
        new_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Attention of ``q [Tq, Hq, d]`` over every store plus the new block ``k_new/v_new [Tq, Hkv, d]``.

        ``causal`` applies only to the new block (bottom-right aligned); cached rows are fully visible.
        ``new_mask`` ``[Tq, Tq]`` bool: explicit visibility inside the new block (block-causal packing);
        it replaces ``causal``.
        ``fused``: ``True`` gathers every resident row (and a non-causal new block) into one temporary
        head-major workspace and makes one attention call when the call has many queries per KV head
        (:data:`~.quantized_store.MANY_QUERIES`); a call of few queries (a decoded token) reads each store where it is
        instead (a quantized one in chunks that stay in the CPU's caches), as ``False`` (default) always does: store
        by store, evicted stores side by side in one buffer as one run (:mod:`.evicted_pool`), merged by LSE. Both are
        exact (same keys, same softmax; outputs differ only by rounding).
        Returns ``(out [Tq, Hq, d], lse [Tq, Hq])``.
        """
        stores = attention_runs([store for store in self.stores if store.num_tokens > 0])
        if not stores and k_new is None:
            raise ValueError("nothing to attend to: the layer is empty and no new block was given")
        if fused and stores and new_mask is None:
            packed = [
                store for store in stores if isinstance(store, QuantizedStore) and packed_attention_kernel(store, q)
            ]
            if packed:  # CUDA with Triton: the kernel reads these packed (packed_attention_triton.py), apart
                return self._attend_packed_apart(q, stores, packed, k_new, v_new, causal, scale)
        many = bool(stores) and q.shape[0] * q.shape[1] >= MANY_QUERIES * stores[0].num_kv_heads
        if fused and many and new_mask is None:
            return self._attend_fused(q, stores, k_new, v_new, causal, scale)
        parts = [store.attend(q, scale) for store in stores]  # adjacent evicted stores as one run (evicted_pool.py)
        if k_new is not None:
            assert v_new is not None, "a new block needs its values"
            if new_mask is not None:
                parts.append(attention_with_lse(q, k_new, v_new, scale=scale, mask=new_mask))
            else:
                parts.append(attention_with_lse(q, k_new, v_new, scale=scale, causal=causal))
        return merge_attention(parts)

    def attend_parts(
        self,
        q: Tensor,
        k_new: Tensor | None = None,
        v_new: Tensor | None = None,
        *,
        causal: bool = False,
        scale: float | None = None,
        new_mask: Tensor | None = None,
    ) -> LayerAttention:
        """Store-by-store attention keeping every store's LSE (attention mass per store at no extra cost)."""
        if not self.stores and k_new is None:
            raise ValueError("nothing to attend to: the layer is empty and no new block was given")
        parts = []
        store_lse = []
        for store in self.stores:
            if store.num_tokens == 0:
                store_lse.append(torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device))
                continue
            part = store.attend(q, scale)
            parts.append(part)
            store_lse.append(part[1])
        new_lse = None
        if k_new is not None:
            assert v_new is not None, "a new block needs its values"
            if new_mask is not None:
                part = attention_with_lse(q, k_new, v_new, scale=scale, mask=new_mask)
            else:
                part = attention_with_lse(q, k_new, v_new, scale=scale, causal=causal)
            parts.append(part)
            new_lse = part[1]
        out, lse = merge_attention(parts)
        return LayerAttention(out, lse, store_lse, new_lse)

    @staticmethod
    def _attend_packed_apart(
        q: Tensor,
        stores: list[KVStore],
        packed: list[QuantizedStore],
        k_new: Tensor | None,
        v_new: Tensor | None,
        causal: bool,
        scale: float | None,
    ) -> tuple[Tensor, Tensor]:
        """The fused path with the ``packed`` stores attended by their kernel (``store.attend``) and merged by LSE."""
        parts = [store.attend(q, scale) for store in packed]
        rest = [store for store in stores if all(store is not p for p in packed)]
        if rest:
            parts.append(SegmentedLayer._attend_fused(q, rest, k_new, v_new, causal, scale))
        elif k_new is not None:
            assert v_new is not None, "a new block needs its values"
            parts.append(attention_with_lse(q, k_new, v_new, scale=scale, causal=causal))
        return merge_attention(parts)

    @staticmethod
    def _attend_fused(
        q: Tensor,
        stores: list[KVStore],
        k_new: Tensor | None,
        v_new: Tensor | None,
        causal: bool,
        scale: float | None,
    ) -> tuple[Tensor, Tensor]:
        """One attention call over a per-step workspace ``[Hkv, T_resident (+ Tq), d]`` in ``q.dtype``.

        Row order inside a head does not matter (cached rows are all visible), so evicted stores with
        per-head rows fit in. The workspace is a temporary: nothing dequantized outlives the call.
        """
        h, d = stores[0].num_kv_heads, stores[0].head_dim
        rows = [store.num_tokens for store in stores]
        append_new = k_new is not None and not causal
        total = sum(rows) + (k_new.shape[0] if k_new is not None and append_new else 0)
        k_ws = torch.empty(h, total, d, dtype=q.dtype, device=q.device)
        v_ws = torch.empty_like(k_ws)
        off = 0
        for store, n in zip(stores, rows):
            store.write_kv(k_ws[:, off : off + n], v_ws[:, off : off + n])
            off += n
        if k_new is not None:
            assert v_new is not None, "a new block needs its values"
            if append_new:
                k_ws[:, off:] = k_new.transpose(0, 1)
                v_ws[:, off:] = v_new.transpose(0, 1)
        out = attention_with_lse(q, k_ws.transpose(0, 1), v_ws.transpose(0, 1), scale=scale)
        if k_new is None or v_new is None or append_new:
            return out
        return merge_attention([out, attention_with_lse(q, k_new, v_new, scale=scale, causal=True)])

    # ------------------------------------------------------------------ contents

    def _check_meta(self, h: int, d: int, dtype: torch.dtype, device: torch.device, what: str) -> None:
        if self._kv_meta is None:
            self._kv_meta = (h, d, dtype, device)
            return
        want = self._kv_meta
        if (h, d) != want[:2]:
            raise ValueError(f"{what} has {h} KV heads x head dim {d}, but this layer holds {want[0]} x {want[1]}")
        if dtype != want[2]:
            raise ValueError(f"{what} is {dtype}, but this layer's cache is {want[2]}; convert it first")
        if torch.device(device) != torch.device(want[3]):
            raise ValueError(f"{what} is on {device}, but this layer's cache is on {want[3]}; move it first")

    def append(self, keys: Tensor, values: Tensor, token_types: Tensor, image: int | None = None) -> None:
        """Append ``[Tn, Hkv, d]`` rows with ``[Tn]`` types; their ``token_index`` are the next append indices.

        ``image``: the input image the rows belong to (an image block). Rows of a candidate type join the open
        store of their (type, image), so each image's ViT and VAE rows stay a segment of their own; rows of a
        protected type join their type's store whatever the image."""
        tn = keys.shape[0]
        if token_types.shape != (tn,):
            raise ValueError(f"`token_types` must be [{tn}], got shape {tuple(token_types.shape)}")
        if keys.shape != values.shape or keys.dim() != 3:
            raise ValueError(
                f"`keys`/`values` must both be [Tn, Hkv, d], got {tuple(keys.shape)}, {tuple(values.shape)}"
            )
        if values.dtype != keys.dtype or values.device != keys.device:
            raise ValueError(
                f"`keys` ({keys.dtype}, {keys.device}) and `values` ({values.dtype}, {values.device}) "
                "must share dtype and device"
            )
        self._check_meta(keys.shape[1], keys.shape[2], keys.dtype, keys.device, "appended keys")
        token_index = torch.arange(
            self.appended_tokens, self.appended_tokens + tn, dtype=torch.int32, device=keys.device
        )
        self.appended_tokens += tn
        types = token_types.to(device=keys.device, dtype=torch.int64)
        for t in torch.unique(types).tolist():
            sel = (types == t).nonzero().squeeze(1)
            k, v, p = keys.index_select(0, sel).detach(), values.index_select(0, sel).detach(), token_index[sel]
            segment_image = image if TokenType(t) in CANDIDATE_TYPES else None
            open_stores = [i for i in self.find(TokenType(t), "full") if self.stores[i].image == segment_image]
            if open_stores:
                store = self.stores[open_stores[-1]]
                assert isinstance(store, FullStore)
                store.append(k, v, p)
                continue
            new = FullStore(k.clone(), v.clone(), p, TokenType(t))
            new.image = segment_image
            self.stores.append(new)

    @property
    def geometry(self) -> tuple[int, int, torch.dtype] | None:
        """``(KV heads, head dim, dtype)`` of every row of the layer, or ``None`` while it is empty."""
        return None if self._kv_meta is None else self._kv_meta[:3]

    def segments(self) -> list[tuple[TokenType, str, int]]:
        """``(token_type, store kind, num_tokens)`` per store, in order."""
        return [(s.token_type, s.kind, s.num_tokens) for s in self.stores]

    def find(
        self, token_type: TokenType | str | int, kind: StoreKind | tuple[StoreKind, ...] | None = None
    ) -> list[int]:
        """Indices of the stores of ``token_type`` (of store ``kind`` when given: ``"full"``, ``"evicted"``,
        ``"quantized"``)."""
        token_type = TokenType.parse(token_type)
        kinds = (kind,) if isinstance(kind, str) else kind
        return [
            i for i, s in enumerate(self.stores) if s.token_type == token_type and (kinds is None or s.kind in kinds)
        ]

    def replace(self, index: int, store: KVStore) -> KVStore:
        """Swap store ``index`` for ``store`` (same token type, heads, head dim, dtype, device); returns the old one."""
        index = check_int("index", index, 0, len(self.stores) - 1)
        if not isinstance(store, KVStore):
            raise ValueError(f"`store` must be a KVStore, got {type(store).__name__}")
        old = self.stores[index]
        if store.token_type != old.token_type:
            raise ValueError(f"`store` has type {store.token_type.name}, segment {index} is {old.token_type.name}")
        if store.num_tokens > old.num_tokens:
            raise ValueError(f"`store` holds {store.num_tokens} rows, more than segment {index} ({old.num_tokens})")
        self._check_meta(store.num_kv_heads, store.head_dim, store.dtype, store.device, "the replacing store")
        store.image = old.image
        self.stores[index] = store
        return old

    def replace_many(self, indices: list[int], store: KVStore) -> list[KVStore]:
        """Replace the stores at ``indices`` (candidate segments pooled by a global policy) by one ``store``.

        ``store`` takes the place of the first of them; it may not hold more rows than they did together.
        Returns the removed stores (their tensors are freed once nothing else holds them).
        """
        if not indices or len(set(indices)) != len(indices):
            raise ValueError(f"`indices` must be distinct store indices, got {indices!r}")
        for i in indices:
            if not 0 <= i < len(self.stores):
                raise ValueError(f"`indices` must lie in [0, {len(self.stores)}), got {i}")
        if not isinstance(store, KVStore):
            raise ValueError(f"`store` must be a KVStore, got {type(store).__name__}")
        held = sum(self.stores[i].num_tokens for i in indices)
        if store.num_tokens > held:
            raise ValueError(f"`store` holds {store.num_tokens} rows, more than the {held} it replaces")
        self._check_meta(store.num_kv_heads, store.head_dim, store.dtype, store.device, "the replacing store")
        first = min(indices)
        removed = [self.stores[i] for i in indices]
        images = {s.image for s in removed}
        store.image = images.pop() if len(images) == 1 else None  # one image's rows, or a pool of several
        dropped = set(indices)
        kept = [s for i, s in enumerate(self.stores) if i not in dropped or i == first]
        kept[kept.index(self.stores[first])] = store
        self.stores = kept
        return removed

    def pool_evicted(self, frozen: frozenset[int] = frozenset()) -> list[tuple[KVStore, KVStore]]:
        """Re-home the layer's evicted stores into one buffer pair (:func:`~.evicted_pool.pool_evicted`), so
        :meth:`attend` reads them in one call; ``frozen`` storages are left alone. Returns ``(old, new)`` per store
        replaced (same rows, bytes and type)."""
        swaps = pool_evicted(self.stores, frozen)
        done: list[tuple[KVStore, KVStore]] = []
        for index, store in swaps.items():
            done.append((self.replace(index, store), store))
        return done

    def share(self) -> SegmentedLayer:
        """A copy whose stores are new objects over the same tensors (a branch clone)."""
        other = SegmentedLayer()
        other.stores = [_shared(s) for s in self.stores]
        other.appended_tokens = self.appended_tokens
        other._kv_meta = self._kv_meta
        return other

    def tensors(self) -> list[Tensor]:
        return [t for s in self.stores for t in s.tensors()]

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.stores)

    def full_bytes(self) -> int:
        """Bytes of K+V if every appended token were held uncompressed (no index tensors)."""
        if self._kv_meta is None:
            return 0
        h, d, dtype, _ = self._kv_meta
        return 2 * self.appended_tokens * h * d * torch.empty(0, dtype=dtype).element_size()

    @property
    def num_tokens(self) -> int:
        """Rows held (per KV head for evicted stores)."""
        return sum(s.num_tokens for s in self.stores)


def _shared(store: KVStore) -> KVStore:
    """``store.share()`` naming the same image."""
    other = store.share()
    other.image = store.image
    return other


class SegmentedKVCache(KVCache):
    """:class:`KVCache` whose layers are :class:`SegmentedLayer` s; compression swaps typed segments."""

    def __init__(self, num_layers: int, *, task: Task | None = None, branch: str | None = None):
        super().__init__(num_layers, task=task, branch=branch)
        self.layers = [SegmentedLayer() for _ in range(num_layers)]

    def layer(self, layer: int) -> SegmentedLayer:
        return self.layers[check_int("layer", layer, 0, self.num_layers - 1)]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tensor:
        """``q [Tn, Hq, d]`` over every store of ``layer`` plus the new block ``k/v [Tn, Hkv, d]`` → ``[Tn, Hq, d]``.

        The new rows are appended (coalesced per token type) when ``call.update``.
        """
        state = self.layer(layer)
        out, _ = state.attend(q, k, v, causal=call.causal, new_mask=call.new_block_mask)
        if call.update:
            state.append(k, v, call.token_types, call.image)
        return out

    def replace_segment(
        self, layer: int, token_type: TokenType | str | int, store: KVStore, index: int | None = None
    ) -> KVStore:
        """Replace the uncompressed segment of ``token_type`` in ``layer`` by ``store``; returns the old store.

        With ``index`` (position in :meth:`segments`) any store of that type may be replaced, e.g. an
        evicted store by a shrunk one.
        """
        state = self.layer(layer)
        token_type = TokenType.parse(token_type)
        if index is None:
            found = state.find(token_type, "full")
            if len(found) != 1:
                raise ValueError(
                    f"layer {layer} has {len(found)} uncompressed segments of type {token_type.name}; "
                    "pass `index` to choose one"
                )
            index = found[0]
        old = state.replace(index, store)
        logger.debug("layer %d: %s segment %s -> %s", layer, token_type.name, old.kind, store.kind)
        return old

    def segments(self, layer: int) -> list[tuple[TokenType, str, int]]:
        """``(token_type, store kind, num_tokens)`` of every store of ``layer``."""
        return self.layer(layer).segments()

    def stores(self, layer: int) -> list[KVStore]:
        """The store objects of ``layer`` (read them; use :meth:`replace_segment` to change them)."""
        return list(self.layer(layer).stores)

    def segment_kv(self, layer: int, token_type: TokenType | str | int) -> FullStore:
        """The single uncompressed :class:`FullStore` of ``token_type`` in ``layer``."""
        state = self.layer(layer)
        found = state.find(TokenType.parse(token_type), "full")
        if len(found) != 1:
            raise ValueError(f"layer {layer} has {len(found)} uncompressed segments of type {token_type!r}")
        store = state.stores[found[0]]
        assert isinstance(store, FullStore)
        return store

    def clone(self, *, branch: str | None = None) -> SegmentedKVCache:
        """A branch copy sharing every tensor (stores are never modified in place, so sharing is safe)."""
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.layers = [layer.share() for layer in self.layers]
        if branch is not None:
            other.branch = branch
        return other

    def tensors(self) -> list[Tensor]:
        return [t for layer in self.layers for t in layer.tensors()]

    @property
    def num_tokens(self) -> int:
        return self.layers[0].num_tokens

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def full_bytes(self) -> int:
        """Bytes the uncompressed cache would hold (K+V of every appended token, all layers)."""
        return sum(layer.full_bytes() for layer in self.layers)


__all__ = ["EvictedStore", "FullStore", "LayerAttention", "QuantizedStore", "SegmentedKVCache", "SegmentedLayer"]
