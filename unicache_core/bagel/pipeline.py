"""The BAGEL procedures (understanding, text-to-image, editing) over pluggable KV caches.

Mirrors ``InterleaveInferencer.interleave_inference`` (docs/bagel.md §5): a request is an ordered item list of
texts and images (:mod:`.items`; :meth:`BagelPipeline.understand_items` and :meth:`BagelPipeline.generate` take
one, with any number of images), whose contexts are built block by block by one mechanism (:mod:`.interleave`);
``understand``, ``text_to_image`` and ``edit`` are its lists ``[image, prompt]`` and ``[prompt]``. Every cache
comes from a :data:`~unicache_core.kv.cache.CacheFactory` (``cfg_text`` is a fork of ``gen`` taken at the official
point), text is decoded by :mod:`.decoding` and latents by the flow loop of :mod:`.denoise` (a generation's run,
in rounds for iterative editing: :mod:`.generation`). Each procedure takes its validated settings
(:mod:`.settings`), a seed, run-time hooks and given latents (:mod:`.request`).

Randomness: one CPU ``torch.Generator`` seeded with ``seed`` gives, in order, the VAE-encode noise of
every input image (in item order), the think-mode reasoning samples (including the official loop's final discarded
draw) and the initial latent noise: the official code draws all of them from the global CPU RNG in
that order, so seeded runs reproduce it (checked against the official code, sampled think mode too).
Seeds below ``2**32`` seed it with ``manual_seed`` exactly as officially; every larger seed (up to
``2**64 - 1``) gets its own stream too (mapping: :mod:`.seeding`).

VAE: the checkpoint's own (``loaded.vae``) or an external one (:class:`~.latents.VAEAdapter`) given to
the pipeline or to one call; a single-file checkpoint loaded without a VAE needs one for every
encode/decode. An edit can start from a given source latent (``GivenLatents.source_latent``) and skip
the encode; a generation can skip the decode (``decode=False``) and return only latents. When the
built-in VAE does not encode, the seeded generator still draws the encode noise it would have used, so
a seed gives the same initial noise in every case.

Non-finite values (NaN/inf) never become an image or a text: logits, velocities, noise, latents and
pixels are checked and a :class:`~unicache_core.errors.NumericalError` names the step/branch and what
to change (:mod:`.numerics`). Finite but absurd settings are refused when the settings are made.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from PIL import Image

from ..kv.cache import CacheFactory, CacheSession, RequestInfo, Task, as_cache_factory, full_cache_factory
from . import contexts as C
from .checkpoint.loader import LoadedBagel
from .checkpoint.model_id import model_id_of
from .contexts import Context, GenerationContexts
from .decoding import decode_text
from .generation import GenerationCall, GenerationResult, run_generation
from .interleave import build_generation_contexts, build_understanding_context
from .items import Item, check_image_item, image_items, single_request
from .request import NO_GIVEN_LATENTS, NO_HOOKS, GivenLatents, RunHooks
from .request_check import CheckedRequest, check_request, check_single
from .run_info import UnderstandingInfo
from .seeding import check_seed, seeded_generator
from .settings import (
    EDIT_DEFAULTS,
    T2I_DEFAULTS,
    UNDERSTANDING_DEFAULTS,
    GenerationSettings,
    UnderstandingSettings,
    check_prompt,
    preset,
)
from .source_images import prepare_image
from .tokens import segment_rows

logger = logging.getLogger(__name__)

PRESET = "unicache_core.bagel.settings.preset"


@dataclass
class UnderstandingResult:
    """Output of :meth:`BagelPipeline.understand`: answer text and generated ids (no ``<|im_start|>``), what the run
    measured (:class:`~.run_info.UnderstandingInfo`) and the KV report."""

    text: str
    token_ids: list[int]
    info: UnderstandingInfo
    kv_report: dict | None = None


def _check_vae(vae):
    """``vae`` unchanged when it is None or has callable ``encode`` and ``decode``; else a ValueError."""
    if vae is None or (callable(getattr(vae, "encode", None)) and callable(getattr(vae, "decode", None))):
        return vae
    raise ValueError(
        f"`vae` must be an object with encode(image [1,3,H,W] in [-1,1]) -> latent [1,16,H/8,W/8] and decode(latent) "
        f"-> image (unicache_core.bagel.latents.VAEAdapter), got {type(vae).__name__}"
    )


def _checked(name: str, value, kind: type, default, how: str):
    """``value`` when it is a ``kind``, ``default`` when it is None, else a ValueError saying ``how`` to make one."""
    if value is None:
        return default
    if not isinstance(value, kind):
        raise ValueError(f"`{name}` must be a {kind.__name__} ({how}), got {type(value).__name__}")
    return value


def _call_parts(hooks, given) -> tuple[RunHooks, GivenLatents]:
    return (
        _checked(
            "hooks",
            hooks,
            RunHooks,
            NO_HOOKS,
            "unicache_core.bagel.RunHooks(progress=, cancel=, preview=, steer=, phase=)",
        ),
        _checked("given", given, GivenLatents, NO_GIVEN_LATENTS, "unicache_core.bagel.GivenLatents"),
    )


def _one_request_call(
    seed: int | None, hooks: RunHooks, given: GivenLatents, vae, decode: bool, return_step0_velocity: bool
) -> GenerationCall:
    """The call of :meth:`BagelPipeline.text_to_image` / :meth:`BagelPipeline.edit`: of ``given`` only the initial
    noise travels on (an edit's source latent and VAE noise are part of its checked request)."""
    noise_only = GivenLatents(initial_noise=given.initial_noise)
    return GenerationCall(
        seed=seed, hooks=hooks, given=noise_only, vae=vae, decode=decode, return_step0_velocity=return_step0_velocity
    )


class BagelPipeline:
    """Runs BAGEL requests on a loaded checkpoint with caches from ``cache_factory``.

    Args:
        loaded: the model, VAE, tokenizer and config (:func:`~unicache_core.bagel.checkpoint.loader.load_bagel`).
        cache_factory: starts the cache session of each request
            (:func:`unicache_core.compression.make_cache_factory`), or a plain ``fn(CacheRequest) -> KVCache``.
        vae: an external VAE (:class:`~.latents.VAEAdapter`: ``encode``/``decode`` in BAGEL's latent
            convention) used instead of ``loaded.vae``; a call's own ``vae=`` overrides it.
    """

    def __init__(self, loaded: LoadedBagel, cache_factory: CacheFactory = full_cache_factory, *, vae=None):
        self.loaded = loaded
        self.cache_factory = as_cache_factory(cache_factory)
        self.vae = _check_vae(vae)
        self.model_id = getattr(loaded, "model_id", "") or ""
        if not self.model_id:
            try:
                self.model_id = model_id_of(loaded.checkpoint_dir)
            except (ValueError, TypeError, OSError):
                self.model_id = ""

    def resolve_vae(self, vae=None, purpose: str | None = None):
        """The VAE a call uses: its own ``vae``, else the pipeline's, else the checkpoint's.

        With ``purpose`` (e.g. ``"decode the latents"``) a missing VAE raises a ``ValueError`` that says
        how to give one; without it, ``None`` is returned.
        """
        chosen = next(
            (v for v in (_check_vae(vae), self.vae, getattr(self.loaded, "vae", None)) if v is not None), None
        )
        if chosen is None and purpose is not None:
            where = getattr(self.loaded, "checkpoint_dir", "the checkpoint")
            raise ValueError(
                f"no VAE to {purpose}: {where} was loaded without one (a single-file checkpoint holds none) and "
                f"no external VAE was given. Pass one (an object with encode/decode, see "
                f"unicache_core.bagel.latents.VAEAdapter) as BagelPipeline(loaded, vae=...) or as vae=... to this "
                f"call, or load the FLUX ae.safetensors with load_bagel(..., vae='ae.safetensors')"
                + ("; or pass decode=False to get only the latents" if purpose.startswith("decode") else "")
            )
        return chosen

    def start_session(
        self, task: Task, num_steps: int | None = None, branch_weights: tuple[tuple[str, float], ...] = ()
    ) -> CacheSession:
        """The cache session of one request (every context of the request gets its cache from it); ``branch_weights``:
        each branch's coefficient in the output (:func:`.sampling.guidance_weights`)."""
        config = getattr(self.loaded, "config", None)
        request = RequestInfo(
            task=task,
            num_layers=self.loaded.model.num_layers,
            num_steps=num_steps,
            model_id=self.model_id,
            branch_weights=branch_weights,
            segment_rows=None if config is None else segment_rows(config),
        )
        return self.cache_factory.start(request)

    def new_context(self, task: Task, branch: str, session: CacheSession | None = None) -> Context:
        """An empty context whose cache comes from ``session`` (a new session of the factory when None)."""
        return C.new_context(self.start_session(task) if session is None else session, branch)

    @torch.inference_mode()
    def build_understanding_context(
        self,
        image: Image.Image | None,
        prompt: str,
        *,
        think: bool = False,
        session: CacheSession | None = None,
        special_tokens: bool = False,
    ) -> Context:
        """The context of ``[image, prompt]`` (:func:`.interleave.build_understanding_context`) in ``session`` (a new
        one when None)."""
        session = self.start_session("understanding") if session is None else session
        items = single_request(prompt, image)
        prepared = {item: prepare_image(self.loaded, item.image, generation=False) for item in image_items(items)}
        return build_understanding_context(
            self.loaded, session, items, prepared, think=think, special_tokens=special_tokens
        )

    @torch.inference_mode()
    def build_generation_contexts(
        self,
        task: Task,
        prompt: str,
        *,
        image: Image.Image | None = None,
        width: int | None = None,
        height: int | None = None,
        think: bool = False,
        generator: torch.Generator | None = None,
        session: CacheSession | None = None,
        given: GivenLatents = NO_GIVEN_LATENTS,
        vae=None,
    ) -> GenerationContexts:
        """The contexts of ``[image, prompt]`` (or ``[prompt]``; :func:`.interleave.build_generation_contexts`) in
        ``session`` (a new one when None); ``width``/``height`` without ``image``; ``vae`` encodes an edit's source
        (see :meth:`resolve_vae`) unless ``given.source_latent`` is set."""
        size: tuple[int, int] | None = None  # an edit's output has its source image's size
        if image is None:
            if width is None or height is None:
                raise ValueError("`width` and `height` are required without a source image")
            size = (width, height)
        session = self.start_session(task) if session is None else session
        items = single_request(prompt, image, latent=given.source_latent, vae_noise=given.vae_noise)
        prepared = {}
        for item in image_items(items):
            encoder = None if item.latent is not None else self.resolve_vae(vae, "encode the source image")
            prepared[item] = prepare_image(
                self.loaded,
                item.image,
                generation=True,
                latent=item.latent,
                vae_noise=item.vae_noise,
                vae=encoder,
                generator=generator,
            )
        return build_generation_contexts(self.loaded, session, items, prepared, size=size, think=think)

    # ---------------------------------------------------------------- public procedures

    def understand(
        self,
        prompt: str,
        image: Image.Image | None = None,
        settings: UnderstandingSettings | None = None,
        *,
        seed: int | None = None,
        hooks: RunHooks | None = None,
    ) -> UnderstandingResult:
        """Answer ``prompt`` about ``image`` (or a text-only prompt when ``image`` is None), docs/bagel.md §5.2: the
        item list ``[image, prompt]`` (:meth:`understand_items`).

        ``settings`` defaults to the official ones; ``seed`` seeds sampled decoding (``None``: unseeded);
        ``hooks``: progress per decoded token, cancel polled before each.
        """
        check_prompt(prompt)
        s = _checked("settings", settings, UnderstandingSettings, UNDERSTANDING_DEFAULTS, PRESET)
        request = check_single(self.loaded.config, self.loaded.tokenizer, "understanding", prompt, image, s)
        return self.understand_request(request, seed=seed, hooks=hooks)

    def understand_items(
        self,
        items: Sequence[Item | str | Image.Image],
        settings: UnderstandingSettings | None = None,
        *,
        seed: int | None = None,
        hooks: RunHooks | None = None,
    ) -> UnderstandingResult:
        """Answer after an item list (:mod:`.items`: texts and images in order, e.g. ``[img_a, img_b, "what differs
        between the two pictures?"]``), built as ``interleave_inference`` builds it; arguments as :meth:`understand`.
        """
        return self.understand_request(self.check("understanding", items, settings), seed=seed, hooks=hooks)

    def check(
        self,
        task: Task,
        items: Sequence[Item | str | Image.Image],
        settings: GenerationSettings | UnderstandingSettings | None = None,
    ) -> CheckedRequest:
        """The item list ``items`` of a ``task`` request checked and tokenised once for this checkpoint
        (:func:`~.request_check.check_request`; ``settings`` default to the task's preset), to run with
        :meth:`understand_request` or :meth:`generate_request`."""
        kind = UnderstandingSettings if task == "understanding" else GenerationSettings
        s = _checked("settings", settings, kind, preset(task), PRESET)
        return check_request(self.loaded.config, self.loaded.tokenizer, task, items, s)

    def understand_request(
        self, request: CheckedRequest, *, seed: int | None = None, hooks: RunHooks | None = None
    ) -> UnderstandingResult:
        """Answer a checked understanding request (:meth:`check`, :func:`~.request_check.check_single`); ``seed``
        and ``hooks`` as in :meth:`understand`."""
        if request.task != "understanding" or not isinstance(request.settings, UnderstandingSettings):
            raise ValueError(f"`request` is a {request.task} request; understand_request answers understanding ones")
        items, s = request.items, request.settings
        hooks, _ = _call_parts(hooks, None)
        generator = None if seed is None else seeded_generator(check_seed(seed))
        session = self.start_session("understanding", s.max_new_tokens)
        with torch.inference_mode():
            t0 = time.perf_counter()
            hooks.enter("contexts")
            prepared = {item: prepare_image(self.loaded, item.image, generation=False) for item in image_items(items)}
            ctx = build_understanding_context(
                self.loaded, session, items, prepared, think=s.think, special_tokens=s.prompt_special_tokens
            )
            C.release_between_phases(self.loaded)
            t1 = time.perf_counter()
            context_tokens = ctx.num_tokens
            hooks.enter("answer")
            text, ids = decode_text(
                self.loaded,
                ctx,
                max_new_tokens=s.max_new_tokens,
                do_sample=s.do_sample,
                temperature=s.temperature,
                generator=generator,
                hooks=hooks,
                session=session,
            )
            t2 = time.perf_counter()
        info = UnderstandingInfo(
            prefill_s=t1 - t0,
            decode_s=t2 - t1,
            context_tokens={"gen": context_tokens},
            cache_bytes=ctx.cache.nbytes(),
            images=len(prepared),
        )
        logger.info("understanding: %d context tokens, %d new tokens, %.2fs", context_tokens, len(ids), t2 - t0)
        return UnderstandingResult(text=text, token_ids=ids, info=info, kv_report=session.finish())

    def text_to_image(
        self,
        prompt: str,
        settings: GenerationSettings | None = None,
        *,
        seed: int | None = 0,
        hooks: RunHooks | None = None,
        given: GivenLatents | None = None,
        vae=None,
        decode: bool = True,
        return_step0_velocity: bool = False,
    ) -> GenerationResult:
        """Text-to-image (docs/bagel.md §5.3) of ``settings.width x settings.height`` pixels: the item list
        ``[prompt]`` (:meth:`generate`).

        Args:
            prompt: the instruction text (wrapped as ``<|im_start|> prompt <|im_end|>``, no chat template).
            settings: denoising, guidance, think mode and size (default: the official T2I preset).
            seed: seeds the CPU generator of the noise and think-mode samples (``None`` = random, reported).
            hooks: progress per plan token and per denoising step, cancel polled before each, live preview
                ``preview(done, total, x0)`` of the clean-latent estimate ``[1, 16, H/8, W/8]`` per step.
            given: ``initial_noise`` ``[h*w, 64]`` to start from instead of drawing it.
            vae: an external VAE for this call (:class:`~.latents.VAEAdapter`), else the pipeline's, else
                the checkpoint's.
            decode: ``False`` skips the VAE decode (``result.image`` is None; ``result.latents`` is set).
            return_step0_velocity: keep the step-0 branch and guided velocities in the result.
        """
        check_prompt(prompt)
        s = _checked("settings", settings, GenerationSettings, T2I_DEFAULTS, PRESET)
        hooks, given = _call_parts(hooks, given)
        request = check_single(self.loaded.config, self.loaded.tokenizer, "t2i", prompt, None, s)
        if given.source_latent is not None:
            raise ValueError("`source_latent` is the latent of an edit's source image; text-to-image takes none")
        return run_generation(self, request, _one_request_call(seed, hooks, given, vae, decode, return_step0_velocity))

    def edit(
        self,
        prompt: str,
        image: Image.Image,
        settings: GenerationSettings | None = None,
        *,
        seed: int | None = 0,
        hooks: RunHooks | None = None,
        given: GivenLatents | None = None,
        vae=None,
        decode: bool = True,
        return_step0_velocity: bool = False,
    ) -> GenerationResult:
        """Edit ``image`` following ``prompt`` (docs/bagel.md §5.4): the item list ``[image, prompt]``
        (:meth:`generate`); output size = the VAE-resized source size, or that of ``given.source_latent``.

        The source goes through the VAE (clean latents, gen expert) and the ViT (und expert); the
        ``cfg_text`` branch sees the image without the text, ``cfg_img`` the text without the image.
        Arguments as in :meth:`text_to_image` (default settings: the official edit preset), plus in
        ``given``: ``vae_noise`` (``[1, 16, H/8, W/8]`` noise of the stochastic VAE encode, drawn first
        from the seeded generator when not given) and ``source_latent`` (the source's ``[1, 16, H/8, W/8]``
        latent in BAGEL's convention, e.g. :func:`~.latents.from_comfy_latent` of ComfyUI's ``VAEEncode``;
        the encode is skipped and ``image`` still feeds the ViT; any size on BAGEL's grid, the output follows it
        and the ViT sees ``image`` resized to it).
        """
        check_prompt(prompt)
        check_image_item(0, image, name="image")
        s = _checked("settings", settings, GenerationSettings, EDIT_DEFAULTS, PRESET)
        hooks, given = _call_parts(hooks, given)
        latent, vae_noise = given.source_latent, given.vae_noise
        config, tokenizer = self.loaded.config, self.loaded.tokenizer
        request = check_single(config, tokenizer, "edit", prompt, image, s, latent=latent, vae_noise=vae_noise)
        return run_generation(self, request, _one_request_call(seed, hooks, given, vae, decode, return_step0_velocity))

    def generate(
        self,
        task: Task,
        items: Sequence[Item | str | Image.Image],
        settings: GenerationSettings | None = None,
        *,
        seed: int | None = 0,
        hooks: RunHooks | None = None,
        given: GivenLatents | None = None,
        vae=None,
        decode: bool = True,
        return_step0_velocity: bool = False,
    ) -> GenerationResult:
        """Generate after an item list (:mod:`.items`), built as ``interleave_inference`` builds it: a multi-reference
        edit ``[img_a, img_b, "put the cat of the first image into the second"]``, or iterative editing
        ``[img, "make it blue", GENERATE, "move it left"]`` (rounds: :mod:`.generation`).

        ``task``: ``"edit"`` (the output takes the last image's size; the official edit preset by default) or
        ``"t2i"`` (``settings.width x settings.height``, images as references; the T2I preset). Each image's source
        latent or encode noise goes in its :class:`~.items.ImageItem`; ``given.initial_noise`` starts the last
        generation. Other arguments as in :meth:`edit`; :attr:`GenerationResult.rounds` holds the earlier rounds.
        """
        if task not in ("t2i", "edit"):
            raise ValueError(f"`task` must be 't2i' or 'edit', got {task!r} (understanding: understand_items)")
        request = self.check(task, items, settings)
        return self.generate_request(
            request,
            seed=seed,
            hooks=hooks,
            given=given,
            vae=vae,
            decode=decode,
            return_step0_velocity=return_step0_velocity,
        )

    def generate_request(
        self,
        request: CheckedRequest,
        *,
        seed: int | None = 0,
        hooks: RunHooks | None = None,
        given: GivenLatents | None = None,
        vae=None,
        decode: bool = True,
        return_step0_velocity: bool = False,
    ) -> GenerationResult:
        """Run a checked generation request (:meth:`check`, :func:`~.request_check.check_single`); other arguments
        as in :meth:`generate`."""
        if not request.generation:
            raise ValueError("`request` is an understanding request; understand_request answers it")
        hooks, given = _call_parts(hooks, given)
        call = GenerationCall(
            seed=seed, hooks=hooks, given=given, vae=vae, decode=decode, return_step0_velocity=return_step0_velocity
        )
        return run_generation(self, request, call)


__all__ = ["BagelPipeline", "GenerationResult", "UnderstandingResult"]
