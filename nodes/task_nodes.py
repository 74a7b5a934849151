"""The task nodes: ``UniCacheTextToImage``, ``UniCacheImageEdit``, ``UniCacheUnderstand``.

Each one checks its inputs, asks ComfyUI to place the model (with the request's predicted memory), runs one
:class:`~unicache_core.bagel.BagelPipeline` procedure with the KV cache of the connected ``UNICACHE_KV``
(full when none) and converts the outputs. Progress goes to ComfyUI's progress bar per denoising step or
decoded token, with a live preview of the clean-latent estimate per step when the host runs with
``--preview-method`` (latent2rgb: a linear projection, no VAE decode); Cancel stops the engine between steps
(ComfyUI then reports ``execution_interrupted``).
"""

from __future__ import annotations

import logging

from unicache_core.bagel import BagelPipeline, GivenLatents, ImageTransforms, RunHooks
from unicache_core.bagel.accounting import count_request
from unicache_core.bagel.comfy_placement import memory_required
from unicache_core.bagel.seeding import MAX_SEED
from unicache_core.bagel.settings import (
    EDIT_DEFAULTS,
    T2I_DEFAULTS,
    TEMPERATURE_RANGE,
    UNDERSTANDING_DEFAULTS,
    check_output_size,
    check_prompt,
    preset,
)
from unicache_core.bagel.taylorseer import taylorseer_order
from unicache_core.compression import Method, make_cache_factory
from unicache_core.compression.report_view import chart_data
from unicache_core.errors import CancelledError

from . import host
from .convert import ComfyVAEAdapter, from_comfy_latent, image_to_pils, pils_to_image, to_comfy_latent
from .items_nodes import ITEMS_INPUT, check_items, kv_name, memory_of, request_items, request_of
from .model import BagelModel
from .task_inputs import (
    KV_INPUT,
    OUTPUT_NAMES,
    OUTPUT_TOOLTIPS,
    OUTPUTS,
    TAYLORSEER_INPUT,
    VAE_INPUT,
    generation_inputs,
    prompt_input,
    seed_input,
)
from .validation import check_source_latent, check_widgets, fit_source_latent

logger = logging.getLogger(__name__)


def _check_model(model) -> None:
    if not isinstance(model, BagelModel):
        raise ValueError(f"`model` must come from the UniCache BAGEL Loader node, got {type(model).__name__}")


def _pipeline(model, kv, memory: int) -> BagelPipeline:
    _check_model(model)
    if kv is not None and not isinstance(kv, Method):
        raise ValueError(f"`kv` must come from the UniCache KV Config node, got {type(kv).__name__}")
    host.load_to_device(model.patcher, memory)
    factory = make_cache_factory(kv if kv is not None else "full", checkpoint_dir=model.checkpoint_dir)
    return BagelPipeline(model.runtime(), factory)


class _Progress:
    """ComfyUI progress over the items of a batch (each item reports ``done/total`` of its own run)."""

    def __init__(self, items: int, per_item: int, loaded=None):
        self.items, self.per_item, self.item = items, max(1, per_item), 0
        self.bar = host.progress_callback(items * self.per_item)
        self.loaded = loaded

    def __call__(self, done: int, total: int, latent=None) -> None:
        if total != self.per_item:  # think mode: the plan tokens first, then the steps
            self.bar(done, total, latent)
        else:
            self.bar(self.item * self.per_item + done, self.items * self.per_item, latent)

    def preview(self, done: int, total: int, x0) -> None:
        """The engine's per-step clean-latent estimate (BAGEL convention) as a live preview in ComfyUI's convention."""
        self(done, total, to_comfy_latent(x0.cpu(), self.loaded))


def _run(call, *args, **kwargs):
    """``call(*args, **kwargs)``, one engine call (its hooks poll ComfyUI's interrupt); an engine cancel becomes
    ComfyUI's interrupt."""
    try:
        return call(*args, **kwargs)
    except CancelledError:
        host.raise_interrupt()


def _hooks(progress: _Progress, *, preview: bool) -> RunHooks:
    return RunHooks(progress=progress, cancel=host.interrupted, preview=progress.preview if preview else None)


