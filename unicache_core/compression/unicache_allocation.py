"""UniCache's byte allocation (docs/compression.md §8.6, §11, §12.1, §13): what each type of a layer keeps for a
layer chunk's retention. Pure functions of a branch's view, the budget and :class:`AllocationSettings` (what they
need of the method); nothing here writes state. :class:`~unicache_core.compression.methods.unicache.UniCache` keeps
the protocol (when to compress, the retention schedule) and calls :func:`plan_layers` for its plan.

A chunk's ``rho * sum(capacity)`` is shared among the types by mass, no quantized type under its 2-bit floor
(:func:`type_ratios`); each layer's types take the (rows, bits) of their table's policy that fit their bytes
(:func:`plan_layer`), quantized types sharing one store where the budget cannot hold them apart (:func:`choose_pool`),
a type's rows of several images split by mass (:func:`_parts`). Rows and bits only go down; bytes a type or layer
leaves go to the next.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from ..kv.token_types import CANDIDATE_TYPES, TokenType
from .allocator import allocate_with_floors, mass_shares
from .defaults import KIVI_FLOOR, MERGED_TYPES, VALUE_FLOOR_BITS
from .family import FULL_BITS, QuantGeometry, Segment, choice_error, choose, quantized_floor_bytes
from .ops import floor_bytes
from .plan import Keep, LayerPlan
from .policy_table import PolicyTable
from .report import type_name
from .routing import Kind
from .stats import fallback_budget_ratio
from .view import POOLED, BranchView, LayerView, SegmentKey
from .written import written_choice

#: The unit of the quantized types that share one store (:func:`choose_pool`): the type a store of several
#: candidate types has.
POOL = TokenType.UNKNOWN

#: Which types are served first when a layer's budgets are applied: the coarse quantized settings, whose unused
#: bytes then go to the types that can use any number of bytes.
_SERVE_ORDER = {Kind.QUANTIZE: 0, Kind.JOINT: 1, Kind.EVICT: 2}


@dataclass(frozen=True)
class AllocationSettings:
    """What the allocation needs of the method's settings.

    Attributes:
        table: the bound policy table (a kind per task and type, a joint plan per joint type).
        geometry: the quantization geometry (the table's, with the method's fixed residual when it sets one).
        recent_fraction: recent share of an eviction budget.
        fit_ranges: least-squares ranges for the quantized values instead of min-max.
        merge: how dropped rows are merged into the kept ones (:mod:`~unicache_core.compression.merging`).
        evict_at_low_bits: an evicted type may hold its rows at low bits where that loses less (the ``memory``
            objective, docs/compression.md §11.16); ``False`` (``speed``): it keeps the rows its budget holds at full
            precision, the rows the paper's UniCache attends.
    """

    table: PolicyTable
    geometry: QuantGeometry
    recent_fraction: float
    fit_ranges: bool
    merge: str = "none"
    evict_at_low_bits: bool = True

    @property
    def value_floor(self) -> int:
        """The fewest bits a quantized value may take below the 2-bit floor (§11.13): fitted ranges only."""
        return VALUE_FLOOR_BITS if self.fit_ranges else KIVI_FLOOR[0]


class ChunkBudget(NamedTuple):
    """A layer chunk's retention and what it is shared by.

    Attributes:
        layers: the chunk's layer indices.
        caps: rows per candidate type the branch plans in the chunk's first layer, counted once per branch that holds
            them (:func:`counted_rows`).
        masses: each type's attention mass, counted like its rows (``None``: not measured; every type then takes
            ``rho``).
        rho: the chunk's scheduled retention.
        floor: the least retention its schedule can reach.
    """

    layers: list[int]
    caps: dict[TokenType, int]
    masses: dict[TokenType, float] | None
    rho: float
    floor: float


class Part(NamedTuple):
    """One segment group of a unit and its share of the unit's budget: ``keys``, ``budget`` bytes, ``full_rows``."""

    keys: tuple[SegmentKey, ...]
    budget: int
    full_rows: int


