"""The task nodes: ``UniCacheTextToImage``, ``UniCacheImageEdit``, ``UniCacheUnderstand`` (ComfyUI V3 nodes).

Each one declares its inputs once (:mod:`.task_inputs`) and runs through one helper, :func:`run_task`: it checks
the inputs, warns about a request that runs but may not do what was meant (on the node and in the log:
:func:`~unicache_core.bagel.notices.request_warnings`), asks ComfyUI to place the model (with the request's
predicted memory), runs one :class:`~unicache_core.bagel.BagelPipeline` procedure per image of the batch with the
KV cache of the connected ``UNICACHE_KV`` (full when none) and converts the outputs. Progress goes to ComfyUI's
progress bar per denoising step or decoded token, with a live preview of the clean-latent estimate per step when
the host runs with ``--preview-method`` (latent2rgb: a linear projection, no VAE decode); Cancel stops the engine
between steps (ComfyUI then reports ``execution_interrupted``).
"""

from __future__ import annotations

import logging
from functools import partial

from unicache_core.bagel import BagelPipeline, ImageTransforms, RunHooks
from unicache_core.bagel.notices import request_warnings, trained_images
from unicache_core.bagel.request_check import CheckedRequest, check_request, check_single
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
from unicache_core.compression import Method, make_cache_factory
from unicache_core.compression.report_view import chart_data
from unicache_core.errors import CancelledError
from unicache_core.kv.token_types import Task

from . import host
from .base import CATEGORY, REPORT, UniCacheNode, warnings_ui
from .convert import ComfyVAEAdapter, from_comfy_latent, image_to_pils, pils_to_image, to_comfy_latent
from .host import io
from .items_nodes import check_items, memory_of, request_items, request_of
from .model import BagelModel
from .task_inputs import (
    generation_inputs,
    generation_outputs,
    items_input,
    kv_input,
    model_input,
    prompt_input,
    seed_input,
    settings_of,
    taylorseer_input,
    think_input,
    vae_input,
)
from .validation import check_source_latent, fit_source_latent

logger = logging.getLogger(__name__)

GENERATION = ("t2i", "edit")


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


def _source_latents(latent, count: int, loaded) -> list:
    """The ``LATENT`` input (core VAEEncode, ComfyUI's FLUX convention, any size) → one BAGEL latent per source
    image, on BAGEL's grid (:func:`~.validation.fit_source_latent`; the edit's output takes its size)."""
    samples = check_source_latent(latent, loaded.config.ae.z_channels)
    if samples.shape[0] not in (1, count):
        raise ValueError(f"`latent` holds {samples.shape[0]} latents for {count} images; encode the same batch")
    samples, _ = fit_source_latent(samples, loaded.config)
    return [from_comfy_latent(samples[min(i, samples.shape[0] - 1) :][:1], loaded) for i in range(count)]


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


def _settings(task: Task, inputs: dict):
    """The node's widgets as the engine's settings (the ``task`` preset's other values)."""
    if task == "understanding":
        keys = ("max_new_tokens", "do_sample", "temperature", "think")
        return preset(task, **{k: inputs[k] for k in keys})
    size = {"width": inputs["width"], "height": inputs["height"]} if task == "t2i" else {}
    return preset(task, **settings_of(inputs), **size)


def _requests(model: BagelModel, task: Task, prior: list, sources: list, prompt: str, latents: list, settings):
    """The request of each image of the batch (``sources``: None for text to image and a text-only question), checked
    and tokenised once: the memory plan and the engine run the same record. With an item chain, its items and then
    the node's own image and prompt; else the single-image call ``[image, prompt]``."""
    config, tokenizer = model.loaded.config, model.loaded.tokenizer
    if prior:
        return [
            check_request(config, tokenizer, task, request_of(prior, source, prompt, latent), settings)
            for source, latent in zip(sources, latents)
        ]
    return [
        check_single(config, tokenizer, task, prompt, source, settings, latent=latent)
        for source, latent in zip(sources, latents)
    ]