def _memory(model: BagelModel, task: str, prompt: str, settings, source_size=None, vae_size=None, kv=None) -> int:
    """The ``memory_required`` of the request for ComfyUI: the memory plan's peak above the weights under the KV
    method ``kv`` (None: full KV), :func:`unicache_core.bagel.comfy_placement.memory_required`; ``vae_size``: an
    edit's output size set by its source latent."""
    check_prompt(prompt)  # before the tokenizer sees it (a lone surrogate can arrive in a /prompt JSON)
    loaded = model.loaded
    tokens = count_request(
        loaded.config, loaded.tokenizer, task, prompt, settings, source_size=source_size, vae_size=vae_size
    )
    return memory_required(loaded.config, loaded.dtype, tokens, kv_name(kv), taylor_order=taylorseer_order(settings))


def _external_vae(loaded, vae):
    """The connected ComfyUI VAE as the engine's external VAE (None: the checkpoint's own); a clear error
    (before anything loads) when the checkpoint has no VAE and none is connected."""
    if vae is not None:
        return ComfyVAEAdapter(vae, loaded)
    if getattr(loaded, "vae", None) is None:
        raise ValueError(
            "this checkpoint has no VAE of its own (a single-file checkpoint): connect a core VAELoader "
            "with the FLUX ae.safetensors (models/vae) to the `vae` input"
        )
    return None


def _encode_sources(vae, loaded, sources) -> list:
    """Encode the sources with ComfyUI's VAE *before* BAGEL is placed on the device: ComfyUI may offload other
    models to load its VAE, which must not happen to BAGEL in the middle of an edit. Same as the engine's own
    external-VAE encode (the VAE resize rule, then the adapter)."""
    adapter, transforms = ComfyVAEAdapter(vae, loaded), ImageTransforms.from_config(loaded.config)
    return [adapter.encode(transforms.vae(transforms.prepare(s, "image")).unsqueeze(0)) for s in sources]


def _source_latents(latent, count: int, loaded) -> tuple[list, tuple[int, int]]:
    """The ``LATENT`` input (core VAEEncode, ComfyUI's FLUX convention, any size) → one BAGEL latent per source
    image, on BAGEL's grid (:func:`~.validation.fit_source_latent`), and the edit's output ``(width, height)``."""
    samples = check_source_latent(latent, loaded.config.ae.z_channels)
    if samples.shape[0] not in (1, count):
        raise ValueError(f"`latent` holds {samples.shape[0]} latents for {count} images; encode the same batch")
    samples, size = fit_source_latent(samples, loaded.config)
    return [from_comfy_latent(samples[min(i, samples.shape[0] - 1) :][:1], loaded) for i in range(count)], size


def _chain_items(items, loaded, vae) -> list:
    """The engine's items of an item chain; a ComfyUI ``vae`` encodes its images now, before BAGEL is placed."""
    return request_items(check_items(items), loaded, vae and (lambda pil: _encode_sources(vae, loaded, [pil])[0]))


def _merge_reports(reports: list[dict]) -> dict:
    if len(reports) == 1:
        return reports[0]
    merged = dict(reports[0])
    merged["batch"] = [r.get("summary") for r in reports]
    return merged


def _generation_outputs(results, pipe: BagelPipeline) -> tuple:
    import torch

    image = pils_to_image([r.image for r in results])
    latent = {"samples": torch.cat([to_comfy_latent(r.latents.cpu(), pipe.loaded) for r in results], dim=0)}
    thinking = "\n\n".join(r.think_text or "" for r in results).strip()
    return image, latent, thinking, _merge_reports([r.kv_report for r in results])


def _generation_settings(
    task,
    steps,
    cfg_text_scale,
    cfg_img_scale,
    cfg_interval_lo,
    cfg_interval_hi,
    timestep_shift,
    cfg_renorm_min,
    cfg_renorm_type,
    think,
    **size,
):
    """The widgets of a generation node as the engine's settings (``size``: the output size, ``taylorseer``; the
    ``task`` preset's other values)."""
    if cfg_interval_lo > cfg_interval_hi:
        raise ValueError(f"cfg_interval_lo ({cfg_interval_lo}) must not exceed cfg_interval_hi ({cfg_interval_hi})")
    return preset(
        task,
        num_timesteps=steps,
        cfg_text_scale=cfg_text_scale,
        cfg_img_scale=cfg_img_scale,
        cfg_interval=(cfg_interval_lo, cfg_interval_hi),
        timestep_shift=timestep_shift,
        cfg_renorm_min=cfg_renorm_min,
        cfg_renorm_type=cfg_renorm_type,
        think=think,
        **size,
    )


