"""H2O (https://arxiv.org/abs/2306.14048): the heavy hitters of the accumulated attention, plus a recent window."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ...validation import check_ratio
from ..defaults import RECENT_FRACTION
from ..protocol import Measurement
from ..scoring import CallProbe
from ..view import BranchView, LayerView
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

    def measure(self, probe: CallProbe) -> Measurement:
        """The attention each row receives from at most ``score_queries`` queries (strided latents, or the last text
        queries); the cache accumulates it over every measured call."""
        found = probe.key_scores(self.score_queries, last=probe.windowed)
        return Measurement(found.scores, found.queries)

    def layer_scores(self, view: BranchView, layer: LayerView) -> Tensor | None:
        return layer.scores  # the heavy hitters: attention accumulated over every measured call

    def recent_share(self) -> float:
        return self.recent_fraction


__all__ = ["H2O"]
