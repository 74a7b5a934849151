"""The request's item list: texts and images in order, as the official ``interleave_inference`` takes them.

A BAGEL request is an ordered list of items (docs/bagel.md §5.1, docs/architecture.md "The request's item
list"): :class:`TextItem` (a text block), :class:`ImageItem` (an input image, with an optional given source
latent for generation) and, in a generation, :data:`GENERATE` (:class:`GenerateItem`: generate an image at this
point from everything before it, then go on with that image as an image item: iterative editing). Plain
``str`` and ``PIL.Image.Image`` elements are accepted as text and image items, as the official list takes them.

:func:`request_items` checks a list once, before anything runs, and names every mistake on one line
(``items[2] ...``, 0-based as the list is written); :func:`rounds` splits a generation's list at its
:data:`GENERATE` markers. Today's single-image calls are the lists ``[image, prompt]`` and ``[prompt]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image
from torch import Tensor

#: Smallest accepted side of an input image, in pixels: a one-pixel side holds no picture (BAGEL's resize rule
#: would stretch it to hundreds of pixels); such an image is nearly always a placeholder passed by mistake.
MIN_IMAGE_SIDE = 2


@dataclass(frozen=True)
class TextItem:
    """A text block: ``<|im_start|> text <|im_end|>`` in ``gen`` and ``cfg_img`` (docs/bagel.md §5.1)."""

    text: str


@dataclass(frozen=True, eq=False)
class ImageItem:
    """An input image: VAE block then ViT block in ``gen`` for generation, ViT block only for understanding.

    Attributes:
        image: the picture (any PIL mode; converted to RGB and resized by the checkpoint's VAE rule).
        latent: generation only: its source latent ``[1, 16, H/8, W/8]`` in BAGEL's convention (e.g.
            :func:`~.latents.from_comfy_latent` of ComfyUI's ``VAEEncode``), used instead of encoding ``image``;
            any size on BAGEL's grid: the image's block follows it and the ViT sees ``image`` resized to it.
        vae_noise: generation only: ``[1, 16, H/8, W/8]`` sampling noise of the built-in VAE's encode of ``image``
            (else drawn from the request's seeded generator, in item order).
    """

    image: Image.Image
    latent: Tensor | None = None
    vae_noise: Tensor | None = None


@dataclass(frozen=True)
class GenerateItem:
    """Generate an image here from everything before it, then continue with it as an image item (generation only).

    The list ``[img, "edit 1", GENERATE, "edit 2"]`` edits ``img``, then edits the result in the same request.
    """


#: The one :class:`GenerateItem` (iterative editing: ``[img, "edit 1", GENERATE, "edit 2"]``).
GENERATE = GenerateItem()

Item = TextItem | ImageItem | GenerateItem


def _where(index: int) -> str:
    return f"`items[{index}]`"


def _check_text(index: int, text: str) -> TextItem:
    if not isinstance(text, str):
        raise ValueError(f"{_where(index)} is a text item whose text is a {type(text).__name__}; give a str")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{_where(index)} is not valid Unicode text: {text[exc.start : exc.end]!r} at index {exc.start} is a "
            f"lone surrogate (an undecodable byte); pass UTF-8 text"
        ) from None
    return TextItem(text)


def check_image_item(index: int, image: object, *, name: str | None = None) -> Image.Image:
    """``image`` when it is a PIL image with both sides >= :data:`MIN_IMAGE_SIDE`, else a one-line ValueError
    naming the item (or ``name``)."""
    where = _where(index) if name is None else f"`{name}`"
    if not isinstance(image, Image.Image):
        raise ValueError(f"{where} must be a PIL.Image.Image, got {type(image).__name__}")
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ValueError(f"{where} has zero size ({width}x{height}); a non-empty image is required")
    if min(width, height) < MIN_IMAGE_SIDE:
        raise ValueError(
            f"{where} is {width}x{height} px: a one-pixel side holds no picture (BAGEL would stretch it to hundreds "
            f"of pixels); pass the real image (at least {MIN_IMAGE_SIDE} px per side)"
        )
    return image


def _as_item(index: int, value: object, generation: bool) -> Item:
    if isinstance(value, GenerateItem):
        if not generation:
            raise ValueError(
                f"{_where(index)} is a GENERATE marker, but an understanding request only answers at its end; "
                f"remove it (markers belong to text-to-image and edit requests)"
            )
        return value
    if isinstance(value, TextItem):
        return _check_text(index, value.text)
    if isinstance(value, str):
        return _check_text(index, value)
    if isinstance(value, ImageItem):
        check_image_item(index, value.image)
        if not generation and (value.latent is not None or value.vae_noise is not None):
            raise ValueError(
                f"{_where(index)} carries a source latent or VAE noise, which only a generation uses (an "
                f"understanding request sees images through the ViT alone); leave them None"
            )
        return value
    if isinstance(value, Image.Image):
        return ImageItem(check_image_item(index, value))
    raise ValueError(
        f"{_where(index)} must be a text (str or TextItem), an image (PIL.Image.Image or ImageItem)"
        + (" or GENERATE" if generation else "")
        + f", got {type(value).__name__}"
    )


def request_items(items: object, *, generation: bool) -> tuple[Item, ...]:
    """The checked item list of a request (``generation``: text-to-image or edit, else understanding).

    Refused, each with one line: a list that is not a list, is empty or holds no text; an element that is not a
    text, an image or (generation) :data:`GENERATE`; an image of zero size or with a one-pixel side; a text that
    is not valid Unicode; a generation (a marker or the request's end) with no text since the previous one.
    """
    if isinstance(items, (str, bytes, Image.Image)) or not isinstance(items, Sequence):
        raise ValueError(
            f"`items` must be a list of texts and images in request order (e.g. [image, 'what is in it?']), "
            f"got {type(items).__name__}"
        )
    if len(items) == 0:
        raise ValueError("`items` is empty: give at least one text (the prompt), e.g. [image, 'what is in it?']")
    checked = tuple(_as_item(i, value, generation) for i, value in enumerate(items))
    if not any(isinstance(item, TextItem) for item in checked):
        raise ValueError(
            f"`items` holds {len(checked)} item(s) but no text: BAGEL needs an instruction or a question; add one "
            f"after the images (e.g. [image, 'what is in it?'])"
        )
    last_generation = -1
    for i, item in enumerate((*checked, GENERATE)):
        if isinstance(item, GenerateItem):
            if not any(isinstance(other, TextItem) for other in checked[last_generation + 1 : i]):
                what = f"{_where(i)} (GENERATE)" if i < len(checked) else "the request's final image"
                raise ValueError(
                    f"{what} would be generated with no text since "
                    + ("the start" if last_generation < 0 else f"the GENERATE at items[{last_generation}]")
                    + ": give each generation its instruction first"
                    + (" (the request generates at its end anyway: drop a final GENERATE)" if i == len(checked) else "")
                )
            last_generation = i
    return checked


def rounds(items: Sequence[Item]) -> list[tuple[Item, ...]]:
    """The items between :data:`GENERATE` markers: ``[a, "e1", GENERATE, "e2"]`` → ``[(a, "e1"), ("e2",)]``; each
    generation's context is every earlier part plus the images generated between them."""
    parts: list[list[Item]] = [[]]
    for item in items:
        if isinstance(item, GenerateItem):
            parts.append([])
        else:
            parts[-1].append(item)
    return [tuple(part) for part in parts]


def image_items(items: Sequence[Item]) -> list[ImageItem]:
    """The image items of ``items`` in request order (the input images, numbered 0, 1, ... by it)."""
    return [item for item in items if isinstance(item, ImageItem)]


def single_request(prompt: str, image: Image.Image | None = None, *, latent=None, vae_noise=None) -> tuple[Item, ...]:
    """The list of today's single-image calls: ``[image, prompt]`` (or ``[prompt]``)."""
    if image is None:
        return (TextItem(prompt),)
    return ImageItem(image, latent=latent, vae_noise=vae_noise), TextItem(prompt)


__all__ = [
    "GENERATE",
    "GenerateItem",
    "ImageItem",
    "Item",
    "MIN_IMAGE_SIDE",
    "TextItem",
    "check_image_item",
    "image_items",
    "request_items",
    "rounds",
    "single_request",
]