# ------------------------------------------------------------------------------------------- nodes


class UniCacheTextToImage:
    DESCRIPTION = (
        "Text-to-image with BAGEL; the KV cache is compressed by the connected UniCache KV Config (full "
        "when none). Outputs the image, its latent (FLUX convention), the think-mode plan and the KV report."
    )
    CATEGORY = "UniCache/BAGEL"
    FUNCTION = "generate"
    RETURN_TYPES = OUTPUTS
    RETURN_NAMES = OUTPUT_NAMES
    OUTPUT_TOOLTIPS = OUTPUT_TOOLTIPS

    @classmethod
    def INPUT_TYPES(cls):
        d = T2I_DEFAULTS
        size = {"min": 16, "max": 1024, "step": 16}
        return {
            "required": {
                "model": ("BAGEL_MODEL", {"tooltip": "From UniCache BAGEL Loader."}),
                "prompt": prompt_input(
                    "a large red circle at the top left on a white background",
                    "What to draw. The bundled unicache-shapes model knows the shapes world: "
                    "'a small blue square at the center and a large yellow triangle at the bottom right "
                    "on a gray background' (docs/shapes.md).",
                ),
                "width": ("INT", {"default": d.width, **size, "tooltip": "Output width in pixels (multiple of 16)."}),
                "height": (
                    "INT",
                    {"default": d.height, **size, "tooltip": "Output height in pixels (multiple of 16)."},
                ),
                **generation_inputs(d),
            },
            # optional inputs added later go last (items last of all): saved workflows keep their slots
            "optional": {"kv": KV_INPUT, "vae": VAE_INPUT, "taylorseer": TAYLORSEER_INPUT, "items": ITEMS_INPUT},
        }

    @classmethod
    def VALIDATE_INPUTS(
        cls,
        width,
        height,
        cfg_text_scale,
        cfg_img_scale,
        cfg_interval_lo,
        cfg_interval_hi,
        timestep_shift,
        cfg_renorm_min,
    ):
        return check_widgets(
            cls,
            width=width,
            height=height,
            cfg_text_scale=cfg_text_scale,
            cfg_img_scale=cfg_img_scale,
            cfg_interval_lo=cfg_interval_lo,
            cfg_interval_hi=cfg_interval_hi,
            timestep_shift=timestep_shift,
            cfg_renorm_min=cfg_renorm_min,
        )

    def generate(
        self,
        model,
        prompt,
        width,
        height,
        steps,
        seed,
        cfg_text_scale,
        cfg_img_scale,
        cfg_interval_lo,
        cfg_interval_hi,
        timestep_shift,
        cfg_renorm_min,
        cfg_renorm_type,
        think,
        kv=None,
        vae=None,
        taylorseer=False,
        items=None,
    ):
        settings = _generation_settings(
            "t2i",
            steps,
            cfg_text_scale,
            cfg_img_scale,
            cfg_interval_lo,
            cfg_interval_hi,
            timestep_shift,
            cfg_renorm_min,
            cfg_renorm_type,
            think,
            taylorseer=taylorseer,
            width=width,
            height=height,
        )
        _check_model(model)
        check_output_size(model.loaded.config, width, height)  # before anything is loaded onto the device
        memory = _memory(model, "t2i", prompt, settings, kv=kv)
        prior = _chain_items(items, model.loaded, vae)
        if prior:  # the chain's items, then the prompt
            memory = memory_of(model.loaded, "t2i", request_of(prior, None, prompt), settings, kv)
        external = _external_vae(model.loaded, vae)
        pipe = _pipeline(model, kv, memory)
        progress = _Progress(1, steps - 1, model.loaded)
        hooks = _hooks(progress, preview=True)
        if prior:
            result = _run(
                pipe.generate, "t2i", request_of(prior, None, prompt), settings, seed=seed, hooks=hooks, vae=external
            )
        else:
            result = _run(pipe.text_to_image, prompt, settings, seed=seed, hooks=hooks, vae=external)
        return _generation_outputs([result], pipe)


