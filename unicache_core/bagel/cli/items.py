"""The command line's item list: ``--image`` given several times, or ``--items FILE.json`` (:mod:`.items_file`).

``understand``, ``t2i`` and ``edit`` take ``--image`` repeatedly: the request is the images in the given order, then
the prompt (``[a, b, prompt]``). One ``--image`` on ``understand`` or ``edit`` is today's single-image request;
anything else becomes an item list for :meth:`~.pipeline.BagelPipeline.generate` or
:meth:`~.pipeline.BagelPipeline.understand_items`. ``--items`` gives any interleaved list instead of ``--prompt``
and ``--image``. Everything here runs before the weights load; a mistake is one line naming the flag.
"""

from __future__ import annotations

import dataclasses
import logging

from PIL import Image

from ...kv.token_types import Task
from ..items import ImageItem, Item, TextItem, request_items
from ..request_check import CheckedRequest, check_request
from .checks import Checked, open_image, preflight, require_prompt
from .files import check_command_outputs, round_paths
from .items_file import open_items

logger = logging.getLogger("unicache_core.bagel.cli")


def is_item_request(args) -> bool:
    """Is the command line an item list: ``--items``, several ``--image``, or ``t2i`` with reference images?"""
    paths = getattr(args, "image", None) or []
    return getattr(args, "items", None) is not None or len(paths) > 1 or (args.command == "t2i" and bool(paths))


def preflight_request(args) -> Checked:
    """:func:`~.checks.preflight` of any command line, an item list's images, texts, positions and round outputs
    included: every check before the weights load. Every output is first checked against every input, the
    checkpoint and each other (:func:`~.files.check_command_outputs`). What runs but may not do what was meant (an
    empty prompt, images resized, ...) is logged as a warning, the notices the nodes show (:func:`warn_request`)."""
    check_command_outputs(args)
    if not is_item_request(args):
        checked = preflight(args)
        warn_request(args, [*([checked.image] if checked.image is not None else []), TextItem(checked.prompt or "")])
        return checked
    from ..config import load_bagel_config
    from ..tokenizer import BagelTokenizer

    checked = preflight(args, items=True)  # every other argument first
    image, items, paths = request_images(args, checked.prompt)
    request = check_item_request(
        load_bagel_config(args.checkpoint), BagelTokenizer.from_dir(args.checkpoint), items, checked.settings, args
    )
    out = getattr(args, "out", None)
    rounds_out = tuple(round_paths(out, items)) if out is not None else ()  # checked with every output by preflight
    warn_request(args, list(request.items))
    return dataclasses.replace(checked, image=image, items=request.items, request=request, rounds_out=rounds_out)


#: Where an empty prompt comes from on the command line (the end of its warning).
CLI_PROMPT_HINT = "a blank --prompt, an empty --prompt-file or an items file's empty last text gives this too"


def warn_request(args, items: list) -> None:
    """Log :func:`~..notices.request_warnings` of the command's request (``items``: images as PIL images or image
    items, and texts), one warning line each: the same notices the nodes show."""
    from ..config import load_bagel_config
    from ..notices import request_warnings, trained_images

    task = "understanding" if args.command == "understand" else args.command
    listed = [ImageItem(item) if isinstance(item, Image.Image) else item for item in items]
    config = load_bagel_config(args.checkpoint)
    lines = request_warnings(task, listed, config, trained=trained_images(args.checkpoint), prompt_hint=CLI_PROMPT_HINT)
    for line in lines:
        logger.warning("%s", line)


def request_images(args, prompt: str | None):
    """``(image, items, image_paths)`` of a parsed ``understand``/``t2i``/``edit`` command line: the one image of a
    single-image request (``items`` None), or the request's checked item list (``image`` its last image)."""
    task = args.command
    paths = list(getattr(args, "image", None) or [])
    items_file = getattr(args, "items", None)
    if items_file is not None:
        if paths:
            raise ValueError(
                f'--image: with --items {items_file}, give the images inside the items file ({{"image": PATH}})'
            )
        items, paths = open_items(items_file, generation=task != "understand")
    else:
        images = [open_image(path) for path in paths]
        if task == "edit" and not images:
            raise ValueError("--image: an edit needs its source image: give --image FILE (or --items FILE.json)")
        if len(images) <= 1 and task != "t2i":
            return (images[0] if images else None), None, paths
        if not images:
            return None, None, paths
        items = request_items([*images, TextItem(require_prompt(prompt))], generation=task != "understand")
    if task == "edit" and not any(isinstance(item, ImageItem) for item in items):
        raise ValueError(f"--items {items_file}: an edit needs an image item before its first text")
    last = [item.image for item in items if isinstance(item, ImageItem)]
    return (last[-1] if last else None), items, paths


def check_item_request(config, tokenizer, items: tuple[Item, ...], settings, args) -> CheckedRequest:
    """The item list checked and counted once for the checkpoint (:func:`~..request_check.check_request`): its RoPE
    positions against the model's (too many images names what fits), the error naming ``--items`` or ``--image``."""
    task: Task = "understanding" if args.command == "understand" else args.command
    flag = f"--items {args.items}" if getattr(args, "items", None) is not None else "--image"
    try:
        return check_request(config, tokenizer, task, items, settings)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None


__all__ = [
    "CLI_PROMPT_HINT",
    "check_item_request",
    "is_item_request",
    "preflight_request",
    "request_images",
    "warn_request",
]
