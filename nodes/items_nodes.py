"""The item nodes: several images and texts, in order, before a task node's own image and prompt (``BAGEL_ITEMS``).

``UniCache BAGEL Image Item`` and ``UniCache BAGEL Text Item`` each add to a chain, as core ComfyUI's reference
latent nodes chain a conditioning: ``Image Item (A) -> Image Edit (items, image B, "put the circle of the first
image into the second")`` is the request ``[A, B, prompt]`` (docs/nodes.md). A task node puts its ``items`` first,
then its own image (each image of its batch on its own, seed + i, as without items) and its prompt. The text item
also outputs its text, so one text can be a task node's prompt and part of a later node's items: iterative editing
is ``Edit 1 (image A, prompt <- text item "p1")`` then ``Edit 2 (items <- [A, "p1"], image <- Edit 1's image, "p2")``,
the official list ``[A, "p1", out1, "p2"]``.

An image item keeps ComfyUI's pixels and, when given, a core ``VAEEncode`` LATENT per image; the task node, which
knows the checkpoint, puts the latent on BAGEL's grid and converts it (:func:`request_items`).
"""

from __future__ import annotations

from dataclasses import dataclass

from unicache_core.bagel.items import ImageItem, TextItem
from unicache_core.bagel.notices import empty_text_warning

from .base import CATEGORY, ITEMS, UniCacheNode, warnings_ui
from .convert import from_comfy_latent, image_to_pils
from .host import io
from .validation import check_source_latent, fit_source_latent

ITEMS_TYPE = ITEMS.io_type


@dataclass(frozen=True, eq=False)
class NodeImage:
    """One image of an image item: RGB pixels and, optionally, the ``[1, C, h, w]`` VAEEncode samples of it."""

    pixels: object
    samples: object = None


@dataclass(frozen=True)
class BagelItems:
    """The ``BAGEL_ITEMS`` value: :class:`NodeImage` and :class:`~unicache_core.bagel.items.TextItem` in order."""

    items: tuple = ()

    def __add__(self, more: tuple) -> BagelItems:
        return BagelItems(self.items + tuple(more))


def check_items(items, name: str = "items") -> BagelItems:
    """``items`` when it comes from an item node (None: empty), else a ValueError naming the input."""
    if items is None:
        return BagelItems()
    if not isinstance(items, BagelItems):
        raise ValueError(f"`{name}` must come from UniCache BAGEL Image Item or Text Item, got {type(items).__name__}")
    return items


def request_items(items: BagelItems, loaded, encode=None) -> list:
    """The engine's items of a chain for the checkpoint ``loaded``: each image item's LATENT checked, put on BAGEL's
    grid and converted (:func:`~.validation.fit_source_latent`); ``encode(pil) -> latent``: an external VAE's encode
    of the images given without one (None: the engine encodes them)."""
    out: list[TextItem | ImageItem] = []
    for index, item in enumerate(items.items):
        if isinstance(item, TextItem):
            out.append(item)
            continue
        latent = None
        if item.samples is not None:
            name = f"items[{index}] latent"
            samples = check_source_latent({"samples": item.samples}, loaded.config.ae.z_channels, name)
            samples, _ = fit_source_latent(samples, loaded.config, name)
            latent = from_comfy_latent(samples, loaded)
        elif encode is not None:
            latent = encode(item.pixels)
        out.append(ImageItem(item.pixels, latent=latent))
    return out


def request_of(prior: list, source, prompt: str, latent=None) -> list:
    """One request of a task node: the chain's items, then its own image (None: none) and its prompt."""
    own = [] if source is None else [ImageItem(source, latent=latent)]
    return [*prior, *own, TextItem(prompt)]