class UniCacheImageEdit:
    DESCRIPTION = (
        "Edits image(s) following the prompt with BAGEL (each image of a batch is edited on its own; "
        "item i uses seed + i). The output size is the source resized by the checkpoint's VAE rule, or, "
        "with a `latent` connected, the latent's size (any size up to 1024 px per side, rounded down to "
        "BAGEL's 16-px grid). The KV cache is compressed by the connected UniCache KV Config (full when "
        "none)."
    )
    CATEGORY = "UniCache/BAGEL"
    FUNCTION = "edit"
    RETURN_TYPES = OUTPUTS
    RETURN_NAMES = OUTPUT_NAMES
    OUTPUT_TOOLTIPS = OUTPUT_TOOLTIPS

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("BAGEL_MODEL", {"tooltip": "From UniCache BAGEL Loader."}),
                "image": ("IMAGE", {"tooltip": "The source image(s) to edit."}),
                "prompt": prompt_input(
                    "change the background to black",
                    "The edit instruction. unicache-shapes knows: make the <colour> <shape> <colour>, move "
                    "the <colour> <shape> to the <position>, add a <size> <colour> <shape> at the "
                    "<position>, remove the <colour> <shape>, change the background to <colour>.",
                ),
                **generation_inputs(EDIT_DEFAULTS),
            },
            "optional": {
                "kv": KV_INPUT,
                "vae": VAE_INPUT,
                "latent": (
                    "LATENT",
                    {
                        "tooltip": "Optional source latent from core VAEEncode of any size (its posterior "
                        "mean is used instead of encoding the image with the checkpoint's VAE). "
                        "The output follows its size, rounded down to BAGEL's 16-px grid (an odd "
                        "last latent row or column is dropped); the image is resized to that "
                        "size for BAGEL's ViT. At most 1024 px per side."
                    },
                ),
                "taylorseer": TAYLORSEER_INPUT,
                "items": ITEMS_INPUT,
            },
        }

    @classmethod
    def VALIDATE_INPUTS(
        cls, cfg_text_scale, cfg_img_scale, cfg_interval_lo, cfg_interval_hi, timestep_shift, cfg_renorm_min
    ):
        return check_widgets(
            cls,
            cfg_text_scale=cfg_text_scale,
            cfg_img_scale=cfg_img_scale,
            cfg_interval_lo=cfg_interval_lo,
            cfg_interval_hi=cfg_interval_hi,
            timestep_shift=timestep_shift,
            cfg_renorm_min=cfg_renorm_min,
        )

    def edit(
        self,
        model,
        image,
        prompt,
        steps,
        seed,
        cfg_text_scale,
        cfg_img_scale,
        cfg_interval_lo,
        cfg_interval_hi,
        timestep_shift,
        cfg_renorm_min,
        cfg_renorm_type,
        think,
        kv=None,
        vae=None,
        latent=None,
        taylorseer=False,
        items=None,
    ):
        settings = _generation_settings(
            "edit",
            steps,
            cfg_text_scale,
            cfg_img_scale,
            cfg_interval_lo,
            cfg_interval_hi,
            timestep_shift,
            cfg_renorm_min,
            cfg_renorm_type,
            think,
            taylorseer=taylorseer,
        )
        sources = image_to_pils(image, "image")
        _check_model(model)
        latents, size = [None] * len(sources), None
        if latent is not None:
            latents, size = _source_latents(latent, len(sources), model.loaded)
        memory = _memory(model, "edit", prompt, settings, source_size=sources[0].size, vae_size=size, kv=kv)
        if latent is None and vae is not None:
            latents = _encode_sources(vae, model.loaded, sources)
        prior = _chain_items(items, model.loaded, vae)
        if prior:  # the chain's items, then each source and the prompt
            memory = memory_of(model.loaded, "edit", request_of(prior, sources[0], prompt, latents[0]), settings, kv)
        external = _external_vae(model.loaded, vae)
        pipe = _pipeline(model, kv, memory)
        progress = _Progress(len(sources), steps - 1, model.loaded)
        results = []
        for i, (source, z) in enumerate(zip(sources, latents)):
            progress.item = i
            seeded = dict(seed=(seed + i) % (MAX_SEED + 1), hooks=_hooks(progress, preview=True), vae=external)
            if prior:
                results.append(_run(pipe.generate, "edit", request_of(prior, source, prompt, z), settings, **seeded))
            else:
                results.append(_run(pipe.edit, prompt, source, settings, given=GivenLatents(source_latent=z), **seeded))
        return _generation_outputs(results, pipe)


