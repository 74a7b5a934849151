"""Token counts and RoPE positions of a BAGEL request, from its item list alone (no forward runs).

* RoPE positions of a request's context (:func:`item_positions` for an item list, :func:`understanding_positions`,
  :func:`generation_positions` for one image and a prompt) and the refusal of a request longer than the model's
  positions (:func:`check_positions`, :func:`check_image_positions`, :func:`check_item_positions`: too many images
  names what would fit);
* the tokens each branch's cache holds (:func:`count_items`, :func:`count_request` → :class:`RequestTokens`), their
  KV bytes at the checkpoint's layer geometry (:func:`kv_bytes_per_token`, :meth:`RequestTokens.kv_bytes`).

A request is counted once, when it is checked (:mod:`.request_check`); the memory plan
(:mod:`unicache_core.bagel.memory.accounting`) turns the counts into bytes. Token counts follow the blocks of
:mod:`.contexts`: a text block is its tokens plus ``<|im_start|>`` and ``<|im_end|>``, an image block its tokens plus
two boundary tokens; images take one RoPE position each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..kv.cache import Task
from ..kv.token_types import THINK
from .config import BagelConfig
from .contexts import GEN_THINK_SYSTEM_PROMPT, VLM_THINK_SYSTEM_PROMPT
from .items import GenerateItem, ImageItem, Item, TextItem
from .settings import GenerationSettings, UnderstandingSettings
from .transforms import ImageTransforms

#: Tokens a block adds around its content (``<|im_start|>``/``<|im_end|>``, or an image's start/end).
BOUNDARY_TOKENS = 2


def understanding_positions(
    tokenizer, prompt: str, *, has_image: bool, think: bool, special_tokens: bool = False
) -> int:
    """RoPE positions of an understanding context: ``[system (think)] [ViT image] [prompt]``."""
    used = len(tokenizer.encode(prompt, special_tokens=special_tokens)) + 2 + (1 if has_image else 0)
    if think:
        used += len(tokenizer.encode(VLM_THINK_SYSTEM_PROMPT)) + 2
    return used


def generation_positions(tokenizer, prompt: str, *, has_image: bool, think: bool, special_tokens: bool = False) -> int:
    """RoPE positions of a ``gen`` context: ``[system] [VAE image, ViT image] prompt``, then the latent block."""
    used = len(tokenizer.encode(prompt, special_tokens=special_tokens)) + 2 + (2 if has_image else 0) + 1
    if think:
        used += len(tokenizer.encode(GEN_THINK_SYSTEM_PROMPT)) + 2
    return used


def item_positions(
    tokenizer, items: Sequence[Item], *, generation: bool, think: bool, special_tokens: bool = False
) -> int:
    """RoPE positions of the largest context of an item list (:mod:`.items`): every text its tokens plus two, every
    image one per block (VAE and ViT for a generation, ViT for understanding; a :data:`~.items.GENERATE` marker's
    image as well, for the rounds after it), a generation's latent block one, and the think system prompt."""
    per_image = 2 if generation else 1
    used = 1 if generation else 0
    for item in items:
        if isinstance(item, TextItem):
            used += len(tokenizer.encode(item.text, special_tokens=special_tokens)) + BOUNDARY_TOKENS
        else:
            used += per_image
    if think:
        prompt = GEN_THINK_SYSTEM_PROMPT if generation else VLM_THINK_SYSTEM_PROMPT
        used += len(tokenizer.encode(prompt)) + BOUNDARY_TOKENS
    return used


def check_item_positions(
    config: BagelConfig,
    tokenizer,
    items: Sequence[Item],
    *,
    generation: bool,
    think: bool,
    special_tokens: bool = False,
    extra: int = 0,
    extra_name: str = "max_new_tokens",
    name: str = "items",
) -> None:
    """Refuse (before any forward) an item list needing more RoPE positions than the model has: a one-line
    ValueError naming the count of images, the limit and how many images would fit with these texts; ``extra``
    positions decoded after the context (``extra_name``: the setting to lower); ``name``: what the message calls
    the request (``prompt`` for a single-image call)."""
    used = item_positions(tokenizer, items, generation=generation, think=think, special_tokens=special_tokens)
    images = sum(isinstance(item, (ImageItem, GenerateItem)) for item in items)
    check_image_positions(config, used, images, generation=generation, extra=extra, extra_name=extra_name, name=name)


