"""One buffer for a layer's evicted rows, so that attention reads them in one call instead of one per store.

UniCache keeps one evicted store per segment (each image's ViT rows, the instruction, ...): at eight images a
decoded token would make a dozen small attention calls per layer, each paying a kernel's fixed cost. After a
compression the layer's evicted stores are re-homed into one head-major buffer pair (:func:`pool_evicted`): each
store keeps its own object, rows and accounting, over a view of the buffer. Attention then finds stores whose
views lie side by side in one buffer (:func:`attention_runs`) and attends each such run in one call; the
statistics path (:meth:`~.segmented_cache.SegmentedLayer.attend_parts`) still reads store by store.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import Tensor

from .stores import EvictedStore, KVStore


class EvictedRun:
    """Adjacent evicted stores of one buffer, attended as one: ``keys/values [Hkv, n, d]`` views (attention only).

    It reads its rows as :class:`~.stores.EvictedStore` does, with that class's own code (it has no row index)."""

    kind = "evicted"
    num_tokens = EvictedStore.num_tokens
    num_kv_heads = EvictedStore.num_kv_heads
    head_dim = EvictedStore.head_dim
    attend = EvictedStore.attend
    write_kv = EvictedStore.write_kv

    def __init__(self, keys: Tensor, values: Tensor):
        self.keys, self.values = keys, values


def _storage_ptrs(store: KVStore) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in store.tensors() if t.numel()}


def _one_buffer(stores: list[EvictedStore]) -> bool:
    """The stores' keys and values already lie side by side, in this order, in one buffer pair."""
    return len(attention_runs(list[KVStore](stores))) == 1


def pool_evicted(stores: list[KVStore], frozen: Collection[int] = ()) -> dict[int, EvictedStore]:
    """New stores for the non-empty evicted stores in ``stores``, over views of one new buffer pair.

    ``frozen``: storage addresses that must stay as they are (rows a cache outside the compression holds, which
    would otherwise be held twice); stores over them are left out. Returns ``{position in stores: new store}``
    (empty when fewer than two stores qualify or they already share one buffer); each new store holds the same
    rows, row index and type as the one it replaces, so bytes and attention are unchanged.
    """
    members = [
        (i, store)
        for i, store in enumerate(stores)
        if isinstance(store, EvictedStore) and store.num_tokens and not (_storage_ptrs(store) & set(frozen))
    ]
    chosen = [store for _, store in members]
    if len(chosen) < 2 or _one_buffer(chosen):
        return {}
    keys = torch.cat([s.keys for s in chosen], dim=1)
    values = torch.cat([s.values for s in chosen], dim=1)
    out: dict[int, EvictedStore] = {}
    start = 0
    for i, old in members:
        stop = start + old.num_tokens
        new = EvictedStore(keys[:, start:stop], values[:, start:stop], old.rows, old.token_type)
        new.image = old.image
        out[i] = new
        start = stop
    return out


def _follows(a: Tensor, b: Tensor) -> bool:
    """``b`` starts in ``a``'s buffer where ``a``'s rows (dim 1) end, with the same layout."""
    return bool(
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.stride() == b.stride()
        and a.shape[0] == b.shape[0]
        and a.shape[2] == b.shape[2]
        and a.storage_offset() + a.shape[1] * a.stride(1) == b.storage_offset()
    )


def _joined(first: Tensor, rows: int) -> Tensor:
    return torch.as_strided(first, (first.shape[0], rows, first.shape[2]), first.stride(), first.storage_offset())


def attention_runs(stores: list[KVStore]) -> list:
    """``stores`` with every run of evicted stores lying side by side in one buffer (keys and values both) joined
    into one :class:`EvictedRun`; other stores are returned as they are. Order does not matter to attention
    (every cached row is visible), so the runs come first."""
    evicted = [s for s in stores if isinstance(s, EvictedStore) and s.num_tokens]
    rest = [s for s in stores if not (isinstance(s, EvictedStore) and s.num_tokens)]
    evicted.sort(key=lambda s: (s.keys.untyped_storage().data_ptr(), s.keys.storage_offset()))
    runs: list = []
    group: list[EvictedStore] = []
    for store in evicted:
        if group and _follows(group[-1].keys, store.keys) and _follows(group[-1].values, store.values):
            group.append(store)
            continue
        runs.append(group)
        group = [store]
    runs.append(group)
    joined: list = []
    for group in runs:
        if len(group) == 1:
            joined.append(group[0])
        elif group:
            rows = sum(s.num_tokens for s in group)
            joined.append(EvictedRun(_joined(group[0].keys, rows), _joined(group[0].values, rows)))
    return joined + rest


__all__ = ["EvictedRun", "attention_runs", "pool_evicted"]
