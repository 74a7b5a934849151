"""Reference SnapKV: observation-window attention, smoothed by 1-D pooling along the keys."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from .base import EvictionPolicy, ScoreInputs, observation_attention, recent_mask


@dataclass(frozen=True)
class SnapKVPolicy(EvictionPolicy):
    """Score keys by the attention of an observation window, pooled along the key axis.

    Paper: https://arxiv.org/abs/2404.14469 (docs/compression.md §4; defaults of kvpress and UniCache's
    baseline operator). Scores are averaged over the window queries and over the query heads of each
    KV group; selection is per KV head with the same count per head.

    Two observation modes:

    - ``queries_in_keys=True`` (prefill, the paper): the queries are the last ``w`` tokens of the
      segment itself, they see keys causally, only the prefix ``T - w`` is scored and pooled, and the
      ``w`` window keys are always kept (inside the budget; if the budget is smaller than the window
      the most recent window keys win).
    - ``queries_in_keys=False`` (denoising, §8.10): the queries are current-latent queries that are
      *not* in the key set; they see every key and every key is a candidate.

    Parameters
    ----------
    window_size : int, default 64
        Observation window: at most this many (last) queries are used.
    kernel_size : int, default 5
        Pooling kernel along the keys; odd, 1 disables pooling.
    pooling : {"avgpool", "maxpool"}, default "avgpool"
    queries_in_keys : bool, default True
        See above.
    """

    window_size: int = 64
    kernel_size: int = 5
    pooling: Literal["avgpool", "maxpool"] = "avgpool"
    queries_in_keys: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.window_size, int) or isinstance(self.window_size, bool) or self.window_size < 1:
            raise ValueError(f"`window_size` must be an int >= 1, got {self.window_size!r}")
        if (
            not isinstance(self.kernel_size, int)
            or isinstance(self.kernel_size, bool)
            or self.kernel_size < 1
            or self.kernel_size % 2 == 0
        ):
            raise ValueError(f"`kernel_size` must be an odd int >= 1, got {self.kernel_size!r}")
        if self.pooling not in ("avgpool", "maxpool"):
            raise ValueError(f"`pooling` must be 'avgpool' or 'maxpool', got {self.pooling!r}")

    def _window_inputs(self, inputs: ScoreInputs) -> ScoreInputs:
        q = inputs.require_queries(type(self).__name__)
        if q.shape[0] <= self.window_size:
            return inputs
        lse = None if inputs.query_lse is None else inputs.query_lse[-self.window_size :]
        return dataclasses.replace(inputs, queries=q[-self.window_size :], query_lse=lse)

    def window_length(self, inputs: ScoreInputs) -> int:
        """Number of window keys forced to keep (0 when the queries are not in the key set)."""
        if not self.queries_in_keys:
            return 0
        return min(self.window_size, inputs.require_queries(type(self).__name__).shape[0])

    def score(self, inputs: ScoreInputs) -> Tensor:
        """Pooled mean window attention ``[T, Hkv]``; window keys (if in the key set) get ``max + 1``."""
        win = self._window_inputs(inputs)
        probs = observation_attention(win, causal=self.queries_in_keys)  # [Hkv, w, T]
        scores = probs.mean(dim=1)  # [Hkv, T]
        w = self.window_length(inputs)
        t = inputs.num_tokens
        prefix = smooth_scores(scores[:, : t - w], self.kernel_size, self.pooling)
        if w == 0:
            return prefix.t().contiguous()
        top = prefix.max() + 1.0 if prefix.numel() else torch.tensor(1.0)
        window = torch.full((scores.shape[0], w), float(top), dtype=scores.dtype, device=scores.device)
        return torch.cat([prefix, window], dim=1).t().contiguous()

    def forced_keep(self, inputs: ScoreInputs, budget: int) -> Tensor | None:
        w = self.window_length(inputs)
        if w == 0:
            return None
        return recent_mask(inputs.num_tokens, inputs.num_kv_heads, w, inputs.keys.device)


def smooth_scores(scores: Tensor, kernel_size: int, pooling: str) -> Tensor:
    """SnapKV's clustering step: each key's score replaced by the mean (``avgpool``) or maximum (``maxpool``) of the
    ``kernel_size`` scores centred on it, stride 1, same length. The paper's reference pads with zeros for the mean
    (and divides by the whole kernel) and with -inf for the maximum. ``scores [Hkv, T]`` -> ``[Hkv, T]``."""
    if kernel_size == 1 or scores.shape[1] == 0:
        return scores
    half = kernel_size // 2
    fill = 0.0 if pooling == "avgpool" else float("-inf")
    padded = torch.nn.functional.pad(scores, (half, half), value=fill)
    windows = padded.unfold(1, kernel_size, 1)  # [Hkv, T, kernel]
    return windows.sum(dim=-1) / kernel_size if pooling == "avgpool" else windows.amax(dim=-1)
