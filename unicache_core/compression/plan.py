"""What a method hands the cache: when to measure (:class:`CallPlan`) and what to keep (:class:`BranchPlan`).

Plans are plain frozen values. A method computes them from a read-only view of the branch
(:mod:`.view`); the cache carries them out (:mod:`.compressing_cache`), so the two never share mutable state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from .family import FULL_BITS, JointChoice
from .view import SegmentKey


@dataclass(frozen=True)
class CallPlan:
    """What one forward pass of a branch measures and when the branch is compressed around it.

    Attributes:
        observe: type masses from the per-store LSE (free once attention ran store by store).
        measure: each layer asks the method's :meth:`~unicache_core.compression.method.Method.measure` for its
            statistic (from the call's queries, keys and attention); prefill calls included.
        compress_before: compress the branch before this call reads it.
        compress_after: compress the branch once this call has run (a prefill call: its block is written, before
            the next item is prefilled).
        store_written: each layer's appended rows are stored as the method's ``plan_written`` says, at once.
        fused: a call that measures nothing attends through one head-major workspace per layer (the method's
            ``fused`` setting, filled in by the session).
    """

    observe: bool = False
    measure: bool = False
    compress_before: bool = False
    compress_after: bool = False
    store_written: bool = False
    fused: bool = True


@dataclass(frozen=True)
class Keep:
    """One change to a layer: the stores of ``segments`` become one store of ``rows`` rows per KV head at ``bits``.

    Attributes:
        segments: the segment keys whose stores are pooled into the new store (their rows, in append order).
        rows: rows kept per KV head (the best by ``scores``; all of them: nothing is dropped).
        bits: :data:`~unicache_core.compression.family.FULL_BITS` keeps the rows at full precision (an evicted
            store); 2, 4 or 8 quantizes them (KIVI layout) with ``group`` and ``residual`` full-precision rows.
        scores: ``[T_appended, Hkv]`` per append index (higher = keep), needed when rows are dropped; a quantized
            store's residual rows are the best-scored ones (the newest without scores). value_bits: the quantized
            values' bits when fewer than ``bits`` (``None``: ``bits``; docs/compression.md §11.13); key_per_token: the
            quantized keys grouped per token (§11.13).
        recent: the most recent rows always kept (H2O's window); forced: ``[T_appended]`` bool rows always kept
            (SnapKV's observation window); smooth_kernel: 1-D average pooling of the scores (SnapKV).
        fit_values: values quantized here get least-squares ranges instead of min-max.
        merge: how the dropped rows are merged into the kept ones (LOOK-M's ``average``, ``pivot``, ``weighted``,
            UniCache's ``mass``; :mod:`~unicache_core.compression.merging`), at full precision or before the kept
            rows are quantized; ``none``: they are dropped.
        expected_bytes: the bytes the method counted on the new store holding (checked when applied).
    """

    segments: tuple[SegmentKey, ...]
    rows: int
    bits: int = FULL_BITS
    group: int = 0
    residual: int = 0
    scores: Tensor | None = None
    recent: int = 0
    forced: Tensor | None = None
    smooth_kernel: int = 1
    fit_values: bool = False
    merge: str = "none"
    expected_bytes: int | None = None
    value_bits: int | None = None
    key_per_token: bool = False

    @property
    def choice(self) -> JointChoice:
        """The (rows, bits, group, residual, value bits, key groups) this change keeps."""
        return JointChoice(self.rows, self.bits, self.group, self.residual, self.value_bits, self.key_per_token)


@dataclass(frozen=True)
class LayerPlan:
    """What one layer keeps: changes applied in order, and what the report records of the layer.

    Attributes:
        keeps: the changes, applied in this order.
        budgets: bytes each type (or ``candidate`` pool) was given (``None``: the layer's record stays).
        flags: a reason per type whose budget was out of reach; a ``None`` reason clears the type's flag.
        pooled: the candidate types the method decided to keep in one store (from this compression on) and each
            one's share of that store's attention mass (how its measured mass is told apart); empty: no change.
    """

    keeps: tuple[Keep, ...] = ()
    budgets: Mapping[str, int] | None = None
    flags: Mapping[Any, str | None] = field(default_factory=dict)
    pooled: Mapping[Any, float] = field(default_factory=dict)


@dataclass(frozen=True)
class BranchPlan:
    """What a branch keeps at one compression point, and the method's state for its next view.

    Attributes:
        layers: layer index -> plan (layers left out do not change).
        rho: the scheduled retention per layer chunk after this compression (empty: the method has no schedule).
        state: what the method keeps for this branch until its next compression (returned by the next view's
            :attr:`~unicache_core.compression.view.BranchView.state`); ``None``: nothing.
        unused: bytes of the branch's budget the plan leaves; at the branch's first compression the session passes
            them to a branch of the request not yet compressed (docs/compression.md §11.15).
    """

    layers: Mapping[int, LayerPlan] = field(default_factory=dict)
    rho: Mapping[int, float] = field(default_factory=dict)
    state: Any = None
    unused: int = 0


__all__ = ["BranchPlan", "CallPlan", "Keep", "LayerPlan"]
