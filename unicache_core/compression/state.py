"""The per-request state of a compressing run: one object the session owns and hands to its caches and views.

Everything a request accumulates across branches and steps lives here, and changes only through its methods: the
chunked attention statistics, the clocks of the running step, the step itself, the resolved memory target, the
bytes moved between branches and layers (grants, docs/compression.md §11.8) and, per branch, its compressions, rho
schedule, the method's state and the phase of its last measured call. The caches record into it; views read it; the
report reads it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from ..kv.cache import StepInfo
from ..kv.token_types import TokenType
from .stats import ChunkedAttentionStats

TIMERS = ("attention", "stats", "alloc", "pack")


def clock(like: Tensor | None = None, sync: bool = False) -> float:
    """``perf_counter()``, after the device of ``like`` finished its work when ``sync`` (synced clocks)."""
    if sync and like is not None and like.is_cuda:
        torch.cuda.synchronize(like.device)
    return time.perf_counter()


@dataclass(frozen=True)
class BranchRecord:
    """What the request knows of one branch between its calls.

    Attributes:
        compressions: compressions applied so far.
        rho: layer chunk -> scheduled retention after the last compression (empty: the method has no schedule).
        method_state: what the method's last plan keeps for this branch (``BranchPlan.state``, a frozen value).
        measured_phase: the phase of the branch's last call that measured (``None``: none yet).
    """

    compressions: int = 0
    rho: Mapping[int, float] = field(default_factory=dict)
    method_state: Any = None
    measured_phase: str | None = None


class RequestState:
    """Statistics, clocks, step, target, grants and branch records of one request (see the module docstring)."""

    def __init__(self, task: str, *, sync_timing: bool = False):
        self.sync_timing = sync_timing  # clocks wait for the device (exact per-call times, slower)
        self.stats = ChunkedAttentionStats.for_task(task)
        self.timers: dict[str, float] = dict.fromkeys(TIMERS, 0.0)
        #: the clocks of the calls outside every step (the prefill of the context, between rounds too)
        self.prefill_timers: dict[str, float] = dict.fromkeys(TIMERS, 0.0)
        self.step: StepInfo | None = None
        self._in_step = False
        self.target_ratio: float | None = None  # resolved memory target (ratio of full managed bytes)
        self.grants: dict[str, dict[int, int]] | None = None  # decided at the request's first compression
        self._branches: dict[str, BranchRecord] = {}

    # ------------------------------------------------------------------ reading

    def branch(self, name: str) -> BranchRecord:
        """The record of branch ``name`` (a fresh one before its first compression)."""
        return self._branches.get(name) or BranchRecord()

    def grant(self, branch: str, layer: int) -> int:
        """Bytes ``layer`` of ``branch`` receives (> 0) or gives (< 0) so every branch keeps its floor (0: none)."""
        return (self.grants or {}).get(branch, {}).get(layer, 0)

    # ------------------------------------------------------------------ recording

    def begin_step(self, step: StepInfo) -> None:
        """``step`` runs now: its clocks start at zero."""
        self.step = step
        self.timers = dict.fromkeys(TIMERS, 0.0)
        self._in_step = True

    def end_step(self) -> None:
        """The running step is over: calls until the next one are the prefill's (:attr:`prefill_timers`)."""
        self._in_step = False

    def add_time(self, kind: str, seconds: float) -> None:
        """Add ``seconds`` to the running step's ``kind`` clock (one of :data:`TIMERS`), or outside a step to the
        prefill's."""
        (self.timers if self._in_step else self.prefill_timers)[kind] += seconds

    def note_masses(self, branch: str, layer: int, step: int, masses: Mapping[TokenType, float]) -> None:
        """The candidate types' attention masses ``layer`` of ``branch`` measured at ``step`` (the chunk EMAs)."""
        self.stats.update(layer, step, dict(masses), branch=branch)

    def note_measured(self, branch: str, phase: str) -> None:
        """``branch`` measured in a call of ``phase``."""
        self._branches[branch] = replace(self.branch(branch), measured_phase=phase)

    def note_compressed(self, branch: str, rho: Mapping[int, float] | None, method_state: Any) -> None:
        """``branch`` was compressed: one more compression, its schedule's ``rho`` (``None``: the plan was not
        applied, the records stay) and the method's state for its next view."""
        record = self.branch(branch)
        if rho is None:
            self._branches[branch] = replace(record, compressions=record.compressions + 1)
            return
        self._branches[branch] = replace(
            record, compressions=record.compressions + 1, rho={**record.rho, **rho}, method_state=method_state
        )

    def fork(self, parent: str, child: str) -> None:
        """``child`` is a copy of ``parent``: it starts from the parent's record."""
        self._branches[child] = self.branch(parent)

    def set_target(self, ratio: float) -> None:
        """The request's memory target, resolved once (a ratio of the full candidate bytes)."""
        self.target_ratio = ratio

    def set_grants(self, grants: dict[str, dict[int, int]]) -> None:
        """The grants (:func:`~.grants.branch_grants`), decided once at the request's first compression."""
        self.grants = grants


__all__ = ["TIMERS", "BranchRecord", "RequestState", "clock"]
