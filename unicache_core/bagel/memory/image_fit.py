"""How many of a request's input images fit, and what to do when they do not (the plan's suggestion for several
images: :func:`~.plan.plan_memory`, the CLI's refusal of a run that does not fit).

The functions take the plan's predictor (``predict(settings) -> fits``) rather than importing the plan, so the plan
can call them. The images kept are the last ones: an edit edits its last image, the earlier ones are references.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

#: The plan's predictor of a trial's settings (a :class:`~.plan.PlanSettings`, not imported: the plan imports
#: this module).
Fits = Callable[[Any], bool]


def fitting_images(settings, fits: Fits) -> int:
    """The most of ``settings.images`` (a :class:`~.plan.PlanSettings`) whose last ones ``fits``; 0 when not
    even the last one does."""
    images = settings.images
    low, high = 0, len(images) + 1  # the last `low` fit; the last `high` do not (or there are not that many)
    while high - low > 1:
        middle = (low + high) // 2
        if fits(replace(settings, images=images[-middle:])):
            low = middle
        else:
            high = middle
    return low


def suggest_fewer_images(
    settings, device_bytes: int, fits: Fits, weights: Sequence[str], one_image: Callable[[Any], str]
) -> str:
    """What to do when a request of several input images does not fit ``device_bytes``: how many of them fit with
    these settings, or the first of ``weights`` x offload that fits them all; ``one_image(settings)``: the plan's
    suggestion for the last image alone (when not even it fits)."""
    count = len(settings.images)
    fit = fitting_images(settings, fits)
    head = f"{count} input images need more than {device_bytes / 1e9:.1f} GB; " + (
        f"at most {fit} of them fit with these settings (keep the last {fit})"
        if fit
        else "not even the last one fits with these settings"
    )
    for offload in ("none", "layers"):
        for weight_dtype in weights:
            trial = replace(settings, weight_dtype=weight_dtype, offload=offload)
            if trial != settings and fits(trial):
                if not fit:  # the weights, not the images, are what does not fit: blame them
                    stored = settings.dtype if settings.weight_dtype == "auto" else settings.weight_dtype
                    where = "on the device" if settings.offload == "none" else f"with --offload {settings.offload}"
                    return (
                        f"the {stored} weights {where} do not fit {device_bytes / 1e9:.1f} GB even with one input "
                        f"image: use --weight-dtype {weight_dtype} --offload {offload} (then all {count} fit)"
                    )
                return f"{head}; or, for all {count}, use --weight-dtype {weight_dtype} --offload {offload}"
    return head if fit else f"{head}; for one image: {one_image(replace(settings, images=settings.images[-1:]))}"


__all__ = ["fitting_images", "suggest_fewer_images"]
