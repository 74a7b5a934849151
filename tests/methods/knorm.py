"""A new eviction method in one file: KnormPress (kvpress), which keeps the keys of the smallest L2 norm.

Keys with a small norm tend to draw the most attention (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based
Strategy for KV Cache Compression"), so ranking rows by ``-||k||`` needs no attention statistics at all. This file is
the whole method: its settings, its scores and its registration (the class names itself). The shared global
eviction (:class:`~unicache_core.compression.methods.eviction.GlobalEviction`) matches it to the byte target,
protects boundaries and latents, and hands the cache the rows to keep.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from unicache_core.compression.methods.eviction import GlobalEviction
from unicache_core.compression.view import BranchView, LayerView


@dataclass(frozen=True, kw_only=True)
class KeyNorm(GlobalEviction):
    """Keeps, per KV head, the candidate rows whose keys have the smallest L2 norm.

    Attributes:
        recent_fraction: share of the budget kept as the most recent rows (0: none).
    """

    name = "knorm"
    needs_scores = False  # the keys alone rank the rows: no attention is scored
    recent_fraction: float = 0.0

    def recent_share(self) -> float:
        return self.recent_fraction

    def layer_scores(self, view: BranchView, layer: LayerView) -> Tensor:
        return -layer.key_norms()  # [T_appended, Hkv]: the smallest norm ranks highest
