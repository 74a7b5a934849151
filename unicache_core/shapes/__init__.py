"""The synthetic "shapes" world the bundled model is trained on, and its exact analyser (docs/shapes.md)."""

from .analyse import analyse, judge_t2i, psnr, scenes_match, unchanged_mask
from .world import (
    Edit,
    Question,
    Scene,
    Shape,
    edit_sample,
    eval_seeds,
    random_scene,
    t2i_sample,
    understanding_sample,
)

__all__ = [
    "Edit",
    "Question",
    "Scene",
    "Shape",
    "analyse",
    "edit_sample",
    "eval_seeds",
    "judge_t2i",
    "psnr",
    "random_scene",
    "scenes_match",
    "t2i_sample",
    "understanding_sample",
    "unchanged_mask",
]
