"""Warnings about a request that runs but may not do what its author meant: one line each, for the ComfyUI nodes
(shown on the node and logged) and any other caller.

:func:`request_warnings` looks at a checked item list (:mod:`.items`) before it runs: an empty text (an empty
prompt, an empty Text Item), an edit with no image, several input images that the checkpoint's size rule resizes
(from which size to which), and more images than the checkpoint was trained on when its ``training.json`` says so
(:func:`trained_images`). Nothing here refuses a request; the refusals are :mod:`.items`' and the settings'.
"""

from __future__ import annotations

import json
from pathlib import Path

from .items import ImageItem, TextItem
from .transforms import ImageTransforms

#: The key of a checkpoint's ``training.json`` that records how many input images one training request held.
TRAINED_IMAGES_KEY = "images_per_request"

#: A resize that changes an image's width/height ratio by more than this share stretches it.
STRETCH = 0.1

_TASK_WORDS = {"t2i": "draws", "edit": "edits", "understanding": "answers"}


def trained_images(checkpoint: str | Path | None) -> int | None:
    """The input images per request the checkpoint was trained on, from its folder's ``training.json``
    (:data:`TRAINED_IMAGES_KEY`); None when the checkpoint does not say (the official BAGEL-7B-MoT has no such
    file) or the file is unreadable."""
    if checkpoint is None:
        return None
    record = Path(checkpoint) / "training.json"
    try:
        value = json.loads(record.read_text(encoding="utf-8")).get(TRAINED_IMAGES_KEY)
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def empty_text_warning(text: str, where: str) -> str | None:
    """The line for an empty (or blank) text item, ``where`` naming it (e.g. ``"this Text Item"``); None when the
    text has words."""
    if text.strip():
        return None
    return f"{where} is empty: it adds only its block markers to the request; type its text or remove it"


def _size(size: tuple[int, int]) -> str:
    return f"{size[0]}x{size[1]}"


def _aspect(size: tuple[int, int]) -> float:
    return size[0] / max(1, size[1])


def _image_sizes(items: list, config) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """``(given size, size the model sees)`` of each image item: the checkpoint's VAE resize rule, or the pixel size
    of the item's given latent ``[1, C, h, w]``."""
    rule = ImageTransforms.from_config(config).vae.resize
    out = []
    for item in items:
        if not isinstance(item, ImageItem):
            continue
        given = item.image.size
        if item.latent is not None:
            cell = config.ae.downsample
            out.append((given, (int(item.latent.shape[-1]) * cell, int(item.latent.shape[-2]) * cell)))
        else:
            out.append((given, rule.size_for(*given)))
    return out


#: Where an empty prompt comes from, ending its warning: in ComfyUI (the command line names its own flags).
NODE_PROMPT_HINT = "an empty Text Item connected to the prompt gives this too"


def request_warnings(
    task: str, items: list, config, *, trained: int | None = None, prompt_hint: str = NODE_PROMPT_HINT
) -> list[str]:
    """One line per thing worth a warning in the checked request ``items`` of ``task`` (``t2i``, ``edit``,
    ``understanding``) for a model of ``config``; the last text item is the prompt. ``trained``: the images per
    request the checkpoint was trained on (:func:`trained_images`; None: not known, no warning about it);
    ``prompt_hint``: where an empty prompt may come from, for the front end that shows the warnings."""
    lines = []
    last = max((i for i, item in enumerate(items) if isinstance(item, TextItem)), default=None)
    for index, item in enumerate(items):
        if isinstance(item, TextItem) and not item.text.strip():
            if index == last:
                lines.append(
                    f"the prompt is empty: BAGEL {_TASK_WORDS.get(task, 'runs')} from the other items alone; "
                    f"type an instruction ({prompt_hint})"
                )
            else:
                lines.append(str(empty_text_warning(item.text, f"items[{index}] (a text item)")))
    sizes = _image_sizes(items, config)
    if task == "edit" and not sizes:
        lines.append("an edit with no image: connect the image to edit (or an Image Item) first")
    resized = [(given, seen) for given, seen in sizes if given != seen]
    if len(sizes) > 1 and resized:
        pairs = ", ".join(f"{_size(given)} -> {_size(seen)}" for given, seen in sizes)
        stretched = [pair for pair in resized if abs(_aspect(pair[1]) / _aspect(pair[0]) - 1) > STRETCH]
        advice = (
            "; some lose their proportions: crop them to the shape you want first"
            if stretched
            else " (the rule keeps each image's proportions, to its 16-px grid)"
        )
        lines.append(
            f"the {len(sizes)} input images are resized by the checkpoint's image size rule before BAGEL sees them "
            f"({pairs}){advice}"
        )
    if trained is not None and len(sizes) > trained:
        lines.append(
            f"{len(sizes)} images in one request, but this checkpoint was trained on {trained} per request "
            f"(its training.json): it runs, expect weaker results than with {trained}"
        )
    return lines


__all__ = ["NODE_PROMPT_HINT", "TRAINED_IMAGES_KEY", "empty_text_warning", "request_warnings", "trained_images"]