def _procedure(pipe: BagelPipeline, request: CheckedRequest):
    """The engine call of one image of the batch."""
    if request.generation:
        return partial(pipe.generate_request, request)
    return partial(pipe.understand_request, request)


def request_notes(model: BagelModel, request: CheckedRequest) -> list[str]:
    """The warnings about the node's checked request (its chain's items, its first image and its prompt)."""
    items = list(request.items)
    return request_warnings(request.task, items, model.loaded.config, trained=trained_images(model.checkpoint_dir))


def run_task(node: str, task: Task, inputs: dict) -> io.NodeOutput:
    """Run one task node (``task``: ``t2i``, ``edit`` or ``understanding``) on its input values ``inputs``."""
    settings = _settings(task, inputs)
    model, prompt = inputs["model"], inputs["prompt"]
    image, latent, vae = inputs.get("image"), inputs.get("latent"), inputs.get("vae")
    _check_model(model)
    loaded = model.loaded
    if task == "t2i":
        check_output_size(loaded.config, inputs["width"], inputs["height"])  # before anything is loaded
    sources = image_to_pils(image, "image") if image is not None else [None]
    latents = [None] * len(sources)
    if latent is not None:
        latents = _source_latents(latent, len(sources), loaded)
    check_prompt(prompt)  # before the tokenizer or a VAE sees it (a lone surrogate can arrive in a /prompt JSON)
    if task == "edit" and latent is None and vae is not None:
        latents = _encode_sources(vae, loaded, sources)
    prior = _chain_items(inputs.get("items"), loaded, vae if task in GENERATION else None)
    requests = _requests(model, task, prior, sources, prompt, latents, settings)
    kv = inputs.get("kv")
    memory = memory_of(loaded, requests[0], kv)
    ui = warnings_ui(node, request_notes(model, requests[0]))
    external = _external_vae(loaded, vae) if task in GENERATION else None
    pipe = _pipeline(model, kv, memory)
    generation = task in GENERATION
    progress = _Progress(len(sources), settings.num_timesteps - 1 if generation else settings.max_new_tokens, loaded)
    results = []
    for i, request in enumerate(requests):
        progress.item = i
        seeded = dict(seed=(inputs["seed"] + i) % (MAX_SEED + 1), hooks=_hooks(progress, preview=generation))
        if generation:
            seeded["vae"] = external
        results.append(_run(_procedure(pipe, request), **seeded))
    if generation:
        return io.NodeOutput(*_generation_outputs(results, pipe), ui=ui)
    text = "\n\n".join(r.text for r in results)
    report = _merge_reports([r.kv_report for r in results])
    return io.NodeOutput(text, report, ui={"text": [text], "unicache_kv": [chart_data(report)], **ui})


# ------------------------------------------------------------------------------------------- nodes


class UniCacheTextToImage(UniCacheNode):
    @classmethod
    def define_schema(cls):
        d = T2I_DEFAULTS

        def side(name: str, default: int):
            tip = f"Output {name} in pixels (multiple of 16)."
            return io.Int.Input(name, default=default, min=16, max=1024, step=16, tooltip=tip)

        return io.Schema(
            node_id="UniCacheTextToImage",
            display_name="UniCache BAGEL Text to Image",
            category=CATEGORY,
            description="Text-to-image with BAGEL; the KV cache is compressed by the connected UniCache KV Config "
            "(full when none). Outputs the image, its latent (FLUX convention), the think-mode plan and the KV "
            "report.",
            inputs=[
                model_input(),
                prompt_input(
                    "a large red circle at the top left on a white background",
                    "What to draw. The bundled unicache-shapes model knows the shapes world: 'a small blue square "
                    "at the center and a large yellow triangle at the bottom right on a gray background' "
                    "(docs/shapes.md).",
                ),
                side("width", d.width),
                side("height", d.height),
                *generation_inputs(d),
                # optional inputs added later go last (items last of all): saved workflows keep their slots
                kv_input(),
                vae_input(),
                taylorseer_input(),
                items_input(),
            ],
            outputs=generation_outputs(),
        )

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        return run_task("Text to Image", "t2i", inputs)


