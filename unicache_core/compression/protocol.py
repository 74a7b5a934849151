"""What a branch cache records per layer, and the shapes of a branch cache and a session as the report reads them.

The report (:mod:`.report`) is written against these protocols and the caches and sessions
(:mod:`.compressing_cache`, :mod:`.session`, :mod:`.full_cache`) implement them, so neither side imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

if TYPE_CHECKING:  # pragma: no cover
    from ..kv.cache import RequestInfo
    from .method import Method


@dataclass
class LayerState:
    """Per-layer records of a branch cache: what it measured (rows indexed by append index) and what the last plans
    said of the layer (budgets, flags, the types held as one store)."""

    scores: Tensor | None = None  # [T, Hkv] fp32, accumulated over scored calls (H2O)
    last_scores: Tensor | None = None  # [T, Hkv] fp32 of the last scored call (SnapKV, VL-Cache)
    last_score_queries: int = 0
    sparsity: float | None = None
    masses: dict = field(default_factory=dict)  # {TokenType: mass} of the last observed call
    segment_masses: dict = field(default_factory=dict)  # {SegmentKey: mass} of the candidate stores, same call
    budgets: dict = field(default_factory=dict)  # {type name: budget bytes} set at the last compression
    flags: dict = field(default_factory=dict)  # {TokenType or type name: reason} for budgets out of reach
    #: {TokenType: share} of the candidate types quantized as one store (UniCache, docs/compression.md §11.7): the
    #: store's attention mass is theirs in these shares (their masses when they were pooled); empty: no pool
    pooled: dict = field(default_factory=dict)

    def copy(self) -> LayerState:
        """A copy whose dicts are new (the score tensors are shared: they are replaced, never edited)."""
        return LayerState(
            self.scores,
            self.last_scores,
            self.last_score_queries,
            self.sparsity,
            dict(self.masses),
            dict(self.segment_masses),
            dict(self.budgets),
            dict(self.flags),
            dict(self.pooled),
        )


class ReportedBranch(Protocol):
    """One branch cache as the report reads it (compressing and uncompressed caches alike)."""

    branch: str | None
    num_layers: int
    compressions: int  # compressions applied so far
    rho: dict[int, float]  # layer chunk -> scheduled retention (empty when the method has no schedule)
    state: list[LayerState]

    def snapshot_types(self) -> dict[str, dict]:
        """Per type name: the policy, bytes held, rows per KV head, budgets, stores, mass (report ``types``)."""
        ...

    def snapshot_images(self) -> dict[str, dict]:
        """Per input image: bytes held and full, and per candidate type bytes and rows (report ``images``)."""
        ...

    def split_bytes(self) -> tuple[int, int]:
        """``(managed, protected)`` bytes held now."""
        ...

    def managed_full_bytes(self, layer: int | None = None) -> int:
        """Bytes the compressible rows would hold uncompressed."""
        ...


class ReportedSession(Protocol):
    """One request's session as the report reads it."""

    request: RequestInfo
    method: Method
    settings: dict
    target_ratio: float | None

    def held_bytes(self) -> int:
        """Bytes of every live branch cache, shared storage counted once."""
        ...

    def live_caches(self) -> list:
        """The branch caches of the request that still exist (:class:`ReportedBranch` each)."""
        ...


__all__ = ["LayerState", "ReportedBranch", "ReportedSession"]