class LayerResult(NamedTuple):
    """A layer's plan, the bytes it leaves unused (``unused``, carried to the next layer) and the bytes it holds
    (``held``, each store counted once per branch that holds it)."""

    plan: LayerPlan
    unused: int
    held: int


class SegmentChange(NamedTuple):
    """One segment's change for its bytes: the ``keep`` to apply (``None``: it keeps what it holds) and the bytes it
    holds after (``held``)."""

    keep: Keep | None
    held: int


def planned_rows(layer: LayerView) -> dict[TokenType, int]:
    """Rows per type this branch plans: all but those another branch plans for both (``planned_elsewhere``)."""
    rows = dict(layer.type_rows)
    for key in layer.planned_elsewhere:
        if key.type in rows:
            rows[key.type] -= layer.segment_rows.get(key, 0)
    return rows


def planned_copies(layer: LayerView) -> dict[TokenType, int]:
    """How many times the request's budget counts each type's planned rows: once per live branch that holds them (a
    store ``gen`` plans for the image rows ``cfg_text`` shares counts in both, as the report's per-branch bytes count
    it; docs/compression.md §11.15). The most over a type's segments, so a type's bytes are never under-counted."""
    out: dict[TokenType, int] = {}
    for key in layer.candidate_keys:
        if key not in layer.planned_elsewhere:
            types = layer.pooled if key.type == POOLED.type else (key.type,)  # a pooled store: its types' rows
            for t in types:
                out[t] = max(out.get(t, 1), 1 + len(layer.shared_with.get(key, frozenset())))
    return out


def counted_rows(layer: LayerView) -> dict[TokenType, int]:
    """Rows per type this branch plans, each counted once per branch that holds it (:func:`planned_copies`)."""
    copies = planned_copies(layer)
    return {t: n * copies.get(t, 1) for t, n in planned_rows(layer).items()}


def planned_types(table: PolicyTable, task: str, layer: LayerView) -> list[TokenType]:
    """The candidate types of ``layer`` with rows this branch plans and a policy other than protect."""
    rows = planned_rows(layer)
    return [t for t in CANDIDATE_TYPES if rows.get(t, 0) and table.kind(task, t) != Kind.PROTECT]


def mean_masses(view: BranchView, layers: list[int], types: list[TokenType]) -> dict[TokenType, float] | None:
    """Each type's attention mass averaged over the measured layers of ``layers`` (``None``: none measured)."""
    seen = [view.layer(index).masses for index in layers if view.layer(index).masses]
    if not seen:
        return None
    return {t: sum(m.get(t, 0.0) for m in seen) / len(seen) for t in types}


class BranchLayers(NamedTuple):
    """A branch's plan per layer (``plans``) and the bytes of its budget they leave (``unused``)."""

    plans: dict[int, LayerPlan]
    unused: int


def plan_layers(view: BranchView, chunks: list[ChunkBudget], settings: AllocationSettings) -> BranchLayers:
    """Every layer's plan for its chunk's retention, the bytes a layer leaves (and the branch's grant) carried to the
    next. What the last layer leaves is offered again to the layers in order (docs/compression.md §11.15): a layer
    planned again with it added takes the plan that holds more, never more than it was offered; what no layer takes
    (and the grants of layers with nothing to plan) is the branch's ``unused``."""
    plans: dict[int, LayerPlan] = {}
    inputs: dict[int, tuple[dict[TokenType, float], float, int, LayerResult]] = {}
    planned = {index for chunk in chunks for index in chunk.layers}
    carry = sum(view.grant(i) for i in range(view.num_layers) if i not in planned)  # bytes no layer of its own plans
    for chunk in chunks:
        ratios = type_ratios(view.task, view.layer(chunk.layers[0]), chunk, settings)
        at_floor = chunk.floor / chunk.rho if chunk.rho > 0 else 1.0
        for index in chunk.layers:
            offered = carry + view.grant(index)
            result = plan_layer(view, view.layer(index), ratios, settings, offered, at_floor)
            plans[index], carry = result.plan, result.unused
            inputs[index] = (ratios, at_floor, offered, result)
    for index, (ratios, at_floor, offered, before) in inputs.items():
        if carry <= 0:
            break
        again = plan_layer(view, view.layer(index), ratios, settings, offered + carry, at_floor)
        gained = again.held - before.held
        if 0 < gained <= carry:
            plans[index] = again.plan
            carry -= gained
    return BranchLayers(plans, max(0, carry))


