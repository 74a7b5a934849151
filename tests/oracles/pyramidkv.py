"""Reference PyramidKV: SnapKV scoring with per-layer budgets that shrink linearly with depth."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from .base import ScoreInputs
from .snapkv import SnapKVPolicy


@dataclass(frozen=True)
class PyramidKVPolicy(SnapKVPolicy):
    """SnapKV scoring; the budget of layer ``inputs.layer`` comes from :func:`pyramid_budgets`.

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
        budgets = pyramid_budgets(num_tokens, self.window_size, self.keep_ratio, num_layers, self.beta)
        if not 0 <= layer < num_layers:
            raise ValueError(f"`layer` must be in [0, {num_layers}), got {layer!r}")
        return min(num_tokens, budgets[layer])

    def select_layer(self, inputs: ScoreInputs) -> Tensor:
        """:meth:`select` with the pyramid budget of ``inputs.layer`` / ``inputs.num_layers``: ``[Hkv, n]``."""
        budget = self.layer_budget(inputs.num_tokens, inputs.layer, inputs.num_layers)
        return self.select(inputs, budget)


def pyramid_budgets(tokens: int, window: int, keep_ratio: float, num_layers: int, beta: float) -> list[int]:
    """PyramidKV's per-layer budgets as the paper's reference (kvpress) computes them, docs/compression.md §5:
    with ``cap = w + T r`` (``r`` the kept fraction), the top layer keeps ``min = (cap - w) / beta`` and the bottom
    ``max = 2 (cap - w) - min`` (capped at ``T - w``, ``min`` following), linear in between, rounded; where those
    bounds fail (``T >= max >= min >= w``) or there is one layer, every layer keeps ``T r``."""
    cap = window + tokens * keep_ratio
    low = (cap - window) / beta
    high = 2 * (cap - window) - low
    if high >= tokens - window:
        high = tokens - window
        low = 2 * (cap - window) - high
    if num_layers == 1 or not tokens >= high >= low >= window:
        return [round(tokens * keep_ratio)] * num_layers
    return [round(high - layer * (high - low) / (num_layers - 1)) for layer in range(num_layers)]