class UniCacheImageEdit(UniCacheNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="UniCacheImageEdit",
            display_name="UniCache BAGEL Image Edit",
            category=CATEGORY,
            description="Edits image(s) following the prompt with BAGEL (each image of a batch is edited on its "
            "own; item i uses seed + i). The output size is the source resized by the checkpoint's VAE rule, or, "
            "with a `latent` connected, the latent's size (any size up to 1024 px per side, rounded down to "
            "BAGEL's 16-px grid). The KV cache is compressed by the connected UniCache KV Config (full when none).",
            inputs=[
                model_input(),
                io.Image.Input("image", tooltip="The source image(s) to edit."),
                prompt_input(
                    "change the background to black",
                    "The edit instruction. unicache-shapes knows: make the <colour> <shape> <colour>, move the "
                    "<colour> <shape> to the <position>, add a <size> <colour> <shape> at the <position>, remove "
                    "the <colour> <shape>, change the background to <colour>.",
                ),
                *generation_inputs(EDIT_DEFAULTS),
                kv_input(),
                vae_input(),
                io.Latent.Input(
                    "latent",
                    optional=True,
                    tooltip="Optional source latent from core VAEEncode of any size (its posterior mean is used "
                    "instead of encoding the image with the checkpoint's VAE). The output follows its size, "
                    "rounded down to BAGEL's 16-px grid (an odd last latent row or column is dropped); the image "
                    "is resized to that size for BAGEL's ViT. At most 1024 px per side.",
                ),
                taylorseer_input(),
                items_input(),
            ],
            outputs=generation_outputs(),
        )

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        return run_task("Image Edit", "edit", inputs)


class UniCacheUnderstand(UniCacheNode):
    @classmethod
    def define_schema(cls):
        d = UNDERSTANDING_DEFAULTS
        lo, hi = TEMPERATURE_RANGE
        return io.Schema(
            node_id="UniCacheUnderstand",
            display_name="UniCache BAGEL Understand",
            category=CATEGORY,
            description="Answers a prompt about an image (or a text-only prompt) with BAGEL; the KV cache is "
            "compressed by the connected UniCache KV Config (full when none) before the first answer token. A "
            "batch of images is answered one by one.",
            is_output_node=True,
            inputs=[
                model_input(),
                prompt_input(
                    "what color is the circle?",
                    "The question or instruction. unicache-shapes answers: what color is the <shape>?, what shape "
                    "is the <colour> object?, how many shapes are there?, where is the <colour> <shape>?, is there "
                    "a <colour> <shape>?, what color is the background?",
                ),
                io.Int.Input(
                    "max_new_tokens",
                    default=d.max_new_tokens,
                    min=1,
                    max=32768,
                    step=1,
                    tooltip="Most answer tokens to decode.",
                ),
                io.Boolean.Input("do_sample", default=d.do_sample, tooltip="Sample tokens (else greedy)."),
                io.Float.Input(
                    "temperature",
                    default=d.temperature,
                    min=lo,
                    max=hi,
                    step=0.05,
                    round=0.001,
                    tooltip="Sampling temperature (used when do_sample is on).",
                ),
                seed_input(),
                think_input("Reason first (think mode system prompt); the answer includes the reasoning."),
                io.Image.Input("image", optional=True, tooltip="The image(s) to ask about; none = a text-only prompt."),
                kv_input(),
                items_input(),
            ],
            outputs=[
                io.String.Output(
                    "text", display_name="text", tooltip="The answer (one paragraph per image of a batch)."
                ),
                REPORT.Output(
                    "kv_report",
                    display_name="kv_report",
                    tooltip="The KV-cache report of the run (connect to UniCache KV Report).",
                ),
            ],
        )

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        return run_task("Understand", "understanding", inputs)
