"""What a calibration run is set with: the task names of the command line, the run options, the
sensitivity ratios and the model dtypes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...compression.defaults import DEFAULT_K90_THRESHOLD, DEFAULT_REDUCTION, SCORE_QUERIES
from ...kv.token_types import Task

#: ``--task`` value → pipeline task name.
TASK_NAMES: dict[str, Task] = {"und": "understanding", "t2i": "t2i", "edit": "edit"}
#: Target retention of the sensitivity ablation (docs/compression.md §8.9: 80% reduction und/edit, 60% t2i).
SENSITIVITY_RATIO = {task: round(1.0 - reduction, 6) for task, reduction in DEFAULT_REDUCTION.items()}
#: ``--dtype`` value → LLM/ViT dtype of the loaded model (the VAE stays fp32).
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class CalibrationOptions:
    """How every calibration request of one task runs and how its records become a table.

    Attributes:
        num_timesteps: ``num_timesteps`` of t2i / edit (``num_timesteps - 1`` denoising steps), as in
            ``python -m unicache_core.bagel``.
        max_new_tokens: most decoded tokens per understanding prompt.
        size: t2i output side and synthetic input image width in px (a multiple of 16).
        seed: noise seed of every run.
        sensitivity: also run each candidate type evicted vs quantized alone (:mod:`.sensitivity`).
        grid: also measure each candidate type's (rows kept, bits) grid at matched bytes and make it a
            ``joint`` entry with the calibrated bits per budget level (:mod:`.grid`).
        score_queries: queries scored per cache read by the observe-only method.
        threshold: K90 at or under which a type is evicted, above which it is quantized.
    """

    num_timesteps: int = 50
    max_new_tokens: int = 64
    size: int = 512
    seed: int = 0
    sensitivity: bool = False
    grid: bool = False
    score_queries: int = SCORE_QUERIES
    threshold: float = DEFAULT_K90_THRESHOLD


__all__ = ["DTYPES", "SENSITIVITY_RATIO", "TASK_NAMES", "CalibrationOptions"]
