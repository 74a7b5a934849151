"""Observe-only method for offline K90 calibration (docs/compression.md §8.4, §8.5).

:class:`CalibrationMethod` scores every call where the cache is *read* — every denoising step of every
CFG branch (t2i, edit), every decoded token and the prompt prefill (understanding) — on all layers,
and never compresses: outputs are those of full KV. :class:`CalibrationSession` turns the per-key
scores of each observed call into one record per (branch, layer, step, candidate type):

- ``k90``: :func:`~unicache_core.compression.routing.k90` of the type's per-key mass (attention averaged
  over heads and over the scored query subsample, :attr:`LayerState.last_scores`);
- ``mass``: the type's share of the full resident softmax, averaged over heads and queries (the
  per-store LSE share of :mod:`.scoring`, exact over every query; for the new block of a prefill call,
  from the scored queries).

The records come back in the request's KV report as ``report["calibration"]["records"]`` (lists
``[branch, layer, step, type_name, k90, mass]``, ``step`` = ``None`` for the prefill observation).
:mod:`unicache_core.bagel.calibration` aggregates them into a policy table.

The session is a :class:`~.session.CompressionSession` whose method, :class:`Calibration`, supplies the scoring
settings (``score_queries``) and never shrinks anything. Start one per request with
:class:`CalibrationCacheFactory`.

Which calls are recorded: the pending observation of a branch is read at the end of each step
(:meth:`end_step`) and, for the understanding prefill, when the first decoding step begins: only the
LAST prefill call is recorded (the question, whose last ``score_queries`` queries see the whole
context: the post-modality window the methods select with).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..kv.cache import AttentionCall, CacheFactory, CacheSession, RequestInfo, StepInfo
from ..kv.token_types import CANDIDATE_TYPES
from .compressing_cache import CompressingKVCache
from .defaults import SCORE_QUERIES
from .method import Method
from .plan import BranchPlan, CallPlan
from .routing import k90
from .session import CompressionSession
from .view import BranchView

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Calibration(Method, register=False):
    """Scores every read call on all layers; never compresses (see the module docstring). Its session records what
    was scored: set :attr:`session` (a :class:`CalibrationSession` does)."""

    name = "calibration"
    needs_scores = True

    def target(self, task: str) -> float:
        return 1.0

    def plan_call(self, view: BranchView, call: AttentionCall) -> CallPlan:
        if view.branch == "plan":
            return CallPlan()  # the think-mode plan context is not read by the answer / the latents
        if view.task == "understanding":
            if call.phase not in ("prefill", "decode"):
                return CallPlan()  # text queries: the last ones (observation window, Method.measure)
        elif call.phase != "denoise":  # latent queries: an evenly strided subsample
            return CallPlan()  # generation prefill: the cache is written, not read for the output
        return CallPlan(observe=True, measure=True)

    def plan(self, view: BranchView) -> BranchPlan:
        """Nothing is kept out: calibration runs at full KV."""
        return BranchPlan()


class CalibrationSession(CompressionSession):
    """:class:`~.cache.CompressionSession` that records per-type K90 and mass of every observed call."""

    def __init__(self, request: RequestInfo, method: Calibration | None = None):
        self.pending: dict[str, tuple[str, int | None]] = {}
        self.records: list[list] = []
        super().__init__(request, method or Calibration(), {"path": None, "source": "calibration", "warning": None})

    def note_observed(self, branch: str, call: AttentionCall) -> None:
        """``branch`` is scored in ``call``: its records are harvested when the call's step (or the prefill) ends."""
        self.pending[branch] = (call.phase, None if call.step is None else int(call.step))

    def _harvest(self, branch: str) -> None:
        phase, step = self.pending.pop(branch)
        cache = self.caches.get(branch)
        if not isinstance(cache, CompressingKVCache):
            return
        for layer in range(cache.num_layers):
            ls = cache.state[layer]
            scores = ls.last_scores
            if scores is None or ls.last_score_queries <= 0 or scores.shape[0] == 0:
                continue
            # [T, Hkv] summed over the scored queries, averaged in each KV group -> mean over heads and queries
            per_key = scores.float().mean(dim=1).cpu() / ls.last_score_queries
            types = cache.types[: per_key.shape[0]].long()
            for ttype in CANDIDATE_TYPES:
                sel = types == int(ttype)
                if not bool(sel.any()):
                    continue
                mass_keys = per_key[sel]
                mass = ls.masses.get(ttype)
                if mass is None:
                    mass = float(mass_keys.sum())
                self.records.append([branch, layer, step, ttype.name.lower(), k90(mass_keys), float(mass)])
        logger.debug("calibration: recorded %s %s step %s", branch, phase, step)

    def begin_step(self, step: StepInfo) -> None:
        for branch, (phase, _) in list(self.pending.items()):
            if phase == "prefill":
                self._harvest(branch)  # the last prefill call before decoding
        super().begin_step(step)

    def end_step(self, step: StepInfo) -> None:
        for branch in list(self.pending):
            if self.pending[branch][0] == step.phase:
                self._harvest(branch)
        super().end_step(step)

    def finish(self) -> dict:
        for branch in list(self.pending):
            self._harvest(branch)
        report = super().finish()
        report["calibration"] = {"fields": ["branch", "layer", "step", "type", "k90", "mass"], "records": self.records}
        return report


class CalibrationCacheFactory(CacheFactory):
    """Starts a :class:`CalibrationSession` per request (``score_queries``: queries scored per call)."""

    method = "calibration"

    def __init__(self, score_queries: int = SCORE_QUERIES):
        self.calibration = Calibration(score_queries=score_queries)

    def start(self, request: RequestInfo) -> CacheSession:
        return CalibrationSession(request, self.calibration)


__all__ = ["Calibration", "CalibrationCacheFactory", "CalibrationSession"]