def type_ratios(
    task: str, layer: LayerView, chunk: ChunkBudget, settings: AllocationSettings
) -> dict[TokenType, float]:
    """Each type's retained ratio for a layer chunk (``layer``: its first): ``rho * sum(caps)`` shared by mass, no
    quantized type under its floor (§8.6); without masses, every type at ``rho`` (at most the fallback)."""
    caps, weights = chunk.caps, chunk.masses
    if weights is None or sum(weights.values()) <= 0:
        ratio = min(chunk.rho, fallback_budget_ratio(task))
        return {t: ratio for t in caps}
    rows = planned_rows(layer)
    floors = {
        t: _type_floor(layer, t, settings.geometry) / (rows[t] * layer.row_bytes)
        for t in caps
        if settings.table.kind(task, t) == Kind.QUANTIZE and rows.get(t)
    }
    return allocate_with_floors(caps, weights, chunk.rho * sum(caps.values()), floors)


def _floor(layer: LayerView, rows: int, geometry: QuantGeometry) -> int:
    """The 2-bit floor of ``rows`` rows of ``layer`` in a store of their own
    (:func:`~unicache_core.compression.family.quantized_floor_bytes`)."""
    geo = layer.geometry
    assert geo is not None
    return quantized_floor_bytes(rows, geo.num_kv_heads, geo.head_dim, geo.elem, geometry)


def _type_floor(layer: LayerView, token_type: TokenType, geometry: QuantGeometry) -> int:
    """The floor of a quantized type: every row of each of its segments (one per input image) at the lowest bits and
    largest group, each segment a store of its own."""
    return sum(
        _floor(layer, rows, geometry)
        for key, rows in layer.segment_rows.items()
        if key.type == token_type and key not in layer.planned_elsewhere
    )


def _parts(
    layer: LayerView, unit: TokenType, keys: tuple[SegmentKey, ...], budget: int, kind: Kind,
    pool: frozenset[TokenType], geometry: QuantGeometry,
) -> list[Part]:  # fmt: skip
    """A unit's segments and each one's share of the unit's ``budget`` bytes.

    A type's rows of several input images are split by the attention mass each image's rows drew in the last
    observed call (by their rows without one), capped by their rows, no quantized segment under its 2-bit floor
    (docs/compression.md §12.1). One segment, or the pool of several types, takes the whole budget."""
    rows = layer.segment_rows
    if unit == POOL or len(keys) < 2:
        return [Part(keys, budget, _unit_segment(layer, unit, keys, pool).full_rows)]
    caps = {key: rows.get(key, 0) for key in keys}
    masses = {key: layer.segment_masses.get(key, 0.0) for key in keys}
    weights = masses if sum(masses.values()) > 0 else {key: float(n) for key, n in caps.items()}
    floors = {}
    if kind == Kind.QUANTIZE:
        floors = {key: _floor(layer, n, geometry) / (n * layer.row_bytes) for key, n in caps.items() if n}
    live = {key: n for key, n in caps.items() if n}
    ratios = allocate_with_floors(live, weights, budget / layer.row_bytes, floors) if live else {}
    return [Part((key,), floor_bytes(ratios.get(key, 0.0), caps[key] * layer.row_bytes), caps[key]) for key in keys]


