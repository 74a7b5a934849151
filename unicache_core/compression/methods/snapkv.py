"""SnapKV (https://arxiv.org/abs/2404.14469): the attention of an observation window of the last queries."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...validation import check_int
from ..defaults import SNAPKV_KERNEL, WINDOW
from ..protocol import Measurement
from ..scoring import CallProbe
from ..view import BranchView, LayerView
from .eviction import GlobalEviction


@dataclass(frozen=True, kw_only=True)
class SnapKV(GlobalEviction):
    """Scores rows by the attention of the last ``window`` queries of the observed call, average-pooled along the
    keys; the selection is frozen afterwards. As in the paper, the window is the end of the prompt: the question
    (understanding) or the instruction prefilled after the input images (generation, ``measures_prompt``: the
    branch is compressed before its first denoising step reads it), and its own rows are always kept (they are in
    the key set). A branch with no prompt after images (text-to-image; ``cfg_text``, a copy of ``gen`` taken before
    the instruction; ``cfg_img``, which holds no image) is measured on its first denoising step's last latent
    queries and compressed after it (docs/compression.md §8.10, §12.2); latents are not in the key set.

    Attributes:
        window: the observation window (queries), 64 (kvpress).
        kernel: width of the average pooling of the scores, 5.
    """

    name = "snapkv"
    measures_prompt = True
    window: int = WINDOW
    kernel: int = SNAPKV_KERNEL

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("window", self.window, 1)
        check_int("kernel", self.kernel, 1)

    def measure(self, probe: CallProbe) -> Measurement:
        """The attention of the observation window: the call's last ``window`` queries."""
        found = probe.key_scores(self.window, last=True)
        return Measurement(found.scores, found.queries)

    def smooth_kernel(self) -> int:
        return self.kernel

    def layer_scores(self, view: BranchView, layer: LayerView) -> Tensor | None:
        return layer.last_scores

    def forced_rows(self, view: BranchView, layer: LayerView) -> Tensor | None:
        if view.task != "understanding" and view.measured_phase != "prefill":
            return None  # the window was denoising latents: not in the key set
        forced = torch.zeros(layer.appended, dtype=torch.bool)
        forced[max(0, layer.appended - self.window) :] = True
        return forced


__all__ = ["SnapKV"]