class UniCacheUnderstand:
    DESCRIPTION = (
        "Answers a prompt about an image (or a text-only prompt) with BAGEL; the KV cache is compressed by "
        "the connected UniCache KV Config (full when none) before the first answer token. A batch of "
        "images is answered one by one."
    )
    CATEGORY = "UniCache/BAGEL"
    FUNCTION = "understand"
    OUTPUT_NODE = True
    RETURN_TYPES = ("STRING", "UNICACHE_KV_REPORT")
    RETURN_NAMES = ("text", "kv_report")
    OUTPUT_TOOLTIPS = (
        "The answer (one paragraph per image of a batch).",
        "The KV-cache report of the run (connect to UniCache KV Report).",
    )

    @classmethod
    def INPUT_TYPES(cls):
        d = UNDERSTANDING_DEFAULTS
        lo, hi = TEMPERATURE_RANGE
        return {
            "required": {
                "model": ("BAGEL_MODEL", {"tooltip": "From UniCache BAGEL Loader."}),
                "prompt": prompt_input(
                    "what color is the circle?",
                    "The question or instruction. unicache-shapes answers: what color is the <shape>?, "
                    "what shape is the <colour> object?, how many shapes are there?, where is the "
                    "<colour> <shape>?, is there a <colour> <shape>?, what color is the background?",
                ),
                "max_new_tokens": (
                    "INT",
                    {
                        "default": d.max_new_tokens,
                        "min": 1,
                        "max": 32768,
                        "step": 1,
                        "tooltip": "Most answer tokens to decode.",
                    },
                ),
                "do_sample": ("BOOLEAN", {"default": d.do_sample, "tooltip": "Sample tokens (else greedy)."}),
                "temperature": (
                    "FLOAT",
                    {
                        "default": d.temperature,
                        "min": lo,
                        "max": hi,
                        "step": 0.05,
                        "round": 0.001,
                        "tooltip": "Sampling temperature (used when do_sample is on).",
                    },
                ),
                "seed": seed_input(),
                "think": (
                    "BOOLEAN",
                    {
                        "default": False,
                        "label_on": "think",
                        "label_off": "direct",
                        "tooltip": "Reason first (think mode system prompt); the answer includes the reasoning.",
                    },
                ),
            },
            "optional": {
                "image": ("IMAGE", {"tooltip": "The image(s) to ask about; none = a text-only prompt."}),
                "kv": KV_INPUT,
                "items": ITEMS_INPUT,
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, temperature):
        return check_widgets(cls, temperature=temperature)

    def understand(
        self, model, prompt, max_new_tokens, do_sample, temperature, seed, think, image=None, kv=None, items=None
    ):
        settings = preset(
            "understanding", max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, think=think
        )
        sources = image_to_pils(image, "image") if image is not None else [None]
        _check_model(model)
        memory = _memory(
            model, "understanding", prompt, settings, source_size=None if sources[0] is None else sources[0].size, kv=kv
        )
        prior = _chain_items(items, model.loaded, None)
        if prior:  # the chain's items, then each image and the prompt
            memory = memory_of(model.loaded, "understanding", request_of(prior, sources[0], prompt), settings, kv)
        pipe = _pipeline(model, kv, memory)
        progress = _Progress(len(sources), max_new_tokens)
        results = []
        for i, source in enumerate(sources):
            progress.item = i
            seeded = dict(seed=(seed + i) % (MAX_SEED + 1), hooks=_hooks(progress, preview=False))
            if prior:
                results.append(_run(pipe.understand_items, request_of(prior, source, prompt), settings, **seeded))
            else:
                results.append(_run(pipe.understand, prompt, source, settings, **seeded))
        text = "\n\n".join(r.text for r in results)
        report = _merge_reports([r.kv_report for r in results])
        return {"ui": {"text": [text], "unicache_kv": [chart_data(report)]}, "result": (text, report)}
