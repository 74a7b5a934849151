"""UniCache (https://arxiv.org/abs/2609.32831; docs/compression.md §8): task- and type-aware KV compression.

Per branch and layer chunk, at the end of every step chunk (and right after the branch's first, full-KV
step; for understanding before the first decoded token, then every chunk of decoded tokens):

1. ``m_j``, the EMA attention mass of the candidate types in the chunk that just ended, updates the
   rho schedule (``rho_j = clip(rho0 * m_j / m_0, floor, rho0)``, never rising again);
2. ``rho * sum(capacity)`` token-equivalents are shared among the types in proportion to their mass,
   capped by each type's size, with redistribution (§8.6);
3. each type gets its table's policy: eviction (H2O scores accumulated over the observed steps, 25%
   recent, keep sets that only shrink) or KIVI quantization (the lookup row whose REAL bytes fit,
   residual 32; bits only ever go down). Bytes a quantized segment leaves unused go to the evicted
   types of the same layer. Budgets are bytes and round down, indices included.
"""

from __future__ import annotations

import logging
import math

from ..kv.cache import AttentionCall
from ..kv.token_types import CANDIDATE_TYPES, TokenType
from .allocator import allocate_types
from .defaults import KIVI_FLOOR
from .method import CompressionMethod
from .ops import evict, floor_bytes, kivi_setting_for, quantize, quantized_bytes, rows_for_bytes
from .policy_table import PolicyTable
from .protocol import CallPlan, CompressibleBranch, MethodSession
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

    def is_compression_step(self, cache: CompressibleBranch, step: int) -> bool:
        if cache.compressions == 0:
            return True
        return step_chunk(step + 1) != step_chunk(step)  # the last step of a chunk

    def plan_decode(self, cache: CompressibleBranch, call: AttentionCall) -> CallPlan:
        # Only the token that ends a step chunk is measured (type masses from the LSE) and re-allocates; the
        # EMA carries across chunks (window 16), every other token takes the fast path. Eviction keeps using the
        # H2O scores of the prompt rows: one decoded query adds little to them and would cost a scoring pass
        # over every resident key (the decoded tokens themselves are protected).
        step = int(call.step or 0)
        if step_chunk(step + 1) != step_chunk(step):
            return CallPlan(observe=True, compress_after=True)
        return CallPlan()

    # ------------------------------------------------------------------ how

    def compress(self, session: MethodSession, cache: CompressibleBranch, call: AttentionCall | None) -> None:
        """Per layer chunk: update rho from the chunk's mass, share it among the types, apply each type's policy."""
        task = session.request.task
        initial = cache.compressions == 0
        step = int(call.step) if call is not None and call.step is not None else 0
        chunk_now = step_chunk(step)
        for c, layers in layer_chunks(cache.num_layers).items():
            rows = cache.type_rows(layers[0])
            types = [t for t in CANDIDATE_TYPES if rows.get(t, 0) and self.table.kind(task, t) != "protect"]
            if not types:
                continue
            caps = {t: rows[t] for t in types}
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
            cache.rho[c] = rho
            if weights is None or sum(weights.values()) <= 0:
                ratio = min(rho, fallback_budget_ratio(task))
                ratios = {t: ratio for t in types}
            else:
                floors = {t: self._floor_ratio(session, cache, layers[0], t, rows[t]) for t in types
                          if self.table.kind(task, t) == "quantize"}
                ratios = _allocate_with_floors(caps, weights, rho * sum(caps.values()), floors)
            for layer in layers:
                self._apply(session, cache, layer, ratios)

    def _floor_ratio(self, session: MethodSession, cache: CompressibleBranch, layer: int,
                     token_type: TokenType, rows: int) -> float:
        """The least retained ratio a quantized type can hold: its 2-bit/G128 bytes (or its uncompressed bytes,
        when quantizing would not shrink it), over its full K+V bytes."""
        st = cache.layer(layer)
        h, d, _, _ = st._kv_meta
        elem = cache.row_bytes(layer) // (2 * h * d)
        full = rows * cache.row_bytes(layer)
        least = min(quantized_bytes(rows, h, d, *KIVI_FLOOR, session.config.kivi_residual, elem), full + 4 * rows)
        return least / full if full else 0.0

    def _apply(self, session: MethodSession, cache: CompressibleBranch, layer: int,
               ratios: dict[TokenType, float]) -> None:
        st = cache.layer(layer)
        ls = cache.state[layer]
        h, d, _, _ = st._kv_meta
        elem = cache.row_bytes(layer) // (2 * h * d)
        rows = cache.type_rows(layer)
        task = session.request.task
        budgets = {t: floor_bytes(r, rows[t] * cache.row_bytes(layer)) for t, r in ratios.items()}
        leftover = 0
        residual = session.config.kivi_residual
        for t in [t for t in ratios if self.table.kind(task, t) == "quantize"]:
            idx = st.find(t)
            if not idx:
                continue
            current = st.stores[idx[0]] if len(idx) == 1 else None
            n = sum(st.stores[i].num_tokens for i in idx)
            setting, fits = kivi_setting_for(ratios[t], budgets[t], n, h, d, elem, residual)
            ls.flags.pop(t, None)
            if not fits:
                ls.flags[t] = (f"{n} rows cannot fit {budgets[t]} B even at 2-bit/G128 with a {residual}-row "
                               "full-precision residual and fp16 scales (the 2-bit floor is used)")
            if setting is not None:
                bits, group = setting
                need = quantized_bytes(n, h, d, bits, group, residual, elem)
                held = sum(st.stores[i].nbytes() for i in idx)
                lower_bits = current is None or current.kind != "quantized" or bits <= current.bits
                if need < held and lower_bits:  # never a store that holds more than the current one
                    quantize(st, idx, bits, group, residual)
            held = sum(s.nbytes() for s in st.stores if s.token_type == t)
            leftover += max(0, budgets[t] - held)
        evicted = [t for t in ratios if self.table.kind(task, t) == "evict"]
        share = sum(budgets[t] for t in evicted)
        # What quantized segments leave unused goes to the evicted types (their floors were already charged
        # to the evicted types by the allocator; a segment still over budget here is flagged).
        for t in evicted:
            if share > 0 and leftover:
                budgets[t] += math.floor(leftover * budgets[t] / share)
            idx = st.find(t)
            if not idx:
                continue
            held_rows = sum(st.stores[i].num_tokens for i in idx)
            keep = rows_for_bytes(budgets[t], h, d, elem)
            if keep >= held_rows:
                continue  # monotonic: a budget never brings rows back; an unchanged segment stays as is
            scores = ls.scores
            if scores is None:
                raise RuntimeError(f"unicache: layer {layer} of branch {cache.branch} was never scored")
            recent = min(keep, int(keep * session.config.recent_fraction + 0.5))
            evict(st, idx, keep, scores, recent=recent)
        ls.budgets = {t.name.lower(): b for t, b in budgets.items()}


def _allocate_with_floors(caps: dict, weights: dict, total: float, floors: dict) -> dict:
    """Mass-proportional, capped shares of ``total`` (docs/compression.md §8.6) in which no quantized type gets
    less than its floor ratio (the 2-bit floor; below it the budget is unreachable and the segment would
    overshoot). What the floors take is taken from the other types. When the floors alone exceed the
    total, the plain shares are kept (the quantized segment is then flagged as unreachable)."""
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
