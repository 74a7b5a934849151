"""Reference StreamingLLM: attention sinks plus a recent window."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import EvictionPolicy, ScoreInputs


@dataclass(frozen=True)
class StreamingLLMPolicy(EvictionPolicy):
    """Keep the first ``n_sink`` tokens and fill the rest of the budget with the most recent ones.

    Paper: https://arxiv.org/abs/2309.17453 (docs/compression.md §3). No scoring; the same set for every
    head. Tokens keep their original positions: unlike the paper, nothing is re-rotated (BAGEL image
    tokens share position ids, §9.8). With a budget below ``n_sink`` the earliest sinks are kept.

    Parameters
    ----------
    n_sink : int, default 4
        Number of leading "sink" tokens always kept (within the budget).
    """

    n_sink: int = 4

    needs_queries = False

    def __post_init__(self) -> None:
        if not isinstance(self.n_sink, int) or isinstance(self.n_sink, bool) or self.n_sink < 0:
            raise ValueError(f"`n_sink` must be an int >= 0, got {self.n_sink!r}")

    def score(self, inputs: ScoreInputs) -> Tensor:
        """Sinks rank first (earliest highest), then recency: ``[T, Hkv]``."""
        t = inputs.num_tokens
        idx = torch.arange(t, dtype=torch.float32, device=inputs.keys.device)
        sinks = idx < self.n_sink
        scores = torch.where(sinks, 2.0 * t - idx, idx)
        return scores[:, None].expand(t, inputs.num_kv_heads).clone()
