"""The three BAGEL procedures (understanding, text-to-image, editing) over pluggable KV caches.

Mirrors ``InterleaveInferencer.interleave_inference`` (docs/bagel.md §5): contexts are built block by
block (:mod:`.contexts`), every cache comes from a :data:`~unicache_core.kv.cache.CacheFactory`
(``cfg_text`` is a ``clone`` of ``gen`` taken at the official point), and the flow loop uses the pure
math in :mod:`.sampling`.

Randomness: one CPU ``torch.Generator`` seeded with ``seed`` gives, in order, the VAE-encode noise of
an edit's source image, the think-mode plan samples (including the official loop's final discarded
draw) and the initial latent noise: the official code draws all of them from the global CPU RNG in
that order, so seeded runs reproduce it (checked against the official code, sampled think mode too).
Seeds below ``2**32`` seed it with ``manual_seed`` exactly as officially; every larger seed (up to
``2**64 - 1``) gets its own stream too, although ``manual_seed`` keeps only 32 bits (mapping:
:mod:`.seeding`).

VAE: the checkpoint's own (``loaded.vae``) or an external one (:class:`~.latents.VAEAdapter`, e.g. the
node pack's wrapper of ComfyUI's VAE) given to the pipeline or to one call; a single-file checkpoint
loaded without a VAE needs one for every encode/decode. An edit can also start from a given source
latent (``source_latent``, BAGEL's convention, e.g. ``from_comfy_latent`` of ComfyUI's ``VAEEncode``)
and skip the encode; a generation can skip the decode (``decode=False``) and return only latents.
When the built-in VAE does not encode (external VAE or given latent), the seeded generator still
draws the encode noise it would have used, so a seed gives the same initial noise in every case.

Non-finite values (NaN/inf) never become an image or a text: the logits of every decoding step, each
branch velocity and the guided velocity of every denoising step, injected noise, the encoded and final
latents and the decoded pixels are checked, and a :class:`~unicache_core.errors.NumericalError` names
the step/branch and what to change (:mod:`.numerics`). Finite but absurd settings are refused up front
(bounds: :data:`MAX_CFG_SCALE`, :data:`TIMESTEP_SHIFT_RANGE`, :data:`TEMPERATURE_RANGE`,
:data:`MAX_NUM_TIMESTEPS`).
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from PIL import Image
from torch import Tensor

from ..errors import CancelledError
from ..kv.cache import CacheFactory, CacheSession, RequestInfo, StepInfo, Task, as_cache_factory, full_cache_factory
from .checkpoint.model_id import model_id_of
from ..kv.token_types import TokenType
from . import contexts as C
from .contexts import Context
from .latents import latent_factors
from .checkpoint.loader import LoadedBagel
from .modeling import AutoEncoder
from .numerics import check_finite, check_logits, check_noise, check_velocities, model_advice
from .settings import EDIT_DEFAULTS as _E, T2I_DEFAULTS as _T, UNDERSTANDING_DEFAULTS as _U
from .sampling import RENORM_TYPES, cfg_active, combine_cfg, next_token, pack_latent, timestep_schedule, unpack_latent
from .seeding import seeded_generator
from .transforms import ImageTransforms, check_image, image_from_tensor

logger = logging.getLogger(__name__)

#: ``progress(done, total)``: called after every decoded token (understanding; in think mode first for
#: the plan tokens, ``total = think_max_new_tokens``) and after every denoising step (``total = steps``).
ProgressFn = Callable[[int, int], None]
CancelFn = Callable[[], bool]
#: ``preview(done, total, x0)``: the current clean-latent estimate ``[1, 16, H/8, W/8]`` after each denoising step.
PreviewFn = Callable[[int, int, Tensor], None]


@dataclass
class GenerationResult:
    """Output of :meth:`BagelPipeline.text_to_image` / :meth:`BagelPipeline.edit`.

    Attributes:
        image: RGB PIL image, ``width x height`` (``None`` when called with ``decode=False``).
        latents: ``[1, 16, H/8, W/8]`` fp32 final latent in BAGEL's convention (what the VAE decoded;
            ComfyUI's ``LATENT["samples"]`` is :func:`~.latents.to_comfy_latent` of it).
        num_steps: denoising steps run (``num_timesteps - 1``).
        seed: seed of the noise generator.
        info: timings (``prefill_s``, ``think_s``, ``denoise_s``, ``decode_s``), context sizes
            (``context_tokens``), denoising forwards per branch (``forwards``), which VAE decoded (``vae``:
            ``"checkpoint"``, ``"external"`` or ``None``), how an edit's source latent was made
            (``source_latent``: ``"checkpoint_vae"``, ``"external_vae"``, ``"given"``) and the latent
            constants (``latent_format``: ``{"convention": "bagel", "scale_factor", "shift_factor"}``).
        think_text: the plan decoded in think mode, else ``None``.
        step0_velocity: with ``return_step0_velocity=True``: ``{"gen", "cfg_text", "cfg_img"
            (branches computed), "guided"}`` ``[h*w, 64]`` velocities of step 0.
    """

    image: Image.Image | None
    latents: Tensor
    num_steps: int
    seed: int
    info: dict = field(default_factory=dict)
    think_text: str | None = None
    step0_velocity: dict[str, Tensor] | None = None
    kv_report: dict | None = None


@dataclass
class UnderstandingResult:
    """Output of :meth:`BagelPipeline.understand`: answer text and generated ids (no ``<|im_start|>``)."""

    text: str
    token_ids: list[int]
    info: dict = field(default_factory=dict)
    kv_report: dict | None = None


@dataclass
class GenerationContexts:
    """The three contexts of one generation request and the output size in pixels."""

    gen: Context
    cfg_text: Context
    cfg_img: Context
    height: int
    width: int
    session: CacheSession | None = None
    #: how the source latent of an edit was made (``"checkpoint_vae"``, ``"external_vae"``, ``"given"``).
    source_latent: str | None = None

    def branches(self) -> dict[str, Context]:
        return {"gen": self.gen, "cfg_text": self.cfg_text, "cfg_img": self.cfg_img}


# --------------------------------------------------------------------------------------- validation


#: Largest accepted ``cfg_text_scale`` / ``cfg_img_scale``. The official defaults are 4.0 and 1.5 (T2I) or
#: 2.0 (edit), and the official demo's sliders stop at 8 and 4. Far larger scales only amplify the branch
#: differences until they overflow.
MAX_CFG_SCALE = 100.0
#: Accepted ``timestep_shift`` range, inclusive (official default 3.0). Below about 1e-7 the fp32 schedule
#: divides by zero. Far outside ``[0.01, 100]``, almost all steps land at one end of the schedule.
TIMESTEP_SHIFT_RANGE = (0.01, 100.0)
#: Accepted sampling ``temperature`` / ``think_temperature`` range when sampling (official default 0.3).
#: Use greedy decoding (``do_sample=False``) rather than a temperature near 0.
TEMPERATURE_RANGE = (1e-3, 100.0)
#: Largest accepted ``num_timesteps`` (official default 50). Each step costs one forward per CFG branch.
MAX_NUM_TIMESTEPS = 1000


def _check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    if (isinstance(value, bool) or not isinstance(value, int) or value < minimum
            or (maximum is not None and value > maximum)):
        bound = f">= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")
        raise ValueError(f"`{name}` must be an integer {bound}, got {value!r}")
    return value


def _check_float(name: str, value: object, minimum: float, *, strict: bool = False, maximum: float | None = None):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = value > minimum if strict else value >= minimum
        ok = ok and (maximum is None or value <= maximum)
    if not ok:
        bound = f"> {minimum}" if strict else f">= {minimum}"
        if maximum is not None:
            bound += f" and <= {maximum}"
        raise ValueError(f"`{name}` must be a finite number {bound}, got {value!r}")
    return float(value)


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False, got {value!r}")
    return value


def _check_prompt(prompt: object) -> str:
    if not isinstance(prompt, str):
        raise ValueError(f"`prompt` must be a str, got {type(prompt).__name__}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # lone surrogates, e.g. undecodable bytes of a command-line argument
        raise ValueError(
            f"`prompt` is not valid Unicode text: {prompt[exc.start:exc.end]!r} at index {exc.start} is a lone "
            f"surrogate (an undecodable byte, e.g. from non-UTF-8 input); pass UTF-8 text"
        ) from None
    return prompt


def _check_vae(vae):
    """``vae`` unchanged when it is None or has callable ``encode`` and ``decode``; else a ValueError."""
    if vae is None or (callable(getattr(vae, "encode", None)) and callable(getattr(vae, "decode", None))):
        return vae
    raise ValueError(
        f"`vae` must be an object with encode(image [1,3,H,W] in [-1,1]) -> latent [1,16,H/8,W/8] and decode(latent) "
        f"-> image (unicache_core.bagel.latents.VAEAdapter), got {type(vae).__name__}"
    )


def _check_latent_tensor(name: str, z: object, shape: tuple[int, ...], width: int, height: int) -> Tensor:
    """A caller's or external VAE's source latent: a float tensor of ``shape`` (finiteness checked after)."""
    if not isinstance(z, Tensor) or not z.is_floating_point():
        raise ValueError(f"`{name}` must be a floating-point torch.Tensor of shape {shape}, got "
                         f"{type(z).__name__ if not isinstance(z, Tensor) else z.dtype}")
    if tuple(z.shape) != shape:
        raise ValueError(
            f"`{name}` has shape {tuple(z.shape)}, but the source image is resized to {width}x{height} (BAGEL's VAE "
            f"transform), whose latent is {shape}; encode the image at {width}x{height} (e.g. resize it before "
            f"VAEEncode) or leave it None to encode here"
        )
    return z.detach().to("cpu", torch.float32)


#: Largest seed (torch generators take unsigned 64-bit seeds; :func:`.seeding.seeded_generator` maps each one).
MAX_SEED = 2**64 - 1


def _check_seed(seed: object) -> int:
    """``None`` → a random seed; else an int in ``[0, 2**64 - 1]``."""
    if seed is None:
        return random.SystemRandom().randrange(0, 2**63)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"`seed` must be an integer in [0, 2**64 - 1] or None, got {seed!r}")
    return seed


@dataclass(frozen=True)
class FlowSettings:
    """Validated denoising settings (docs/bagel.md §5.3)."""

    num_timesteps: int
    timestep_shift: float
    cfg_text_scale: float
    cfg_img_scale: float
    cfg_interval: tuple[float, float]
    cfg_renorm_min: float
    cfg_renorm_type: str

    @classmethod
    def create(
        cls, num_timesteps, timestep_shift, cfg_text_scale, cfg_img_scale, cfg_interval, cfg_renorm_min,
        cfg_renorm_type,
    ) -> "FlowSettings":
        _check_int("num_timesteps", num_timesteps, 2, MAX_NUM_TIMESTEPS)
        lo_shift, hi_shift = TIMESTEP_SHIFT_RANGE
        shift = _check_float("timestep_shift", timestep_shift, lo_shift, maximum=hi_shift)
        text_scale = _check_float("cfg_text_scale", cfg_text_scale, 0.0, maximum=MAX_CFG_SCALE)
        img_scale = _check_float("cfg_img_scale", cfg_img_scale, 0.0, maximum=MAX_CFG_SCALE)
        if not isinstance(cfg_interval, Sequence) or isinstance(cfg_interval, str) or len(cfg_interval) != 2:
            raise ValueError(f"`cfg_interval` must be a pair (lo, hi) with 0 <= lo <= hi <= 1, got {cfg_interval!r}")
        lo = _check_float("cfg_interval[0]", cfg_interval[0], 0.0, maximum=1.0)
        hi = _check_float("cfg_interval[1]", cfg_interval[1], 0.0, maximum=1.0)
        if lo > hi:
            raise ValueError(f"`cfg_interval` must satisfy lo <= hi, got {tuple(cfg_interval)!r}")
        renorm_min = _check_float("cfg_renorm_min", cfg_renorm_min, 0.0, maximum=1.0)
        if cfg_renorm_type not in RENORM_TYPES:
            raise ValueError(f"`cfg_renorm_type` must be one of {RENORM_TYPES}, got {cfg_renorm_type!r}")
        timesteps, dts = timestep_schedule(num_timesteps, shift)
        check_finite(torch.cat([timesteps, dts]), f"the flow schedule of timestep_shift={shift:g}",
                     "choose a timestep_shift nearer 1 (official default 3.0)")
        return cls(num_timesteps, shift, text_scale, img_scale, (lo, hi), renorm_min, cfg_renorm_type)


@dataclass(frozen=True)
class _ThinkSettings:
    """Validated think-mode decoding settings of a generation request (docs/bagel.md §5.5)."""

    max_new_tokens: int
    do_sample: bool
    temperature: float

    @classmethod
    def create(cls, think, max_new_tokens, do_sample, temperature) -> "_ThinkSettings | None":
        """``None`` when ``think`` is False; otherwise the checked settings."""
        if not _check_bool("think", think):
            return None
        _check_int("think_max_new_tokens", max_new_tokens, 1)
        if _check_bool("think_do_sample", do_sample):
            _check_float("think_temperature", temperature, TEMPERATURE_RANGE[0], maximum=TEMPERATURE_RANGE[1])
        return cls(max_new_tokens, do_sample, float(temperature))


def check_understanding_args(max_new_tokens, do_sample, temperature, think, seed) -> None:
    """The argument checks of :meth:`BagelPipeline.understand` (no model needed; the CLI runs them first)."""
    _check_int("max_new_tokens", max_new_tokens, 1)
    if _check_bool("do_sample", do_sample):
        _check_float("temperature", temperature, TEMPERATURE_RANGE[0], maximum=TEMPERATURE_RANGE[1])
    _check_bool("think", think)
    if seed is not None:
        _check_seed(seed)


def check_output_size(config, width: object, height: object) -> tuple[int, int]:
    """``width``/``height`` of a T2I request: positive multiples of the latent patch (16 px for BAGEL), within
    ``latent_downsample * max_latent_size`` (1024 px for BAGEL); ``config`` is a :class:`BagelConfig`."""
    step = config.latent_downsample
    limit = step * config.max_latent_size
    for name, value in (("width", width), ("height", height)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % step or value > limit:
            raise ValueError(f"`{name}` must be a positive multiple of {step} and <= {limit}, got {value!r}")
    return width, height


def understanding_positions(tokenizer, prompt: str, *, has_image: bool, think: bool) -> int:
    """RoPE positions of an understanding context: ``[system (think)] [ViT image] [prompt]``."""
    used = len(tokenizer.encode(prompt)) + 2 + (1 if has_image else 0)
    if think:
        used += len(tokenizer.encode(C.VLM_THINK_SYSTEM_PROMPT)) + 2
    return used


def generation_positions(tokenizer, prompt: str, *, has_image: bool, think: bool) -> int:
    """RoPE positions of a ``gen`` context: ``[system] [VAE image, ViT image] prompt``, then the latent block."""
    used = len(tokenizer.encode(prompt)) + 2 + (2 if has_image else 0) + 1
    if think:
        used += len(tokenizer.encode(C.GEN_THINK_SYSTEM_PROMPT)) + 2
    return used


def check_positions(config, used: int, extra: int, name: str) -> None:
    """Refuse (before any forward) a request needing more RoPE positions than the model was trained on.

    The official code would run past ``max_position_embeddings`` with untrained positions; here it
    is an error. Images take one position each, text one per token.
    """
    limit = config.llm.max_position_embeddings
    if used + extra > limit:
        detail = f"{used} for the context" + (f" + {extra} for decoding" if extra else "")
        raise ValueError(
            f"`{name}` is too long: the request needs {used + extra} RoPE positions ({detail}) but "
            f"max_position_embeddings = {limit}; shorten the prompt"
            + (f" or lower `{name}`" if extra else "")
        )


# ----------------------------------------------------------------------------------------- pipeline


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
        chosen = next((v for v in (_check_vae(vae), self.vae, getattr(self.loaded, "vae", None)) if v is not None), None)
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

    def start_session(self, task: Task, num_steps: int | None = None) -> CacheSession:
        """The cache session of one request (every context of the request gets its cache from it)."""
        return self.cache_factory.start(RequestInfo(task=task, num_layers=self.loaded.model.num_layers,
                                                    num_steps=num_steps, model_id=self.model_id))

    # ---------------------------------------------------------------- position budget

    def _check_positions(self, used: int, extra: int, name: str) -> None:
        """:func:`check_positions` with this checkpoint's config."""
        check_positions(self.loaded.config, used, extra, name)

    # ---------------------------------------------------------------- building blocks

    def new_context(self, task: Task, branch: str, session: CacheSession | None = None) -> Context:
        """An empty context whose cache comes from ``session`` (a new session of the factory when None)."""
        session = self.start_session(task) if session is None else session
        return Context(cache=session.new_cache(branch), rope=0)

    @torch.inference_mode()
    def decode_text(
        self,
        ctx: Context,
        *,
        max_new_tokens: int,
        do_sample: bool = False,
        temperature: float = 0.3,
        generator: torch.Generator | None = None,
        progress: ProgressFn | None = None,
        cancel: CancelFn | None = None,
        draw_discarded_sample: bool = False,
        session: CacheSession | None = None,
        branch: str = "gen",
    ) -> tuple[str, list[int]]:
        """Decode an answer from ``ctx`` (modified in place: the fed tokens are cached).

        Starts with an ``<|im_start|>`` query at ``ctx.rope``; stops when ``<|im_end|>`` is predicted
        (not kept) or after ``max_new_tokens`` generated tokens. (The official ``max_length`` counts
        forwards including the start token: official ``max_length = M`` equals ``max_new_tokens = M-1``.)
        ``draw_discarded_sample``: when sampling stops at the length limit, consume the one extra
        multinomial draw the official loop makes (and discards) from ``generator``, so that later draws
        from the same generator (the latent noise after a think plan) match the official RNG stream.
        ``session``/``branch``: the cache session is told where each decoded token begins and ends.

        Returns:
            ``(text, generated ids)``; text is decoded and cut as the official ``gen_text`` does.
        """
        tok = self.loaded.tokenizer
        ids: list[int] = []
        current, current_type = tok.bos_token_id, TokenType.BOUNDARY
        vocab = 0
        for step in range(max_new_tokens):
            if cancel is not None and cancel():
                raise CancelledError(f"text decoding cancelled after {step} of at most {max_new_tokens} tokens")
            info = StepInfo(phase="decode", step=step, total=max_new_tokens, branches=(branch,))
            if session is not None:
                session.begin_step(info)
            try:
                logits = C.decode_step(self.loaded, ctx, current, step, current_type)
            finally:
                if session is not None:
                    session.end_step(info)
            check_logits(logits, step=step, max_new_tokens=max_new_tokens, dtype=self.loaded.dtype)
            vocab = logits.shape[-1]
            current = next_token(logits, do_sample=do_sample, temperature=temperature, generator=generator)
            current_type = TokenType.DECODED_TEXT
            if progress is not None:
                progress(step + 1, max_new_tokens)
            if current == tok.eos_token_id:
                break
            ids.append(current)
        else:
            if draw_discarded_sample and do_sample and vocab:
                # the official loop samples once more after the last kept token; the token is dropped
                # but its draw advances the generator (same size, so the same amount of randomness)
                torch.multinomial(torch.ones(vocab), num_samples=1, generator=generator)
        return self._answer_text(ids), ids

    def _answer_text(self, ids: list[int]) -> str:
        tok = self.loaded.tokenizer
        text = tok.decode([tok.bos_token_id, *ids])
        text = text.split("<|im_end|>")[0]
        if "<|im_start|>" in text:
            text = text.split("<|im_start|>")[1]
        return text

    @torch.inference_mode()
    def build_understanding_context(self, image: Image.Image | None, prompt: str, *, think: bool = False,
                                    session: CacheSession | None = None) -> Context:
        """``[system (think)] [ViT image] [text]`` in one ``gen`` context (docs/bagel.md §4.6)."""
        ctx = self.new_context("understanding", "gen", session)
        if think:
            C.append_text(self.loaded, ctx, C.VLM_THINK_SYSTEM_PROMPT)
        if image is not None:
            transforms = ImageTransforms.from_config(self.loaded.config)
            resized = transforms.prepare(image, "image")
            C.append_vit(self.loaded, ctx, transforms.vit(resized))
        C.append_text(self.loaded, ctx, prompt)
        return ctx

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
        vae_noise: Tensor | None = None,
        session: CacheSession | None = None,
        source_latent: Tensor | None = None,
        vae=None,
    ) -> GenerationContexts:
        """Build ``gen``, ``cfg_text`` and ``cfg_img`` as ``interleave_inference`` does (image, then text).

        For an edit the output size is the VAE-resized source size; ``vae_noise`` ``[1, 16, H/8, W/8]``
        (else drawn from ``generator``) is the VAE sampling noise of the built-in VAE. ``source_latent``
        ``[1, 16, H/8, W/8]`` (BAGEL's convention, of the VAE-resized source) replaces the encode;
        ``vae`` is an external VAE for the encode (see :meth:`resolve_vae`).
        """
        if image is None and (width is None or height is None):
            raise ValueError("`width` and `height` are required without a source image")
        session = self.start_session(task) if session is None else session
        gen = self.new_context(task, "gen", session)
        cfg_img = self.new_context(task, "cfg_img", session)
        if think:
            C.append_text(self.loaded, gen, C.GEN_THINK_SYSTEM_PROMPT)
            C.append_text(self.loaded, cfg_img, C.GEN_THINK_SYSTEM_PROMPT)
        if image is not None:
            transforms = ImageTransforms.from_config(self.loaded.config)
            resized = transforms.prepare(image, "image")
            width, height = resized.size
            vae_input = transforms.vae(resized)
            lp = self.loaded.config.latent_downsample
            h, w = vae_input.shape[1] // lp, vae_input.shape[2] // lp
            latent, how = self._source_latent(vae_input, vae=vae, source_latent=source_latent, vae_noise=vae_noise,
                                              generator=generator)
            C.append_vae(self.loaded, gen, latent, h, w)
            C.append_vit(self.loaded, gen, transforms.vit(resized))
        # the official deepcopy(gen) point: after the image, before the text; the session builds it from gen
        cfg_text = Context(session.fork(gen.cache, "cfg_text"), gen.rope)
        C.append_text(self.loaded, gen, prompt)
        C.append_text(self.loaded, cfg_img, prompt)
        return GenerationContexts(gen=gen, cfg_text=cfg_text, cfg_img=cfg_img, height=height, width=width,
                                  session=session, source_latent=how if image is not None else None)

    def _source_latent(self, vae_input: Tensor, *, vae, source_latent: Tensor | None, vae_noise: Tensor | None,
                       generator: torch.Generator | None) -> tuple[Tensor, str]:
        """Packed ``[(H/16)*(W/16), 64]`` clean latent of an edit's source and how it was made."""
        cfg = self.loaded.config
        ds = cfg.ae.downsample
        height, width = vae_input.shape[1], vae_input.shape[2]
        shape = (1, cfg.ae.z_channels, height // ds, width // ds)
        chosen = None if source_latent is not None else self.resolve_vae(vae, "encode the source image")
        if isinstance(chosen, AutoEncoder):
            if vae_noise is not None:
                check_noise("vae_noise", vae_noise, shape)
            latent = C.encode_vae_latent(self.loaded, vae_input, noise=vae_noise, generator=generator, vae=chosen)
            how = "checkpoint_vae" if chosen is self.loaded.vae else "external_vae"
            check_finite(latent, "the VAE encoding of the source image",
                         "check ae.safetensors (re-download it); the VAE always runs in fp32")
            return latent, how
        if vae_noise is not None:
            raise ValueError("`vae_noise` is the sampling noise of the built-in VAE encode; it is not used with "
                             "`source_latent` or an external VAE: leave it None")
        if generator is not None:  # the draw the built-in encode makes, so the seed gives the same later noise
            torch.randn(shape, generator=generator, dtype=torch.float32)
        if source_latent is not None:
            z, how = _check_latent_tensor("source_latent", source_latent, shape, width, height), "given"
            advice = "pass a finite latent (e.g. from_comfy_latent of VAEEncode's samples)"
        else:
            with torch.inference_mode():
                z = chosen.encode(vae_input.unsqueeze(0).float().cpu())
            z, how = _check_latent_tensor("the external VAE's encode", z, shape, width, height), "external_vae"
            advice = "check the external VAE (its encode must return a finite [1, 16, H/8, W/8] latent)"
        check_finite(z, "the source latent" if how == "given" else "the external VAE encoding of the source image",
                     advice)
        return pack_latent(z[0].float(), cfg.latent_patch_size), how

    @torch.inference_mode()
    def branch_velocities(
        self,
        contexts: GenerationContexts,
        x: Tensor,
        t: Tensor | float,
        *,
        step: int = 0,
        branches: Sequence[str] = ("gen", "cfg_text", "cfg_img"),
    ) -> dict[str, Tensor]:
        """Raw velocities ``[h*w, 64]`` (model dtype) of the listed branches for latents ``x`` ``[h*w, 64]`` at ``t``.

        The query embeddings are built once and shared by every branch; each branch's latent block
        sits at its own context's rope. Caches are not modified.
        """
        lp = self.loaded.config.latent_downsample
        h, w = contexts.height // lp, contexts.width // lp
        timestep = float(t)
        embeds = C.latent_block_embeds(self.loaded, x, h, w, timestep)
        by_name = contexts.branches()
        return {
            name: C.latent_velocity(self.loaded, by_name[name], embeds, step=step, timestep=timestep)
            for name in branches
        }

    @staticmethod
    def step_branches(t: Tensor, settings: FlowSettings) -> tuple[list[str], float, float]:
        """``(branches computed at time t, text scale, image scale)`` as the official ``_forward_flow`` decides."""
        active = cfg_active(t, settings.cfg_interval)
        text_scale = settings.cfg_text_scale if active else 1.0
        img_scale = settings.cfg_img_scale if active else 1.0
        names = ["gen"]
        if text_scale > 1.0:
            names.append("cfg_text")
            if img_scale > 1.0:
                names.append("cfg_img")
        return names, text_scale, img_scale

    @torch.inference_mode()
    def velocity(
        self,
        contexts: GenerationContexts,
        x: Tensor,
        t: Tensor | float,
        settings: FlowSettings,
        *,
        step: int = 0,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Guided velocity of one denoising step and the raw branch velocities it used.

        Branches are computed as the official ``_forward_flow`` does: ``cfg_text`` only when the text
        scale (after the interval test) is > 1, ``cfg_img`` only when the image scale is > 1 as well
        (when the text scale is <= 1 the image term is never used, so it is not computed).
        """
        t_tensor = t if isinstance(t, Tensor) else torch.tensor(t, dtype=torch.float32)
        names, text_scale, img_scale = self.step_branches(t_tensor, settings)
        raw = self.branch_velocities(contexts, x, t_tensor, step=step, branches=names)
        guided = combine_cfg(
            raw["gen"], raw.get("cfg_text"), raw.get("cfg_img"), text_scale=text_scale, img_scale=img_scale,
            renorm_type=settings.cfg_renorm_type, renorm_min=settings.cfg_renorm_min,
        )
        return guided, raw

    @torch.inference_mode()
    def denoise(
        self,
        contexts: GenerationContexts,
        x: Tensor,
        settings: FlowSettings,
        *,
        progress: ProgressFn | None = None,
        cancel: CancelFn | None = None,
        return_step0_velocity: bool = False,
        preview: PreviewFn | None = None,
    ) -> tuple[Tensor, dict[str, int], dict[str, Tensor] | None]:
        """Euler flow from noise ``x`` ``[h*w, 64]`` (fp32): ``x -= v * dt`` for ``num_timesteps - 1`` steps.

        ``preview(done, total, x0)``: after each step, the flow's current estimate of the clean latent,
        ``x0 = x_t - t * v`` unpacked to ``[1, 16, H/8, W/8]`` (BAGEL's convention), for a live preview.

        Returns:
            ``(x0 [h*w, 64] fp32, forwards per branch, step-0 velocities or None)``.
        """
        timesteps, dts = timestep_schedule(settings.num_timesteps, settings.timestep_shift)
        total = len(timesteps)
        forwards = {"gen": 0, "cfg_text": 0, "cfg_img": 0}
        step0 = None
        for i in range(total):
            if cancel is not None and cancel():
                raise CancelledError(f"denoising cancelled before step {i + 1} of {total}")
            names, _, _ = self.step_branches(timesteps[i], settings)
            info = StepInfo(phase="denoise", step=i, total=total, branches=tuple(names), timestep=float(timesteps[i]))
            if contexts.session is not None:
                contexts.session.begin_step(info)
            try:
                v, raw = self.velocity(contexts, x, timesteps[i], settings, step=i)
            finally:
                if contexts.session is not None:
                    contexts.session.end_step(info)
            check_velocities(raw, v, step=i, total=total, dtype=self.loaded.dtype,
                             cfg_text_scale=settings.cfg_text_scale, cfg_img_scale=settings.cfg_img_scale)
            for name in raw:
                forwards[name] += 1
            if i == 0 and return_step0_velocity:
                step0 = {**raw, "guided": v}
            # Official order: the velocity (model dtype) times the fp32 0-dim dt stays in the velocity
            # dtype, then it is subtracted from the fp32 latent.
            if preview is not None:
                lp = self.loaded.config.latent_downsample
                h, w = contexts.height // lp, contexts.width // lp
                estimate = x.float() - float(timesteps[i]) * v.to(x.device).float()
                preview(i + 1, total, unpack_latent(estimate, h, w, self.loaded.config.latent_channel,
                                                    self.loaded.config.latent_patch_size))
            x = x - v.to(x.device) * dts[i].to(x.device)
            if progress is not None:
                progress(i + 1, total)
        return x, forwards, step0

    @torch.inference_mode()
    def decode_latents(self, x: Tensor, height: int, width: int, *, vae=None,
                       decode: bool = True) -> tuple[Tensor, Image.Image | None]:
        """Packed ``[h*w, 64]`` → ``([1, 16, 2h, 2w] latent, PIL image)`` via the VAE (:meth:`resolve_vae`).

        The checkpoint's VAE runs in fp32; an external one gets the latent as CPU fp32. ``decode=False``
        returns ``(latent, None)`` without any VAE.
        """
        cfg = self.loaded.config
        h, w = height // cfg.latent_downsample, width // cfg.latent_downsample
        latent = unpack_latent(x.float(), h, w, cfg.latent_channel, cfg.latent_patch_size)
        check_finite(latent, "the final latent", model_advice(self.loaded.dtype))
        if not decode:
            return latent, None
        chosen = self.resolve_vae(vae, "decode the latents")
        if isinstance(chosen, AutoEncoder):
            vae_device = next(chosen.parameters()).device
            pixels = chosen.decode(latent.to(vae_device))
            advice = "check ae.safetensors (re-download it); the VAE always runs in fp32"
        else:
            pixels = chosen.decode(latent.detach().cpu().clone())
            if not isinstance(pixels, Tensor) or not pixels.is_floating_point() or tuple(pixels.shape) != (
                    1, 3, height, width):
                got = tuple(pixels.shape) if isinstance(pixels, Tensor) else type(pixels).__name__
                raise ValueError(f"the external VAE's decode must return a float tensor of shape "
                                 f"{(1, 3, height, width)} in [-1, 1], got {got}")
            advice = "check the external VAE (its decode returned non-finite pixels)"
        check_finite(pixels, "the decoded image (VAE output, before the uint8 conversion)", advice)
        return latent, image_from_tensor(pixels)

    # ---------------------------------------------------------------- public procedures

    def understand(
        self,
        image: Image.Image | None,
        prompt: str,
        *,
        max_new_tokens: int = _U.max_new_tokens,
        do_sample: bool = _U.do_sample,
        temperature: float = _U.temperature,
        think: bool = False,
        seed: int | None = None,
        progress: ProgressFn | None = None,
        cancel: CancelFn | None = None,
    ) -> UnderstandingResult:
        """Answer ``prompt`` about ``image`` (or a text-only prompt when ``image`` is None), docs/bagel.md §5.2."""
        _check_prompt(prompt)
        if image is not None:
            check_image(image, "image")
        check_understanding_args(max_new_tokens, do_sample, temperature, think, seed)
        generator = None
        if seed is not None:
            generator = seeded_generator(_check_seed(seed))
        used = understanding_positions(self.loaded.tokenizer, prompt, has_image=image is not None, think=think)
        self._check_positions(used, 0, "prompt")
        self._check_positions(used, max_new_tokens, "max_new_tokens")
        session = self.start_session("understanding", max_new_tokens)
        with torch.inference_mode():
            t0 = time.perf_counter()
            ctx = self.build_understanding_context(image, prompt, think=think, session=session)
            t1 = time.perf_counter()
            context_tokens = ctx.num_tokens
            text, ids = self.decode_text(
                ctx, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                generator=generator, progress=progress, cancel=cancel, session=session,
            )
            t2 = time.perf_counter()
        info = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "context_tokens": {"gen": context_tokens},
                "cache_bytes": ctx.cache.nbytes()}
        kv_report = session.finish()
        logger.info("understanding: %d context tokens, %d new tokens, %.2fs", context_tokens, len(ids), t2 - t0)
        return UnderstandingResult(text=text, token_ids=ids, info=info, kv_report=kv_report)

    def text_to_image(
        self,
        prompt: str,
        *,
        width: int = _T.width,
        height: int = _T.height,
        num_timesteps: int = _T.num_timesteps,
        timestep_shift: float = _T.timestep_shift,
        cfg_text_scale: float = _T.cfg_text_scale,
        cfg_img_scale: float = _T.cfg_img_scale,
        cfg_interval: tuple[float, float] = _T.cfg_interval,
        cfg_renorm_min: float = _T.cfg_renorm_min,
        cfg_renorm_type: str = _T.cfg_renorm_type,
        seed: int | None = 0,
        think: bool = False,
        think_max_new_tokens: int = _T.think_max_new_tokens,
        think_do_sample: bool = _T.think_do_sample,
        think_temperature: float = _T.think_temperature,
        initial_noise: Tensor | None = None,
        progress: ProgressFn | None = None,
        cancel: CancelFn | None = None,
        return_step0_velocity: bool = False,
        vae=None,
        decode: bool = True,
        preview: PreviewFn | None = None,
    ) -> GenerationResult:
        """Text-to-image (docs/bagel.md §5.3); defaults are ``app.py``'s (cfg_img_scale 1.5 is the interleave default).

        Args:
            prompt: the instruction text (wrapped as ``<|im_start|> prompt <|im_end|>``, no chat template).
            width, height: output size in pixels, positive multiples of 16, at most 16 * max_latent_size.
            num_timesteps: points of the shifted schedule; ``num_timesteps - 1`` Euler steps are run.
            timestep_shift: ``s`` in ``t' = s t / (1 + (s - 1) t)``.
            cfg_text_scale: text guidance (``cfg_text`` branch computed only when > 1).
            cfg_img_scale: image guidance (``cfg_img`` branch; in T2I its context equals ``gen``).
            cfg_interval: guidance is active for steps with ``lo < t <= hi``.
            cfg_renorm_min, cfg_renorm_type: norm clamp after guidance: ``global`` | ``channel`` | ``text_channel``.
            seed: seeds the CPU generator of the initial noise (``None`` = random, reported in the result).
            think, think_max_new_tokens, think_do_sample, think_temperature: decode a plan first and append it.
            initial_noise: ``[h*w, 64]`` latent noise to use instead of drawing it.
            progress: ``progress(done, total)`` per plan token and per denoising step.
            cancel: polled between steps; returning True raises :class:`~unicache_core.errors.CancelledError`.
            return_step0_velocity: keep the step-0 branch and guided velocities in the result.
            vae: an external VAE for this call (:class:`~.latents.VAEAdapter`), else the pipeline's, else
                the checkpoint's.
            decode: ``False`` skips the VAE decode (``result.image`` is None; ``result.latents`` is set).
            preview: ``preview(done, total, x0)`` after each denoising step with the current clean-latent
                estimate ``[1, 16, H/8, W/8]`` (BAGEL's convention; see :meth:`denoise`).
        """
        _check_prompt(prompt)
        check_output_size(self.loaded.config, width, height)
        settings = FlowSettings.create(
            num_timesteps, timestep_shift, cfg_text_scale, cfg_img_scale, cfg_interval, cfg_renorm_min,
            cfg_renorm_type,
        )
        plan = _ThinkSettings.create(think, think_max_new_tokens, think_do_sample, think_temperature)
        return self._generate(
            "t2i", prompt, None, settings, seed=seed, think=plan, width=width, height=height,
            initial_noise=initial_noise, progress=progress, cancel=cancel,
            return_step0_velocity=return_step0_velocity, vae=vae, decode=decode, preview=preview,
        )

    def edit(
        self,
        image: Image.Image,
        prompt: str,
        *,
        num_timesteps: int = _E.num_timesteps,
        timestep_shift: float = _E.timestep_shift,
        cfg_text_scale: float = _E.cfg_text_scale,
        cfg_img_scale: float = _E.cfg_img_scale,
        cfg_interval: tuple[float, float] = _E.cfg_interval,
        cfg_renorm_min: float = _E.cfg_renorm_min,
        cfg_renorm_type: str = _E.cfg_renorm_type,
        seed: int | None = 0,
        think: bool = False,
        think_max_new_tokens: int = _E.think_max_new_tokens,
        think_do_sample: bool = _E.think_do_sample,
        think_temperature: float = _E.think_temperature,
        vae_noise: Tensor | None = None,
        initial_noise: Tensor | None = None,
        progress: ProgressFn | None = None,
        cancel: CancelFn | None = None,
        return_step0_velocity: bool = False,
        source_latent: Tensor | None = None,
        vae=None,
        decode: bool = True,
        preview: PreviewFn | None = None,
    ) -> GenerationResult:
        """Edit ``image`` following ``prompt`` (docs/bagel.md §5.4); output size = the VAE-resized source size.

        The source goes through the VAE (clean latents, gen expert) and the ViT (und expert); the
        ``cfg_text`` branch sees the image without the text, ``cfg_img`` the text without the image.
        Arguments as in :meth:`text_to_image` (edit defaults: image scale 2.0, interval (0, 1],
        ``text_channel`` renorm), plus ``vae_noise`` (``[1, 16, H/8, W/8]`` noise of the stochastic VAE
        encode, drawn first from the seeded generator when not given).

        ``source_latent``: the source's ``[1, 16, H/8, W/8]`` latent in BAGEL's convention (e.g.
        :func:`~.latents.from_comfy_latent` of ComfyUI's ``VAEEncode``, a posterior mean where the official
        encode samples); the encode is skipped. ``H, W`` are the VAE-resized source size (the output
        size, multiples of 16); ``image`` still feeds the ViT. ``vae``/``decode`` as in :meth:`text_to_image`.
        """
        _check_prompt(prompt)
        check_image(image, "image")
        settings = FlowSettings.create(
            num_timesteps, timestep_shift, cfg_text_scale, cfg_img_scale, cfg_interval, cfg_renorm_min,
            cfg_renorm_type,
        )
        plan = _ThinkSettings.create(think, think_max_new_tokens, think_do_sample, think_temperature)
        return self._generate(
            "edit", prompt, image, settings, seed=seed, think=plan, vae_noise=vae_noise,
            initial_noise=initial_noise, progress=progress, cancel=cancel,
            return_step0_velocity=return_step0_velocity, source_latent=source_latent, vae=vae, decode=decode,
            preview=preview,
        )

    def _generate(
        self,
        task: Task,
        prompt: str,
        image: Image.Image | None,
        settings: FlowSettings,
        *,
        seed: int | None,
        think: "_ThinkSettings | None",
        width: int | None = None,
        height: int | None = None,
        vae_noise: Tensor | None = None,
        initial_noise: Tensor | None = None,
        progress: ProgressFn | None = None,
        cancel: CancelFn | None = None,
        return_step0_velocity: bool = False,
        source_latent: Tensor | None = None,
        vae=None,
        decode: bool = True,
        preview: "PreviewFn | None" = None,
    ) -> GenerationResult:
        """Shared body of :meth:`text_to_image` (``image`` None, explicit size) and :meth:`edit`."""
        seed = _check_seed(seed)
        _check_bool("decode", decode)
        if source_latent is not None and image is None:
            raise ValueError("`source_latent` is the latent of an edit's source image; text-to-image takes none")
        # a missing VAE is refused before any forward
        if image is not None and source_latent is None:
            self.resolve_vae(vae, "encode the source image")
        if decode:
            self.resolve_vae(vae, "decode the latents")
        # gen context: [system] [VAE image, ViT image] prompt [plan], then the latent block (1 position)
        used = generation_positions(self.loaded.tokenizer, prompt, has_image=image is not None,
                                    think=think is not None)
        self._check_positions(used, 0, "prompt")
        if think is not None:
            # the plan is decoded (<= think.max_new_tokens positions) and then re-fed as a text block
            self._check_positions(used, think.max_new_tokens + 2, "think_max_new_tokens")
        generator = seeded_generator(seed)
        session = self.start_session(task, settings.num_timesteps - 1)
        with torch.inference_mode():
            t0 = time.perf_counter()
            contexts = self.build_generation_contexts(
                task, prompt, image=image, width=width, height=height, think=think is not None,
                generator=generator, vae_noise=vae_noise, session=session, source_latent=source_latent, vae=vae,
            )
            t1 = time.perf_counter()
            think_text = None
            if think is not None:
                plan_ctx = Context(session.fork(contexts.gen.cache, "plan"), contexts.gen.rope)
                think_text, _ = self.decode_text(
                    plan_ctx, max_new_tokens=think.max_new_tokens, do_sample=think.do_sample,
                    temperature=think.temperature, generator=generator, progress=progress, cancel=cancel,
                    draw_discarded_sample=True, session=session, branch="plan",
                )
                session.release("plan")
                del plan_ctx
                C.append_text(self.loaded, contexts.gen, think_text)
            t2 = time.perf_counter()
            lp = self.loaded.config.latent_downsample
            shape = ((contexts.height // lp) * (contexts.width // lp), self.loaded.config.patch_latent_dim)
            if initial_noise is None:
                x = torch.randn(shape, generator=generator, dtype=torch.float32)
            else:
                x = check_noise("initial_noise", initial_noise, shape).float().clone()
            x = x.to(self.loaded.device)
            x, forwards, step0 = self.denoise(
                contexts, x, settings, progress=progress, cancel=cancel, return_step0_velocity=return_step0_velocity,
                preview=preview,
            )
            t3 = time.perf_counter()
            latent, picture = self.decode_latents(x, contexts.height, contexts.width, vae=vae, decode=decode)
            t4 = time.perf_counter()
        scale, shift = latent_factors(self.loaded.config)
        used_vae = self.resolve_vae(vae) if decode else None
        info = {
            "prefill_s": t1 - t0, "think_s": t2 - t1, "denoise_s": t3 - t2, "decode_s": t4 - t3,
            "context_tokens": {name: ctx.num_tokens for name, ctx in contexts.branches().items()},
            "cache_bytes": {name: ctx.cache.nbytes() for name, ctx in contexts.branches().items()},
            "forwards": forwards,
            "vae": None if used_vae is None else ("checkpoint" if used_vae is self.loaded.vae else "external"),
            "source_latent": contexts.source_latent,
            "latent_format": {"convention": "bagel", "scale_factor": scale, "shift_factor": shift},
        }
        logger.info("%s %dx%d: %d steps in %.2fs", task, contexts.width, contexts.height, settings.num_timesteps - 1,
                    t3 - t2)
        return GenerationResult(
            image=picture, latents=latent, num_steps=settings.num_timesteps - 1, seed=seed, info=info,
            think_text=think_text, step0_velocity=step0, kv_report=session.finish(),
        )
