"""One mechanism for every request: its item list becomes BAGEL's contexts as ``interleave_inference`` builds them.

The official rules (docs/bagel.md §5.1), applied to a list of :class:`~.items.TextItem` and
:class:`~.items.ImageItem` (a generation's :data:`~.items.GENERATE` markers are split off first, :mod:`.generation`):

* think mode: the system prompt first, in ``gen`` (and ``cfg_img`` for a generation);
* a text: ``cfg_text`` becomes a copy of ``gen``, then the text goes to ``gen`` and ``cfg_img``;
* an image: to ``gen`` only, its VAE block then its ViT block for a generation, the ViT block only for
  understanding; it sets the output size (unless the request gives one: text-to-image); then ``cfg_text`` becomes a
  copy of ``gen``. Each block takes one RoPE position; the blocks of image ``k`` (0-based in request order) carry
  ``index=k`` (:attr:`~unicache_core.kv.cache.AttentionCall.image`).

Every copy but the last is replaced before anything reads it (each item makes one), so only the last item's copy is
taken: before the last item when it is a text, after it when it is an image. ``cfg_text`` thus holds ``gen`` without
a final text: for ``[img_a, img_b, "put the cat of the first into the second"]`` ``gen`` = A B text, ``cfg_text`` =
A B, ``cfg_img`` = text. The copy is :meth:`~unicache_core.kv.cache.CacheSession.fork`, which shares the parent's
tensors (no copy of the KV); skipping the discarded copies also keeps the caches from holding an earlier image's rows
twice while the next image is appended. Understanding builds ``gen`` alone (its answer reads nothing else).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..kv.cache import CacheSession
from .checkpoint.loader import LoadedBagel
from .contexts import (
    GEN_THINK_SYSTEM_PROMPT,
    VLM_THINK_SYSTEM_PROMPT,
    Context,
    GenerationContexts,
    append_text,
    append_vae,
    append_vit,
    new_context,
)
from .items import ImageItem, Item, TextItem
from .source_images import PreparedImage
from .transforms import ImageTransforms


def build_understanding_context(
    loaded: LoadedBagel,
    session: CacheSession,
    items: Sequence[Item],
    prepared: Mapping[ImageItem, PreparedImage],
    *,
    think: bool = False,
    special_tokens: bool = False,
) -> Context:
    """``[system (think)]`` then every item in order, images as ViT blocks, in one ``gen`` context (docs/bagel.md
    §4.6); ``prepared``: each image item made ready (:func:`~.source_images.prepare_image`); ``special_tokens``: the
    texts' control-token strings are parsed (:meth:`~.tokenizer.BagelTokenizer.encode`)."""
    vit = ImageTransforms.from_config(loaded.config).vit
    ctx = new_context(session, "gen")
    if think:
        append_text(loaded, ctx, VLM_THINK_SYSTEM_PROMPT)
    index = 0
    for position, item in enumerate(items):
        if isinstance(item, TextItem):
            append_text(loaded, ctx, item.text, special_tokens=special_tokens)
        else:
            append_vit(loaded, ctx, vit(_prepared(prepared, position, item).picture), index=index)
            index += 1
    return ctx


def _prepared(prepared: Mapping[ImageItem, PreparedImage], position: int, item: Item) -> PreparedImage:
    """The prepared image of ``items[position]``, an image item (a ValueError for a :data:`~.items.GENERATE`
    marker: :mod:`.generation` splits the request at them before any context is built)."""
    if not isinstance(item, ImageItem):
        raise ValueError(f"item {position}: a GENERATE marker cannot enter a context; split the request at it first")
    return prepared[item]


def build_generation_contexts(
    loaded: LoadedBagel,
    session: CacheSession,
    items: Sequence[Item],
    prepared: Mapping[ImageItem, PreparedImage],
    *,
    size: tuple[int, int] | None = None,
    think: bool = False,
    special_tokens: bool = False,
) -> GenerationContexts:
    """``gen``, ``cfg_text`` and ``cfg_img`` of a generation's items (module docstring).

    ``prepared``: each image item with its source latent (:func:`~.source_images.prepare_image`); ``size``: the
    output ``(width, height)`` (text-to-image), or None for the last image's (an edit).
    """
    vit = ImageTransforms.from_config(loaded.config).vit
    gen = new_context(session, "gen")
    cfg_img = new_context(session, "cfg_img")
    if think:
        append_text(loaded, gen, GEN_THINK_SYSTEM_PROMPT)
        append_text(loaded, cfg_img, GEN_THINK_SYSTEM_PROMPT)
    cfg_text = None
    output_size = size
    hows: list[str] = []
    last = len(items) - 1
    for position, item in enumerate(items):
        if isinstance(item, TextItem):
            if position == last:  # the official deepcopy(gen) before a text
                cfg_text = Context(session.fork(gen.cache, "cfg_text"), gen.rope)
            append_text(loaded, gen, item.text, special_tokens=special_tokens)
            append_text(loaded, cfg_img, item.text, special_tokens=special_tokens)
            continue
        image = _prepared(prepared, position, item)
        if image.latent is None or image.how is None:
            raise ValueError(
                f"item {position}: the image was prepared for understanding, without a source latent; "
                "prepare it with generation=True"
            )
        append_vae(loaded, gen, image.latent, *image.grid, index=len(hows))
        append_vit(loaded, gen, vit(image.picture), index=len(hows))
        hows.append(image.how)
        if size is None:
            output_size = (image.width, image.height)
        if position == last:  # the official deepcopy(gen) after an image
            cfg_text = Context(session.fork(gen.cache, "cfg_text"), gen.rope)
    if cfg_text is None:  # no items: the official cfg_text is the empty context it starts from
        cfg_text = new_context(session, "cfg_text")
    if output_size is None:
        raise ValueError("a generation needs an output size: give one, or an image item whose size it takes")
    width, height = output_size
    return GenerationContexts(
        gen=gen,
        cfg_text=cfg_text,
        cfg_img=cfg_img,
        height=height,
        width=width,
        session=session,
        source_latent=hows[-1] if hows else None,
        source_latents=tuple(hows),
    )


__all__ = ["build_generation_contexts", "build_understanding_context"]
