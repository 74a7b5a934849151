"""StreamingLLM (https://arxiv.org/abs/2309.17453): attention sinks plus the most recent rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...validation import check_int
from ..defaults import SINK_TOKENS
from ..view import BranchView, LayerView
from .eviction import GlobalEviction


def sink_recency_scores(num_rows: int, candidates: Tensor, num_sinks: int) -> Tensor:
    """StreamingLLM's ranking of ``num_rows`` appended rows: the ``num_sinks`` earliest candidate rows first
    (earliest highest), then every row by recency.

    Args:
        candidates: ``[num_rows]`` bool, the rows the eviction pool holds.

    Returns:
        ``[num_rows]`` fp32 scores (higher = keep).
    """
    idx = torch.arange(num_rows, dtype=torch.float32)
    sinks = torch.nonzero(candidates).squeeze(1)[:num_sinks]
    scores = idx.clone()
    scores[sinks] = 2.0 * num_rows + 1.0 - idx[sinks]
    return scores


@dataclass(frozen=True, kw_only=True)
class StreamingLLM(GlobalEviction):
    """Keeps the first ``sinks`` compressible rows and the most recent ones; no scores. Original positions are kept
    (no re-rotation: BAGEL's image tokens share RoPE ids).

    Attributes:
        sinks: the attention sinks, 4.
    """

    name = "streamingllm"
    needs_scores = False
    sinks: int = SINK_TOKENS

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("sinks", self.sinks, 0)

    def layer_scores(self, view: BranchView, layer: LayerView) -> Tensor:
        n = layer.appended
        scores = sink_recency_scores(n, layer.candidate_mask(), self.sinks)
        heads = 0 if layer.geometry is None else layer.geometry.num_kv_heads
        return scores[:, None].expand(n, heads).contiguous()


__all__ = ["StreamingLLM", "sink_recency_scores"]
