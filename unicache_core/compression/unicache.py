"""UniCache (https://arxiv.org/abs/2609.32831; docs/compression.md §8): task- and type-aware KV compression.

Per branch and layer chunk, at the end of every step chunk (and right after the branch's first, full-KV
step; for understanding before the first decoded token, then every chunk of decoded tokens):

1. ``m_j``, the EMA attention mass of the candidate types in the chunk that just ended, updates the
   rho schedule (``rho_j = clip(rho0 * m_j / m_0, floor, rho0)``, never rising again);
2. ``rho * sum(capacity)`` token-equivalents are shared among the types in proportion to their mass,
   capped by each type's size, with redistribution (§8.6);
3. each type takes the (rows kept, bits) of its table's policy that fits its bytes (docs/compression.md
   §11): ``evict`` keeps its best-scored rows at full precision (H2O scores of the branch's first
   observation, 25% recent), ``quantize`` keeps every row at the most precise KIVI setting whose REAL bytes fit
   (below its 2-bit floor: a subset of its rows at 2 bits), ``joint`` keeps its best-scored rows at the
   bits calibrated for its budget level. Residual and groups follow the segment (§11.2). Where the budget
   cannot hold the quantized types at 4 bits (or one under its own 2-bit floor), they share one store with
   their budgets summed (§11.7; decided once, at the first compression), and a branch whose quantized rows
   cannot keep their 2-bit floor in its own budget is paid for by the other branches' bytes above theirs
   (§11.8). Rows and bits only ever go down.
   Bytes a type leaves unused go to the joint and evicted types of the same layer; what the whole layer
   leaves goes to the next layer's types (in layer order, across layer chunks), so a branch holds as close
   to its budget as its stores' granularity allows, never above it.
   Budgets are bytes and round down, indices included; no type ever holds more than its full K and V.

A re-allocation runs only when some layer chunk's rho went down since the branch's last compression: at an
unchanged budget a new split could only drop rows (a type given more could not take rows back). Once every
chunk's rho is fixed (understanding, or a target at the floor) or at its floor, the branch is settled and is
neither measured nor compressed again.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable
from dataclasses import replace

from ..kv.cache import AttentionCall
from ..kv.token_types import CANDIDATE_TYPES, TokenType
from .allocator import allocate_types
from .defaults import POOL_BELOW_BITS
from .family import FULL_BITS, JointChoice, QuantGeometry, Segment, choose, least_quantized_bytes
from .method import CompressionMethod
from .ops import compress_rows, floor_bytes, shared_rows
from .policy_table import PolicyTable
from .protocol import CallPlan, CompressibleBranch, MethodSession
from .report import type_name
from .schedule import RetentionSchedule
from .stats import fallback_budget_ratio, layer_chunks, step_chunk

logger = logging.getLogger(__name__)


class UniCacheMethod(CompressionMethod):
    """See the module docstring. ``table`` gives each (task, type) its policy family."""

    name = "unicache"

    def __init__(self, table: PolicyTable):
        self.table = table

    # ------------------------------------------------------------------ schedule

    def schedule(self, session: MethodSession, branch: str, chunk: int) -> RetentionSchedule:
        """The retention schedule of (``branch``, layer ``chunk``): the task's preset, with ``rho0`` and the floor
        from the config when it sets them (an explicit ``kv_target`` fixes ``rho0``)."""
        key = (branch, chunk)
        if key not in session.schedules:
            task = session.request.task
            preset = RetentionSchedule.for_task(task)
            rho0, floor = preset.rho0, preset.floor
            cfg = session.config
            if cfg.kv_target is not None:
                rho0 = session.resolve_target()
                floor = min(floor, rho0)
            if cfg.rho is not None:
                rho0 = cfg.rho
                floor = min(floor, rho0)
            if cfg.rho_floor is not None:
                floor = cfg.rho_floor
            if floor > rho0:
                raise ValueError(f"`rho_floor` ({floor}) must not exceed rho ({rho0})")
            session.schedules[key] = RetentionSchedule(rho0=rho0, floor=floor, fixed=preset.fixed)
        return session.schedules[key]

    def target(self, session: MethodSession) -> float | int:
        """The explicit ``kv_target``, else the task's ``rho0``."""
        cfg = session.config
        return cfg.kv_target if cfg.kv_target is not None else RetentionSchedule.for_task(session.request.task).rho0

    # ------------------------------------------------------------------ when

    def settled(self, session: MethodSession, cache: CompressibleBranch) -> bool:
        """Whether ``cache``'s budget can no longer go down: compressed, and every layer chunk's schedule fixed or
        at its floor. Re-allocating a budget that stays can only lose rows (what one type would gain it could not
        take back: rows and bits never grow), so a settled branch is neither measured nor compressed again."""
        if cache.compressions == 0:
            return False
        schedules = [sched for (branch, _), sched in session.schedules.items() if branch == cache.branch]
        return bool(schedules) and all(sched.fixed or sched.rho <= sched.floor for sched in schedules)

    def is_compression_step(self, cache: CompressibleBranch, step: int) -> bool:
        """After the branch's first step, then at the last step of each step chunk that calls its caches: the step
        after which its next call (``step + 1``; with TaylorSeer its next computed step, forecast steps call
        nothing) falls in a later chunk, or after which none comes (docs/compression.md §11.12)."""
        if cache.compressions == 0:
            return True
        if self.settled(cache.session, cache):
            return False
        info = cache.session.step
        upcoming = info.next_call_step(cache.branch) if info is not None and info.step == step else step + 1
        return upcoming is None or step_chunk(upcoming) != step_chunk(step)

    def plan_decode(self, cache: CompressibleBranch, call: AttentionCall) -> CallPlan:
        # Only the token that ends a step chunk is measured (type masses from the LSE) and re-allocates; the
        # EMA carries across chunks (window 16), every other token takes the fast path. Eviction keeps using the
        # H2O scores of the prompt rows: one decoded query adds little to them and would cost a scoring pass
        # over every resident key (the decoded tokens themselves are protected).
        step = int(call.step or 0)
        if step_chunk(step + 1) != step_chunk(step) and not self.settled(cache.session, cache):
            return CallPlan(observe=True, compress_after=True)
        return CallPlan()

    # ------------------------------------------------------------------ how

    def compress(self, session: MethodSession, cache: CompressibleBranch, call: AttentionCall | None) -> None:
        """Per layer chunk: update rho from the chunk's mass, share it among the types, apply each type's policy."""
        task = session.request.task
        initial = cache.compressions == 0
        step = int(call.step) if call is not None and call.step is not None else 0
        chunk_now = step_chunk(step)
        chunks: list[tuple[list[int], dict, dict | None, float, float]] = []  # (layers, caps, masses, rho, floor)
        lowered = initial
        for c, layers in layer_chunks(cache.num_layers).items():
            rows = cache.type_rows(layers[0])
            types = [t for t in CANDIDATE_TYPES if rows.get(t, 0) and self.table.kind(task, t) != "protect"]
            if not types:
                continue
            if task == "understanding" and initial:
                weights = _mean_masses(cache, layers, types)  # the prompt's (post-modality) observation
            else:
                weights = session.stats.cell_masses(c, chunk_now, types, branch=cache.branch)
            sched = self.schedule(session, cache.branch, c)
            if weights is not None:
                mass = sum(weights.values())
                if sched.m0 is None:
                    sched.observe(0, mass)  # the branch's first (full-KV) observation is the reference
                elif not initial:
                    sched.observe(max(1, chunk_now), mass)
            rho = sched.rho
            lowered = lowered or c not in cache.rho or rho < cache.rho[c]
            cache.rho[c] = rho
            chunks.append((layers, {t: rows[t] for t in types}, weights, rho, sched.least))
        if not lowered:
            return  # no budget went down: the branch already holds at most it, and a re-split could only lose rows
        if initial:
            for layer, grant in self._floor_grants(session, cache).items():
                cache.state[layer].grant = grant
        carry = 0  # bytes the previous layers left unused
        for layers, caps, weights, rho, floor in chunks:
            ratios = self._type_ratios(session, cache, layers[0], caps, weights, rho)
            for layer in layers:
                carry = self._apply(
                    session, cache, layer, ratios, carry + cache.state[layer].grant, floor / rho if rho > 0 else 1.0
                )

    def _least_budgets(self, session: MethodSession, cache: CompressibleBranch) -> dict[int, tuple[int, int]]:
        """Per layer of ``cache``: ``(budget, floor)`` bytes at the least retention its schedule can reach: the
        candidate rows' budget, and what its quantized rows need to keep every row at 2 bits (one store when two
        or more types are quantized, :meth:`_pool`)."""
        task = session.request.task
        geometry = self.geometry(session)
        out = {}
        for c, layers in layer_chunks(cache.num_layers).items():
            least = self.schedule(session, cache.branch, c).least
            for layer in layers:
                meta = cache.layer(layer)._kv_meta
                rows = {
                    t: n
                    for t, n in cache.type_rows(layer).items()
                    if t in CANDIDATE_TYPES and self.table.kind(task, t) != "protect"
                }
                if meta is None or not rows:
                    continue
                h, d, dtype, _ = meta
                quantized = [n for t, n in rows.items() if self.table.kind(task, t) == "quantize"]
                need = 0
                if quantized:
                    need = _floor_bytes(sum(quantized), h, d, dtype.itemsize, geometry)
                out[layer] = (floor_bytes(least, sum(rows.values()) * cache.row_bytes(layer)), need)
        return out

    def _floor_grants(self, session: MethodSession, cache: CompressibleBranch) -> dict[int, int]:
        """Bytes each layer of ``cache`` receives (> 0) or gives (< 0) so that every live branch's quantized rows
        can keep their 2-bit floor (docs/compression.md §11.8), decided at the branch's first compression.

        A branch whose whole budget is under the floor of its quantized rows (an edit's image-free CFG branch
        holds only its instruction: 5 rows at 2 bits need 476 B a layer where 10% gives 256 B) would otherwise
        drop them; the other branches' bytes above their floors pay for it, in proportion to what they have
        above, so the request's total stays within its budget. Every branch computes the same plan from the
        same live branches at the same retention, so what one branch is given the others give."""
        plans = {
            c.branch: self._least_budgets(session, c) for c in session.live_caches() if c.num_layers == cache.num_layers
        }
        deficit = {
            (b, layer): max(0, need - budget) for b, plan in plans.items() for layer, (budget, need) in plan.items()
        }
        surplus = {
            (b, layer): max(0, budget - need) for b, plan in plans.items() for layer, (budget, need) in plan.items()
        }
        short, spare = sum(deficit.values()), sum(surplus.values())
        moved = min(short, spare)
        if moved == 0:
            return {}
        mine = plans.get(cache.branch, {})
        return {
            layer: (deficit[(cache.branch, layer)] * moved) // short
            - -((-surplus[(cache.branch, layer)] * moved) // spare)
            for layer in mine
        }

    def _type_ratios(
        self,
        session: MethodSession,
        cache: CompressibleBranch,
        layer: int,
        caps: dict,
        weights: dict | None,
        rho: float,
    ) -> dict[TokenType, float]:
        """Each type's retained ratio for a layer chunk (``layer``: its first): ``rho * sum(caps)`` shared by mass,
        no quantized type under its floor (§8.6); without masses, every type at ``rho`` (at most the fallback)."""
        task = session.request.task
        if weights is None or sum(weights.values()) <= 0:
            ratio = min(rho, fallback_budget_ratio(task))
            return {t: ratio for t in caps}
        h, d, dtype, _ = cache.layer(layer)._kv_meta
        geometry = self.geometry(session)
        row = cache.row_bytes(layer)
        floors = {
            t: _floor_bytes(n, h, d, dtype.itemsize, geometry) / (n * row)
            for t, n in caps.items()
            if self.table.kind(task, t) == "quantize"
        }
        return _allocate_with_floors(caps, weights, rho * sum(caps.values()), floors)

    def geometry(self, session: MethodSession):
        """The quantization geometry: the table's, with the config's fixed residual when it sets one."""
        return session.config.quant_geometry(self.table.geometry)

    def _segments(
        self, cache: CompressibleBranch, layer: int, types: Iterable[TokenType], pool: frozenset = frozenset()
    ) -> dict[TokenType, tuple[Segment, list[int]]]:
        """The rows of each of ``types`` in ``layer`` as a family choice sees them, and their store indices (one
        pass over the layer's stores). :data:`POOL` stands for the quantized types ``pool`` shares one store
        among: its rows are those of its members and of the pooled store."""
        st = cache.layer(layer)
        wanted = set(types)
        found: dict[TokenType, list[int]] = {t: [] for t in wanted}
        for i, store in enumerate(st.stores):
            unit = _unit(store, pool)
            if unit in wanted:
                found[unit].append(i)
        h, d, _, _ = st._kv_meta
        elem = cache.row_bytes(layer) // (2 * h * d)
        full_rows = cache.type_rows(layer)
        if POOL in wanted:
            full_rows[POOL] = sum(full_rows.get(t, 0) for t in pool)
        out = {}
        for t, idx in found.items():
            stores = [st.stores[i] for i in idx]
            bits = min((s.bits if s.kind == "quantized" else FULL_BITS for s in stores), default=FULL_BITS)
            out[t] = (
                Segment(
                    full_rows=full_rows.get(t, 0),
                    held_rows=sum(s.num_tokens for s in stores),
                    held_bits=bits,
                    held_bytes=sum(s.nbytes() for s in stores),
                    shared_rows=shared_rows(stores),
                    num_kv_heads=h,
                    head_dim=d,
                    elem=elem,
                ),
                idx,
            )
        return out

    def _pool(
        self,
        session: MethodSession,
        cache: CompressibleBranch,
        layer: int,
        budgets: dict[TokenType, int],
        kinds: dict[TokenType, str],
        at_floor: float,
    ) -> frozenset:
        """The quantized types of ``layer`` that share one store (docs/compression.md §11.7), decided once, at the
        branch's first compression, for the least budget its schedule can reach (``budgets`` x ``at_floor``, the
        schedule's floor over its rho): with two or more quantized types present, all of them when their budgets
        together cannot hold every row at :data:`~unicache_core.compression.defaults.POOL_BELOW_BITS` bits or one's
        budget is under its own floor (every row at the lowest bits in a store of its own).

        Below that budget no type can take more bits: a split by type can only buy finer key groups for the types
        with more mass, and every store of its own pays for its own groups (the scale and zero of every channel).
        Under its floor a type drops rows, all of them when its budget is below one row (a short instruction).
        One store for all of them pays for one set of groups, keeps every row at the lowest bits where separate
        stores could not, spends what is left on every row alike, and what it cannot keep it drops by score
        across the types."""
        if cache.compressions:  # decided at the branch's first compression, while every row is at full precision
            return frozenset(cache.state[layer].pooled)
        budgets = {t: math.floor(b * at_floor) for t, b in budgets.items()}
        quantized = [t for t in budgets if kinds[t] == "quantize"]
        if len(quantized) < 2:
            return frozenset()
        segments = {t: segment for t, (segment, idx) in self._segments(cache, layer, quantized).items() if idx}
        if len(segments) < 2:
            return frozenset()
        rows = sum(segment.full_rows for segment in segments.values())
        shared = replace(
            next(iter(segments.values())), full_rows=rows, held_rows=rows, held_bits=FULL_BITS, shared_rows=True
        )
        geometry = self.geometry(session)
        finer = shared.choice_bytes(JointChoice(rows, POOL_BELOW_BITS, max(geometry.groups), 0))
        if sum(budgets[t] for t in segments) >= finer and all(
            budgets[t]
            >= _floor_bytes(segment.full_rows, segment.num_kv_heads, segment.head_dim, segment.elem, geometry)
            for t, segment in segments.items()
        ):
            return frozenset()
        return frozenset(quantized)

    def _apply(
        self,
        session: MethodSession,
        cache: CompressibleBranch,
        layer: int,
        ratios: dict[TokenType, float],
        carry: int = 0,
        at_floor: float = 1.0,
    ) -> int:
        """Give each type its (rows, bits) for its bytes (docs/compression.md §11.3), never more rows or bits than
        it holds. ``carry`` (bytes earlier layers left unused) is added to the types' budgets in proportion to
        them. Types are served coarsest first (quantize, joint, evict): what a type leaves of its budget goes to
        the joint and evicted types after it, in proportion to their budgets. Quantized types may share one store
        (:meth:`_pool`; ``at_floor``: the schedule's floor over its current rho).

        Returns:
            the bytes this layer leaves unused, for the next layer.
        """
        st = cache.layer(layer)
        ls = cache.state[layer]
        task = session.request.task
        geometry = self.geometry(session)
        rows = cache.type_rows(layer)
        budgets = {t: floor_bytes(r, rows[t] * cache.row_bytes(layer)) for t, r in ratios.items()}
        base = sum(budgets.values())
        for t in budgets:
            budgets[t] += math.floor(carry * (budgets[t] / base if base else 1 / len(budgets)))
        held_all = 0
        kinds = {t: self.table.kind(task, t) for t in ratios}
        pool = self._pool(session, cache, layer, budgets, kinds, at_floor)
        if pool:  # the pooled types are one unit: their budgets summed, quantized together
            if not ls.pooled:
                ls.pooled = _shares({t: ls.masses.get(t, 0.0) for t in pool}, {t: rows[t] for t in pool})
            budgets[POOL] = sum(budgets.pop(t) for t in pool if t in budgets)
            kinds = {t: kind for t, kind in kinds.items() if t not in pool} | {POOL: "quantize"}
        order = sorted(budgets, key=lambda t: _SERVE_ORDER[kinds[t]])
        segments = self._segments(cache, layer, order, pool)
        leftover = 0
        for position, t in enumerate(order):
            kind = kinds[t]
            if kind != "quantize" and leftover:
                takers = [u for u in order[position:] if kinds[u] != "quantize"]
                share = sum(budgets[u] for u in takers)
                extra = leftover if share == 0 else math.floor(leftover * budgets[t] / share)
                budgets[t] += extra
                leftover -= extra
            segment, idx = segments[t]
            ls.flags.pop(t, None)
            if not idx:
                continue
            plan = self.table.plan_for(task, t) if kind == "joint" else None
            choice = choose(segment, kind, budgets[t], geometry, plan.bits_for(ratios[t]) if plan else None)
            fewer = choice.rows < segment.held_rows or choice.bits < segment.held_bits
            if fewer or (segment.held_bytes > budgets[t] and segment.choice_bytes(choice) < segment.held_bytes):
                if choice.rows < segment.held_rows and ls.scores is None:
                    raise RuntimeError(f"unicache: layer {layer} of branch {cache.branch} was never scored")
                recent = min(choice.rows, int(choice.rows * session.config.recent_fraction + 0.5))
                stores_before = len(st.stores)
                compress_rows(
                    st,
                    idx,
                    choice.rows,
                    choice.bits,
                    choice.group,
                    choice.residual,
                    ls.scores,
                    recent=recent,
                    fit_values=session.config.fits_value_ranges,
                )
                if len(st.stores) != stores_before:  # pooled stores became one: the later types' indices moved
                    segments = self._segments(cache, layer, order[position + 1 :], pool)
            held = sum(s.nbytes() for s in st.stores if _unit(s, pool) == t)
            if held > budgets[t]:
                ls.flags[t] = (
                    f"{segment.held_rows} rows held ({held} B) exceed their budget of {budgets[t]} B: "
                    "rows and bits never grow back, and nothing smaller fits this policy"
                )
            leftover += max(0, budgets[t] - held)
            held_all += held
        ls.budgets = {type_name(t): b for t, b in budgets.items()}
        return max(0, base + carry - held_all)  # a type over its budget (flagged) uses up what others left


#: The unit of the quantized types that share one store (:meth:`UniCacheMethod._pool`): the type a store of
#: several candidate types has (:func:`~unicache_core.compression.ops.pooled_type`).
POOL = TokenType.UNKNOWN


def _unit(store, pool: frozenset) -> TokenType:
    """What ``store`` belongs to in a layer whose ``pool`` types share one store: :data:`POOL` for a member's
    store or the pooled one, else its own type."""
    if pool and (store.token_type in pool or (store.token_type == POOL and store.kind != "full")):
        return POOL
    return store.token_type


@functools.lru_cache(maxsize=4096)
def _floor_bytes(rows: int, num_kv_heads: int, head_dim: int, elem: int, geometry: QuantGeometry) -> int:
    """The floor of a quantized type of ``rows`` rows: the bytes of every row at the lowest bits and largest group
    without residual in a store of its own, or its uncompressed bytes when quantizing would not shrink it. Pure,
    so cached: a layer's rows per type stay fixed once appended."""
    whole = Segment(
        full_rows=rows,
        held_rows=rows,
        held_bits=FULL_BITS,
        held_bytes=0,
        shared_rows=True,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        elem=elem,
    )
    return least_quantized_bytes(whole, geometry)


def _shares(masses: dict, rows: dict) -> dict:
    """Each type's share of a pooled store's attention mass: of their ``masses``, or of their ``rows`` without."""
    total = sum(masses.values())
    weights = masses if total > 0 else rows
    total = sum(weights.values())
    return {t: w / total for t, w in weights.items()}


#: Which types are served first when a layer's budgets are applied: the coarse quantized settings, whose
#: unused bytes then go to the types that can use any number of bytes.
_SERVE_ORDER = {"quantize": 0, "joint": 1, "evict": 2}


def _allocate_with_floors(caps: dict, weights: dict, total: float, floors: dict) -> dict:
    """Mass-proportional, capped shares of ``total`` (docs/compression.md §8.6) in which no quantized type gets
    less than its floor ratio (every row at 2 bits; below it the type must drop rows). What the floors take
    is taken from the other types. When the floors alone exceed the total, the plain shares are kept and
    the quantized types keep a subset of their rows at 2 bits."""
    fixed: dict = {}
    while True:
        free = {t: c for t, c in caps.items() if t not in fixed}
        left = total - sum(floors[t] * caps[t] for t in fixed)
        if left < 0:
            alloc = allocate_types(caps, weights, total)
            return {t: min(1.0, alloc[t] / caps[t]) for t in caps}
        alloc = allocate_types(free, {t: weights.get(t, 0.0) for t in free}, left)
        below = [t for t in free if t in floors and alloc[t] < floors[t] * caps[t] - 1e-9]
        if not below:
            ratios = {t: min(1.0, alloc[t] / caps[t]) for t in free}
            ratios.update({t: min(1.0, floors[t]) for t in fixed})
            return ratios
        fixed.update({t: True for t in below})


def _mean_masses(cache: CompressibleBranch, layers: list[int], types: list[TokenType]) -> dict | None:
    seen = [cache.state[layer].masses for layer in layers if cache.state[layer].masses]
    if not seen:
        return None
    return {t: sum(m.get(t, 0.0) for m in seen) / len(seen) for t in types}


__all__ = ["UniCacheMethod"]
