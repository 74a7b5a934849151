"""H2O (https://arxiv.org/abs/2306.14048): the heavy hitters of the accumulated attention, plus a recent window."""

from __future__ import annotations

from dataclasses import dataclass

from ...validation import check_ratio
from ..defaults import RECENT_FRACTION
from .eviction import GlobalEviction


@dataclass(frozen=True, kw_only=True)
class H2O(GlobalEviction):
    """Keeps the rows with the most attention accumulated over every scored query so far, and the most recent ones.

    Attributes:
        recent_fraction: share of the budget kept as the most recent rows (UniCache's dynamic-budget split, heavy
            0.375 / recent 0.125 of a 0.5 budget).
    """

    name = "h2o"
    recent_fraction: float = RECENT_FRACTION

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ratio("recent_fraction", self.recent_fraction, allow_zero=True)

    def recent_share(self) -> float:
        return self.recent_fraction


__all__ = ["H2O"]
