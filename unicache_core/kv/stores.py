"""Physical per-segment KV storage: uncompressed and evicted (compacted per KV head); the KIVI-quantized store is
:mod:`unicache_core.kv.quantized_store`.

Every store answers exact attention of new queries over what it really holds and returns the
log-sum-exp, so the stores of one layer can be merged with
:func:`unicache_core.kv.attention.merge_attention` (docs/compression.md §8.8, physical path). Cached keys
are always fully visible, so no store takes a mask.

``token_index`` is the APPEND INDEX of a row in its context (0 for the first token ever cached, ...,
int32), never a RoPE position (RoPE ids live in :class:`~unicache_core.kv.cache.AttentionCall`; keys are
stored already rotated). ``nbytes()`` is the sum of ``.nbytes`` of every tensor a store holds (payload,
scales/zeros, residual and the row index of compressed stores; an uncompressed store names its rows by
a few runs of consecutive indices and holds exactly its K and V; a store whose heads hold different rows names
them by :class:`~unicache_core.kv.row_index.RowIndex`, a packed bitmap over its span or an int32 list);
``nominal_bytes()`` is the same quantity from the closed-form formula of docs/compression.md §1.

All stores share one interface (:class:`KVStore`): ``kind``, ``token_type``, ``num_tokens``,
``num_kv_heads``, ``head_dim``, ``dtype``, ``device``, ``span``, ``attend``, ``write_kv``, ``score_keys``,
``nbytes``, ``nominal_bytes``, ``tensors``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Literal

import torch
from torch import Tensor

from .attention import attention_with_lse
from .index_runs import index_runs, runs_index
from .row_index import RowIndex, Runs
from .token_types import TokenType

StoreKind = Literal["full", "evicted", "quantized"]


def check_kv(keys: Tensor, values: Tensor, token_index: Tensor) -> None:
    if not isinstance(keys, Tensor) or not isinstance(values, Tensor):
        raise ValueError(f"`keys`/`values` must be tensors, got {type(keys).__name__}, {type(values).__name__}")
    if keys.dim() != 3 or keys.shape != values.shape:
        raise ValueError(f"`keys`/`values` must both be [T, Hkv, d]; got {tuple(keys.shape)} and {tuple(values.shape)}")
    if keys.dtype != values.dtype or not keys.dtype.is_floating_point:
        raise ValueError(f"`keys` ({keys.dtype}) and `values` ({values.dtype}) must share one floating dtype")
    if keys.device != values.device:
        raise ValueError(f"`keys` are on {keys.device} but `values` on {values.device}; move both to one device")
    if token_index.dim() != 1 or token_index.shape[0] != keys.shape[0]:
        raise ValueError(f"`token_index` must be [T] with T={keys.shape[0]}, got shape {tuple(token_index.shape)}")


class KVStore(ABC):
    """What every physical store provides (see the module docstring)."""

    kind: ClassVar[StoreKind]
    token_type: TokenType
    #: ``[T]`` int32 append indices of the rows (``[Hkv, T]`` where the KV heads hold different rows)
    token_index: Tensor
    #: The input image (0-based, in request order) whose rows the store holds; ``None``: no image's, or several.
    image: int | None = None

    @property
    @abstractmethod
    def num_tokens(self) -> int:
        """Rows held (per KV head for evicted stores)."""

    @property
    @abstractmethod
    def num_kv_heads(self) -> int: ...

    @property
    @abstractmethod
    def head_dim(self) -> int: ...

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """The cache dtype (what attention reads; quantized stores dequantize to it)."""

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @abstractmethod
    def attend(self, q: Tensor, scale: float | None = None) -> tuple[Tensor, Tensor]:
        """``q [Tq, Hq, d]`` → ``(out [Tq, Hq, d], lse [Tq, Hq] fp32)`` over every row held."""

    @abstractmethod
    def write_kv(self, k_out: Tensor, v_out: Tensor) -> None:
        """Copy every row head-major into ``k_out/v_out [Hkv, num_tokens, d]``."""

    def score_keys(self) -> Tensor | None:
        """``[num_tokens, Hkv, d]`` keys to score rows with (row ``i`` of head ``h``), or ``None`` when the
        store cannot be scored without dequantizing (quantized stores are never evicted from)."""
        return None

    @abstractmethod
    def tensors(self) -> list[Tensor]:
        """Every tensor the store holds (for byte accounting and storage sharing between branches)."""

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    @abstractmethod
    def nominal_bytes(self) -> int:
        """``nbytes()`` from the closed-form formula of docs/compression.md §1."""

    @property
    @abstractmethod
    def span(self) -> Runs:
        """The append indices the store's rows were chosen from, as ``((start, length), ...)`` runs: every row it
        holds when its heads share their rows, the rows its stores were made from when they hold different rows."""

    @abstractmethod
    def share(self) -> KVStore:
        """A new store object over the SAME tensors (a branch clone; tensors are never modified in place)."""


class _RowStore(KVStore):
    """A store holding its rows as plain ``keys``/``values`` tensors (head dim last): dtype and device are theirs."""

    keys: Tensor

    @property
    def head_dim(self) -> int:
        return int(self.keys.shape[2])

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def device(self) -> torch.device:
        return self.keys.device


class FullStore(_RowStore):
    """Uncompressed (protected or not yet compressed) rows.

    Rows are named by their append indices as a few runs of consecutive indices (``runs``: one per
    contiguous stretch the layer appended, a handful of integers per segment, like the cache's per-row
    type map), not by a per-row tensor: an uncompressed segment holds exactly its K and V bytes, the
    same as no compression at all. ``token_index`` builds the ``[T]`` int32 indices from them on demand.

    Attributes:
        keys, values: ``[T, Hkv, d]`` in the cache dtype.
        runs: ``((first append index, length), ...)`` in row order.
        token_type: type of every row.
    """

    kind: ClassVar[StoreKind] = "full"

    def __init__(self, keys: Tensor, values: Tensor, token_index: Tensor, token_type: TokenType):
        """``keys/values [T, Hkv, d]``, ``token_index [T]`` append indices of the rows."""
        check_kv(keys, values, token_index)
        self.keys, self.values = keys, values
        self.runs = index_runs(token_index)
        self.token_type = TokenType(token_type)

    @classmethod
    def from_runs(
        cls, keys: Tensor, values: Tensor, runs: tuple[tuple[int, int], ...], token_type: TokenType
    ) -> FullStore:
        """A store over ``keys/values [T, Hkv, d]`` whose rows are named by ``runs`` (no index tensor is built)."""
        store = object.__new__(cls)
        store.keys, store.values, store.runs, store.token_type = keys, values, tuple(runs), TokenType(token_type)
        if sum(n for _, n in store.runs) != keys.shape[0]:
            raise ValueError(f"`runs` name {sum(n for _, n in store.runs)} rows but `keys` holds {keys.shape[0]}")
        return store

    @property
    def token_index(self) -> Tensor:  # type: ignore[override]
        """``[T]`` int32 append indices (built from ``runs``)."""
        return runs_index(self.runs, self.keys.device)

    @property
    def span(self) -> Runs:
        return self.runs

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.keys.shape[1])

    def attend(self, q: Tensor, scale: float | None = None) -> tuple[Tensor, Tensor]:
        return attention_with_lse(q, self.keys.to(q.dtype), self.values.to(q.dtype), scale=scale)

    def write_kv(self, k_out: Tensor, v_out: Tensor) -> None:
        k_out.copy_(self.keys.transpose(0, 1))
        v_out.copy_(self.values.transpose(0, 1))

    def score_keys(self) -> Tensor:
        return self.keys

    def tensors(self) -> list[Tensor]:
        return [self.keys, self.values]

    def nominal_bytes(self) -> int:
        t, h, d = self.keys.shape
        return 2 * t * h * d * self.keys.element_size()

    def share(self) -> FullStore:
        return FullStore.from_runs(self.keys, self.values, self.runs, self.token_type)

    def append(self, keys: Tensor, values: Tensor, token_index: Tensor) -> None:
        """Append ``[Tn, Hkv, d]`` rows; new tensors are built (``torch.cat``), the old ones are left untouched
        (a branch clone sharing them keeps its rows)."""
        check_kv(keys, values, token_index)
        if keys.shape[1:] != self.keys.shape[1:]:
            raise ValueError(
                f"appended rows are [*, {keys.shape[1]}, {keys.shape[2]}] but this store holds "
                f"[*, {self.num_kv_heads}, {self.head_dim}] (KV heads, head dim)"
            )
        if keys.device != self.device:
            raise ValueError(f"appended rows are on {keys.device}, this store on {self.device}")
        self.keys = torch.cat([self.keys, keys.to(self.keys.dtype)])
        self.values = torch.cat([self.values, values.to(self.values.dtype)])
        runs = list(self.runs)
        for start, length in index_runs(token_index):
            if runs and runs[-1][0] + runs[-1][1] == start:
                runs[-1] = (runs[-1][0], runs[-1][1] + length)
            else:
                runs.append((start, length))
        self.runs = tuple(runs)


class EvictedStore(_RowStore):
    """Rows kept by an eviction policy, compacted per KV head (heads may keep different tokens).

    Attributes:
        keys, values: ``[Hkv, n_keep, d]``; a new tensor (the dropped rows are really gone).
        rows: which rows each head keeps, within the span they were chosen from
            (:class:`~unicache_core.kv.row_index.RowIndex`: a packed bitmap, or an int32 list where cheaper).
        token_type: type of the rows.
    """

    kind: ClassVar[StoreKind] = "evicted"

    def __init__(self, keys: Tensor, values: Tensor, rows: Tensor | RowIndex, token_type: TokenType):
        """``keys/values [Hkv, n_keep, d]``; ``rows``: a :class:`RowIndex`, or ``[Hkv, n_keep]`` append indices
        ascending per head (named within the runs of every row a head keeps)."""
        if keys.dim() != 3 or keys.shape != values.shape:
            raise ValueError(
                f"`keys`/`values` must both be [Hkv, n_keep, d]; got {tuple(keys.shape)}, {tuple(values.shape)}"
            )
        if keys.dtype != values.dtype or keys.device != values.device:
            raise ValueError(
                f"`keys` ({keys.dtype}, {keys.device}) and `values` ({values.dtype}, "
                f"{values.device}) must share dtype and device"
            )
        shape = (rows.num_heads, rows.rows) if isinstance(rows, RowIndex) else tuple(rows.shape)
        if tuple(shape) != tuple(keys.shape[:2]):
            raise ValueError(f"`keep_idx` must be [Hkv, n_keep]={tuple(keys.shape[:2])}, got {tuple(shape)}")
        self.keys, self.values = keys, values
        self.rows = rows if isinstance(rows, RowIndex) else RowIndex.encode(rows.to(keys.device))
        self.token_type = TokenType(token_type)

    @classmethod
    def from_selection(
        cls, keys: Tensor, values: Tensor, token_index: Tensor, keep: Tensor, token_type: TokenType
    ) -> EvictedStore:
        """Compact ``keys/values [T, Hkv, d]`` to the rows ``keep [Hkv, n_keep]`` (indices into T) per head; the span
        is the runs of ``token_index``."""
        check_kv(keys, values, token_index)
        t, h, d = keys.shape
        if keep.dim() != 2 or keep.shape[0] != h:
            raise ValueError(f"`keep` must be [Hkv={h}, n_keep], got shape {tuple(keep.shape)}")
        keep = torch.sort(keep.long().to(keys.device), dim=1).values
        if keep.numel() and (keep.min() < 0 or keep.max() >= t):
            raise ValueError(f"`keep` indices must lie in [0, {t}), got range [{keep.min()}, {keep.max()}]")
        if keep.shape[1] > 1 and bool((keep[:, 1:] == keep[:, :-1]).any()):
            raise ValueError("`keep` must not repeat an index within a head")
        idx = keep.unsqueeze(-1).expand(h, keep.shape[1], d)
        k = torch.gather(keys.transpose(0, 1), 1, idx)  # new [Hkv, n_keep, d] tensor
        v = torch.gather(values.transpose(0, 1), 1, idx)
        index = token_index.to(keys.device).long()
        return cls(k, v, RowIndex.encode(index[keep], index_runs(torch.sort(index).values)), token_type)

    @property
    def keep_idx(self) -> Tensor:
        """``[Hkv, n_keep]`` int32 append indices of the kept rows, ascending per head (decoded from :attr:`rows`)."""
        return self.rows.decode()

    @property
    def span(self) -> Runs:
        return self.rows.span

    @property
    def num_tokens(self) -> int:
        """Kept rows per KV head."""
        return int(self.keys.shape[1])

    @property
    def num_kv_heads(self) -> int:
        return int(self.keys.shape[0])

    @property
    def token_index(self) -> Tensor:  # type: ignore[override]
        """``[Hkv, n_keep]`` append indices (per head, decoded from :attr:`rows`)."""
        return self.rows.decode()

    def attend(self, q: Tensor, scale: float | None = None) -> tuple[Tensor, Tensor]:
        """Query head ``h`` only sees the rows of KV head ``h // g``."""
        # Row i of every head is an arbitrary (per-head) token; attention never needs the token identity,
        # so the head-major store is handed over as a [n_keep, Hkv, d] view (no copy).
        return attention_with_lse(
            q, self.keys.transpose(0, 1).to(q.dtype), self.values.transpose(0, 1).to(q.dtype), scale=scale
        )

    def write_kv(self, k_out: Tensor, v_out: Tensor) -> None:
        """Row ``i`` of head ``h`` is ``keep_idx[h, i]``."""
        k_out.copy_(self.keys)
        v_out.copy_(self.values)

    def score_keys(self) -> Tensor:
        return self.keys.transpose(0, 1)

    def tensors(self) -> list[Tensor]:
        return [self.keys, self.values, *self.rows.tensors()]

    def nominal_bytes(self) -> int:
        h, n, d = self.keys.shape
        return h * n * 2 * d * self.keys.element_size() + self.rows.nominal_bytes()

    def share(self) -> EvictedStore:
        return EvictedStore(self.keys, self.values, self.rows, self.token_type)

    def shrink(self, keep_sub: Tensor) -> EvictedStore:
        """A new store keeping rows ``keep_sub [Hkv, n_new]`` (indices into this store's rows, n_new <= n_keep).

        Eviction is monotonic: rows can only be dropped, never added back.
        """
        h, n, d = self.keys.shape
        if keep_sub.dim() != 2 or keep_sub.shape[0] != h:
            raise ValueError(f"`keep_sub` must be [Hkv={h}, n_new], got shape {tuple(keep_sub.shape)}")
        if keep_sub.shape[1] > n:
            raise ValueError(
                f"`keep_sub` asks for {keep_sub.shape[1]} rows but the store holds {n}; eviction never adds rows"
            )
        if keep_sub.numel() and (keep_sub.min() < 0 or keep_sub.max() >= n):
            raise ValueError(
                f"`keep_sub` indices must lie in [0, {n}) (rows of this store), "
                f"got range [{keep_sub.min()}, {keep_sub.max()}]"
            )
        keep_sub = torch.sort(keep_sub.long().to(self.device), dim=1).values
        if keep_sub.shape[1] > 1 and bool((keep_sub[:, 1:] == keep_sub[:, :-1]).any()):
            raise ValueError("`keep_sub` must not repeat a row within a head")
        return self.take(keep_sub)

    def take(self, rows: Tensor) -> EvictedStore:
        """A new store of ``rows [Hkv, n_new]`` int64: positions into this store's rows, ascending and distinct per
        head (not checked: :meth:`shrink` checks them; an eviction's own selection is built that way), named within
        this store's span."""
        idx = rows.unsqueeze(-1).expand(-1, -1, self.keys.shape[2])
        return EvictedStore(
            torch.gather(self.keys, 1, idx),
            torch.gather(self.values, 1, idx),
            self.rows.take(rows),
            self.token_type,
        )


#: Any physical store.
Store = KVStore

__all__ = [
    "EvictedStore",
    "FullStore",
    "KVStore",
    "Store",
    "StoreKind",
    "check_kv",
    "index_runs",
    "runs_index",
]
