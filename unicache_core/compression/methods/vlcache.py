"""VL-Cache (https://arxiv.org/abs/2410.23317): post-modality attention scores, layer budgets by density."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from ...validation import check_int, check_ratio
from ..allocator import allocate_integer
from ..defaults import VLCACHE_THRESHOLD
from ..protocol import Measurement
from ..scoring import CallProbe
from ..view import BranchView, LayerView
from .eviction import GlobalEviction


def vlcache_layer_budgets(sparsities: Sequence[float], total: int, num_tokens: int) -> list[int]:
    """Split ``total`` tokens across layers in proportion to density ``1 - gamma_l``.

    ``k_l = total (1 - gamma_l) / sum_j (1 - gamma_j)``, clipped to ``[1, num_tokens]``; what clipping removes or
    adds is redistributed so the budgets sum exactly to ``total`` (integer water-filling, each layer first gets its
    minimum of 1). All-zero density splits uniformly.

    Args:
        sparsities: ``gamma_l`` per layer, each in [0, 1].
        total: total budget over layers, in ``[L, L * num_tokens]``.
        num_tokens: prompt length ``T`` (per-layer cap).
    """
    n_layers = len(sparsities)
    if n_layers == 0:
        raise ValueError("`sparsities` must not be empty")
    for i, g in enumerate(sparsities):
        check_ratio(f"sparsities[{i}]", g, allow_zero=True)
    check_int("num_tokens", num_tokens, 1)
    check_int("total", total, n_layers, n_layers * num_tokens)  # 1..T tokens per layer
    extra = allocate_integer([num_tokens - 1] * n_layers, [1.0 - g for g in sparsities], total - n_layers)
    return [1 + e for e in extra]


@dataclass(frozen=True, kw_only=True)
class VLCache(GlobalEviction):
    """Scores rows by the post-modality attention (the question after the image for understanding; the latent
    queries after the conditioning when denoising); layer budgets in proportion to each layer's density
    ``1 - sparsity``.

    Attributes:
        threshold: the ThresholdFilter's relative ``p``: an attention entry counts when >= p x its row maximum (1%).
    """

    name = "vlcache"
    threshold: float = VLCACHE_THRESHOLD

    def __post_init__(self) -> None:
        super().__post_init__()
        check_ratio("threshold", self.threshold)

    def measure(self, probe: CallProbe) -> Measurement:
        """The post-modality attention (the last text queries, or strided latents) and the layer's sparsity: the
        share of the (query, key) entries below ``threshold`` of their row's largest, over every head."""
        found = probe.key_scores(self.score_queries, last=probe.windowed, relative_threshold=self.threshold)
        assert found.counts is not None  # counted: a relative threshold was given
        heads = probe.q.shape[1]
        sparsity = 1.0 - float(found.counts.sum()) / max(1, found.entries * heads)
        return Measurement(found.scores, found.queries, {"sparsity": sparsity})

    def layer_scores(self, view: BranchView, layer: LayerView) -> Tensor | None:
        return layer.last_scores

    def layer_rows(self, view: BranchView, budgets: list[int], rows: list[int]) -> list[int]:
        total = sum(budgets)
        if not rows or min(rows) == 0 or total < len(rows):
            return budgets
        sparsity = []
        for i in range(len(rows)):
            measured = view.layer(i).measured.get("sparsity")
            sparsity.append(measured if measured is not None else 0.0)
        cap = min(rows)
        total = min(total, cap * len(rows))
        return vlcache_layer_budgets(sparsity, total, cap)


__all__ = ["VLCache", "vlcache_layer_budgets"]