def _unit_keys(layer: LayerView, unit: TokenType, pool: frozenset[TokenType]) -> tuple[SegmentKey, ...]:
    """The segment keys of a unit: a type's own, or (:data:`POOL`) the pooled types' and the pooled store's."""
    if unit == POOL:
        return layer.keys_of([*pool, POOLED.type])
    return tuple(key for key in layer.keys_of([unit]) if key not in layer.planned_elsewhere)


def _unit_segment(
    layer: LayerView, unit: TokenType, keys: tuple[SegmentKey, ...], pool: frozenset[TokenType]
) -> Segment:
    rows = planned_rows(layer)
    full = sum(rows.get(t, 0) for t in pool) if unit == POOL else rows.get(unit, 0)
    return layer.segment(keys, full_rows=full)


def choose_pool(
    view: BranchView, layer: LayerView, budgets: Mapping[TokenType, int], kinds: Mapping[TokenType, Kind],
    at_floor: float, geometry: QuantGeometry, value_floor: int = KIVI_FLOOR[0],
) -> frozenset[TokenType]:  # fmt: skip
    """The quantized types of ``layer`` that share one store (docs/compression.md §11.7), decided once, at the
    branch's first compression: two or more quantized types whose budgets at the schedule's floor give a smaller
    expected error in one store than apart (:func:`~unicache_core.compression.family.choice_error`, weighted by
    each type's measured attention mass): apart, a type whose mass share is below its byte share falls to fewer
    bits (or drops rows under its 2-bit floor: a short instruction's scale/zero per key channel), where one
    store keeps every row at the same bits, KIVI's choice. One store pays for one set of groups, spends its bytes
    on every row alike, and what it cannot keep it drops by score across the types."""
    if view.compressions:  # decided at the branch's first compression, while every row is at full precision
        return frozenset(layer.pooled)
    at_least = {t: math.floor(b * at_floor) for t, b in budgets.items()}
    quantized = _poolable(layer, [t for t in at_least if kinds[t] == Kind.QUANTIZE])
    if len(quantized) < 2:
        return frozenset()
    segments = {}
    for t in quantized:
        keys = _unit_keys(layer, t, frozenset())
        if keys:
            segments[t] = _unit_segment(layer, t, keys, frozenset())
    if len(segments) < 2:
        return frozenset()
    rows = sum(segment.full_rows for segment in segments.values())
    shared = replace(
        next(iter(segments.values())), full_rows=rows, held_rows=rows, held_bits=FULL_BITS, shared_rows=True
    )
    weights = {t: max(0.0, layer.masses.get(t, 0.0)) for t in segments}
    if sum(weights.values()) <= 0:
        weights = {t: float(segment.full_rows) for t, segment in segments.items()}
    apart = sum(
        w * choice_error(segments[t], choose(segments[t], Kind.QUANTIZE, at_least[t], geometry, None, value_floor))
        for t, w in weights.items()
    )
    pooled = choose(shared, Kind.QUANTIZE, sum(at_least[t] for t in segments), geometry, None, value_floor)
    return frozenset(quantized) if sum(weights.values()) * choice_error(shared, pooled) < apart else frozenset()


def _poolable(layer: LayerView, types: list[TokenType]) -> list[TokenType]:
    """The largest group of ``types`` whose segments the same branches hold (each holder can take the pool, §13)."""
    groups: dict[frozenset[str], list[TokenType]] = {}
    for t in types:
        holders = {layer.shared_with.get(key, frozenset()) for key in _unit_keys(layer, t, frozenset())}
        if len(holders) == 1:
            groups.setdefault(holders.pop(), []).append(t)
    rows = planned_rows(layer)
    return max(groups.values(), key=lambda group: sum(rows.get(t, 0) for t in group), default=[])


