"""What a method sees of a branch: read-only views of its layers, segments, measurements and bytes.

A :class:`BranchView` is handed to :meth:`~unicache_core.compression.method.Method.plan_call`,
:meth:`~unicache_core.compression.method.Method.plan_written` and :meth:`~unicache_core.compression.method.Method.plan`;
it reads the branch cache (through :class:`~unicache_core.compression.protocol.ViewedBranch`), the other live branches
of the request and the request's :class:`~unicache_core.compression.state.RequestState`, and offers nothing that
changes them. A segment is the rows of one token type of one input image
(:class:`SegmentKey`); the stores a method pooled earlier carry the key ``(UNKNOWN, None)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..kv.cache import AttentionCall, RequestInfo, StepInfo
from ..kv.quantized_store import QuantizedStore
from ..kv.row_index import merge_spans, span_length
from ..kv.stores import KVStore
from ..kv.token_types import BRANCHES, CANDIDATE_TYPES, THINK, TokenType
from .family import FULL_BITS, Segment
from .ops import shared_rows
from .protocol import LayerState, ViewedBranch
from .state import RequestState


class SegmentKey(NamedTuple):
    """The rows of one token type of one input image (``image`` None: not an image's rows)."""

    type: TokenType
    image: int | None = None


#: The key of a store that pools several candidate types (or segments).
POOLED = SegmentKey(TokenType.UNKNOWN, None)


def key_of(store: KVStore) -> SegmentKey:
    """The segment key of ``store``."""
    return SegmentKey(store.token_type, store.image)


def storages(store: KVStore) -> set[int]:
    """The addresses of ``store``'s non-empty tensors (two stores over the same tensors are shared; stores over
    different views of one buffer, as :func:`~unicache_core.kv.evicted_pool.pool_evicted` makes, are not)."""
    return {t.data_ptr() for t in store.tensors() if t.numel()}


def is_candidate(store: KVStore) -> bool:
    """``store`` holds compressible rows: a candidate type, or a pool of them."""
    return store.token_type in CANDIDATE_TYPES or store.token_type == TokenType.UNKNOWN


@dataclass(frozen=True)
class RowGeometry:
    """The geometry of one cached row of a layer: KV heads, head dim and bytes per element of the cache dtype."""

    num_kv_heads: int
    head_dim: int
    elem: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one uncompressed row (K + V over the KV heads)."""
        return 2 * self.num_kv_heads * self.head_dim * self.elem


class LayerView:
    """One layer of a branch: its stores' rows and bytes per segment, and what the cache measured there."""

    def __init__(self, cache: ViewedBranch, index: int, peers: Sequence[ViewedBranch] = ()):
        self._layer = cache.layer(index)
        self._state: LayerState = cache.state[index]
        self._cache = cache
        self._peers = peers
        self.index = index

    # ------------------------------------------------------------------ geometry and rows

    @cached_property
    def geometry(self) -> RowGeometry | None:
        """The row geometry, or ``None`` while the layer holds nothing."""
        geo = self._layer.geometry
        if geo is None:
            return None
        h, d, dtype = geo
        return RowGeometry(h, d, dtype.itemsize)

    @property
    def row_bytes(self) -> int:
        """Bytes of one uncompressed row; 0 while empty."""
        return 0 if self.geometry is None else self.geometry.row_bytes

    @property
    def appended(self) -> int:
        """Rows ever appended to the layer (the length of a score tensor)."""
        return self._layer.appended_tokens

    @cached_property
    def type_rows(self) -> dict[TokenType, int]:
        """Uncompressed row count per token type (every appended row, compressed or not)."""
        return self._cache.type_rows(self.index)

    @cached_property
    def segment_rows(self) -> dict[SegmentKey, int]:
        """Uncompressed row count per segment: per (candidate type, input image); protected types with image None."""
        return self._cache.segment_rows(self.index)

    @property
    def managed_full_bytes(self) -> int:
        """K + V bytes the candidate rows would hold uncompressed."""
        return self._cache.managed_full_bytes(self.index)

    def _stores(self, keys: Iterable[SegmentKey]) -> list[KVStore]:
        wanted = set(keys)
        return [s for s in self._layer.stores if s.num_tokens and key_of(s) in wanted]

    @cached_property
    def candidate_keys(self) -> tuple[SegmentKey, ...]:
        """Keys of the non-empty candidate (or pooled) stores, in store order, each once."""
        keys: dict[SegmentKey, None] = {}
        for store in self._layer.stores:
            if store.num_tokens and is_candidate(store):
                keys[key_of(store)] = None
        return tuple(keys)

    def keys_of(self, types: Iterable[TokenType]) -> tuple[SegmentKey, ...]:
        """Keys of every store whose type is one of ``types`` (stores emptied by an eviction included), in store
        order, each once."""
        wanted = set(types)
        keys: dict[SegmentKey, None] = {}
        for store in self._layer.stores:
            if store.token_type in wanted:
                keys[key_of(store)] = None
        return tuple(keys)

    def held_rows(self, keys: Iterable[SegmentKey]) -> int:
        """Rows (per KV head) the stores of ``keys`` hold now."""
        return sum(s.num_tokens for s in self._stores(keys))

    def held_bytes(self, keys: Iterable[SegmentKey]) -> int:
        """Bytes the stores of ``keys`` hold now."""
        return sum(s.nbytes() for s in self._stores(keys))

    def span_rows(self, keys: Iterable[SegmentKey]) -> int:
        """Rows of the span a store pooling the stores of ``keys`` (empty ones included, as a plan's change pools
        them) names per-head rows within (:class:`~unicache_core.kv.row_index.RowIndex`)."""
        wanted = set(keys)
        return span_length(merge_spans(s.span for s in self._layer.stores if key_of(s) in wanted))

    def segment(self, keys: Iterable[SegmentKey], full_rows: int | None = None) -> Segment:
        """The rows of the stores of ``keys`` as one choice sees them (:class:`~.family.Segment`).

        ``full_rows``: the rows they had uncompressed (default: the rows of their segments).
        """
        keys = list(keys)
        stores = self._stores(keys)
        geo = self.geometry
        if geo is None:
            raise ValueError(f"layer {self.index} holds no rows")
        if full_rows is None:
            full_rows = sum(self.segment_rows.get(k, 0) for k in set(keys))
        bits = min((s.bits if isinstance(s, QuantizedStore) else FULL_BITS for s in stores), default=FULL_BITS)
        value_bits = min((s.value_bits for s in stores if isinstance(s, QuantizedStore)), default=bits)
        return Segment(
            full_rows=full_rows,
            held_rows=sum(s.num_tokens for s in stores),
            held_bits=bits,
            held_bytes=sum(s.nbytes() for s in stores),
            shared_rows=shared_rows(stores),
            num_kv_heads=geo.num_kv_heads,
            head_dim=geo.head_dim,
            elem=geo.elem,
            held_value_bits=value_bits if value_bits < bits else None,
            span_rows=self.span_rows(keys),
        )

    def type_mask(self, types: Iterable[TokenType]) -> Tensor:
        """``[T_appended]`` bool: the append indices whose token type is one of ``types`` (held or not)."""
        wanted = torch.tensor(sorted(int(t) for t in types), dtype=self._cache.types.dtype)
        return torch.isin(self._cache.types[: self.appended], wanted)

    def candidate_mask(self) -> Tensor:
        """``[T_appended]`` bool: the append indices the candidate stores hold (in any KV head)."""
        mask = torch.zeros(self.appended, dtype=torch.bool)
        for store in self._layer.stores:
            if store.num_tokens and is_candidate(store):
                mask[store.token_index.long().reshape(-1).cpu()] = True
        return mask

    def key_norms(self) -> Tensor:
        """``[T_appended, Hkv]`` fp32 L2 norm of every key the candidate stores hold in full precision, per append
        index and KV head (0 where a row is not held or only quantized)."""
        geo = self.geometry
        norms = torch.zeros(self.appended, 0 if geo is None else geo.num_kv_heads, dtype=torch.float32)
        for store in self._layer.stores:
            keys = store.score_keys() if store.num_tokens and is_candidate(store) else None
            if keys is None:
                continue
            index = store.token_index.long().cpu()
            rows = index.unsqueeze(1).expand(-1, norms.shape[1]) if index.dim() == 1 else index.t()
            norms.scatter_(0, rows, keys.float().norm(dim=-1).cpu())
        return norms

    @cached_property
    def shared_with(self) -> Mapping[SegmentKey, frozenset[str]]:
        """The candidate segments whose stores other live branches of the request hold too (a fork's rows until one of
        them re-lays them out), and those branches; the ``think`` branch is not counted."""
        others = [
            c
            for c in self._peers
            if c is not self._cache and c.branch != THINK and c.num_layers == self._cache.num_layers
        ]
        holders: dict[int, set[str]] = {}
        for other in others:
            for store in other.layer(self.index).stores:
                for ptr in storages(store):
                    holders.setdefault(ptr, set()).add(other.branch or "")
        out: dict[SegmentKey, set[str]] = {}
        for store in self._layer.stores:
            if store.num_tokens and is_candidate(store):
                for ptr in storages(store):
                    if ptr in holders:
                        out.setdefault(key_of(store), set()).update(holders[ptr])
        return {key: frozenset(branches) for key, branches in out.items()}

    @cached_property
    def planned_elsewhere(self) -> frozenset[SegmentKey]:
        """The shared segments another branch plans: those held by a branch that comes before this one in
        :data:`~unicache_core.kv.token_types.BRANCHES` (``gen`` plans the image rows ``cfg_text`` shares with it;
        docs/compression.md §13), and those whose stores it replaced with its own while it is live (a pool or an
        emptied store hides their keys). The others' plans leave them alone and receive its stores."""
        branch = self._cache.branch or ""
        order = {name: i for i, name in enumerate(BRANCHES)}
        mine = order.get(branch, len(order))
        live = {c.branch or "" for c in self._peers if c is not self._cache}
        return frozenset(
            key for key, others in self.shared_with.items() if any(order.get(b, len(order)) < mine for b in others)
        ) | frozenset(key for key, planner in self._state.planned_by.items() if planner in live)

    # ------------------------------------------------------------------ measurements

    @property
    def scores(self) -> Tensor | None:
        """``[T_appended, Hkv]`` fp32 attention accumulated over every scored call (H2O), or ``None``."""
        return self._state.scores

    @property
    def last_scores(self) -> Tensor | None:
        """``[T_appended, Hkv]`` fp32 scores of the last scored call (SnapKV, VL-Cache), or ``None``."""
        return self._state.last_scores

    @property
    def measured(self) -> Mapping[str, Any]:
        """The method's own statistics of the layer at its last measured call, by name (``Measurement.extra``)."""
        return self._state.measured

    @property
    def masses(self) -> Mapping[TokenType, float]:
        """Attention mass per type of the last observed call."""
        return self._state.masses

    @property
    def segment_masses(self) -> Mapping[SegmentKey, float]:
        """Attention mass per candidate segment (per input image) of the last observed call."""
        return self._state.segment_masses

    @property
    def pooled(self) -> Mapping[TokenType, float]:
        """The types a pooled store of this layer holds and their shares of its mass (empty: no pooled store)."""
        return self._state.pooled


class BranchView:
    """One branch cache at one call, read-only (see the module docstring).

    Args:
        cache: the branch cache; state: the request's state; call: the call (``None`` outside one).
        peers: every live branch cache of the request (the shared rows and a byte target are counted over them).
        method_target: the method's memory target for the task (a ratio, or bytes over every branch).
    """

    def __init__(
        self,
        cache: ViewedBranch,
        state: RequestState,
        call: AttentionCall | None = None,
        *,
        request: RequestInfo,
        peers: Sequence[ViewedBranch] = (),
        method_target: float | int = 1.0,
    ):
        self._cache = cache
        self._state = state
        self._peers = tuple(peers)
        self._method_target = method_target
        self.call = call
        self.branch: str = cache.branch or ""
        self.request: RequestInfo = request
        self.task: str = request.task
        self.num_layers: int = cache.num_layers
        self._record = state.branch(self.branch)
        self.compressions: int = self._record.compressions

    @property
    def call_step(self) -> int:
        """The step (denoising step or decoded token) of the call, 0 without one."""
        return int(self.call.step) if self.call is not None and self.call.step is not None else 0

    @property
    def step_info(self) -> StepInfo | None:
        """The step running now (``None`` before the first)."""
        return self._state.step

    @property
    def state(self) -> Any:
        """What the method returned for this branch with its last plan (``None`` before the first)."""
        return self._record.method_state

    @property
    def rho(self) -> dict[int, float]:
        """The scheduled retention per layer chunk after the last compression."""
        return dict(self._record.rho)

    @property
    def measured_phase(self) -> str | None:
        """The phase of the branch's last call that measured (``"prefill"``: the statistics in the layers' records
        come from the context's prefill, e.g. an instruction's queries; ``None``: nothing measured yet)."""
        return self._record.measured_phase

    @cached_property
    def target(self) -> float:
        """The request's memory target as a ratio of the full candidate bytes (byte targets converted over every
        live branch but the think-mode ``plan`` context; the session keeps it from the first compression on)."""
        if self._state.target_ratio is not None:
            return self._state.target_ratio
        target = self._method_target
        if isinstance(target, int):
            full = sum(c.managed_full_bytes() for c in self._peers if c.branch != THINK)
            return 1.0 if full == 0 else min(1.0, target / full)
        return float(target)

    def grant(self, layer: int) -> int:
        """Bytes the session moves into (> 0) or out of (< 0) this branch's ``layer`` (docs/compression.md §11.8)."""
        return self._state.grant(self.branch, layer)

    def layer(self, index: int) -> LayerView:
        return LayerView(self._cache, index, self._peers)

    def cell_masses(
        self, layer_chunk: int, step_chunk: int, types: Iterable[TokenType]
    ) -> dict[TokenType, float] | None:
        """EMA masses of ``types`` in one (layer chunk, step chunk) cell of this branch, or ``None``."""
        return self._state.stats.cell_masses(layer_chunk, step_chunk, types, branch=self.branch)

    def next_call_step(self, step: int) -> int | None:
        """The next step after denoising ``step`` at which this branch's caches are called: ``step + 1``, or with
        TaylorSeer its next computed step (forecast steps call nothing; docs/compression.md §11.12); ``None`` when
        none comes."""
        info = self._state.step
        if info is not None and info.phase == "denoise" and info.step == step:
            return info.next_call_step(self.branch)
        return step + 1

    def recompresses_unread(self, step: int) -> bool:
        """Whether a re-compression at ``step`` would come after the last call that reads the cache it would shrink:
        the request's last denoising step or last possible decoded token, or the branch's last computed step when
        the later ones are forecast (TaylorSeer). (The first compression still runs: the report's figures are those
        of a compressed cache.)"""
        info = self._state.step
        if self.compressions == 0 or info is None or info.phase not in ("denoise", "decode"):
            return False
        if info.phase == "denoise" and info.step == step:
            return info.next_call_step(self.branch) is None
        return step >= info.total - 1


__all__ = ["POOLED", "BranchView", "LayerView", "RowGeometry", "SegmentKey", "is_candidate", "key_of", "storages"]
