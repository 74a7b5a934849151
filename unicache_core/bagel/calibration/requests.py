"""One calibration request: a prompt (and its image) through the pipeline with the task's official preset."""

from __future__ import annotations

from ..settings import preset
from .options import CalibrationOptions


def run_request(pipe, task: str, prompt: str, image, options: CalibrationOptions):
    """Run ``prompt`` as ``task`` on ``pipe`` (a :class:`~unicache_core.bagel.BagelPipeline`).

    t2i makes a ``options.size`` px square image and edit edits ``image``, both with
    ``options.num_timesteps``; understanding answers about ``image`` with at most ``options.max_new_tokens``
    tokens. Every run uses ``options.seed``. Returns the pipeline's result.
    """
    if task == "t2i":
        settings = preset("t2i", width=options.size, height=options.size, num_timesteps=options.num_timesteps)
        return pipe.text_to_image(prompt, settings, seed=options.seed)
    if task == "edit":
        return pipe.edit(prompt, image, preset("edit", num_timesteps=options.num_timesteps), seed=options.seed)
    return pipe.understand(
        prompt, image, preset("understanding", max_new_tokens=options.max_new_tokens), seed=options.seed
    )


__all__ = ["run_request"]
