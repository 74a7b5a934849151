"""UniCache (https://arxiv.org/abs/2609.32831; docs/compression.md §8, §11, §13): task- and type-aware KV compression.

An image's rows are stored quantized as each layer writes them (:meth:`plan_written`): the types the table quantizes
at the bits the starting retention gives, the types it evicts at the lowest bits, their rows chosen at those bits once
the scores exist (a ratio of an evicted type is a share of what it stores). Per branch and layer chunk, after the
branch's first step and at the end of every step chunk (understanding: before the first decoded token, then every
chunk of decoded tokens): the chunk's EMA attention mass lowers the rho schedule (never raising it);
``rho * sum(capacity)`` is shared among the types by mass (§8.6); each type takes the (rows, bits) of its table's
policy that fits its bytes (evict, quantize or joint, §11), quantized types sharing one store where the budget cannot
hold them at 4 bits (§11.7), a branch under its 2-bit floor paid for by the others (§11.8). Rows and bits only go
down; bytes a type or layer leaves go to the next; no type holds more than its full K and V. Rows a fork shares with
its parent are planned by the parent, which pools them apart from its own, and stay one store for both (§13). A
re-allocation runs only when some chunk's rho went down; once every chunk's rho is fixed or at its floor the branch
is settled and neither measured nor compressed again.

This class is the method's protocol (when to measure and compress, the retention schedule); the byte allocation is
the pure functions of :mod:`~unicache_core.compression.unicache_allocation`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, cast

from ...kv.cache import AttentionCall, RequestInfo
from ...kv.quant import SUPPORTED_BITS
from ...kv.token_types import Task, TokenType
from ...validation import check_bool, check_ratio
from .. import defaults
from ..defaults import (
    FIT_VALUE_RANGES,
    RECENT_FRACTION,
    UNICACHE_MERGE,
    UNICACHE_OBJECTIVE,
    UNICACHE_OBJECTIVES,
    UNICACHE_SCORE_QUERIES,
)
from ..family import FULL_BITS, JointChoice, QuantGeometry, Segment, choice_error, quantized_floor_bytes
from ..grants import Level, UnitNeed
from ..merging import MERGES
from ..method import KVTimeline, Method
from ..ops import floor_bytes
from ..plan import BranchPlan, CallPlan, LayerPlan
from ..policy_table import PolicyTable, resolve_policy_table
from ..routing import Kind
from ..schedule import RetentionSchedule
from ..stats import layer_chunks, step_chunk
from ..unicache_allocation import (
    AllocationSettings,
    ChunkBudget,
    counted_rows,
    mean_masses,
    plan_layers,
    planned_copies,
    planned_types,
)
from ..view import BranchView
from ..written import WrittenEviction, written_plan, written_segment_choice


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
        merge: how the rows a budget drops are merged into the kept ones (docs/compression.md §11.17): ``mass``
            (default: each row weighted by its attention mass), LOOK-M's rules, or ``none`` (only dropped).
        score_queries: most queries a measured call scores rows with (64; the baselines' 256).
        objective: what an evicted type's budget buys (docs/compression.md §11.19): ``speed`` (the paper's
            UniCache: the rows its budget holds at full precision, so the rows attended fall with the bytes; an image's
            rows evicted as they are written where their prefill was measured) or ``memory`` (every row held at low
            bits where that loses less, §11.16: the least error for the bytes, every row attended).
    """

    name = "unicache"
    budget = "rho"
    compresses_written = True
    #: The policy kinds whose image rows are stored compressed as they are written (:meth:`written_store`).
    written_kinds: ClassVar[tuple[Kind, ...]] = (Kind.QUANTIZE, Kind.EVICT)
    score_queries: int = UNICACHE_SCORE_QUERIES
    policy: str | Path | PolicyTable | None = None
    rho: float | None = None
    rho_floor: float | None = None
    recent_fraction: float = RECENT_FRACTION
    residual: int | None = None
    fit_ranges: bool = FIT_VALUE_RANGES
    merge: str = UNICACHE_MERGE
    objective: str = UNICACHE_OBJECTIVE

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rho is not None:
            check_ratio("rho", self.rho)
        if self.rho_floor is not None:
            check_ratio("rho_floor", self.rho_floor, allow_zero=True)
        for name in ("rho", "rho_floor"):  # one rule, never a silent precedence: a target sets the schedule itself
            if self.kv_target is not None and getattr(self, name) is not None:
                raise ValueError(
                    f"`{name}` ({getattr(self, name)}) and `kv_target` ({self.kv_target}) both set UniCache's "
                    f"retention: an explicit kv_target is its rho0 (docs/engine.md); give `kv_target` alone, or "
                    f"`rho` and `rho_floor` without it"
                )
        if self.rho is not None and self.rho_floor is not None and self.rho_floor > self.rho:
            raise ValueError(
                f"`rho_floor` ({self.rho_floor}) must not exceed `rho` ({self.rho}); lower the floor or raise rho"
            )
        if self.policy is not None and not isinstance(self.policy, (str, Path, PolicyTable)):
            raise ValueError(f"`policy` must be a policy-table path or PolicyTable, got {type(self.policy).__name__}")
        check_ratio("recent_fraction", self.recent_fraction, allow_zero=True)
        QuantGeometry().with_residual(self.residual)
        check_bool("fit_ranges", self.fit_ranges)
        if self.merge not in MERGES:
            raise ValueError(f"`merge` must be one of {', '.join(MERGES)}, got {self.merge!r}")
        if self.objective not in UNICACHE_OBJECTIVES:
            raise ValueError(
                f"`objective` must be one of {', '.join(UNICACHE_OBJECTIVES)}, got {self.objective!r} (speed: the "
                "types the policy table evicts are evicted; memory: they may be held at low bits instead)"
            )

    # ------------------------------------------------------------------ settings

    def settings(self) -> dict[str, Any]:
        out = super().settings()
        if isinstance(self.policy, PolicyTable):
            out["policy"] = self.policy.model_id
        return out

    def bind(self, request: RequestInfo, checkpoint_dir: str) -> tuple[Method, dict]:
        """The method with its policy table resolved for the request's checkpoint (and checked for its task)."""
        table, info = resolve_policy_table(self.policy, checkpoint_dir, request.model_id, request.segment_rows)
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

    def starting_rho(self, task: str) -> float:
        """``rho0`` of a request of ``task`` (:meth:`new_schedule`'s, before any observation): the explicit ``rho``,
        else a ratio ``kv_target``, else the task's preset."""
        if self.rho is not None:
            return self.rho
        if isinstance(self.kv_target, float):
            return self.kv_target
        return RetentionSchedule.for_task(task).rho0

    # ------------------------------------------------------------------ what the memory plan reads

    def kv_timeline(self, task: Task) -> KVTimeline:
        """The shared timeline (:meth:`Method.kv_timeline`): the rows a fork shares are planned by its parent and kept
        one store (module docstring); what the first compression keeps is known only as a bound (:meth:`kept_bytes`)."""
        return replace(super().kv_timeline(task), shares_forked_rows=True, kept_exact=False)

    def written_store(self, task: Task, token_type: TokenType, segment: Segment) -> JointChoice | None:
        """An image's rows of a type in :attr:`written_kinds` at ``rho0``'s bytes (docs/compression.md §13;
        :func:`~unicache_core.compression.written.written_segment_choice`); none under a byte target, a share of the
        whole context known once it is filled. Under ``speed`` an evicted type's rows are evicted to the full-precision
        rows ``rho0`` holds in understanding, whose image blocks are scored as they are prefilled, and wait in full
        precision in a generation."""
        if isinstance(self.kv_target, int):
            return None
        kind = self.table.kind(task, token_type)
        if kind not in self.written_kinds:
            return None
        # under speed an evicted type is evicted as written where its prefill is scored (understanding's calls are)
        evict = self.objective == "speed" and task == "understanding"
        if self.objective == "speed" and kind == Kind.EVICT and not evict:
            return None  # a generation's image rows are not scored as prefilled: they wait in full precision
        return written_segment_choice(segment, kind, self.starting_rho(task), self.geometry(), evict)

    def kept_bytes(self, task: Task, segments, layers: int, ratio: float) -> int:
        """At most what the branch holds: the first compression shares the request's budget among the types by the
        attention mass the run measures and moves it between branches and layers by their weights (§11.8, §11.15);
        rows and bits only go down, and an image's rows are held at ``rho0``'s bytes already (:meth:`written_store`)."""
        return layers * sum(segment.held_bytes for _, segment in segments)

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
        return RetentionSchedule(rho0=rho0, floor=floor, fixed=preset.fixed, per_bit=self._per_bit(view))

    @staticmethod
    def _per_bit(view: BranchView) -> float | None:
        """The retention of one bit per element of the branch's cache dtype (the schedule decays in bits,
        :data:`~unicache_core.compression.defaults.RHO_DECAY_IN_BITS`), ``None``: the power law (or no rows yet)."""
        if not defaults.RHO_DECAY_IN_BITS:
            return None
        geometry = next((g for i in range(view.num_layers) if (g := view.layer(i).geometry) is not None), None)
        return None if geometry is None else 1.0 / (8 * geometry.elem)

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
        """An image's rows, stored as each layer writes them (§13): :meth:`written_store` of each segment
        (:func:`~unicache_core.compression.written.written_plan`); under ``speed`` an evicted type's are evicted by
        the scores of the call that wrote them."""
        eviction = WrittenEviction(self.recent_fraction, self.merge) if self.objective == "speed" else None
        store = partial(self.written_store, cast(Task, view.task))
        return written_plan(view.layer(layer), store, self.fit_ranges, eviction)

    def allocation(self) -> AllocationSettings:
        """What the byte allocation (:mod:`~unicache_core.compression.unicache_allocation`) needs of the settings."""
        low_bits = self.objective == "memory"
        return AllocationSettings(
            self.table, self.geometry(), self.recent_fraction, self.fit_ranges, self.merge, low_bits
        )

    def plan(self, view: BranchView) -> BranchPlan:
        """Per layer chunk: update rho from the chunk's mass, share it among the types, apply each type's policy
        (:func:`~unicache_core.compression.unicache_allocation.plan_layers`)."""
        initial = view.compressions == 0
        chunk_now = step_chunk(view.call_step)
        schedules = self._schedules(view)
        rho_before = view.rho
        rho_now = dict(rho_before)
        chunks: list[ChunkBudget] = []
        lowered = initial
        for c, layers in layer_chunks(view.num_layers).items():
            first = view.layer(layers[0])
            types = planned_types(self.table, view.task, first)
            if not types:
                continue
            if view.task == "understanding" and initial:
                masses = mean_masses(view, layers, types)  # the prompt's (post-modality) observation
            else:
                masses = view.cell_masses(c, chunk_now, types)
            sched = schedules.get(c) or self.new_schedule(view)
            if masses is not None:
                mass = sum(masses.values())
                if sched.m0 is None:
                    sched = sched.observe(0, mass)  # the branch's first (full-KV) observation is the reference
                elif not initial:
                    sched = sched.observe(max(1, chunk_now), mass)
            schedules[c] = sched
            lowered = lowered or c not in rho_before or sched.rho < rho_before[c]
            rho_now[c] = sched.rho
            rows, copies = counted_rows(first), planned_copies(first)
            counted = None if masses is None else {t: m * copies.get(t, 1) for t, m in masses.items()}
            chunks.append(ChunkBudget(layers, {t: rows[t] for t in types}, counted, sched.rho, sched.least))
        state = UniCacheState(schedules)
        if not lowered:
            # no budget went down: the branch already holds at most it, and a re-split could only lose rows
            return BranchPlan(rho=rho_now, state=state)
        planned = plan_layers(view, chunks, self.allocation())
        return BranchPlan(layers=planned.plans, rho=rho_now, state=state, unused=planned.unused)

    def grant_needs(self, view: BranchView) -> dict[int, UnitNeed]:
        """Per layer, at the least retention the branch's schedule can reach: the candidate rows' budget and the
        ladder of its quantized rows (one store when two or more types are quantized,
        :func:`~unicache_core.compression.unicache_allocation.choose_pool`): :func:`quantized_ladder` when every
        planned type is quantized, else only their 2-bit floor (docs/compression.md §11.8)."""
        geometry = self.geometry()
        out = {}
        for c, layers in layer_chunks(view.num_layers).items():
            least = self._schedule(view, c).least
            for index in layers:
                layer = view.layer(index)
                geo = layer.geometry
                planned = counted_rows(layer)  # the request's budget counts shared rows once per holder
                rows = {t: planned[t] for t in planned_types(self.table, view.task, layer)}
                if geo is None or not rows:
                    continue
                quantized = sum(n for t, n in rows.items() if self.table.kind(view.task, t) == Kind.QUANTIZE)
                ladder = quantized_ladder(quantized, geo.num_kv_heads, geo.head_dim, geo.elem, geometry)
                if quantized != sum(rows.values()):
                    ladder = ladder[:1]
                out[index] = UnitNeed(floor_bytes(least, sum(rows.values()) * layer.row_bytes), ladder)
        return out


