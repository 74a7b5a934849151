"""What the parts of a compressing run exchange: the per-call plan, the per-layer state, and the shapes of a
branch cache and a session as methods and the report see them.

The methods (:mod:`.method`) and the report (:mod:`.report`) are written against these protocols, and the
caches and sessions (:mod:`.compressing_cache`, :mod:`.full`) implement them, so neither side imports the
other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

from .defaults import SCORE_QUERIES

if TYPE_CHECKING:  # pragma: no cover
    from ..kv.cache import RequestInfo, StepInfo
    from ..kv.segmented_cache import SegmentedLayer
    from .config import KVConfig
    from .stats import ChunkedAttentionStats


@dataclass
class CallPlan:
    """What one forward pass of a branch measures and when the branch is compressed around it.

    Decided by the method (:meth:`~unicache_core.compression.method.CompressionMethod.plan_call`) when the
    call begins; carried out by the cache.
    """

    observe: bool = False  # type masses from the per-store LSE
    score: bool = False  # per-key scores over a query subsample
    last_queries: bool = False  # subsample = the last queries (text window) rather than strided
    num_queries: int = SCORE_QUERIES
    sparsity: bool = False  # VL-Cache layer sparsity
    compress_before: bool = False  # compress the branch before this call reads it
    compress_after: bool = False  # compress the branch once this call has run


@dataclass
class LayerState:
    """Per-layer statistics kept by a branch cache (rows indexed by append index)."""

    scores: Tensor | None = None  # [T, Hkv] fp32, accumulated over scored calls (H2O)
    last_scores: Tensor | None = None  # [T, Hkv] fp32 of the last scored call (SnapKV, VL-Cache)
    last_score_queries: int = 0
    sparsity: float | None = None
    masses: dict = field(default_factory=dict)  # {TokenType: mass} of the last observed call
    budgets: dict = field(default_factory=dict)  # {type name: budget bytes} set at the last compression
    flags: dict = field(default_factory=dict)  # {TokenType or type name: reason} for budgets out of reach
    #: {TokenType: share} of the candidate types quantized as one store (UniCache, docs/compression.md §11.7): the
    #: store's attention mass is theirs in these shares (their masses when they were pooled); empty: no pool
    pooled: dict = field(default_factory=dict)
    #: bytes this layer's budget gets (> 0) or gives (< 0) so every branch can keep its quantized floor (UniCache)
    grant: int = 0

    def copy(self) -> LayerState:
        """A copy whose dicts are new (the score tensors are shared: they are replaced, never edited)."""
        return LayerState(
            self.scores,
            self.last_scores,
            self.last_score_queries,
            self.sparsity,
            dict(self.masses),
            dict(self.budgets),
            dict(self.flags),
            dict(self.pooled),
            self.grant,
        )


class NamedMethod(Protocol):
    """A compression method as the report names it."""

    name: str


class ReportedBranch(Protocol):
    """One branch cache as the report reads it (compressing and uncompressed caches alike)."""

    branch: str
    num_layers: int
    compressions: int  # compressions applied so far
    rho: dict[int, float]  # layer chunk -> scheduled retention (empty when the method has no schedule)

    def snapshot_types(self) -> dict[str, dict]:
        """Per type name: the policy, bytes held, rows per KV head, budgets, stores, mass (report ``types``)."""

    def split_bytes(self) -> tuple[int, int]:
        """``(managed, protected)`` bytes held now."""

    def managed_full_bytes(self, layer: int | None = None) -> int:
        """Bytes the compressible rows would hold uncompressed."""


class ReportedSession(Protocol):
    """One request's session as the report reads it."""

    request: RequestInfo
    config: KVConfig
    method: NamedMethod
    target_ratio: float | None

    def held_bytes(self) -> int:
        """Bytes of every live branch cache, shared storage counted once."""

    def live_caches(self) -> list[ReportedBranch]:
        """The branch caches of the request that still exist."""


class MethodSession(Protocol):
    """One request's session as a method reads it."""

    request: RequestInfo
    config: KVConfig
    stats: ChunkedAttentionStats
    schedules: dict
    step: StepInfo | None  # the step (denoising or decoded token) running now; None before the first

    def resolve_target(self) -> float:
        """The memory target as a ratio of the full managed bytes."""


class CompressibleBranch(ReportedBranch, Protocol):
    """One branch cache as a method reads and shrinks it."""

    session: MethodSession
    state: list[LayerState]

    def layer(self, index: int) -> SegmentedLayer:
        """The segmented stores of one layer."""

    def row_bytes(self, layer: int) -> int:
        """Bytes of one uncompressed row (K+V over the KV heads) of ``layer``."""

    def type_rows(self, layer: int) -> dict:
        """Uncompressed row count per token type of ``layer``."""


__all__ = [
    "CallPlan",
    "CompressibleBranch",
    "LayerState",
    "MethodSession",
    "NamedMethod",
    "ReportedBranch",
    "ReportedSession",
]
