"""The session of one compressing request: its branch caches, statistics, clocks, target and report.

:class:`CompressionSession` is the :class:`~unicache_core.kv.cache.CacheSession` of one request: the branch caches
(:class:`~unicache_core.compression.compressing_cache.CompressingKVCache`), the chunked statistics (keyed per
branch), the clocks, the memory target, the bytes moved between branches so every branch can keep its floor
(:meth:`CompressionSession.grant`, docs/compression.md §11.8) and the per-step records returned as the report
(:mod:`.report`). At a compression point it asks the method for a plan over a read-only view of the branch and has
the cache apply it (:meth:`CompressionSession.compress`).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor

from ..kv.cache import AttentionCall, CacheSession, KVCache, RequestInfo, StepInfo, unique_nbytes
from ..kv.stores import KVStore
from ..kv.token_types import THINK
from .compressing_cache import CompressingKVCache
from .method import Method
from .report import ReportBuilder
from .stats import ChunkedAttentionStats
from .view import BranchView, storages

logger = logging.getLogger(__name__)


def floor_grants(needs: dict[str, dict[int, tuple[int, int]]]) -> dict[str, dict[int, int]]:
    """Bytes each (branch, layer) receives (> 0) or gives (< 0) so that every branch's quantized rows can keep their
    2-bit floor (docs/compression.md §11.8).

    A branch whose whole budget is under the floor of its quantized rows (an edit's image-free CFG branch holds only
    its instruction: 5 rows at 2 bits need 476 B a layer where 10% gives 256 B) would otherwise drop them; the other
    branches' bytes above their floors pay for it, in proportion to what they have above, so the request's total
    stays within its budget.

    Args:
        needs: per branch, per layer ``(budget, floor)`` bytes at the least retention the branch can reach.
    """
    deficit = {(b, layer): max(0, need - budget) for b, plan in needs.items() for layer, (budget, need) in plan.items()}
    surplus = {(b, layer): max(0, budget - need) for b, plan in needs.items() for layer, (budget, need) in plan.items()}
    short, spare = sum(deficit.values()), sum(surplus.values())
    moved = min(short, spare)
    if moved == 0:
        return {}
    return {
        b: {
            layer: (deficit[(b, layer)] * moved) // short - -((-surplus[(b, layer)] * moved) // spare) for layer in plan
        }
        for b, plan in needs.items()
    }


class CompressionSession(CacheSession):
    """Per-request state of a compressing method (see the module docstring).

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
        self.stats = ChunkedAttentionStats.for_task(request.task)
        self.timers = {"attention": 0.0, "stats": 0.0, "alloc": 0.0}
        self.step: StepInfo | None = None
        self.target_ratio: float | None = None  # resolved memory target (ratio of full managed bytes)
        self.released: set[str] = set()
        self._grants: dict[str, dict[int, int]] | None = None  # decided at the request's first compression
        self._step_start: float | None = None  # perf_counter() when the current step began
        self.report = ReportBuilder(self, policy_info or {})

    def clock(self, like: Tensor | None = None) -> float:
        """``perf_counter()``, after the device of ``like`` finished its work when the method asks for synced clocks."""
        if self.method.sync_timing and like is not None and like.is_cuda:
            torch.cuda.synchronize(like.device)
        return time.perf_counter()

    # ------------------------------------------------------------------ caches

    def new_cache(self, branch: str) -> KVCache:
        super().new_cache(branch)  # validates the name
        cache = CompressingKVCache(self, branch)
        self.caches[branch] = cache
        return cache

    def fork(self, parent: KVCache, branch: str) -> KVCache:
        cache = super().fork(parent, branch)
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

    # ------------------------------------------------------------------ steps

    def begin_step(self, step: StepInfo) -> None:
        if self.step is None:
            self.report.note_peak()
        self.step = step
        self.timers = {"attention": 0.0, "stats": 0.0, "alloc": 0.0}
        self.report.begin_step(step)
        self._step_start = time.perf_counter()

    def end_step(self, step: StepInfo) -> None:
        timers = dict(self.timers)
        timers["step"] = 0.0 if self._step_start is None else time.perf_counter() - self._step_start
        self.report.end_step(step, timers)

    def note_observed(self, branch: str, call: AttentionCall) -> None:
        """``call`` of ``branch`` measures statistics (its plan observes or scores): the report marks the branch
        ``observed`` in a denoising step or decoded token; a session that records them listens here (calibration)."""
        if call.phase in ("denoise", "decode"):
            self.report.note_observed(branch)

    def note_rows(self, branch: str, call: AttentionCall, rows: int) -> None:
        """Record the rows ``call`` of ``branch`` attended over (summed over its layers)."""
        self.report.note_rows(branch, call, rows)

    # ------------------------------------------------------------------ budgets

    def resolve_target(self) -> float:
        """The memory target as a ratio of the full managed bytes of every live branch (bytes are converted)."""
        if self.target_ratio is None:
            target = self.method.target(self.request.task)
            if isinstance(target, int):
                full = sum(c.managed_full_bytes() for c in self.live_caches() if c.branch != THINK)
                ratio = 1.0 if full == 0 else min(1.0, target / full)
                logger.info("kv_target %d bytes = %.4f of the %d full managed bytes", target, ratio, full)
                self.target_ratio = ratio
            else:
                self.target_ratio = float(target)
        return self.target_ratio

    def _keeps_every_row(self) -> bool:
        """Whether the target is 100% (a ratio of 1, or bytes >= the full KV): then no method compresses anything.
        Read without resolving the target, so a method that never asks for it (UniCache's schedule) reports none."""
        if self.target_ratio is not None:
            return self.target_ratio >= 1.0
        target = self.method.target(self.request.task)
        if isinstance(target, int):
            return target >= sum(c.managed_full_bytes() for c in self.live_caches() if c.branch != THINK)
        return float(target) >= 1.0

    def grant(self, branch: str, layer: int) -> int:
        """Bytes ``layer`` of ``branch`` receives (> 0) or gives (< 0) so every branch keeps its floor (0: none)."""
        return (self._grants or {}).get(branch, {}).get(layer, 0)

    def _decide_grants(self, cache: CompressingKVCache) -> None:
        """The floor grants of every live branch, from the method's needs, at the request's first compression: every
        branch is then at the same least retention, so what one branch is given the others give."""
        needs = {}
        for other in self.live_caches():
            if other.num_layers != cache.num_layers:
                continue
            need = self.method.floor_needs(BranchView(other))
            if need is None:
                self._grants = {}
                return
            needs[other.branch or ""] = need
        self._grants = floor_grants(needs)

    def compress(self, cache: CompressingKVCache, call: AttentionCall | None) -> None:
        """Plan ``cache``'s compression at ``call`` with the method and apply it, timed as allocation and recorded."""
        start = self.clock()
        if self._grants is None and cache.compressions == 0:
            self._decide_grants(cache)
        if not self._keeps_every_row():
            self._share(cache, cache.apply(self.method.plan(BranchView(cache, call))))
        cache.compressions += 1
        self.timers["alloc"] += self.clock() - start
        self.report.note_compression(cache)

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

    def finish(self) -> dict:
        """The request's KV report (:mod:`.report`)."""
        return self.report.build()


__all__ = ["CompressionSession", "floor_grants"]
