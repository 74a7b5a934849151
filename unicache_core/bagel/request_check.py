"""A request checked and tokenised once: :class:`CheckedRequest`, which the node, the memory plan and the engine share.

:func:`check_request` checks an item list (:func:`~.items.request_items`), counts its tokens once
(:func:`~.tokens.count_items`) and refuses, before any forward, a request longer than the model's RoPE positions
(counted from those same tokens); :func:`check_single` does the same for the single-image calls ``[image, prompt]``
and ``[prompt]``, whose messages name ``prompt`` and ``image``. The ComfyUI node makes one per request, asks the memory
plan for its bytes (:func:`unicache_core.bagel.memory.comfy_placement.memory_required` of
:attr:`CheckedRequest.tokens`) and runs that same record (:meth:`~.pipeline.BagelPipeline.generate_request`,
:meth:`~.pipeline.BagelPipeline.understand_request`); the pipeline's public calls make one and run it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image

from ..kv.cache import Task
from .config import BagelConfig
from .items import Item, check_image_item, request_items, single_request
from .settings import GenerationSettings, UnderstandingSettings, check_output_size, check_prompt
from .tokens import BOUNDARY_TOKENS, RequestTokens, check_image_positions, count_items


@dataclass(frozen=True)
class CheckedRequest:
    """One request after its checks, with its token counts.

    Attributes:
        task: ``understanding``, ``t2i`` or ``edit``.
        items: the checked item list (:mod:`.items`), in request order.
        settings: the request's settings (``GenerationSettings`` or ``UnderstandingSettings``, of ``task``).
        tokens: the tokens each branch holds at the request's largest round (:class:`~.tokens.RequestTokens`).
        positions: RoPE positions of its largest context (at most the model's ``max_position_embeddings``).
        single: made by a single-image call (messages name ``prompt``, ``image``, ``source_latent``), else from an
            item list (messages name ``items``).
    """

    task: Task
    items: tuple[Item, ...]
    settings: GenerationSettings | UnderstandingSettings
    tokens: RequestTokens
    positions: int
    single: bool = False

    @property
    def generation(self) -> bool:
        """A text-to-image or edit request (else understanding)."""
        return self.task != "understanding"


def request_positions(tokens: RequestTokens, *, think: bool) -> int:
    """RoPE positions of the largest context of a counted request (what :func:`~.tokens.item_positions` counts):
    every text its tokens plus two, every image one per block (two for a generation: VAE and ViT), a generation's
    latent block one, and the think system prompt plus two."""
    generation = tokens.task != "understanding"
    used = tokens.prompt + BOUNDARY_TOKENS * tokens.texts + len(tokens.images) * (2 if generation else 1)
    used += 1 if generation else 0
    return used + (tokens.system + BOUNDARY_TOKENS if think else 0)


def _counted(
    config: BagelConfig,
    tokenizer,
    task: Task,
    items: tuple[Item, ...],
    settings: GenerationSettings | UnderstandingSettings,
    single: bool,
) -> CheckedRequest:
    """Count ``items`` once and refuse them when they need more RoPE positions than the model has."""
    if task == "t2i" and isinstance(settings, GenerationSettings):
        check_output_size(config, settings.width, settings.height)
    tokens = count_items(config, tokenizer, task, items, settings)
    used = request_positions(tokens, think=settings.think)
    if isinstance(settings, GenerationSettings):
        extra, extra_name = (settings.think_max_new_tokens + 2 if settings.think else 0), "think_max_new_tokens"
    else:
        extra, extra_name = settings.max_new_tokens, "max_new_tokens"
    name = "prompt" if single else "items"
    generation = task != "understanding"
    check_image_positions(
        config, used, len(tokens.images), generation=generation, extra=extra, extra_name=extra_name, name=name
    )
    return CheckedRequest(task=task, items=items, settings=settings, tokens=tokens, positions=used, single=single)


def check_request(
    config: BagelConfig,
    tokenizer,
    task: Task,
    items: Sequence[object],
    settings: GenerationSettings | UnderstandingSettings,
) -> CheckedRequest:
    """The :class:`CheckedRequest` of an item list (texts, images, and for a generation ``GENERATE`` markers) for the
    checkpoint of ``config`` and ``tokenizer``: one ValueError line for a bad list or one too long for the model."""
    checked = request_items(items, generation=task != "understanding")
    return _counted(config, tokenizer, task, checked, settings, single=False)


def check_single(
    config: BagelConfig,
    tokenizer,
    task: Task,
    prompt: str,
    image: Image.Image | None,
    settings: GenerationSettings | UnderstandingSettings,
    *,
    latent=None,
    vae_noise=None,
) -> CheckedRequest:
    """The :class:`CheckedRequest` of a single-image call: ``[image, prompt]`` (``[prompt]`` when ``image`` is None;
    an edit's given source ``latent`` and encode ``vae_noise`` go with the image)."""
    check_prompt(prompt)
    if image is not None:
        check_image_item(0, image, name="image")
    items = single_request(prompt, image, latent=latent, vae_noise=vae_noise)
    return _counted(config, tokenizer, task, items, settings, single=True)


__all__ = ["CheckedRequest", "check_request", "check_single", "request_positions"]
