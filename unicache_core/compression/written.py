"""How UniCache stores an image's rows as each layer writes them (docs/compression.md §13), and what an evicted type's
rows held so become for a later budget. Pure functions of a layer's view and a segment.

- Every type the policy table quantizes or evicts: an image's rows at the most precise lookup setting whose real bytes
  fit ``rho0`` of the rows' uncompressed bytes (the bits the rows keep at most). A quantized type's rows that would
  not all fit wait for the first compression; an evicted type's are then stored at the lookup's lowest setting
  (:func:`written_floor`: 2 bits, largest group, no residual) until the scores to evict exist. A full target
  (``rho0`` 1) leaves them whole.
- Under UniCache's ``speed`` objective an evicted type's rows are evicted as written instead: the full-precision rows
  ``rho0`` holds, the best by the scores of the call that wrote them (understanding measures its image blocks as they
  are prefilled); where that call scored nothing they wait in full precision for the first compression.
- A retained ratio is a share of a type's uncompressed bytes, whatever it stores. An evicted type's rows held
  quantized then take :func:`written_choice` for their bytes: every row at fewer bits while they all fit, else the
  most rows that fit at the lowest bits, the best by score (the eviction).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ..kv.quant import SUPPORTED_BITS
from ..kv.token_types import TokenType
from .defaults import MERGED_TYPES
from .family import FULL_BITS, JointChoice, QuantGeometry, Segment, choose
from .ops import floor_bytes
from .plan import Keep, LayerPlan
from .routing import Kind
from .view import LayerView, SegmentKey


def written_floor(geometry: QuantGeometry, rows: int) -> JointChoice:
    """How ``rows`` rows of an evicted type are stored as they are written when ``rho0`` is under every setting that
    keeps them all: the lookup's lowest setting, the bytes of
    :func:`~unicache_core.compression.family.quantized_floor_bytes`."""
    return JointChoice(rows, min(SUPPORTED_BITS), max(geometry.groups), 0)


def written_segment_choice(
    segment: Segment, kind: Kind, rho0: float, geometry: QuantGeometry, evict: bool = False
) -> JointChoice | None:
    """How one input image's rows of a type of policy ``kind`` (``segment``, as just written to a layer) are stored at
    once (module docstring), or ``None``: kept whole until the first compression (a full target, rows compressed
    already, a quantized type whose rows would not all fit, or too few rows for quantizing to shrink them). ``evict``:
    an evicted type's rows are evicted now, to the full-precision rows ``rho0`` holds (the call that wrote them scored
    them; UniCache's ``speed`` objective)."""
    if rho0 >= 1.0 or segment.held_bits != FULL_BITS or not segment.shared_rows:
        return None
    if segment.held_rows < segment.full_rows:
        return None  # compressed already
    if kind == Kind.EVICT and evict:
        evicted = choose(segment, Kind.EVICT, floor_bytes(rho0, segment.full_bytes), geometry, evict_at_low_bits=False)
        return evicted if evicted.rows < segment.held_rows else None
    choice = choose(segment, Kind.QUANTIZE, floor_bytes(rho0, segment.full_bytes), geometry)
    if not choice.quantized or choice.rows < segment.held_rows:
        if kind != Kind.EVICT:
            return None
        choice = written_floor(geometry, segment.held_rows)  # an eviction waits for scores: every row, at least
    if segment.choice_bytes(choice) >= segment.held_bytes:
        return None  # too few rows for quantizing to shrink them
    return choice


def written_plan(
    layer: LayerView, store: Callable[[TokenType, Segment], JointChoice | None], fit_values: bool,
    eviction: WrittenEviction | None = None,
) -> LayerPlan:  # fmt: skip
    """The stores of ``layer``'s image segments just written: ``store(type, segment)`` for each (the method's
    :meth:`~unicache_core.compression.method.Method.written_store`; ``None`` keeps a segment as it is). A choice of
    fewer full-precision rows is an eviction by the scores of the call that wrote them, as ``eviction`` says (without
    those scores the segment waits as it is)."""
    if layer.geometry is None:
        return LayerPlan()
    keeps = []
    for key in layer.candidate_keys:
        if key.image is None:
            continue  # an image's rows only: a text's few rows wait for the first compression's carry and scores
        segment = layer.segment((key,))
        choice = store(key.type, segment)
        if choice is None:
            continue
        held = segment.choice_bytes(choice)
        if not choice.quantized:
            keep = _written_eviction(layer, key, choice, held, eviction or WrittenEviction(0.0))
            keeps.extend([] if keep is None else [keep])
            continue
        keeps.append(Keep((key,), choice.rows, choice.bits, choice.group, choice.residual, fit_values=fit_values, expected_bytes=held))  # noqa: E501  # fmt: skip
    return LayerPlan(keeps=tuple(keeps))


@dataclass(frozen=True)
class WrittenEviction:
    """How an evicted type's rows are evicted as they are written: H2O's recent share, and the merge of the rows it
    drops (:mod:`~unicache_core.compression.merging`)."""

    recent_fraction: float
    merge: str = "none"


def _written_eviction(
    layer: LayerView, key: SegmentKey, choice: JointChoice, held: int, eviction: WrittenEviction
) -> Keep | None:
    """The eviction of a just-written segment to ``choice``'s full-precision rows, the best by the scores of the call
    that wrote them (``None``: that call measured no scores for them)."""
    scores = layer.scores
    if scores is None or scores.shape[0] < layer.appended:
        return None  # this call's rows were not scored: they wait in full precision for the first compression
    merge = eviction.merge if key.type in MERGED_TYPES else "none"
    recent = min(choice.rows, int(choice.rows * eviction.recent_fraction + 0.5))
    return Keep((key,), choice.rows, scores=scores, recent=recent, merge=merge, expected_bytes=held)


def written_choice(segment: Segment, budget: int, geometry: QuantGeometry) -> JointChoice:
    """The (rows, bits) of an evicted type's segment held quantized (written so) for ``budget`` bytes, never more rows
    or bits than it holds: every row at the most precise setting that fits (the quantize route of
    :func:`~unicache_core.compression.family.choose`), and below every row's floor the most rows that fit at the
    lowest bits, the rows to keep chosen by score. The written residual-free store stays residual-free (the
    full-precision values a residual would hold are gone)."""
    return choose(segment, Kind.QUANTIZE, budget, replace(geometry, residual_max=0))


__all__ = ["WrittenEviction", "written_choice", "written_floor", "written_plan", "written_segment_choice"]