def quantized_ladder(
    rows: int, num_kv_heads: int, head_dim: int, elem: int, geometry: QuantGeometry
) -> tuple[Level, ...]:
    """The levels of ``rows`` quantized rows in one store (:class:`~unicache_core.compression.grants.Level`): every
    row at 2, 4 and 8 bits with the largest group and no residual (the least bytes that hold those bits; the first is
    their floor, :func:`~unicache_core.compression.family.quantized_floor_bytes`, or with keys grouped per token when
    that costs less, fewer rows than channels), then full precision; the error of
    each is :func:`~unicache_core.compression.family.choice_error`. ``((0, 0.0),)`` without rows."""
    if rows == 0:
        return (Level(0, 0.0),)
    whole = Segment(rows, rows, FULL_BITS, 0, True, num_kv_heads, head_dim, elem)
    full = JointChoice(rows, FULL_BITS)
    floor = quantized_floor_bytes(rows, num_kv_heads, head_dim, elem, geometry)
    if rows < head_dim:  # fewer rows than channels: keys grouped per token hold every row at 2 bits for less (§11.13)
        per_token = JointChoice(rows, min(SUPPORTED_BITS), max(geometry.groups), 0, key_per_token=True)
        floor = min(floor, whole.choice_bytes(per_token))
    ladder = [Level(floor, 4.0 ** -min(SUPPORTED_BITS))]
    for bits in sorted(SUPPORTED_BITS)[1:]:
        choice = JointChoice(rows, bits, max(geometry.groups), 0)
        cost = whole.choice_bytes(choice)
        if ladder[-1].bytes < cost < whole.full_bytes:
            ladder.append(Level(cost, choice_error(whole, choice)))
    if ladder[-1].bytes < whole.full_bytes:
        ladder.append(Level(whole.full_bytes, choice_error(whole, full)))
    return tuple(ladder)


__all__ = ["UniCache", "UniCacheState", "quantized_ladder"]
