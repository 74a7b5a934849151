"""A generation request from its item list: every input image encoded, the contexts built, denoised, decoded.

The request's items (:mod:`.items`) are checked, its RoPE positions counted and its VAEs resolved before any forward
(:func:`run_generation`). A list with :data:`~.items.GENERATE` markers runs in rounds (iterative editing): round
``r`` builds its contexts from every item before its marker (the list up to there, with each earlier round's output
image in place of its marker, exactly what the official ``interleave_inference`` builds for that list), denoises and
decodes; its image then goes back in as an image item. Each round is its own cache session (its KV report in
:attr:`GenerationResult.rounds`), released before its decode, so a later round never holds an earlier one's KV
beside its own; the earlier items are prefilled again at full precision, every KV method compressing the same
contexts a one-round request of that list would.

Randomness: one CPU generator seeded with ``seed`` gives, in order, the VAE-encode noise of every input image (in
item order; an image is encoded once, when its round first needs it), each round's think-mode samples and initial
latent noise, then the encode noise of the image it made. For a one-round request that is the official order.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from ..kv.cache import Task
from ..kv.token_types import THINK
from . import contexts as C
from .decoding import decode_text
from .denoise import Denoised, decode_latents, denoise
from .interleave import build_generation_contexts
from .items import ImageItem, Item, image_items, rounds
from .latents import latent_factors
from .modeling import AutoEncoder
from .numerics import check_noise
from .request import GivenLatents, RunHooks
from .request_check import CheckedRequest
from .run_info import GenerationInfo
from .sampling import guidance_weights
from .seeding import check_seed, seeded_generator
from .settings import GenerationSettings, check_bool
from .source_images import SINGLE_IMAGE_NAMES, ImageNames, PreparedImage, check_given, prepare_image

logger = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    """Output of a generation (:meth:`~.pipeline.BagelPipeline.text_to_image`, ``edit``, ``generate``).

    Attributes:
        image: RGB PIL image, ``width x height`` (``None`` when called with ``decode=False``).
        latents: ``[1, 16, H/8, W/8]`` fp32 final latent in BAGEL's convention (what the VAE decoded;
            ComfyUI's ``LATENT["samples"]`` is :func:`~.latents.to_comfy_latent` of it).
        num_steps: denoising steps run (``num_timesteps - 1``).
        seed: seed of the noise generator.
        info: what the round measured (:class:`~.run_info.GenerationInfo`: timings, context sizes, cache bytes and
            decoder forwards per branch, TaylorSeer's forecasts, which VAE decoded, how the source latents were made,
            the latent constants); read by attribute, or as a mapping of the same values.
        think_text: the reasoning decoded in think mode, else ``None``.
        step0_velocity: with ``return_step0_velocity=True``: ``{"gen", "cfg_text", "cfg_img"
            (branches computed), "guided"}`` ``[h*w, 64]`` velocities of step 0.
        kv_report: the cache session's report (see :mod:`unicache_core.compression`).
        rounds: the earlier generations of a request with :data:`~.items.GENERATE` markers, in order (each with its
            image, latents, info and KV report); empty otherwise.
    """

    image: Image.Image | None
    latents: Tensor
    num_steps: int
    seed: int
    info: GenerationInfo
    think_text: str | None = None
    step0_velocity: dict[str, Tensor] | None = None
    kv_report: dict | None = None
    rounds: list[GenerationResult] = field(default_factory=list)


@dataclass(frozen=True)
class _Request:
    """What every round of one generation shares."""

    task: Task
    settings: GenerationSettings
    hooks: RunHooks
    encoder: object
    decoder: object
    generator: torch.Generator
    names: dict[ImageItem, ImageNames]


@dataclass(frozen=True)
class GenerationCall:
    """A generation call's arguments besides its items and settings (see :meth:`~.pipeline.BagelPipeline.edit`).

    ``given.initial_noise`` starts the last round."""

    seed: int | None
    hooks: RunHooks
    given: GivenLatents
    vae: object = None
    decode: bool = True
    return_step0_velocity: bool = False


def check_generation(pipe, request: CheckedRequest, call: GenerationCall, names: dict[ImageItem, ImageNames]) -> None:
    """Refuse, before any forward, what a checked generation request (its items and RoPE positions already checked,
    :mod:`.request_check`) cannot run: an edit without an image before its first generation, latents given in the
    wrong place or of the wrong shape."""
    given, items = call.given, request.items
    first = rounds(items)[0]
    if request.task == "edit" and not any(isinstance(item, ImageItem) for item in first):
        raise ValueError(
            "an edit needs an image to edit: put an image item before the first text it generates from "
            "(e.g. [image, 'make it blue'])"
        )
    if given.source_latent is not None or given.vae_noise is not None:
        raise ValueError(
            "with an item list, give each image's source latent or VAE noise in its ImageItem (latent=, vae_noise=), "
            "not in GivenLatents"
        )
    external = not isinstance(pipe.resolve_vae(call.vae), AutoEncoder)  # an adapter never samples the noise
    for item in image_items(items):
        check_given(pipe.loaded, item.image, item.latent, item.vae_noise, external_vae=external, names=names[item])


def run_generation(pipe, request: CheckedRequest, call: GenerationCall) -> GenerationResult:
    """Run a checked generation ``request`` (:mod:`.request_check`) on ``pipe`` (a :class:`~.pipeline.BagelPipeline`),
    round by round (module docstring)."""
    if not isinstance(request.settings, GenerationSettings):
        raise TypeError(f"a generation request takes GenerationSettings, got {type(request.settings).__name__}")
    task, items, settings = request.task, request.items, request.settings
    seed = check_seed(call.seed)
    decode, given, vae, single = check_bool("decode", call.decode), call.given, call.vae, request.single
    parts = rounds(items)
    needs_encode = len(parts) > 1 or any(item.latent is None for item in image_items(items))
    # a missing VAE is refused before any forward
    encoder = pipe.resolve_vae(vae, "encode the source image") if needs_encode else None
    if decode or len(parts) > 1:
        pipe.resolve_vae(vae, "decode the latents")
    names = {
        item: SINGLE_IMAGE_NAMES if single else ImageNames.of_item(i)
        for i, item in enumerate(items)
        if isinstance(item, ImageItem)
    }
    check_generation(pipe, request, call, names)
    shared = _Request(task, settings, call.hooks, encoder, vae, seeded_generator(seed), names)
    history: list[Item] = []
    prepared: dict[ImageItem, PreparedImage] = {}
    earlier: list[GenerationResult] = []
    for number, part in enumerate(parts):
        history.extend(part)
        last = number == len(parts) - 1
        run = _RoundOptions(
            initial_noise=given.initial_noise if last else None,
            decode=decode or not last,
            step0=call.return_step0_velocity and last,
            keep_sources=not last,
        )
        result = _round(pipe, shared, history, prepared, seed, run)
        if not last:
            earlier.append(result)
            if result.image is None:  # an earlier round is always decoded: the next round edits its image
                raise RuntimeError(f"GENERATE {number + 1}: the round returned no image to edit further")
            generated = ImageItem(result.image)
            names[generated] = ImageNames(f"the image generated at GENERATE {number + 1}")
            history.append(generated)
    result.rounds = earlier
    return result


@dataclass(frozen=True)
class _RoundOptions:
    """How one round runs: ``initial_noise`` ``[h*w, 64]`` to start from (None: drawn), ``decode`` its latent,
    keep its ``step0`` velocities, ``keep_sources``: keep the prepared images for a later round."""

    initial_noise: Tensor | None
    decode: bool
    step0: bool
    keep_sources: bool


def _prefill(pipe, shared: _Request, session, items: list[Item], prepared: dict[ImageItem, PreparedImage], keep: bool):
    """Encode the images not yet encoded (in item order, so the generator's draws are the official ones) and build
    the round's contexts; ``keep``: keep ``prepared`` for a later round."""
    loaded, s = pipe.loaded, shared.settings
    for item in items:
        if isinstance(item, ImageItem) and item not in prepared:
            prepared[item] = prepare_image(
                loaded,
                item.image,
                generation=True,
                latent=item.latent,
                vae_noise=item.vae_noise,
                vae=shared.encoder,
                generator=shared.generator,
                names=shared.names[item],
            )
    size = (s.width, s.height) if shared.task == "t2i" else None
    contexts = build_generation_contexts(
        loaded, session, items, prepared, size=size, think=s.think, special_tokens=s.prompt_special_tokens
    )
    if not keep:  # no later round prefills them again: nothing but the caches outlives the prefill
        prepared.clear()
    C.release_between_phases(loaded)
    return contexts


def _think(loaded, shared: _Request, session, contexts: C.GenerationContexts) -> str:
    """Think mode: decode the reasoning in a fork of ``gen`` (the ``THINK`` branch), then append it to ``gen`` as
    the official code does (its control tokens parsed)."""
    s = shared.settings
    think_ctx = C.Context(session.fork(contexts.gen.cache, THINK), contexts.gen.rope)
    text, _ = decode_text(
        loaded,
        think_ctx,
        max_new_tokens=s.think_max_new_tokens,
        do_sample=s.think_do_sample,
        temperature=s.think_temperature,
        generator=shared.generator,
        hooks=shared.hooks,
        draw_discarded_sample=True,
        session=session,
        branch=THINK,
    )
    session.release(THINK)
    del think_ctx
    C.append_text(loaded, contexts.gen, text, special_tokens=True)
    return text


def _initial_latent(loaded, contexts: C.GenerationContexts, generator, initial_noise: Tensor | None) -> Tensor:
    """The noise ``[h*w, 64]`` fp32 the flow starts from: drawn from ``generator``, or the given one checked."""
    lp = loaded.config.latent_downsample
    shape = ((contexts.height // lp) * (contexts.width // lp), loaded.config.patch_latent_dim)
    if initial_noise is None:
        return torch.randn(shape, generator=generator, dtype=torch.float32)
    return check_noise("initial_noise", initial_noise, shape).float().clone()


def _measured(contexts: C.GenerationContexts, denoised: Denoised) -> dict[str, Any]:
    """The round's :class:`~.run_info.GenerationInfo` fields that its contexts and its flow give: context sizes,
    cache bytes, decoder forwards (and forecasts) per branch, and its input images' latents."""
    branches = contexts.branches()
    return {
        "context_tokens": {name: ctx.num_tokens for name, ctx in branches.items()},
        "cache_bytes": {name: ctx.cache.nbytes() for name, ctx in branches.items()},
        "forwards": denoised.forwards,
        "source_latent": contexts.source_latent,
        "source_latents": list(contexts.source_latents),
        "images": len(contexts.source_latents),
        "forecasts": denoised.forecasts,
        "taylorseer_peak_bytes": denoised.peak_factor_bytes,
    }


def _round(
    pipe, shared: _Request, items: list[Item], prepared: dict[ImageItem, PreparedImage], seed: int, run: _RoundOptions
) -> GenerationResult:
    """One generation from ``items`` (texts and images): encode the images not yet encoded, build the contexts,
    [think], denoise, release the caches, decode."""
    loaded, s, hooks = pipe.loaded, shared.settings, shared.hooks
    session = pipe.start_session(shared.task, s.num_steps, guidance_weights(s.cfg_text_scale, s.cfg_img_scale))
    with torch.inference_mode():
        t0 = time.perf_counter()
        hooks.enter("contexts")
        contexts = _prefill(pipe, shared, session, items, prepared, run.keep_sources)
        t1 = time.perf_counter()
        think_text = None
        if s.think:
            hooks.enter("think")
            think_text = _think(loaded, shared, session, contexts)
        t2 = time.perf_counter()
        x = _initial_latent(loaded, contexts, shared.generator, run.initial_noise)
        hooks.enter("denoise")
        denoised = denoise(loaded, contexts, x.to(loaded.device), s, hooks=hooks, return_step0_velocity=run.step0)
        del x  # the initial noise: only the denoised latent is alive at the decode
        t3 = time.perf_counter()
        width, height, measured = contexts.width, contexts.height, _measured(contexts, denoised)
        kv_report = session.finish()
        # The caches are done with: free them before the VAE decode, the largest activation of a large image
        # (a 1024 px decode needs 4.3 GB; BAGEL-7B's full KV of that edit is 1.0 GB).
        for name in contexts.branches():
            session.release(name)
        del contexts
        C.release_between_phases(loaded)
        hooks.enter("decode")
        chosen = pipe.resolve_vae(shared.decoder, "decode the latents") if run.decode else None
        latent, picture = decode_latents(loaded, denoised.latent, height, width, chosen)
        t4 = time.perf_counter()
    scale, shift = latent_factors(loaded.config)
    info = GenerationInfo(
        **measured,
        prefill_s=t1 - t0,
        think_s=t2 - t1,
        denoise_s=t3 - t2,
        decode_s=t4 - t3,
        vae=None if chosen is None else ("checkpoint" if chosen is loaded.vae else "external"),
        latent_format={"convention": "bagel", "scale_factor": scale, "shift_factor": shift},
    )
    logger.info("%s %dx%d: %d steps in %.2fs", shared.task, width, height, s.num_steps, t3 - t2)
    return GenerationResult(
        image=picture,
        latents=latent,
        num_steps=s.num_steps,
        seed=seed,
        info=info,
        think_text=think_text,
        step0_velocity=denoised.step0_velocity,
        kv_report=kv_report,
    )


__all__ = ["GenerationCall", "GenerationResult", "check_generation", "run_generation"]
