"""PyramidKV (https://arxiv.org/abs/2406.02069): SnapKV's scores, per-layer budgets decreasing with depth."""

from __future__ import annotations

from dataclasses import dataclass

from ...validation import check_float, check_int, check_ratio
from ..defaults import PYRAMID_BETA
from ..view import BranchView
from .snapkv import SnapKV


def pyramid_layer_budgets(
    total_tokens: int, window: int, compression: float, num_layers: int, beta: float = PYRAMID_BETA
) -> list[int]:
    """Per-layer token budgets of PyramidKV (kvpress 0.5.4 formula, docs/compression.md §5).

    With ``cap = w + T(1-c)``: ``min = (cap-w)/beta``, ``max = 2(cap-w) - min``; if ``max >= T - w`` then
    ``max = T - w`` and ``min = 2(cap-w) - max``. Layer ``l`` keeps ``round(max - l (max-min)/(L-1))`` tokens
    (window included), so the mean over layers is ``T(1-c)`` up to rounding. If ``T >= max >= min >= w`` fails
    (short prompts, or one layer), every layer falls back to SnapKV's ``round(T(1-c))``.

    Args:
        total_tokens: prompt length ``T``; window: observation window ``w``;
        compression: removed fraction ``c`` in [0, 1); num_layers: ``L``; beta: pyramid steepness (>= 1).

    Returns:
        ``L`` integer budgets, non-increasing with depth.
    """
    check_int("total_tokens", total_tokens, 0)
    check_int("window", window, 0)
    check_int("num_layers", num_layers, 1)
    check_ratio("compression", compression, allow_zero=True, allow_one=False)
    check_float("beta", beta, 1.0)
    kept = total_tokens * (1.0 - compression)
    fallback = [round(kept)] * num_layers
    min_num = kept / beta
    max_num = 2.0 * kept - min_num
    if max_num >= total_tokens - window:
        max_num = float(total_tokens - window)
        min_num = 2.0 * kept - max_num
    if num_layers == 1 or not (total_tokens >= max_num >= min_num >= window):
        return fallback
    step = (max_num - min_num) / (num_layers - 1)
    return [round(max_num - layer * step) for layer in range(num_layers)]


@dataclass(frozen=True, kw_only=True)
class PyramidKV(SnapKV):
    """SnapKV's scores and window; per-layer budgets decreasing with depth whose mean equals the matched budget.

    Attributes:
        beta: steepness of the pyramid (20).
    """

    name = "pyramidkv"
    beta: float = PYRAMID_BETA

    def __post_init__(self) -> None:
        super().__post_init__()
        check_float("beta", self.beta, 1.0)

    def layer_rows(self, view: BranchView, budgets: list[int], rows: list[int]) -> list[int]:
        if not rows or max(rows) == 0 or sum(budgets) == 0:
            return budgets  # nothing to keep anywhere (a budget below one row per layer): no pyramid to shape
        total = rows[0]
        keep = sum(budgets) / len(budgets)
        window = min(self.window, total)
        pyramid = (
            pyramid_layer_budgets(total, window, 1.0 - min(1.0, keep / total), len(rows), self.beta)
            if keep < total
            else [total] * len(rows)
        )
        # never above the matched mean in total: trim the rounding surplus from the deepest layers
        surplus = sum(pyramid) - sum(budgets)
        layer = len(pyramid) - 1
        while surplus > 0 and layer >= 0:
            cut = min(surplus, pyramid[layer])
            pyramid[layer] -= cut
            surplus -= cut
            layer -= 1
        return [min(p, r) for p, r in zip(pyramid, rows)]


__all__ = ["PyramidKV", "pyramid_layer_budgets"]
