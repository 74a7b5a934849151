"""How UniCache stores an image's rows as each layer writes them (docs/compression.md §13), and what a later
retention ratio of those rows is a share of. Pure functions of a layer's view; no scores needed.

- A type the policy table quantizes: every row at the most precise lookup setting whose real bytes fit ``rho0`` of
  the rows' uncompressed bytes (the bits the rows keep); rows that would not all fit wait for the first compression.
- A type the table evicts: every row at the lookup's lowest setting (:func:`written_floor`: 2 bits, largest group, no
  residual) until the scores to evict exist (a full target, ``rho0`` 1, leaves them whole). Its retained ratio is
  then a share of what it stores (:func:`reference_bytes`): the eviction keeps that share of its rows, the best by
  score, at the bits they were written at (bits never rise).
"""

from __future__ import annotations

from ..kv.quant import SUPPORTED_BITS
from ..kv.token_types import TokenType
from .family import FULL_BITS, JointChoice, QuantGeometry, choose, quantized_floor_bytes
from .ops import floor_bytes
from .plan import Keep, LayerPlan
from .routing import Kind
from .view import LayerView


def written_floor(geometry: QuantGeometry, rows: int) -> JointChoice:
    """How ``rows`` rows of an evicted type are stored as they are written: the lookup's lowest setting, the bytes of
    :func:`~unicache_core.compression.family.quantized_floor_bytes`."""
    return JointChoice(rows, min(SUPPORTED_BITS), max(geometry.groups), 0)


def written_plan(
    layer: LayerView, kinds: dict[TokenType, Kind], rho0: float, geometry: QuantGeometry, fit_values: bool
) -> LayerPlan:
    """The stores of ``layer``'s image segments just written (module docstring); ``kinds``: the policy kind of each
    type stored as written (the others wait)."""
    if layer.geometry is None:
        return LayerPlan()
    keeps = []
    for key in layer.candidate_keys:
        kind = kinds.get(key.type)
        if key.image is None or kind is None:
            continue  # an image's rows only: a text's few rows wait for the first compression's carry and scores
        segment = layer.segment((key,))
        if segment.held_bits != FULL_BITS or not segment.shared_rows or segment.held_rows < segment.full_rows:
            continue  # compressed already
        if kind == Kind.EVICT:
            choice = written_floor(geometry, segment.held_rows)
            if rho0 >= 1.0 or segment.choice_bytes(choice) >= segment.held_bytes:
                continue  # a full target keeps every row as it is; too few rows for quantizing to shrink them
        else:
            choice = choose(segment, Kind.QUANTIZE, floor_bytes(rho0, segment.full_bytes), geometry)
            if not choice.quantized or choice.rows < segment.held_rows:
                continue
        held = segment.choice_bytes(choice)
        keeps.append(Keep((key,), choice.rows, choice.bits, choice.group, choice.residual, fit_values=fit_values, expected_bytes=held))  # noqa: E501  # fmt: skip
    return LayerPlan(keeps=tuple(keeps))


def reference_bytes(layer: LayerView, token_type: TokenType, kind: Kind, rows: int, geometry: QuantGeometry) -> int:
    """The bytes a retained ratio of ``rows`` rows of ``token_type`` (those this branch plans) is a share of: their
    uncompressed K and V, but for an evicted type each image segment stored as written counts at the floor's bytes."""
    if kind != Kind.EVICT:
        return rows * layer.row_bytes
    geo = layer.geometry
    assert geo is not None
    total = 0
    for key, n in layer.segment_rows.items():
        if key.type != token_type or key in layer.planned_elsewhere:
            continue
        written = key.image is not None and layer.segment((key,)).held_bits != FULL_BITS
        floor = quantized_floor_bytes(n, geo.num_kv_heads, geo.head_dim, geo.elem, geometry)
        total += floor if written else n * layer.row_bytes
    return total


__all__ = ["reference_bytes", "written_floor", "written_plan"]
