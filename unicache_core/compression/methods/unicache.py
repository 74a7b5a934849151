"""UniCache (https://arxiv.org/abs/2609.32831; docs/compression.md §8, §11, §13): task- and type-aware KV compression.

An image's rows of the types the table quantizes are stored quantized as each layer writes them (:meth:`plan_written`,
at the bits the starting retention gives). Per branch and layer chunk, after the branch's first step and at the end of
every step chunk (understanding: before the first decoded token, then every chunk of decoded tokens): the chunk's EMA
attention mass lowers the rho schedule (never raising it); ``rho * sum(capacity)`` is shared among the types by mass
(§8.6); each type takes the (rows, bits) of its table's policy that fits its bytes (evict, quantize or joint, §11),
quantized types sharing one store where the budget cannot hold them at 4 bits (§11.7), a branch under its 2-bit floor
paid for by the others (§11.8). Rows and bits only go down; bytes a type or layer leaves go to the next; no type holds
more than its full K and V. Rows a fork shares with its parent are planned by the parent, which pools them apart from
its own, and stay one store for both (§13). A re-allocation runs only when some chunk's rho went down; once every
chunk's rho is fixed or at its floor the branch is settled and neither measured nor compressed again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ...kv.cache import AttentionCall, RequestInfo
from ...kv.token_types import CANDIDATE_TYPES, TokenType
from ...validation import check_bool, check_ratio
from ..allocator import allocate_with_floors, mass_shares
from ..defaults import FIT_VALUE_RANGES, POOL_BELOW_BITS, RECENT_FRACTION
from ..family import FULL_BITS, JointChoice, QuantGeometry, Segment, choose, quantized_floor_bytes
from ..method import Method
from ..ops import floor_bytes
from ..plan import BranchPlan, CallPlan, Keep, LayerPlan
from ..policy_table import PolicyTable, resolve_policy_table
from ..report import type_name
from ..schedule import RetentionSchedule
from ..stats import fallback_budget_ratio, layer_chunks, step_chunk
from ..view import POOLED, BranchView, LayerView, SegmentKey

#: The unit of the quantized types that share one store (:meth:`UniCache._pool`): the type a store of several
#: candidate types has.
POOL = TokenType.UNKNOWN


@dataclass(frozen=True)
class UniCacheState:
    """What UniCache keeps of a branch between its compressions: the retention schedule of each layer chunk."""

    schedules: Mapping[int, RetentionSchedule] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class UniCache(Method):
    """See the module docstring.

    Attributes:
        policy: the policy table (a path or a :class:`~unicache_core.compression.policy_table.PolicyTable`); default:
            the checkpoint's ``unicache_policy.json``, else the shipped paper table.
        rho: starting retention ``rho0`` (default: the task's, 0.2 understanding and editing, 0.4 text-to-image); an
            explicit ``kv_target`` fixes it too.
        rho_floor: the lowest retention the schedule may reach (default 0.35 t2i, 0.1 edit).
        recent_fraction: recent share of an eviction budget (0.25).
        residual: a fixed number of full-precision residual rows for the quantized segments; ``None`` (default): the
            residual follows the segment's length (docs/compression.md §11.2).
        fit_ranges: least-squares ranges for the quantized values (docs/compression.md §11.10); False: KIVI's min-max.
    """

    name = "unicache"
    budget = "rho"
    compresses_written = text_prior = True
    policy: str | Path | PolicyTable | None = None
    rho: float | None = None
    rho_floor: float | None = None
    recent_fraction: float = RECENT_FRACTION
    residual: int | None = None
    fit_ranges: bool = FIT_VALUE_RANGES

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rho is not None:
            check_ratio("rho", self.rho)
        if self.rho_floor is not None:
            check_ratio("rho_floor", self.rho_floor, allow_zero=True)
        if self.rho is not None and self.rho_floor is not None and self.rho_floor > self.rho:
            raise ValueError(
                f"`rho_floor` ({self.rho_floor}) must not exceed `rho` ({self.rho}); lower the floor or raise rho"
            )
        if self.policy is not None and not isinstance(self.policy, (str, Path, PolicyTable)):
            raise ValueError(f"`policy` must be a policy-table path or PolicyTable, got {type(self.policy).__name__}")
        check_ratio("recent_fraction", self.recent_fraction, allow_zero=True)
        QuantGeometry().with_residual(self.residual)
        check_bool("fit_ranges", self.fit_ranges)

    # ------------------------------------------------------------------ settings

    def settings(self) -> dict[str, Any]:
        out = super().settings()
        if isinstance(self.policy, PolicyTable):
            out["policy"] = self.policy.model_id
        return out

    def bind(self, request: RequestInfo, checkpoint_dir: str) -> tuple[Method, dict]:
        """The method with its policy table resolved for the request's checkpoint (and checked for its task)."""
        table, info = resolve_policy_table(self.policy, checkpoint_dir, request.model_id)
        table.require_task(request.task)
        return replace(self, policy=table), info

    @property
    def table(self) -> PolicyTable:
        """The policy table of a bound method (:meth:`bind`)."""
        if not isinstance(self.policy, PolicyTable):
            raise RuntimeError("UniCache runs with its policy table resolved: bind() it to a request first")
        return self.policy

    def target(self, task: str) -> float | int:
        """The explicit ``kv_target``, else the task's ``rho0``."""
        return self.kv_target if self.kv_target is not None else RetentionSchedule.for_task(task).rho0

    def geometry(self) -> QuantGeometry:
        """The quantization geometry: the table's, with the fixed residual when one is set."""
        return self.table.geometry.with_residual(self.residual)

    # ------------------------------------------------------------------ schedule

    def new_schedule(self, view: BranchView) -> RetentionSchedule:
        """A layer chunk's schedule before any observation: the task's preset, with ``rho0`` and the floor from the
        settings when they set them (an explicit ``kv_target`` fixes ``rho0``)."""
        preset = RetentionSchedule.for_task(view.task)
        rho0, floor = preset.rho0, preset.floor
        if self.kv_target is not None:
            rho0 = view.target
            floor = min(floor, rho0)
        if self.rho is not None:
            rho0 = self.rho
            floor = min(floor, rho0)
        if self.rho_floor is not None:
            floor = self.rho_floor
        if floor > rho0:
            raise ValueError(f"`rho_floor` ({floor}) must not exceed rho ({rho0})")
        return RetentionSchedule(rho0=rho0, floor=floor, fixed=preset.fixed)

    def _schedules(self, view: BranchView) -> dict[int, RetentionSchedule]:
        state = view.state
        return dict(state.schedules) if isinstance(state, UniCacheState) else {}

    def _schedule(self, view: BranchView, chunk: int) -> RetentionSchedule:
        return self._schedules(view).get(chunk) or self.new_schedule(view)

    # ------------------------------------------------------------------ when

    def settled(self, view: BranchView) -> bool:
        """Whether the branch's budget can no longer go down: compressed, and every layer chunk's schedule fixed or at
        its floor. Re-allocating a budget that stays can only lose rows (what one type would gain it could not take
        back: rows and bits never grow), so a settled branch is neither measured nor compressed again."""
        if view.compressions == 0:
            return False
        schedules = [self._schedule(view, c) for c in layer_chunks(view.num_layers)]  # unobserved chunks: fresh
        return all(s.fixed or s.rho <= s.floor for s in schedules)

    def is_compression_step(self, view: BranchView, step: int) -> bool:
        """After the branch's first step, then at the last step of each step chunk that calls its caches: the step
        after which its next call (``step + 1``; with TaylorSeer its next computed step, forecast steps call
        nothing) falls in a later chunk, or after which none comes (docs/compression.md §11.12)."""
        if view.compressions == 0:
            return True
        if self.settled(view):
            return False
        upcoming = view.next_call_step(step)
        return upcoming is None or step_chunk(upcoming) != step_chunk(step)

    def plan_decode(self, view: BranchView, call: AttentionCall) -> CallPlan:
        # Only the token that ends a step chunk is measured (type masses from the LSE) and re-allocates; the EMA
        # carries across chunks (window 16), every other token takes the fast path. Eviction keeps using the H2O
        # scores of the prompt rows: one decoded query adds little to them and would cost a scoring pass over every
        # resident key (the decoded tokens themselves are protected).
        step = int(call.step or 0)
        if step_chunk(step + 1) != step_chunk(step) and not self.settled(view):
            return CallPlan(observe=True, compress_after=True)
        return CallPlan()

    # ------------------------------------------------------------------ how

    def plan_written(self, view: BranchView, layer: int) -> LayerPlan:
        """An image's rows of a type the table quantizes, stored as each layer writes them (§13): every row at the most
        precise setting that fits ``rho0`` of their bytes (no scores needed); rows that would not all fit wait."""
        if isinstance(self.kv_target, int):
            return LayerPlan()  # a byte target is a share of the whole context: known once it is filled
        lay = view.layer(layer)
        if lay.geometry is None:
            return LayerPlan()
        rho = self.new_schedule(view).rho0
        keeps = []
        for key in lay.candidate_keys:
            if key.image is None or self.table.kind(view.task, key.type) != "quantize":
                continue  # an image's rows only: a text's few rows wait for the first compression's carry and scores
            segment = lay.segment((key,))
            if segment.held_bits != FULL_BITS or not segment.shared_rows or segment.held_rows < segment.full_rows:
                continue  # compressed already
            choice = choose(segment, "quantize", floor_bytes(rho, segment.full_bytes), self.geometry())
            if not choice.quantized or choice.rows < segment.held_rows:
                continue
            held = segment.choice_bytes(choice)
            keeps.append(Keep((key,), choice.rows, choice.bits, choice.group, choice.residual, fit_values=self.fit_ranges, expected_bytes=held))  # noqa: E501  # fmt: skip
        return LayerPlan(keeps=tuple(keeps))

    @staticmethod
    def _rows(layer: LayerView) -> dict[TokenType, int]:
        """Rows per type this branch plans: all but those another branch plans for both (``planned_elsewhere``)."""
        rows = dict(layer.type_rows)
        for key in layer.planned_elsewhere:
            if key.type in rows:
                rows[key.type] -= layer.segment_rows.get(key, 0)
        return rows

    def _types(self, view: BranchView, layer: LayerView) -> list[TokenType]:
        rows = self._rows(layer)
        return [t for t in CANDIDATE_TYPES if rows.get(t, 0) and self.table.kind(view.task, t) != "protect"]

    def plan(self, view: BranchView) -> BranchPlan:
        """Per layer chunk: update rho from the chunk's mass, share it among the types, apply each type's policy."""
        task = view.task
        initial = view.compressions == 0
        chunk_now = step_chunk(view.call_step)
        schedules = self._schedules(view)
        rho_before = view.rho
        rho_now = dict(rho_before)
        chunks: list[tuple[list[int], dict, dict | None, float, float]] = []  # (layers, caps, masses, rho, floor)
        lowered = initial
        for c, layers in layer_chunks(view.num_layers).items():
            first = view.layer(layers[0])
            types = self._types(view, first)
            if not types:
                continue
            if task == "understanding" and initial:
                weights = _mean_masses(view, layers, types)  # the prompt's (post-modality) observation
            else:
                weights = view.cell_masses(c, chunk_now, types)
            sched = schedules.get(c) or self.new_schedule(view)
            if weights is not None:
                mass = sum(weights.values())
                if sched.m0 is None:
                    sched = sched.observe(0, mass)  # the branch's first (full-KV) observation is the reference
                elif not initial:
                    sched = sched.observe(max(1, chunk_now), mass)
            schedules[c] = sched
            lowered = lowered or c not in rho_before or sched.rho < rho_before[c]
            rho_now[c] = sched.rho
            caps = {t: self._rows(first)[t] for t in types}
            chunks.append((layers, caps, weights, sched.rho, sched.least))
        state = UniCacheState(schedules)
        if not lowered:
            # no budget went down: the branch already holds at most it, and a re-split could only lose rows
            return BranchPlan(rho=rho_now, state=state)
        plans: dict[int, LayerPlan] = {}
        carry = 0  # bytes the previous layers left unused
        for layers, caps, weights, rho, floor in chunks:
            ratios = self._type_ratios(view, view.layer(layers[0]), caps, weights, rho)
            for index in layers:
                plans[index], carry = self._plan_layer(
                    view, view.layer(index), ratios, carry + view.grant(index), floor / rho if rho > 0 else 1.0
                )
        return BranchPlan(layers=plans, rho=rho_now, state=state)

    def floor_needs(self, view: BranchView) -> dict[int, tuple[int, int]]:
        """Per layer: ``(budget, floor)`` bytes at the least retention the branch's schedule can reach: the candidate
        rows' budget, and what its quantized rows need to keep every row at 2 bits (one store when two or more types
        are quantized, :meth:`_pool`)."""
        geometry = self.geometry()
        out = {}
        for c, layers in layer_chunks(view.num_layers).items():
            least = self._schedule(view, c).least
            for index in layers:
                layer = view.layer(index)
                geo = layer.geometry
                rows = {t: self._rows(layer)[t] for t in self._types(view, layer)}
                if geo is None or not rows:
                    continue
                quantized = [n for t, n in rows.items() if self.table.kind(view.task, t) == "quantize"]
                need = (
                    quantized_floor_bytes(sum(quantized), geo.num_kv_heads, geo.head_dim, geo.elem, geometry)
                    if quantized
                    else 0
                )
                out[index] = (floor_bytes(least, sum(rows.values()) * layer.row_bytes), need)
        return out

    def _type_ratios(
        self, view: BranchView, layer: LayerView, caps: dict, weights: dict | None, rho: float
    ) -> dict[TokenType, float]:
        """Each type's retained ratio for a layer chunk (``layer``: its first): ``rho * sum(caps)`` shared by mass, no
        quantized type under its floor (§8.6); without masses, every type at ``rho`` (at most the fallback)."""
        if weights is None or sum(weights.values()) <= 0:
            ratio = min(rho, fallback_budget_ratio(view.task))
            return {t: ratio for t in caps}
        floors = {
            t: self._type_floor(layer, t) / (n * layer.row_bytes)
            for t, n in caps.items()
            if self.table.kind(view.task, t) == "quantize"
        }
        return allocate_with_floors(caps, weights, rho * sum(caps.values()), floors)

    def _floor(self, layer: LayerView, rows: int) -> int:
        """The 2-bit floor of ``rows`` rows of ``layer`` in a store of their own
        (:func:`~unicache_core.compression.family.quantized_floor_bytes`)."""
        geo = layer.geometry
        assert geo is not None
        return quantized_floor_bytes(rows, geo.num_kv_heads, geo.head_dim, geo.elem, self.geometry())

    def _type_floor(self, layer: LayerView, token_type: TokenType) -> int:
        """The floor of a quantized type: every row of each of its segments (one per input image) at the lowest bits
        and largest group, each segment a store of its own."""
        return sum(
            self._floor(layer, rows)
            for key, rows in layer.segment_rows.items()
            if key.type == token_type and key not in layer.planned_elsewhere
        )

    def _parts(
        self, layer: LayerView, unit: TokenType, keys: tuple[SegmentKey, ...], budget: int, kind: str, pool: frozenset
    ) -> list[tuple[tuple[SegmentKey, ...], int, int]]:
        """A unit's segments and each one's share of the unit's ``budget`` bytes: ``(keys, budget, full rows)``.

        A type's rows of several input images are split by the attention mass each image's rows drew in the last
        observed call (by their rows without one), capped by their rows, no quantized segment under its 2-bit floor
        (docs/compression.md §12.1). One segment, or the pool of several types, takes the whole budget."""
        rows = layer.segment_rows
        if unit == POOL or len(keys) < 2:
            return [(keys, budget, self._unit_segment(layer, unit, keys, pool).full_rows)]
        caps = {key: rows.get(key, 0) for key in keys}
        masses = {key: layer.segment_masses.get(key, 0.0) for key in keys}
        weights = masses if sum(masses.values()) > 0 else {key: float(n) for key, n in caps.items()}
        floors = {}
        if kind == "quantize":
            floors = {key: self._floor(layer, n) / (n * layer.row_bytes) for key, n in caps.items() if n}
        live = {key: n for key, n in caps.items() if n}
        ratios = allocate_with_floors(live, weights, budget / layer.row_bytes, floors) if live else {}
        return [((key,), floor_bytes(ratios.get(key, 0.0), caps[key] * layer.row_bytes), caps[key]) for key in keys]

    def _unit_keys(self, layer: LayerView, unit: TokenType, pool: frozenset) -> tuple[SegmentKey, ...]:
        """The segment keys of a unit: a type's own, or (:data:`POOL`) the pooled types' and the pooled store's."""
        if unit == POOL:
            return layer.keys_of([*pool, POOLED.type])
        return tuple(key for key in layer.keys_of([unit]) if key not in layer.planned_elsewhere)

    def _unit_segment(self, layer: LayerView, unit: TokenType, keys, pool: frozenset) -> Segment:
        rows = self._rows(layer)
        full = sum(rows.get(t, 0) for t in pool) if unit == POOL else rows.get(unit, 0)
        return layer.segment(keys, full_rows=full)

    def _pool(
        self, view: BranchView, layer: LayerView, budgets: dict[TokenType, int], kinds: Mapping[TokenType, str],
        at_floor: float,
    ) -> frozenset:  # fmt: skip
        """The quantized types of ``layer`` that share one store (docs/compression.md §11.7), decided once, at the
        branch's first compression: two or more quantized types whose budgets at the schedule's floor together
        cannot hold every row at :data:`~unicache_core.compression.defaults.POOL_BELOW_BITS` bits or one's cannot
        hold its own 2-bit floor (a short instruction's scale/zero per key channel). Under its floor a type drops
        rows, all of them when its budget is below one row (a short instruction). One store for all of them pays
        for one set of groups, keeps every row at the lowest bits where separate stores could not, spends what is
        left on every row alike, and what it cannot keep it drops by score across the types."""
        if view.compressions:  # decided at the branch's first compression, while every row is at full precision
            return frozenset(layer.pooled)
        budgets = {t: math.floor(b * at_floor) for t, b in budgets.items()}
        quantized = self._poolable(layer, [t for t in budgets if kinds[t] == "quantize"])
        if len(quantized) < 2:
            return frozenset()
        segments = {}
        for t in quantized:
            keys = self._unit_keys(layer, t, frozenset())
            if keys:
                segments[t] = self._unit_segment(layer, t, keys, frozenset())
        if len(segments) < 2:
            return frozenset()
        rows = sum(segment.full_rows for segment in segments.values())
        shared = replace(
            next(iter(segments.values())), full_rows=rows, held_rows=rows, held_bits=FULL_BITS, shared_rows=True
        )
        geometry = self.geometry()
        finer = shared.choice_bytes(JointChoice(rows, POOL_BELOW_BITS, max(geometry.groups), 0))
        if sum(budgets[t] for t in segments) >= finer and all(
            budgets[t] >= self._type_floor(layer, t) for t in segments
        ):
            return frozenset()
        return frozenset(quantized)

    def _poolable(self, layer: LayerView, types: list[TokenType]) -> list[TokenType]:
        """The largest group of ``types`` whose segments the same branches hold (each holder can take the pool, §13)."""
        groups: dict[frozenset[str], list[TokenType]] = {}
        for t in types:
            holders = {layer.shared_with.get(key, frozenset()) for key in self._unit_keys(layer, t, frozenset())}
            if len(holders) == 1:
                groups.setdefault(holders.pop(), []).append(t)
        rows = self._rows(layer)
        return max(groups.values(), key=lambda group: sum(rows.get(t, 0) for t in group), default=[])

    def _plan_layer(
        self, view: BranchView, layer: LayerView, ratios: dict[TokenType, float], carry: int = 0, at_floor: float = 1.0
    ) -> tuple[LayerPlan, int]:
        """Each type's (rows, bits) for its bytes (docs/compression.md §11.3), never more rows or bits than it holds.
        ``carry`` (bytes earlier layers left unused) is added to the types' budgets in proportion to them. Types are
        served coarsest first (quantize, joint, evict): what a type leaves of its budget goes to the joint and evicted
        types after it, in proportion to their budgets. Quantized types may share one store (:meth:`_pool`;
        ``at_floor``: the schedule's floor over its current rho).

        Returns:
            the layer's plan and the bytes it leaves unused, for the next layer.
        """
        task = view.task
        rows = self._rows(layer)
        budgets = {t: floor_bytes(r, rows[t] * layer.row_bytes) for t, r in ratios.items()}
        base = sum(budgets.values())
        for t in budgets:
            budgets[t] += math.floor(carry * (budgets[t] / base if base else 1 / len(budgets)))
        kinds = {t: self.table.kind(task, t) for t in ratios}
        pool = self._pool(view, layer, budgets, kinds, at_floor)
        pooled: dict = {}
        if pool:  # the pooled types are one unit: their budgets summed, quantized together
            if not layer.pooled:
                pooled = mass_shares({t: layer.masses.get(t, 0.0) for t in pool}, {t: rows[t] for t in pool})
            budgets[POOL] = sum(budgets.pop(t) for t in pool if t in budgets)
            kinds = {t: kind for t, kind in kinds.items() if t not in pool} | {POOL: "quantize"}
        order = sorted(budgets, key=lambda t: _SERVE_ORDER[kinds[t]])
        keeps: list[Keep] = []
        flags: dict[Any, str | None] = {}
        held_all = leftover = 0
        for position, t in enumerate(order):
            kind = kinds[t]
            if kind != "quantize" and leftover:
                takers = [u for u in order[position:] if kinds[u] != "quantize"]
                share = sum(budgets[u] for u in takers)
                extra = leftover if share == 0 else math.floor(leftover * budgets[t] / share)
                budgets[t] += extra
                leftover -= extra
            flags[t] = None
            keys = self._unit_keys(layer, t, pool)
            if not keys:
                continue
            joint = self.table.plan_for(task, t) if kind == "joint" else None
            plan_bits = joint.bits_for(ratios[t]) if joint else None
            held = held_rows = 0
            spare = 0  # what the unit's earlier segments left of their share
            for part_keys, part_budget, full_rows in self._parts(layer, t, keys, budgets[t], kind, pool):
                part_budget += spare
                segment = layer.segment(part_keys, full_rows=full_rows)
                keep, part_held = self._choose(view, layer, segment, part_keys, kind, part_budget, plan_bits)
                if keep is not None:
                    keeps.append(keep)
                spare = max(0, part_budget - part_held)
                held += part_held
                held_rows += segment.held_rows
            if held > budgets[t]:
                flags[t] = (
                    f"{held_rows} rows held ({held} B) exceed their budget of {budgets[t]} B: "
                    "rows and bits never grow back, and nothing smaller fits this policy"
                )
            leftover += max(0, budgets[t] - held)
            held_all += held
        plan = LayerPlan(
            keeps=tuple(keeps), budgets={type_name(t): b for t, b in budgets.items()}, flags=flags, pooled=pooled
        )
        return plan, max(0, base + carry - held_all)  # a type over its budget (flagged) uses up what others left

    def _choose(
        self, view: BranchView, layer: LayerView, segment: Segment, keys: tuple[SegmentKey, ...], kind: str,
        budget: int, plan_bits: int | None,
    ) -> tuple[Keep | None, int]:  # fmt: skip
        """The (rows, bits) of one segment for ``budget`` bytes (:func:`~.family.choose`): the change to apply (or
        ``None`` when it keeps what it holds) and the bytes it holds after."""
        choice = choose(segment, kind, budget, self.geometry(), plan_bits)
        fewer = choice.rows < segment.held_rows or choice.bits < segment.held_bits
        if not (fewer or (segment.held_bytes > budget and segment.choice_bytes(choice) < segment.held_bytes)):
            return None, segment.held_bytes
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
            recent=min(choice.rows, int(choice.rows * self.recent_fraction + 0.5)),
            fit_values=self.fit_ranges,
            expected_bytes=held,
        )
        return keep, held


#: Which types are served first when a layer's budgets are applied: the coarse quantized settings, whose unused
#: bytes then go to the types that can use any number of bytes.
_SERVE_ORDER = {"quantize": 0, "joint": 1, "evict": 2}


def _mean_masses(view: BranchView, layers: list[int], types: list[TokenType]) -> dict | None:
    seen = [view.layer(index).masses for index in layers if view.layer(index).masses]
    if not seen:
        return None
    return {t: sum(m.get(t, 0.0) for m in seen) / len(seen) for t in types}


__all__ = ["POOL", "UniCache", "UniCacheState"]
