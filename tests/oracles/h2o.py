"""Reference H2O (Heavy-Hitter Oracle): accumulated attention plus a recent window."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from .base import EvictionPolicy, ScoreInputs, budget_from_ratio, observation_attention, recent_mask


@dataclass(frozen=True)
class H2OPolicy(EvictionPolicy):
    """Keep the most recent tokens plus the "heavy hitters" with the largest accumulated attention.

    Paper: https://arxiv.org/abs/2306.14048 (docs/compression.md §2). The score of a key is the attention
    it received, summed over every observation query so far (``score_update_policy="cumulative"``),
    averaged over the query heads of its KV group. Selection is per KV head.

    Parameters
    ----------
    heavy_ratio : float | None, default None
        Heavy-hitter share of the tokens (paper headline 0.1; UniCache gen/edit 0.375, und 0.15).
    recent_ratio : float | None, default None
        Recent-window share of the tokens (paper 0.1; UniCache gen/edit 0.125, und 0.05). When both
        ratios are set, a budget is split in proportion ``recent_ratio : heavy_ratio`` and
        :meth:`budget_for` gives ``round((heavy_ratio + recent_ratio) * T)``.
    recent_fraction : float, default 0.25
        Recent share of a budget when the ratios are not set (UniCache's dynamic-budget default).
    """

    heavy_ratio: float | None = None
    recent_ratio: float | None = None
    recent_fraction: float = 0.25

    needs_queries = False  # accumulated scores alone are enough

    def __post_init__(self) -> None:
        if (self.heavy_ratio is None) != (self.recent_ratio is None):
            raise ValueError(
                f"`heavy_ratio` and `recent_ratio` must be set together, got "
                f"heavy_ratio={self.heavy_ratio!r}, recent_ratio={self.recent_ratio!r}"
            )
        for name in ("heavy_ratio", "recent_ratio"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"`{name}` must be in [0, 1], got {value!r}")
        if self.heavy_ratio is not None and self.heavy_ratio + self.recent_ratio > 1.0 + 1e-9:
            raise ValueError(f"`heavy_ratio` + `recent_ratio` must be <= 1, got {self.heavy_ratio + self.recent_ratio}")
        if not 0.0 <= self.recent_fraction <= 1.0:
            raise ValueError(f"`recent_fraction` must be in [0, 1], got {self.recent_fraction!r}")

    @property
    def recent_share(self) -> float:
        """Fraction of a budget given to the recent window."""
        if self.heavy_ratio is not None:
            total = self.heavy_ratio + self.recent_ratio
            return self.recent_ratio / total if total > 0 else 0.0
        return self.recent_fraction

    def budget_for(self, num_tokens: int) -> int:
        """Total budget ``round((heavy_ratio + recent_ratio) * T)``; needs both ratios."""
        if self.heavy_ratio is None:
            raise ValueError("`budget_for` needs `heavy_ratio` and `recent_ratio`; pass a budget to select() instead")
        return budget_from_ratio(min(1.0, self.heavy_ratio + self.recent_ratio), num_tokens)

    def recent_count(self, budget: int) -> int:
        """Recent-window size inside ``budget`` (rounded half up)."""
        return min(budget, math.floor(budget * self.recent_share + 0.5))

    def update_scores(self, accumulated: Tensor | None, inputs: ScoreInputs) -> Tensor:
        """New running scores ``[T, Hkv]``: ``accumulated`` plus this observation's attention (summed over queries)."""
        observed = observation_attention(inputs).sum(dim=1).t()  # [T, Hkv]
        if accumulated is None:
            return observed
        if tuple(accumulated.shape) != tuple(observed.shape):
            raise ValueError(f"`accumulated` must be {tuple(observed.shape)}, got {tuple(accumulated.shape)}")
        return accumulated.float() + observed

    def score(self, inputs: ScoreInputs) -> Tensor:
        """``accumulated`` plus the attention of ``queries`` when given: ``[T, Hkv]``."""
        if inputs.queries is None:
            if inputs.accumulated is None:
                raise ValueError("H2OPolicy needs `queries` or `accumulated` scores; got neither")
            return inputs.accumulated.float()
        return self.update_scores(inputs.accumulated, inputs)

    def forced_keep(self, inputs: ScoreInputs, budget: int) -> Tensor:
        return recent_mask(inputs.num_tokens, inputs.num_kv_heads, self.recent_count(budget), inputs.keys.device)
