"""The shapes the compression package's modules meet through: what a branch cache records per layer, what a method's
measurement returns, and the read-only sides of a branch cache and a session that views and the report read.

A leaf module (it imports nothing of the package), so the caches, the session, the views and the report are written
against these protocols and none of them imports another to type it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from ..kv.cache import AttentionCall, RequestInfo
from ..kv.segmented_cache import SegmentedLayer
from ..kv.token_types import TokenType


@dataclass(frozen=True)
class Measurement:
    """What a method's :meth:`~unicache_core.compression.method.Method.measure` took from one layer of an attention
    call.

    Attributes:
        scores: ``[T_appended, Hkv]`` fp32 attention each appended row received, summed over the scored queries and
            averaged over each KV group's heads (``None``: no per-key scores).
        queries: how many queries were scored.
        extra: the method's own statistics of the layer by name (VL-Cache's ``sparsity``), read back by its plan
            through :attr:`~unicache_core.compression.view.LayerView.measured`.
    """

    scores: Tensor | None = None
    queries: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class LayerState:
    """Per-layer records of a branch cache: what it measured (rows indexed by append index) and what the last plans
    said of the layer (budgets, flags, the types held as one store)."""

    scores: Tensor | None = None  # [T, Hkv] fp32, accumulated over scored calls (H2O)
    last_scores: Tensor | None = None  # [T, Hkv] fp32 of the last scored call (SnapKV, VL-Cache)
    last_score_queries: int = 0
    measured: Mapping[str, Any] = field(default_factory=dict)  # Measurement.extra of the last measured call
    masses: dict = field(default_factory=dict)  # {TokenType: mass} of the last observed call
    segment_masses: dict = field(default_factory=dict)  # {SegmentKey: mass} of the candidate stores, same call
    budgets: dict = field(default_factory=dict)  # {type name: budget bytes} set at the last compression
    flags: dict = field(default_factory=dict)  # {TokenType or type name: reason} for budgets out of reach
    #: {TokenType: share} of the candidate types quantized as one store (UniCache, docs/compression.md §11.7): the
    #: store's attention mass is theirs in these shares (their masses when they were pooled); empty: no pool
    pooled: dict = field(default_factory=dict)
    #: {SegmentKey: branch} the segments whose rows another branch planned and shares with this one (their stores
    #: were replaced by that branch's, docs/compression.md §13): this branch does not plan or budget them
    planned_by: dict = field(default_factory=dict)

    def copy(self) -> LayerState:
        """A copy whose dicts are new (the score tensors are shared: they are replaced, never edited)."""
        return LayerState(
            self.scores,
            self.last_scores,
            self.last_score_queries,
            self.measured,
            dict(self.masses),
            dict(self.segment_masses),
            dict(self.budgets),
            dict(self.flags),
            dict(self.pooled),
            dict(self.planned_by),
        )

    def record(self, measurement: Measurement) -> None:
        """Keep ``measurement`` as the layer's last one and add its scores to the accumulated ones."""
        self.measured = measurement.extra
        dense = measurement.scores
        if dense is None:
            return
        self.last_scores = dense
        self.last_score_queries = measurement.queries
        if self.scores is None:
            self.scores = dense.clone()
        elif self.scores.shape == dense.shape:  # nothing appended since: a new tensor (forks share the old one)
            self.scores = self.scores + dense
        else:
            grown = torch.zeros_like(dense)
            grown[: self.scores.shape[0]] = self.scores
            self.scores = grown.add_(dense)


class ViewedBranch(Protocol):
    """A branch cache as a view reads it (:class:`~unicache_core.compression.view.BranchView`): its layers and
    records, never changed through this side."""

    branch: str | None
    num_layers: int
    state: list[LayerState]
    types: Tensor  # [T] int8 TokenType of each append index

    def layer(self, index: int) -> SegmentedLayer: ...

    def type_rows(self, layer: int) -> dict[TokenType, int]: ...

    def segment_rows(self, layer: int) -> dict: ...

    def managed_full_bytes(self, layer: int | None = None) -> int: ...


class ReportedBranch(Protocol):
    """One branch cache as the report reads it (compressing and uncompressed caches alike): its rows, stores and
    records (:mod:`.report` builds the snapshots from them)."""

    branch: str | None
    num_layers: int
    state: list[LayerState]
    types: Tensor  # [T] int8 TokenType of each append index
    images: Tensor  # [T] int16 input image of each append index (-1: none)
    holds_every_row: bool  # an uncompressed cache (``full``): its stores are the appended rows, all in full

    def stores_of(self, layer: int) -> list: ...

    def type_rows(self, layer: int) -> dict[TokenType, int]: ...

    def segment_rows(self, layer: int) -> dict: ...

    def row_bytes(self, layer: int) -> int: ...

    def split_bytes(self) -> tuple[int, int]: ...

    def managed_full_bytes(self, layer: int | None = None) -> int: ...


class MethodTraits(Protocol):
    """What the report reads of a method (:class:`~unicache_core.compression.method.Method`'s class attributes)."""

    @property
    def name(self) -> str: ...

    @property
    def compresses(self) -> bool: ...

    @property
    def budget(self) -> str: ...


class ReportedSession(Protocol):
    """One request's session as the report reads it."""

    request: RequestInfo
    settings: dict

    @property
    def method(self) -> MethodTraits: ...

    def held_bytes(self) -> int:
        """Bytes of every live branch cache, shared storage counted once."""
        ...

    def live_caches(self) -> list:
        """The branch caches of the request that still exist (:class:`ReportedBranch` each)."""
        ...


class CallCoordinator(Protocol):
    """What a branch cache asks of its session at the seams of an attention call (the session is the one that plans
    with the method and applies the plans; the cache only measures and stores)."""

    def plan_call(self, cache: Any, call: AttentionCall) -> Any: ...

    def plan_written(self, cache: Any, call: AttentionCall, layer: int) -> Any: ...

    def compress(self, cache: Any, call: AttentionCall | None) -> None: ...

    def note_observed(self, branch: str, call: AttentionCall) -> None: ...

    def note_rows(self, branch: str, call: AttentionCall, rows: int) -> None: ...


__all__ = [
    "CallCoordinator",
    "LayerState",
    "Measurement",
    "MethodTraits",
    "ReportedBranch",
    "ReportedSession",
    "ViewedBranch",
]
