"""The session of one compressing request: its branch caches, its state and its report.

:class:`CompressionSession` is the :class:`~unicache_core.kv.cache.CacheSession` of one request. It owns the branch
caches (:class:`~unicache_core.compression.compressing_cache.CompressingKVCache`) and the request's one
:class:`~unicache_core.compression.state.RequestState` (statistics, clocks, step, target, the bytes moved between
branches so every branch can keep its floor, docs/compression.md §11.8, and each branch's compressions and schedule),
which it hands to its caches to record into. It is the one that talks to the method: at each call it asks for the
call's plan, while the context fills for the plan of the rows just written, and at a compression point for a plan
over a read-only view of the branch, which the cache applies (:meth:`CompressionSession.compress`). The per-step
records are returned as the report (:mod:`.report`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from ..kv.cache import AttentionCall, CacheSession, KVCache, RequestInfo, StepInfo, unique_nbytes
from ..kv.stores import KVStore
from ..kv.token_types import THINK
from .compressing_cache import CompressingKVCache
from .grants import branch_grants, pass_on
from .method import Method
from .plan import CallPlan, LayerPlan
from .report import ReportBuilder
from .state import RequestState, clock
from .view import BranchView, key_of, storages

logger = logging.getLogger(__name__)


class CompressionSession(CacheSession):
    """Per-request owner of a compressing method's caches and state (see the module docstring).

    Args:
        request: the request.
        method: the method as it runs this request (:meth:`~.method.Method.bind` applied).
        policy_info: what the report says of the method's policy.
        settings: the settings the report shows (default: ``method.settings()``; the method as the user gave it,
            before its files were resolved).
    """

    def __init__(
        self, request: RequestInfo, method: Method, policy_info: dict | None = None, settings: dict | None = None
    ):
        super().__init__(request)
        self.method = method
        self.settings = settings if settings is not None else method.settings()
        self.state = RequestState(request.task, sync_timing=method.sync_timing)
        self.released: set[str] = set()
        self._step_start: float | None = None  # perf_counter() when the current step began
        self.report = ReportBuilder(self, self.state, policy_info or {})

    def clock(self, like=None) -> float:
        """``perf_counter()``, after the device of ``like`` finished its work when the method asks for synced clocks."""
        return clock(like, self.method.sync_timing)

    # ------------------------------------------------------------------ caches

    def new_cache(self, branch: str) -> KVCache:
        super().new_cache(branch)  # validates the name
        cache = CompressingKVCache(self, self.request, self.method, self.state, branch)
        self.caches[branch] = cache
        return cache

    def fork(self, parent: KVCache, branch: str) -> KVCache:
        cache = super().fork(parent, branch)
        self.state.fork(parent.branch or "", branch)
        logger.debug("fork %s -> %s at %d tokens", parent.branch, branch, cache.num_tokens)
        return cache

    def release(self, branch: str) -> None:
        super().release(branch)
        self.released.add(branch)

    def live_caches(self) -> list[CompressingKVCache]:
        """The branch caches of this request that were built and not yet released."""
        return [c for c in self.caches.values() if isinstance(c, CompressingKVCache)]

    def held_bytes(self) -> int:
        """Bytes of every live branch cache, storages shared by branches counted once."""
        return unique_nbytes(t for c in self.live_caches() for t in c.tensors())

    def view(self, cache: CompressingKVCache, call: AttentionCall | None = None) -> BranchView:
        """A read-only view of ``cache`` at ``call`` for the method."""
        return BranchView(
            cache,
            self.state,
            call,
            request=self.request,
            peers=self.live_caches(),
            method_target=self.method.target(self.request.task),
        )

    # ------------------------------------------------------------------ steps

    def begin_step(self, step: StepInfo) -> None:
        if self.state.step is None:
            self.report.note_peak()
        self.state.begin_step(step)
        self.report.begin_step(step)
        self._step_start = time.perf_counter()

    def end_step(self, step: StepInfo) -> None:
        self.state.end_step()
        timers = dict(self.state.timers)
        timers["step"] = 0.0 if self._step_start is None else time.perf_counter() - self._step_start
        self.report.end_step(step, timers)

    # ------------------------------------------------------------------ the call seams (CallCoordinator)

    def plan_call(self, cache: CompressingKVCache, call: AttentionCall) -> CallPlan:
        """The method's plan of ``call`` on ``cache`` (with the method's attention setting, ``fused``)."""
        plan = self.method.plan_call(self.view(cache, call), call)
        return plan if self.method.fused else replace(plan, fused=False)

    def plan_written(self, cache: CompressingKVCache, call: AttentionCall, layer: int) -> LayerPlan:
        """The method's plan of the rows ``call`` just appended to ``layer`` of ``cache``."""
        return self.method.plan_written(self.view(cache, call), layer)

    def note_observed(self, branch: str, call: AttentionCall) -> None:
        """``call`` of ``branch`` measures statistics (its plan observes or measures): the report marks the branch
        ``observed`` in a denoising step or decoded token; a session that records them listens here (calibration)."""
        if call.phase in ("denoise", "decode"):
            self.report.note_observed(branch)

    def note_rows(self, branch: str, call: AttentionCall, rows: int) -> None:
        """Record the rows ``call`` of ``branch`` attended over (summed over its layers)."""
        self.report.note_rows(branch, call, rows)

    # ------------------------------------------------------------------ budgets

    def _full_managed_bytes(self) -> int:
        return sum(c.managed_full_bytes() for c in self.live_caches() if c.branch != THINK)

    def _resolve_target(self) -> None:
        """Keep the memory target as a ratio of the full managed bytes of every live branch (bytes are converted),
        once, for a method whose budget is its target (or that was given one)."""
        if self.state.target_ratio is not None:
            return
        if self.method.budget != "kv_target" and self.method.kv_target is None:
            return  # the method's own schedule sets its bytes: no target to report
        target = self.method.target(self.request.task)
        if isinstance(target, int):
            full = self._full_managed_bytes()
            ratio = 1.0 if full == 0 else min(1.0, target / full)
            logger.info("kv_target %d bytes = %.4f of the %d full managed bytes", target, ratio, full)
            self.state.set_target(ratio)
        else:
            self.state.set_target(float(target))

    def _keeps_every_row(self) -> bool:
        """Whether the target is 100% (a ratio of 1, or bytes >= the full KV): then no method compresses anything.
        Read without resolving the target, so a method that never asks for it (UniCache's schedule) reports none."""
        if self.state.target_ratio is not None:
            return self.state.target_ratio >= 1.0
        target = self.method.target(self.request.task)
        if isinstance(target, int):
            return target >= self._full_managed_bytes()
        return float(target) >= 1.0

    def grant(self, branch: str, layer: int) -> int:
        """Bytes ``layer`` of ``branch`` receives (> 0) or gives (< 0) so every branch keeps its floor (0: none)."""
        return self.state.grant(branch, layer)

    def _decide_grants(self, cache: CompressingKVCache) -> None:
        """The grants of every live branch and layer, from the method's needs and the branches' weights in the
        request's output (the square of their coefficients), at the request's first compression: every branch is then
        at the same least retention, so what one branch is given the others give (:func:`.grants.branch_grants`)."""
        needs = {}
        for other in self.live_caches():
            if other.num_layers != cache.num_layers:
                continue
            need = self.method.grant_needs(self.view(other))
            if need is None:
                self.state.set_grants({})
                return
            needs[other.branch or ""] = need
        weights = {b: self.request.branch_weight(b) ** 2 for b in needs}
        self.state.set_grants(branch_grants(needs, weights))

    def compress(self, cache: CompressingKVCache, call: AttentionCall | None) -> None:
        """Plan ``cache``'s compression at ``call`` with the method and apply it, timed as allocation and recorded."""
        start = self.clock()
        branch = cache.branch or ""
        if self.state.grants is None and self.state.branch(branch).compressions == 0:
            self._decide_grants(cache)
        if self._keeps_every_row():
            self.state.note_compressed(branch, None, None)
        else:
            self._resolve_target()
            plan = self.method.plan(self.view(cache, call))
            self._share(cache, cache.apply(plan, self._unshared_storages(cache)))
            if self.state.branch(branch).compressions == 0:
                self._pass_on(cache, plan.unused)
            self.state.note_compressed(branch, plan.rho, plan.state)
        self.state.add_time("alloc", self.clock() - start)
        self.report.note_compression(cache)

    def _pass_on(self, cache: CompressingKVCache, unused: int) -> None:
        """What ``cache``'s first plan left of its budget goes to the branch of the request not yet compressed whose
        errors weigh most in its output (the first of them on a tie; its first layer, whose carry passes it on through
        its layers; :func:`.grants.pass_on`): one request budget, not one per branch (docs/compression.md §11.15)."""
        takers = [
            c
            for c in self.live_caches()
            if c is not cache
            and c.branch != THINK
            and c.num_layers == cache.num_layers
            and self.state.branch(c.branch or "").compressions == 0
        ]
        if unused <= 0 or not takers or cache.num_layers == 0:
            return
        first = max(takers, key=lambda c: abs(self.request.branch_weight(c.branch or "")))  # the heaviest (§11.8)
        giver, taker = (cache.branch or "", cache.num_layers - 1), (first.branch or "", 0)
        self.state.set_grants(pass_on(self.state.grants or {}, giver, taker, unused))

    def _unshared_storages(self, cache: CompressingKVCache) -> frozenset[int]:
        """Storages held by a live cache :meth:`_share` does not update (``think``): ``cache`` must not move them."""
        return frozenset(
            t.untyped_storage().data_ptr()
            for c in self.live_caches()
            if c is not cache and c.branch == THINK
            for t in c.tensors()
            if t.numel()
        )

    def _share(self, cache: CompressingKVCache, replaced: list[tuple[int, list[KVStore], KVStore]]) -> None:
        """Stores ``cache`` replaced that other branches held too (a fork's rows) are replaced there by the same new
        store, so the rows stay one store after compression (docs/compression.md §13). A branch holding only some of
        the replaced stores keeps its own; the ``think`` branch is never compressed."""
        others = [c for c in self.live_caches() if c is not cache and c.branch != THINK]
        for index, old, new in replaced:
            wanted = [storages(store) for store in old]
            for other in others:
                layer = other.layer(index)
                found = [i for i, store in enumerate(layer.stores) if storages(store) in wanted]
                if found and len(found) == len(old):
                    layer.replace_many(found, new.share())
                    other.state[index].planned_by.update({key_of(store): cache.branch or "" for store in old})

    def finish(self) -> dict:
        """The request's KV report (:mod:`.report`)."""
        return self.report.build()


__all__ = ["CompressionSession"]