def plan_layer(
    view: BranchView, layer: LayerView, ratios: dict[TokenType, float], settings: AllocationSettings, carry: int = 0,
    at_floor: float = 1.0,
) -> LayerResult:  # fmt: skip
    """Each type's (rows, bits) for its bytes (docs/compression.md §11.3), never more rows or bits than it holds.
    ``carry`` (bytes earlier layers left unused) is added to the types' budgets in proportion to them. Types are
    served coarsest first (quantize, joint, evict): what a type leaves of its budget goes to the joint and evicted
    types after it, in proportion to their budgets. Quantized types may share one store (:func:`choose_pool`;
    ``at_floor``: the schedule's floor over its current rho). A type over its budget (flagged) uses up what the others
    left. Budgets and bytes count a type's rows once per branch that holds them (:func:`planned_copies`): each of its
    stores is chosen for its budget over that count."""
    task = view.task
    rows = planned_rows(layer)
    copies = planned_copies(layer)
    kinds = {t: settings.table.kind(task, t) for t in ratios}
    geometry = settings.geometry
    budgets = {t: floor_bytes(r, rows[t] * copies.get(t, 1) * layer.row_bytes) for t, r in ratios.items()}
    base = sum(budgets.values())
    for t in budgets:
        budgets[t] += math.floor(carry * (budgets[t] / base if base else 1 / len(budgets)))
    per_copy = {t: b // copies.get(t, 1) for t, b in budgets.items()}
    pool = choose_pool(view, layer, per_copy, kinds, at_floor, geometry, settings.value_floor)
    pooled: dict[TokenType, float] = {}
    if pool:  # the pooled types are one unit: their budgets summed, quantized together
        if not layer.pooled:
            pooled = mass_shares({t: layer.masses.get(t, 0.0) for t in pool}, {t: rows[t] for t in pool})
        copies[POOL] = max(copies.get(t, 1) for t in pool)  # the pooled types' segments have the same holders
        budgets[POOL] = sum(budgets.pop(t) for t in pool if t in budgets)
        kinds = {t: kind for t, kind in kinds.items() if t not in pool} | {POOL: Kind.QUANTIZE}
    order = sorted(budgets, key=lambda t: _SERVE_ORDER[kinds[t]])
    keeps: list[Keep] = []
    flags: dict[TokenType, str | None] = {}
    held_all = leftover = 0
    for position, t in enumerate(order):
        kind = kinds[t]
        if kind != Kind.QUANTIZE and leftover:
            takers = [u for u in order[position:] if kinds[u] != Kind.QUANTIZE]
            share = sum(budgets[u] for u in takers)
            extra = leftover if share == 0 else math.floor(leftover * budgets[t] / share)
            budgets[t] += extra
            leftover -= extra
        flags[t] = None
        keys = _unit_keys(layer, t, pool)
        if not keys:
            continue
        count = copies.get(t, 1)
        joint = settings.table.plan_for(task, t) if kind == Kind.JOINT else None
        plan_bits = joint.bits_for(ratios[t]) if joint else None
        held = held_rows = 0
        spare = 0  # what the unit's earlier segments left of their share
        for part in _parts(layer, t, keys, budgets[t] // count, kind, pool, geometry):
            budget = part.budget + spare
            segment = layer.segment(part.keys, full_rows=part.full_rows)
            change = segment_change(view, layer, segment, part.keys, kind, budget, plan_bits, settings)
            if change.keep is not None:
                keeps.append(change.keep)
            spare = max(0, budget - change.held)
            held += change.held
            held_rows += segment.held_rows
        if held * count > budgets[t]:
            flags[t] = (
                f"{held_rows} rows held ({held} B) exceed their budget of {budgets[t] // count} B: "
                "rows and bits never grow back, and nothing smaller fits this policy"
            )
        leftover += max(0, budgets[t] - held * count)
        held_all += held * count
    plan = LayerPlan(
        keeps=tuple(keeps), budgets={type_name(t): b for t, b in budgets.items()}, flags=flags, pooled=pooled
    )
    return LayerResult(plan, max(0, base + carry - held_all), held_all)


def kept_mass(layer: LayerView, keys: tuple[SegmentKey, ...], held: int) -> tuple[float, ...] | None:
    """``[k]``: the share of the attention mass of the rows of ``keys`` that its ``k`` best-scored rows drew (their
    scores averaged over the KV heads), ``k = 0 .. held``; ``None`` without scores."""
    if layer.scores is None or held == 0:
        return None
    mask = layer.type_mask({key.type for key in keys}) & layer.candidate_mask()
    scores = layer.scores[: mask.shape[0]][mask[: layer.scores.shape[0]]].float().clamp(min=0).mean(dim=1)
    total = float(scores.sum())
    if scores.numel() == 0 or total <= 0:
        return None
    order = torch.sort(scores, descending=True).values[:held].cumsum(0) / total
    return (0.0, *(float(v) for v in order), *([1.0] * max(0, held - order.numel())))


def merges(layer: LayerView, keys: tuple[SegmentKey, ...]) -> bool:
    """Whether the rows ``keys`` drop are merged into the ones they keep: every type they hold (a pooled store's
    types included) is one of :data:`~unicache_core.compression.defaults.MERGED_TYPES`."""
    types = {key.type for key in keys if key != POOLED} | (set(layer.pooled) if POOLED in keys else set())
    return bool(types) and types <= set(MERGED_TYPES)


def segment_change(
    view: BranchView, layer: LayerView, segment: Segment, keys: tuple[SegmentKey, ...], kind: Kind, budget: int,
    plan_bits: int | None, settings: AllocationSettings,
) -> SegmentChange:  # fmt: skip
    """The (rows, bits) of one segment for ``budget`` bytes (:func:`~unicache_core.compression.family.choose`): an
    evicted or quantized segment over its budget is weighed by the attention mass its best-scored rows drew
    (:func:`kept_mass`), so an evicted text held at full precision is quantized instead where every row at low bits
    loses less than the rows eviction drops (docs/compression.md §11.16)."""
    low_bits = settings.evict_at_low_bits
    if kind == Kind.EVICT and segment.held_bits != FULL_BITS and low_bits:  # an evicted type's rows stored as written
        choice = written_choice(segment, budget, settings.geometry)
    else:
        if kind in (Kind.QUANTIZE, Kind.EVICT) and segment.held_bytes > budget:  # what choice_error weighs rows by
            segment = replace(segment, kept_mass=kept_mass(layer, keys, segment.held_rows))
        choice = choose(segment, kind, budget, settings.geometry, plan_bits, settings.value_floor, True, low_bits)
    held_values = segment.held_bits if segment.held_value_bits is None else segment.held_value_bits
    fewer = choice.rows < segment.held_rows or choice.bits < segment.held_bits or choice.vbits < held_values
    if not (fewer or (segment.held_bytes > budget and segment.choice_bytes(choice) < segment.held_bytes)):
        return SegmentChange(None, segment.held_bytes)
    if choice.rows < segment.held_rows and layer.scores is None:
        raise RuntimeError(f"unicache: layer {layer.index} of branch {view.branch} was never scored")
    held = segment.choice_bytes(choice)
    keep = Keep(
        segments=keys,
        rows=choice.rows,
        bits=choice.bits,
        group=choice.group,
        residual=choice.residual,
        scores=layer.scores,
        recent=min(choice.rows, int(choice.rows * settings.recent_fraction + 0.5)),
        fit_values=settings.fit_ranges,
        merge=settings.merge if merges(layer, keys) else "none",
        expected_bytes=held,
        value_bits=choice.value_bits,
        key_per_token=choice.key_per_token,
    )
    return SegmentChange(keep, held)


__all__ = [
    "POOL",
    "AllocationSettings",
    "BranchLayers",
    "ChunkBudget",
    "LayerResult",
    "Part",
    "SegmentChange",
    "choose_pool",
    "counted_rows",
    "merges",
    "mean_masses",
    "plan_layer",
    "plan_layers",
    "planned_copies",
    "planned_rows",
    "planned_types",
    "segment_change",
    "type_ratios",
]
