"""LOOK-M (Wan et al., "LOOK-M: Look-Once Optimization in KV Cache for Efficient Multimodal Long-Context Inference",
Findings of EMNLP 2024, https://arxiv.org/abs/2406.18139): text-prior eviction at prefill, evicted rows merged into
the kept ones (docs/compression.md §14).

- **Scores**: every row's attention summed over the prompt's queries while the context is prefilled (each block's
  queries over the rows they see: earlier blocks and, causally or bidirectionally as the block attends, its own),
  averaged over the query heads of a KV group.
- **Text prior**: text rows (the instruction, a question) rank above every image row (source ViT and VAE); image
  rows are ranked among themselves by their scores.
- **Keep**: per KV head, the most recent rows of the prompt (``recent_fraction`` of the kept rows) plus the best
  ranked of the others, as many as the byte target buys (equal bytes with every other method).
- **Merge**: each evicted row is folded into its most similar kept row (:mod:`..merging`: ``average``, ``pivot``,
  ``weighted``; ``none`` evicts only).
- **When**: once, at the end of the branch's prefill, before anything reads the cache (the first denoising step, or
  the first decoded token); the selection is frozen afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ...kv.cache import AttentionCall
from ...kv.token_types import Task, TokenType
from ...validation import check_ratio
from ..defaults import LOOKM_MERGE, LOOKM_RECENT_FRACTION
from ..merging import MERGES
from ..method import KVTimeline
from ..plan import CallPlan
from ..protocol import Measurement
from ..scoring import CallProbe
from ..view import BranchView, LayerView
from .eviction import GlobalEviction

#: The token types LOOK-M's text prior keeps first (every other candidate type is an image's rows).
TEXT_TYPES: tuple[TokenType, ...] = (TokenType.INSTRUCTION,)
#: The contexts LOOK-M compresses: the CFG branches (an understanding request's one context is ``gen``); the
#: think-mode plan context is never compressed.
COMPRESSED_BRANCHES: tuple[str, ...] = ("gen", "cfg_text", "cfg_img")


def text_prior_scores(scores: Tensor, text: Tensor) -> Tensor:
    """Scores in LOOK-M's text-prior order: every text row above every other row, each group by its own score.

    Args:
        scores: ``[T, Hkv]`` fp32 attention each row received over the prompt's queries (non-negative).
        text: ``[T]`` bool, the text rows.

    Returns:
        ``[T, Hkv]`` fp32: ``scores`` with ``1 + max |scores|`` (per KV head) added to the text rows. (The official
        code subtracts 65516 from the image rows instead: the same order for scores below that.)
    """
    offset = 1.0 + scores.float().abs().amax(dim=0, keepdim=True) if scores.numel() else scores.float()
    return scores.float() + text.to(scores.device).unsqueeze(1).float() * offset


@dataclass(frozen=True, kw_only=True)
class LOOKM(GlobalEviction):
    """LOOK-M's text-prior eviction at prefill with merging (see the module docstring).

    Attributes:
        merge: how evicted rows are merged into the kept ones: ``pivot`` (the official scripts' default),
            ``average``, ``weighted`` or ``none``.
        recent_fraction: share of a layer's kept rows that are the prompt's most recent rows (0.5: the official
            ``hh_ratio = recent_ratio = 0.1``).
        prefer_text: rank text rows above image rows (``False``: LOOK-M's merging over plain accumulated attention).
    """

    name = "lookm"
    merge: str = LOOKM_MERGE
    recent_fraction: float = LOOKM_RECENT_FRACTION
    prefer_text: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.merge not in MERGES:
            raise ValueError(f"`merge` must be one of {', '.join(MERGES)}, got {self.merge!r}")
        check_ratio("recent_fraction", self.recent_fraction)
        if not isinstance(self.prefer_text, bool):
            raise ValueError(f"`prefer_text` must be true or false, got {self.prefer_text!r}")

    def plan_call(self, view: BranchView, call: AttentionCall) -> CallPlan:
        """Every prefill call is measured (:meth:`measure`: the rows it sees, scored by its own queries); the branch is
        compressed before its first denoising step or decoded token reads it, i.e. at the end of its prefill.
        Nothing is measured afterwards."""
        if view.branch not in COMPRESSED_BRANCHES:
            return CallPlan()
        if call.phase == "prefill":
            return CallPlan(measure=call.update)
        if view.compressions == 0:
            return CallPlan(compress_before=True)
        return CallPlan()

    def kv_timeline(self, task: Task) -> KVTimeline:
        """Every prefill block is scored as it is prefilled, and every branch is compressed at the end of its prefill
        (:meth:`plan_call`)."""
        return KVTimeline(scored=("prefill",), compressed_before="every")

    def measure(self, probe: CallProbe) -> Measurement:
        """The attention each row receives from the prefill call's queries (an evenly strided subset of at most
        ``score_queries`` of them; every query of a shorter block); the cache sums it over the calls."""
        found = probe.key_scores(self.score_queries, last=False)
        return Measurement(found.scores, found.queries)

    def layer_scores(self, view: BranchView, layer: LayerView) -> Tensor | None:
        scores = layer.scores
        if scores is None or not self.prefer_text:
            return scores
        return text_prior_scores(scores, layer.type_mask(TEXT_TYPES)[: scores.shape[0]])

    def recent_share(self) -> float:
        return self.recent_fraction

    def merge_rule(self) -> str:
        return self.merge


__all__ = ["COMPRESSED_BRANCHES", "LOOKM", "TEXT_TYPES", "text_prior_scores"]
