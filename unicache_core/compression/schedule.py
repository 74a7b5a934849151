"""Task-aware retention schedule ``rho`` over denoising step chunks (docs/compression.md §8.7)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from .defaults import FIXED_RHO_TASKS, RHO0, RHO_FLOOR, RHO_GAMMA, RHO_MIN_FALL

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionSchedule:
    """Total retention ratio of the candidate KV, decaying with the conditional attention mass.

    One value per (branch, layer chunk); a frozen value: :meth:`observe` returns the schedule after an observation
    (UniCache hands it back to its branch with each plan). Step chunk 0 (the full-KV step) supplies the reference
    mass ``m0``. For every later observation of chunk ``j``: ``rho_j = clip(rho0 * (m_j / m0) ** gamma, floor,
    rho0)`` and the scheduled ``rho`` is the minimum over all observations so far: it never rises. ``m0 ~ 0`` (or not
    observed yet) keeps ``rho0``. With ``per_bit`` set the schedule decays in bits instead (error parity,
    docs/compression.md §11.5): ``rho_j = clip(rho0 + per_bit * log4(m_j / m0), floor, rho0)``, ``per_bit`` the
    retention of one bit per element of the cache's dtype, so a row's expected error ``m * 4**-b`` stays at the
    reference's as the mass falls. A ``rho_j`` less than ``min_fall`` (relative) below the ``rho`` in force, and above
    the floor, is not acted on: the schedule falls in steps of at least 5%, or straight to its floor.

    Attributes:
        rho0: starting ratio (the task's default: :data:`~unicache_core.compression.defaults.RHO0`).
        floor: lowest ratio (:data:`~unicache_core.compression.defaults.RHO_FLOOR`).
        gamma: exponent (:data:`~unicache_core.compression.defaults.RHO_GAMMA`).
        fixed: ``rho`` stays ``rho0`` whatever is observed (understanding).
        min_fall: least relative fall acted on (:data:`~unicache_core.compression.defaults.RHO_MIN_FALL`; 0: every
            fall, the paper's schedule).
        per_bit: retention of one bit per cached element (``1 / (8 * bytes per element)``); ``None``: the power law.
        m0: the reference mass (``None`` until step chunk 0 is observed).
        rho: the scheduled retention ratio now (``rho0`` until it falls).
    """

    rho0: float = RHO0["t2i"]
    floor: float = RHO_FLOOR["t2i"]
    gamma: float = RHO_GAMMA
    fixed: bool = False
    min_fall: float = RHO_MIN_FALL
    per_bit: float | None = None
    m0: float | None = None
    rho: float = -1.0  # set to rho0 when not given

    def __post_init__(self) -> None:
        if not 0.0 < self.rho0 <= 1.0:
            raise ValueError(f"`rho0` must be in (0, 1], got {self.rho0!r}")
        if not 0.0 <= self.floor <= self.rho0:
            raise ValueError(f"`floor` must be in [0, rho0={self.rho0}], got {self.floor!r}")
        if not (math.isfinite(self.gamma) and self.gamma > 0):
            raise ValueError(f"`gamma` must be > 0, got {self.gamma!r}")
        if not 0.0 <= self.min_fall < 1.0:
            raise ValueError(f"`min_fall` must be in [0, 1), got {self.min_fall!r}")
        if self.per_bit is not None and not (math.isfinite(self.per_bit) and self.per_bit > 0):
            raise ValueError(f"`per_bit` must be > 0 or None, got {self.per_bit!r}")
        if self.rho < 0:
            object.__setattr__(self, "rho", self.rho0)

    @classmethod
    def for_task(cls, task: str) -> RetentionSchedule:
        """Preset of the task (:data:`~unicache_core.compression.defaults.RHO0`, ``RHO_FLOOR``): understanding fixed
        at 0.2; t2i 0.4 -> floor 0.35; edit 0.2 -> floor 0.1."""
        if task not in RHO0:
            raise ValueError(f"`task` must be one of {tuple(RHO0)}, got {task!r}")
        return cls(rho0=RHO0[task], floor=RHO_FLOOR[task], fixed=task in FIXED_RHO_TASKS)

    @property
    def least(self) -> float:
        """The least retention the schedule can still reach: ``rho`` when fixed, else its floor (at most ``rho``)."""
        return self.rho if self.fixed else min(self.floor, self.rho)

    def ratio_for(self, mass: float) -> float:
        """``clip(rho0 * (mass / m0) ** gamma, floor, rho0)`` (with ``per_bit``: ``rho0 + per_bit * log4(mass / m0)``);
        ``rho0`` when ``m0`` is unknown or ~0."""
        if self.fixed or self.m0 is None or self.m0 <= 1e-12:
            return self.rho0
        rel = max(0.0, mass) / self.m0
        if self.per_bit is None:
            proposed = self.rho0 * rel**self.gamma
        else:
            proposed = self.floor if rel <= 0 else self.rho0 + self.per_bit * math.log(rel, 4)
        return min(self.rho0, max(self.floor, proposed))

    def observe(self, step_chunk: int, mass: float) -> RetentionSchedule:
        """The schedule after the summed candidate mass ``mass`` of ``step_chunk`` was observed."""
        if not isinstance(step_chunk, int) or isinstance(step_chunk, bool) or step_chunk < 0:
            raise ValueError(f"`step_chunk` must be an int >= 0, got {step_chunk!r}")
        if not math.isfinite(mass) or mass < 0:
            raise ValueError(f"`mass` must be finite and >= 0, got {mass!r}")
        if self.fixed:
            return self
        if step_chunk == 0:
            return replace(self, m0=float(mass))
        if self.m0 is None:
            logger.debug(
                "retention schedule: chunk %d observed before the reference chunk 0; rho unchanged", step_chunk
            )
            return self
        proposed = self.ratio_for(mass)
        if proposed <= self.floor or proposed <= self.rho * (1.0 - self.min_fall):
            return replace(self, rho=min(self.rho, proposed))
        return self