def check_image_positions(
    config: BagelConfig,
    used: int,
    images: int,
    *,
    generation: bool,
    extra: int = 0,
    extra_name: str = "max_new_tokens",
    name: str = "items",
    lowered: bool = True,
) -> None:
    """:func:`check_item_positions` of a request whose context takes ``used`` RoPE positions with ``images``
    images in it (the run's item list, or the memory plan's ``--image-sizes``: one check for both). The images that
    fit are counted with the ``extra`` decoded positions, so the count it gives is one the run takes; ``lowered``:
    the message may advise lowering ``extra_name`` (the plan has no such flag)."""
    limit = config.llm.max_position_embeddings
    if used + extra > limit and images > 1:
        per_image = 2 if generation else 1
        fit = max(0, (limit - extra - (used - images * per_image)) // per_image)
        decoded = f", + {extra} decoded ({extra_name})" if extra else ""
        raise ValueError(
            f"`{name}` holds {images} images, more than the model's positions allow: the request needs "
            f"{used + extra} RoPE positions ({used} for the context, {per_image} per image{decoded}) but "
            f"max_position_embeddings = {limit}; at most {fit} images fit with these texts"
            + (" and that answer" if extra else "")
            + ": drop images or shorten the texts"
            + (f", or lower `{extra_name}`" if extra and lowered else "")
        )
    check_positions(config, used, 0, name)
    if extra:
        check_positions(config, used, extra, extra_name)


def check_positions(config: BagelConfig, used: int, extra: int, name: str) -> None:
    """Refuse (before any forward) a request needing more RoPE positions than the model was trained on.

    The official code would run past ``max_position_embeddings`` with untrained positions; here it
    is an error. Images take one position each, text one per token.
    """
    limit = config.llm.max_position_embeddings
    if used + extra > limit:
        detail = f"{used} for the context" + (f" + {extra} for decoding" if extra else "")
        raise ValueError(
            f"`{name}` is too long: the request needs {used + extra} RoPE positions ({detail}) but "
            f"max_position_embeddings = {limit}; shorten the {'texts' if name == 'items' else 'prompt'}"
            + (f" or lower `{name}`" if extra else "")
        )


@dataclass(frozen=True)
class RequestTokens:
    """The content tokens of one request's blocks (boundaries not included).

    Attributes:
        task: ``understanding``, ``t2i`` or ``edit``.
        prompt: text tokens (of every text item).
        system: think-mode system prompt tokens (0 without think mode).
        vit: ViT patch tokens of the input images (0 without one).
        vae: latent tokens of a generation's input images (0 otherwise).
        latent: latent tokens denoised (t2i and edit: ``(H/16) * (W/16)`` of the output).
        decoded: most tokens decoded: the answer (understanding) or the think text (generation).
        images: ``(vae, vit)`` tokens of each input image in request order; empty: one image of ``vae``/``vit``
            tokens when either is set (the single-image requests).
        texts: text blocks (each adds its two boundary tokens).
        cfg_text_tail: tokens (boundaries included) at the end of ``gen`` that ``cfg_text`` does not hold: the last
            item when it is a text, 0 when it is an image; None: the one prompt after the images.
    """

    task: Task
    prompt: int
    system: int = 0
    vit: int = 0
    vae: int = 0
    latent: int = 0
    decoded: int = 0
    images: tuple[tuple[int, int], ...] = ()
    texts: int = 1
    cfg_text_tail: int | None = None

    def image_blocks(self) -> tuple[tuple[int, int], ...]:
        """``(vae, vit)`` tokens of every input image, in request order."""
        if self.images:
            return self.images
        return ((self.vae, self.vit),) if self.vae or self.vit else ()

    def branches(self) -> dict[str, int]:
        """Most tokens each branch's cache holds (uncompressed): ``{"gen"}`` for understanding; ``gen``,
        ``cfg_text``, ``cfg_img`` (and ``think`` in think mode: a fork of ``gen`` the reasoning is decoded in)
        for generation. The reasoning is then appended to ``gen`` as a text block."""
        system = self.system + BOUNDARY_TOKENS if self.system else 0
        texts = self.prompt + BOUNDARY_TOKENS * self.texts
        if self.task == "understanding":
            vit = sum(v + BOUNDARY_TOKENS for _, v in self.image_blocks() if v)
            return {"gen": system + vit + texts + self.decoded}
        images = sum(vae + vit + 2 * BOUNDARY_TOKENS for vae, vit in self.image_blocks() if vae)
        tail = self.prompt + BOUNDARY_TOKENS if self.cfg_text_tail is None else self.cfg_text_tail
        gen = system + images + texts
        counts = {"gen": gen, "cfg_text": gen - tail, "cfg_img": system + texts}
        if self.system:
            counts[THINK] = counts["gen"] + self.decoded
            counts["gen"] += self.decoded + BOUNDARY_TOKENS
        return counts

    def largest_image(self) -> tuple[int, int]:
        """``(vae, vit)``: the most tokens of one input image's VAE block and of one ViT block (encoded and
        prefilled one image at a time)."""
        blocks = self.image_blocks()
        return max((vae for vae, _ in blocks), default=0), max((vit for _, vit in blocks), default=0)

    def largest_block(self) -> int:
        """Tokens of the largest single forward: a prefilled block or the latent query block."""
        blocks = [self.prompt, self.system, *self.largest_image(), self.latent]
        return max(blocks) + BOUNDARY_TOKENS

    def kv_bytes(self, config: BagelConfig, dtype: torch.dtype) -> dict[str, int]:
        """Uncompressed KV bytes of each branch (:meth:`branches` x :func:`kv_bytes_per_token`)."""
        per_token = kv_bytes_per_token(config, dtype)
        return {name: tokens * per_token for name, tokens in self.branches().items()}


def kv_bytes_per_token(config: BagelConfig, dtype: torch.dtype) -> int:
    """Bytes one cached token takes over all layers: keys and values of every KV head, in the model dtype."""
    llm = config.llm
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * llm.num_hidden_layers * llm.num_key_value_heads * llm.head_dim * element


def segment_rows(config: BagelConfig) -> int:
    """The most rows one cached segment of this model can hold: its longest text (one RoPE position per token) or
    one image's tokens (the latent position table's ``max_latent_size ** 2``, the ViT's
    ``vit_max_num_patch_per_side ** 2``). A policy table's sizes are bounded by it (32768 for BAGEL-7B-MoT)."""
    return max(config.llm.max_position_embeddings, config.max_latent_size**2, config.vit_max_num_patch_per_side**2)


def image_tokens(
    config: BagelConfig, source_size: tuple[int, int], *, vae_size: tuple[int, int] | None = None
) -> tuple[int, int]:
    """``(vae, vit)`` content tokens of an input image of ``(width, height)`` pixels after the checkpoint's resize
    rules (every input image is resized by the VAE rule first, then the ViT's); ``vae_size``: the size an edit's
    given source latent sets instead of the VAE rule."""
    transforms = ImageTransforms.from_config(config)
    width, height = vae_size if vae_size is not None else transforms.vae.resize.size_for(*source_size)
    vit_width, vit_height = transforms.vit.resize.size_for(width, height)
    step, patch = config.latent_downsample, config.vit.patch_size
    return (width // step) * (height // step), (vit_width // patch) * (vit_height // patch)


def _generation(settings: GenerationSettings | UnderstandingSettings) -> GenerationSettings:
    """``settings`` of a text-to-image or edit request (the caller's task says so; a mismatch is a caller's bug)."""
    if not isinstance(settings, GenerationSettings):
        raise TypeError(f"a generation request takes GenerationSettings, got {type(settings).__name__}")
    return settings


def _understanding(settings: GenerationSettings | UnderstandingSettings) -> UnderstandingSettings:
    """``settings`` of an understanding request."""
    if not isinstance(settings, UnderstandingSettings):
        raise TypeError(f"an understanding request takes UnderstandingSettings, got {type(settings).__name__}")
    return settings


def count_request(
    config: BagelConfig,
    tokenizer,
    task: Task,
    prompt: str,
    settings: GenerationSettings | UnderstandingSettings,
    *,
    source_size: tuple[int, int] | None = None,
    vae_size: tuple[int, int] | None = None,
) -> RequestTokens:
    """The :class:`RequestTokens` of a request (``source_size``: the input image's ``(width, height)``;
    ``vae_size``: an edit's output size set by a given source latent, :func:`image_tokens`)."""
    vae = vit = latent = 0
    if source_size is not None:
        vae, vit = image_tokens(config, source_size, vae_size=vae_size)
    if task == "understanding":
        system_prompt, decoded = VLM_THINK_SYSTEM_PROMPT, _understanding(settings).max_new_tokens
        vae = 0
    else:
        gen = _generation(settings)
        system_prompt, decoded = GEN_THINK_SYSTEM_PROMPT, gen.think_max_new_tokens if gen.think else 0
        step = config.latent_downsample
        latent = vae if task == "edit" else (gen.width // step) * (gen.height // step)
    system = len(tokenizer.encode(system_prompt)) if settings.think else 0
    prompt_tokens = len(tokenizer.encode(prompt, special_tokens=settings.prompt_special_tokens))
    return RequestTokens(
        task=task, prompt=prompt_tokens, system=system, vit=vit, vae=vae, latent=latent, decoded=decoded
    )


def count_items(
    config: BagelConfig,
    tokenizer,
    task: Task,
    items: Sequence[Item],
    settings: GenerationSettings | UnderstandingSettings,
) -> RequestTokens:
    """The :class:`RequestTokens` of an item list (:mod:`.items`) at its largest round: every image at its size
    (an image item with a given latent at the latent's size; a :data:`~.items.GENERATE` marker's image at the output
    size it is generated at), every text, the output (an edit's last image, or the text-to-image size)."""
    generation = task != "understanding"
    images: list[tuple[int, int]] = []
    prompt = texts = tail = 0
    output_size = (_generation(settings).width, _generation(settings).height) if task == "t2i" else None
    last_vae_size = None
    for item in items:
        if isinstance(item, TextItem):
            tokens = len(tokenizer.encode(item.text, special_tokens=settings.prompt_special_tokens))
            prompt, texts, tail = prompt + tokens, texts + 1, tokens + BOUNDARY_TOKENS
            continue
        tail = 0
        if isinstance(item, GenerateItem):  # its image is generated at the size of the one before it
            vae_size = last_vae_size if output_size is None else output_size
            if vae_size is None:  # request_items refuses a list whose first image is a GENERATE marker
                raise ValueError("a GENERATE marker needs an input image before it (or an output size)")
            vae, vit = image_tokens(config, vae_size, vae_size=vae_size)
        else:
            vae_size = _latent_size(config, item.latent) if generation else None
            vae, vit = image_tokens(config, item.image.size, vae_size=vae_size)
            if vae_size is None:
                vae_size = ImageTransforms.from_config(config).vae.resize.size_for(*item.image.size)
        last_vae_size = vae_size
        images.append((vae if generation else 0, vit))
    step = config.latent_downsample
    if task == "understanding":
        system_prompt, decoded, latent = VLM_THINK_SYSTEM_PROMPT, _understanding(settings).max_new_tokens, 0
    else:
        gen = _generation(settings)
        system_prompt, decoded = GEN_THINK_SYSTEM_PROMPT, gen.think_max_new_tokens if gen.think else 0
        width, height = output_size if output_size is not None else last_vae_size or (0, 0)
        latent = (width // step) * (height // step)
    return RequestTokens(
        task=task,
        prompt=prompt,
        system=len(tokenizer.encode(system_prompt)) if settings.think else 0,
        vit=sum(vit for _, vit in images),
        vae=sum(vae for vae, _ in images),
        latent=latent,
        decoded=decoded,
        images=tuple(images),
        texts=texts,
        cfg_text_tail=tail,
    )


def _latent_size(config: BagelConfig, latent) -> tuple[int, int] | None:
    """The pixel size a given source latent ``[1, C, H/8, W/8]`` sets (None without one)."""
    if getattr(latent, "ndim", None) != 4:  # None, or a malformed latent that check_given refuses before any forward
        return None
    return latent.shape[3] * config.ae.downsample, latent.shape[2] * config.ae.downsample


__all__ = [
    "BOUNDARY_TOKENS",
    "RequestTokens",
    "check_image_positions",
    "check_item_positions",
    "check_positions",
    "count_items",
    "count_request",
    "generation_positions",
    "image_tokens",
    "item_positions",
    "kv_bytes_per_token",
    "segment_rows",
    "understanding_positions",
]
