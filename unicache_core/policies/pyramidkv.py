"""PyramidKV: SnapKV scoring with per-layer budgets that shrink linearly with depth."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .base import ScoreInputs
from .snapkv import SnapKVPolicy


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}, got {value!r}")


def pyramid_layer_budgets(
    total_tokens: int, window: int, compression: float, num_layers: int, beta: float = 20.0
) -> list[int]:
    """Per-layer token budgets of PyramidKV (kvpress 0.5.4 formula, docs/compression.md §5).

    With ``cap = w + T(1-c)``: ``min = (cap-w)/beta``, ``max = 2(cap-w) - min``; if ``max >= T - w``
    then ``max = T - w`` and ``min = 2(cap-w) - max``. Layer ``l`` keeps
    ``round(max - l (max-min)/(L-1))`` tokens (window included), so the mean over layers is
    ``T(1-c)`` up to rounding. If ``T >= max >= min >= w`` fails (short prompts, or one layer), every
    layer falls back to SnapKV's ``round(T(1-c))``.

    Args:
        total_tokens: prompt length ``T``; window: observation window ``w``;
        compression: removed fraction ``c`` in [0, 1); num_layers: ``L``; beta: pyramid steepness (>= 1).

    Returns:
        ``L`` integer budgets, non-increasing with depth.
    """
    _check_int("total_tokens", total_tokens, 0)
    _check_int("window", window, 0)
    _check_int("num_layers", num_layers, 1)
    if not 0.0 <= compression < 1.0:
        raise ValueError(f"`compression` must be in [0, 1), got {compression!r}")
    if not beta >= 1:
        raise ValueError(f"`beta` must be >= 1, got {beta!r}")
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


@dataclass(frozen=True)
class PyramidKVPolicy(SnapKVPolicy):
    """SnapKV scoring; the budget of layer ``inputs.layer`` comes from :func:`pyramid_layer_budgets`.

    Paper: https://arxiv.org/abs/2406.02069 (docs/compression.md §5). Note §5's multimodal caveat: VLM
    sparsity is not monotone in depth.

    Parameters
    ----------
    keep_ratio : float, default 0.5
        Mean retained fraction over layers (kvpress's compression ratio is ``1 - keep_ratio``).
    beta : float, default 20
        Pyramid steepness.
    window_size, kernel_size, pooling, queries_in_keys
        As :class:`SnapKVPolicy` (64, 5, "avgpool", True). ``window_size`` is also the ``w`` of the budget formula.
    """

    keep_ratio: float = 0.5
    beta: float = 20.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.keep_ratio <= 1.0:
            raise ValueError(f"`keep_ratio` must be in (0, 1], got {self.keep_ratio!r}")
        if not self.beta >= 1:
            raise ValueError(f"`beta` must be >= 1, got {self.beta!r}")

    def layer_budget(self, num_tokens: int, layer: int, num_layers: int) -> int:
        """Budget of ``layer`` out of ``num_layers`` for a segment of ``num_tokens`` tokens."""
        if self.keep_ratio >= 1.0:
            return num_tokens
        budgets = pyramid_layer_budgets(num_tokens, self.window_size, 1.0 - self.keep_ratio, num_layers, self.beta)
        if not 0 <= layer < num_layers:
            raise ValueError(f"`layer` must be in [0, {num_layers}), got {layer!r}")
        return min(num_tokens, budgets[layer])

    def select_layer(self, inputs: ScoreInputs) -> Tensor:
        """:meth:`select` with the pyramid budget of ``inputs.layer`` / ``inputs.num_layers``: ``[Hkv, n]``."""
        budget = self.layer_budget(inputs.num_tokens, inputs.layer, inputs.num_layers)
        return self.select(inputs, budget)