def memory_of(loaded, request, kv=None) -> int:
    """The ``memory_required`` for ComfyUI of a checked request (a
    :class:`~unicache_core.bagel.request_check.CheckedRequest`: its KV at its largest under the KV method ``kv``,
    None: full KV; working memory and, when on, TaylorSeer's factors), from the tokens counted when it was checked:
    :func:`unicache_core.bagel.memory.comfy_placement.memory_required`."""
    from unicache_core.bagel.memory.comfy_placement import memory_required
    from unicache_core.bagel.taylorseer import taylorseer_order

    order = taylorseer_order(request.settings)
    method = "full" if kv is None else kv  # the configured method: its target, policy table and settings
    checkpoint = str(loaded.checkpoint_dir)
    return memory_required(
        loaded.config, loaded.dtype, request.tokens, method, taylor_order=order, checkpoint=checkpoint
    )


def _items_in(tip: str):
    return ITEMS.Input("items", optional=True, tooltip=tip)


class UniCacheImageItem(UniCacheNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="UniCacheImageItem",
            display_name="UniCache BAGEL Image Item",
            category=CATEGORY,
            description="Adds image(s) to a BAGEL item list, after the connected items: a batch of N images adds N "
            "images in batch order. Connect the list to a task node's `items` (several reference images for an "
            "edit, several images to ask about). Optional: a core VAEEncode LATENT of the image(s), one per image, "
            "used instead of encoding them.",
            inputs=[
                io.Image.Input("image", tooltip="The image(s) to add (a batch adds each in order)."),
                _items_in("The items that come before this image."),
                io.Latent.Input(
                    "latent",
                    optional=True,
                    tooltip="Optional core VAEEncode of these images (FLUX VAE), one latent per image: used instead "
                    "of encoding them (any size up to 1024 px per side, rounded down to BAGEL's 16-px grid; the "
                    "image is resized to it for BAGEL's ViT).",
                ),
            ],
            outputs=[
                ITEMS.Output("items_out", display_name="items", tooltip="The items so far, this image (or batch) last.")
            ],
        )

    @classmethod
    def execute(cls, image, items=None, latent=None) -> io.NodeOutput:
        chain = check_items(items)
        pixels = image_to_pils(image, "image")
        samples = [None] * len(pixels)
        if latent is not None:
            batch = latent.get("samples") if isinstance(latent, dict) else None
            shape = tuple(getattr(batch, "shape", ()))  # a samples tensor [B, C, H, W], else no batch
            count = int(shape[0]) if shape else None
            if batch is None or count != len(pixels):
                raise ValueError(
                    f"`latent` holds {count if count is not None else 'no'} latent(s) for {len(pixels)} image(s); "
                    f"encode the same batch with VAEEncode (one latent per image)"
                )
            samples = [batch[i : i + 1] for i in range(count)]
        return io.NodeOutput(chain + tuple(NodeImage(p, s) for p, s in zip(pixels, samples)))


class UniCacheTextItem(UniCacheNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="UniCacheTextItem",
            display_name="UniCache BAGEL Text Item",
            category=CATEGORY,
            description="Adds a text to a BAGEL item list, after the connected items, and outputs the text too "
            "(connect it to a task node's prompt, and the list to a later node's `items`: iterative editing in one "
            "context). An empty text runs, with a warning on the node.",
            inputs=[
                io.String.Input("text", multiline=True, default="", tooltip="The text (a block of its own)."),
                _items_in("The items that come before this text."),
            ],
            outputs=[
                ITEMS.Output("items_out", display_name="items", tooltip="The items so far, this text last."),
                io.String.Output(
                    "text_out", display_name="text", tooltip="The text itself (e.g. for a task node's prompt)."
                ),
            ],
        )

    @classmethod
    def execute(cls, text, items=None) -> io.NodeOutput:
        if not isinstance(text, str):
            raise ValueError(f"`text` must be a STRING, got {type(text).__name__}")
        chain = check_items(items) + (TextItem(text),)
        note = empty_text_warning(text, "this Text Item")
        return io.NodeOutput(chain, text, ui=warnings_ui("Text Item", [note] if note else []))


__all__ = [
    "BagelItems",
    "ITEMS_TYPE",
    "NodeImage",
    "UniCacheImageItem",
    "UniCacheTextItem",
    "check_items",
    "memory_of",
    "request_items",
    "request_of",
]
