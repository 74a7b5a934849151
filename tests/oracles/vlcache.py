"""Reference VL-Cache: post-modality attention scores and the dense layer sparsity."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .base import EvictionPolicy, ScoreInputs, observation_attention, recent_mask


def layer_sparsity(probs: Tensor, threshold: float = 0.01, valid: Tensor | None = None) -> float:
    """Fraction of attention entries below ``threshold`` x their row maximum (VL-Cache ThresholdFilter).

    Args:
        probs: ``[H, Tq, T]`` attention of the post-modality queries.
        threshold: relative threshold ``p`` (default 1%).
        valid: optional ``[Tq, T]`` bool mask of causally valid entries; invalid ones are not counted.

    Returns:
        Sparsity ``gamma`` in [0, 1] (1.0 when nothing is valid).
    """
    if probs.dim() != 3:
        raise ValueError(f"`probs` must be [H, Tq, T], got {tuple(probs.shape)}")
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"`threshold` must be in [0, 1], got {threshold!r}")
    p = probs.float()
    if valid is None:
        valid = torch.ones(p.shape[1:], dtype=torch.bool, device=p.device)
    elif tuple(valid.shape) != tuple(p.shape[1:]):
        raise ValueError(f"`valid` must be [Tq, T] = {tuple(p.shape[1:])}, got {tuple(valid.shape)}")
    p = p.masked_fill(~valid, 0.0)
    row_max = p.amax(dim=-1, keepdim=True)
    kept = (p >= threshold * row_max) & valid & (row_max > 0)
    count = int(valid.sum()) * p.shape[0]
    if count == 0:
        return 1.0
    return 1.0 - float(kept.sum()) / count


@dataclass(frozen=True)
class VLCachePolicy(EvictionPolicy):
    """Keep the keys with the largest accumulated post-modality attention.

    Paper: https://arxiv.org/abs/2410.23317 (docs/compression.md §7). The
    observation queries are the tokens after the last modality boundary (the prompt text after the
    image, or BAGEL's queries after the conditioning); their attention is summed per key and averaged
    over the query heads of a KV group. Layer budgets come from
    :func:`unicache_core.compression.methods.vlcache.vlcache_layer_budgets` over :meth:`sparsity`.

    Parameters
    ----------
    threshold : float, default 0.01
        Relative ThresholdFilter ``p`` used by :meth:`sparsity`.
    queries_in_keys : bool, default True
        The post-modality queries are the last ``Tq`` keys of the segment: they see keys causally and
        are always kept (inside the budget). ``False`` for queries outside the key set.
    """

    threshold: float = 0.01
    queries_in_keys: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"`threshold` must be in [0, 1], got {self.threshold!r}")

    def score(self, inputs: ScoreInputs) -> Tensor:
        """Post-modality attention summed over queries: ``[T, Hkv]``."""
        return observation_attention(inputs, causal=self.queries_in_keys).sum(dim=1).t().contiguous()

    def sparsity(self, inputs: ScoreInputs) -> float:
        """Layer sparsity ``gamma`` over all query heads and the causally valid entries."""
        probs = observation_attention(inputs, causal=self.queries_in_keys, per_query_head=True)
        tq, t = probs.shape[1], probs.shape[2]
        valid = None
        if self.queries_in_keys:
            valid = torch.ones(tq, t, dtype=torch.bool, device=probs.device).tril(diagonal=t - tq)
        return layer_sparsity(probs, self.threshold, valid)

    def forced_keep(self, inputs: ScoreInputs, budget: int) -> Tensor | None:
        if not self.queries_in_keys:
            return None
        tq = inputs.require_queries(type(self).__name__).shape[0]
        return recent_mask(inputs.num_tokens, inputs.num_kv_heads, tq, inputs.keys.device)
