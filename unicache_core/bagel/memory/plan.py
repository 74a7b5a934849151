"""The device memory a BAGEL run will need, predicted before anything loads, and whether it fits.

:func:`plan_memory` adds up, for one request shape and one choice of settings:

- ``weights_device_<dtype>``: the bytes of BAGEL's weights on the compute device per stored dtype (counted from
  the config's tensor shapes as a build with that ``weight_dtype`` stores them, :mod:`.weight_layout`: nothing is
  built, so a config claiming millions of layers costs no more to plan than the real one);
  with ``offload="layers"`` only two decoder layers (the running one and the prefetched one) are there and
  the rest is ``weights_host``;
- ``vae``: the fp32 VAE's weights;
- ``working``: the larger of the two phases that never overlap (:func:`~.accounting.request_memory_parts`):
  - the LLM's: ``kv_held``, the KV the branches hold together before the first compression, plus its largest
    forward (``upcast`` + ``attention`` + ``mlp`` + a key-scoring method's ``kv_scoring``), or ``kv_held`` plus
    ``kv_compressing`` when the first branch is compressed (the KV terms: :mod:`.plan_kv`). ``upcast`` is, with
    low-precision storage, the largest weights upcast at once to the compute dtype (one decoder layer inside
    :func:`~.modeling.operations.shared_upcasts`, or ``lm_head``);
  - the VAE's encode or decode (``vae_working``): every source is encoded before any image or prompt token is
    cached (one at a time: the largest counts), and the pipeline releases the caches before it decodes.

Several input images (``PlanSettings.images``, the CLI's ``--image-sizes``) are counted in ``gen`` and ``cfg_text``
as the official contexts hold them (``settings.kv_images`` of :meth:`MemoryPlan.to_json`: each one's bytes).
TaylorSeer's factors (``taylorseer``, :func:`~.accounting.taylorseer_bytes`) add to the LLM phase when it is on.

On the CPU (``device="cpu"``) two parts the tensors do not show are added (:func:`cpu_runtime_parts`):

- ``cpu_kernel_cache``: oneDNN, which runs the bf16 matrix products and the VAE's convolutions on the CPU,
  compiles and keeps a kernel for every new operand shape (:data:`CPU_MATMUL_KERNEL_BYTES` each product
  shape, :data:`CPU_CONV_KERNEL_BYTES` each convolution shape), counted from the request's shapes;
- ``cpu_freed_heap`` and ``cpu_vae_heap`` (inside ``working``, detailed apart): glibc keeps memory that is freed
  resident when its blocks are under its largest mmap threshold (:data:`GLIBC_MMAP_THRESHOLD_MAX`), and a new
  tensor seldom fits the holes: an LLM forward's resident set holds its activations about twice, a VAE pass
  holds about two of its largest such activations more than its tensors (an edit's decode also those of its
  encode).

On CUDA (``device="cuda"``) two parts measured on an H200 are added (:func:`cuda_runtime_parts`):

- ``cuda_runtime``: what CUDA allocates beside the request's tensors (cuBLAS's and cuBLASLt's workspaces, which
  PyTorch takes from its caching allocator), :data:`CUDA_RUNTIME_BYTES`;
- ``cuda_vae_workspace`` (inside ``working``, detailed apart): what the fp32 VAE's pass takes beyond its
  tensors (cuDNN's convolution workspaces), per pixel of its image: :data:`CUDA_VAE_DECODE_PER_PIXEL` for a
  decode, :data:`CUDA_VAE_ENCODE_PER_PIXEL` for an encode; ``vae_working`` is then the tensors of whichever
  pass needs more with it.

The peak is the sum of the parts not in :data:`NOT_IN_PEAK`; :func:`tensor_peak_bytes` is the peak without the
runtime's parts (CPU or CUDA). ``python -m benchmarks.gpu_real_size`` checks the CUDA plan phase by phase at
BAGEL-7B-MoT's geometry. ``python -m benchmarks.memory_plan_check`` checks both on the CPU, on the bundled and the
medium checkpoints, against a run's tensor accounting and the process's resident set. ``bagel-7b-mot`` plans
BAGEL-7B-MoT's geometry without any file (:data:`OFFICIAL_CHECKPOINT`).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...kv.token_types import Task
from ..config import BagelConfig, bagel_config_from_dicts, load_bagel_config
from ..settings import T2I_DEFAULTS
from .accounting import (
    PLAN_PROMPT_TOKENS,
    RequestTokens,
    request_memory_parts,
    request_tokens,
)
from .image_fit import suggest_fewer_images
from .phase_work import forward_bytes, llm_peak, phase_working, working_memory
from .plan_kv import KVPhase, kv_parts, kv_per_image, kv_phases
from .runtime import (
    CPU_CONV_KERNEL_BYTES,
    CPU_MATMUL_KERNEL_BYTES,
    CUDA_RUNTIME_BYTES,
    CUDA_VAE_DECODE_PER_PIXEL,
    CUDA_VAE_ENCODE_PER_PIXEL,
    GLIBC_MMAP_THRESHOLD_MAX,
    cpu_runtime_parts,
    cuda_runtime_parts,
    matmul_shapes,
)
from .vae import tiled_tokens

logger = logging.getLogger(__name__)

#: The ``--checkpoint`` name that plans BAGEL-7B-MoT's geometry from its published configs (no files).
OFFICIAL_CHECKPOINT = "bagel-7b-mot"
#: Breakdown entries that detail the peak's parts or lie outside it (the rest add up to ``peak_bytes``).
NOT_IN_PEAK = (
    "weights_host",
    "kv_full",
    "kv_shared",
    "kv_held",
    "kv_transient",
    "kv_scoring",
    "kv_compressed",
    "upcast",
    "upcast_attention",
    "attention",
    "mlp",
    "vae_working",
    "cpu_freed_heap",
    "cpu_vae_heap",
    "cuda_vae_workspace",
    "taylorseer",
    "taylorseer_official",
)
#: Tasks a plan accepts (the CLI's names).
PLAN_TASKS: dict[str, Task] = {"und": "understanding", "understand": "understanding", "t2i": "t2i", "edit": "edit"}
#: Weight dtypes tried, in order, when the chosen settings do not fit (cheapest in quality first).
FALLBACK_WEIGHTS = ("bf16", "fp8_e4m3fn", "int8")
#: The smallest ``--device-memory`` a plan accepts (64 MiB: less is no GPU, nor a machine running torch).
MIN_DEVICE_BYTES = 64 << 20


def official_config() -> BagelConfig:
    """BAGEL-7B-MoT's configuration (the published ``llm_config.json`` / ``vit_config.json``, kept once in
    :mod:`.checkpoint.single_file`)."""
    from ..checkpoint.single_file import OFFICIAL_LLM_CONFIG, OFFICIAL_VIT_CONFIG

    return bagel_config_from_dicts(dict(OFFICIAL_LLM_CONFIG), dict(OFFICIAL_VIT_CONFIG), source=OFFICIAL_CHECKPOINT)


def plan_config(checkpoint: str | Path) -> BagelConfig:
    """The configuration a plan uses: :func:`official_config` for ``bagel-7b-mot``, else the folder's JSON."""
    if str(checkpoint).lower() == OFFICIAL_CHECKPOINT:
        return official_config()
    return load_bagel_config(checkpoint)


def parse_memory_size(value: str) -> int:
    """``"24GB"``, ``"24 GiB"``, ``"1.5e10"`` → bytes (:func:`~unicache_core.sizes.parse_size`, >= 64 MiB)."""
    from ...sizes import parse_size

    return parse_size(value, "--device-memory", minimum=MIN_DEVICE_BYTES)


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of ``device``: the GPU's, or the machine's RAM for the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


@dataclass(frozen=True)
class PlanSettings:
    """What a plan is made for (the CLI's flags)."""

    task: str
    width: int
    height: int
    #: the KV method: a name (its defaults) or the configured method object (every setting of its own)
    kv_method: Any = "full"
    weight_dtype: str = "auto"
    dtype: str = "bf16"
    offload: str = "none"
    #: the device type planned for; ``"cpu"`` adds the CPU runtime's own memory (:func:`cpu_runtime_parts`)
    device: str = "cuda"
    #: ``(width, height)`` of each input image in request order (und, edit; text-to-image: references); empty: one
    #: input image of ``width x height`` for und and edit (none for an und of size 0), none for text-to-image
    images: tuple[tuple[int, int], ...] = ()
    #: TaylorSeer on (t2i and edit), keeping Taylor factors up to ``taylorseer_order``
    taylorseer: bool = False
    taylorseer_order: int = T2I_DEFAULTS.taylorseer_order
    #: the checkpoint folder the method's own files are found in (UniCache's policy table), as a run binds it; ``""``:
    #: BAGEL-7B-MoT's geometry (the shipped paper table)
    checkpoint: str = ""

    def to_dict(self) -> dict[str, Any]:
        from ...compression import method_from_name

        method = method_from_name(self.kv_method)
        return {
            **self.__dict__,
            "kv_method": method.name,
            "kv_settings": method.settings(),
            "images": [list(size) for size in self.images],
        }


@dataclass(frozen=True)
class MemoryPlan:
    """A plan's result (:meth:`to_json` is the CLI's JSON)."""

    peak_bytes: int
    breakdown: dict[str, int]
    device_bytes: int
    fits: bool
    suggestion: str | None
    settings: PlanSettings
    kv_branches: dict[str, int]
    #: ``"tiled"`` when the whole VAE decode would not fit and the plan counts the tiled one the pipeline falls
    #: back to on CUDA (:mod:`.modeling.vae_tiling`), else ``"whole"``
    vae_decode: str = "whole"
    #: each input image's uncompressed KV: ``{"size", "vae_tokens", "vit_tokens", "bytes_per_branch"}``
    kv_images: tuple[dict[str, Any], ...] = ()
    #: each phase's bytes on the device (weights, runtime and that phase's working memory), in the order they run:
    #: ``vae:encode``, ``prefill:item<j>``, ``denoise:first`` or ``decode`` (understanding), ``vae:decode``
    phases: tuple[tuple[str, int], ...] = ()
    #: the same without the runtime's own memory (CPU kernels and heap, CUDA workspaces): the tensors alone
    tensor_phases: tuple[tuple[str, int], ...] = ()

    @property
    def peak_phase(self) -> str:
        """The phase that reaches the peak (the first of equal ones)."""
        return max(self.phases, key=lambda phase: phase[1])[0] if self.phases else ""

    @property
    def above_weights(self) -> int:
        """The peak less the weights on the device and the VAE's: what a host keeps free beside the model
        (ComfyUI's ``memory_required``)."""
        weights = sum(v for k, v in self.breakdown.items() if k.startswith("weights_device_"))
        return self.peak_bytes - weights - self.breakdown.get("vae", 0)

    def to_json(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "breakdown": dict(self.breakdown),
            "device_bytes": self.device_bytes,
            "fits": self.fits,
            "suggestion": self.suggestion,
            "vae_decode": self.vae_decode,
            "peak_phase": self.peak_phase,
            "phases": dict(self.phases),
            "settings": {
                **self.settings.to_dict(),
                "kv_branches": dict(self.kv_branches),
                "kv_images": [dict(image) for image in self.kv_images],
            },
        }


@functools.lru_cache(maxsize=16)
def _weights(config: BagelConfig, weight_dtype: str, dtype: torch.dtype, offload: str) -> tuple[dict[str, int], int]:
    """(``weights_device_<dtype>``, ``weights_host``, ``vae``, ``upcast`` bytes, the compute dtype's element size),
    counted from the config's tensor shapes (:mod:`.weight_layout`): nothing is built, at any layer count."""
    from ..weight_layout import bagel_layout, vae_bytes, weight_bytes

    parts = weight_bytes(bagel_layout(config), weight_dtype, dtype, offload)
    upcast = parts.pop("upcast")
    parts["vae"] = vae_bytes(config.ae)
    parts["upcast"] = upcast
    return parts, dtype.itemsize


@functools.lru_cache(maxsize=16)
def _upcasts(config: BagelConfig, weight_dtype: str, upcast: int) -> tuple[int, int]:
    """(``upcast``, ``upcast_attention``): a decoder layer's upcast weights (``upcast``, :func:`_weights`) as a
    forward holds them: the whole layer during its MLP, the attention's during the attention call (a layer upcasts
    its Linears as they are called); fp8 e4m3fn adds one weight's int16 bits (:func:`~.modeling.operations.
    upcast_weight` goes through them) while the last is made: +136 MB at BAGEL-7B, measured on the CPU
    (docs/memory.md)."""
    from ..weight_layout import bagel_layout
    from ..weights import WEIGHT_DTYPES, parse_weight_dtype

    linear = [s for s in bagel_layout(config).llm_layer if s.role == "linear"]
    attention = [s for s in linear if s.name.startswith("self_attn.")]
    upcast_attention = upcast * sum(s.numel for s in attention) // max(1, sum(s.numel for s in linear))
    if upcast and WEIGHT_DTYPES[parse_weight_dtype(weight_dtype)] == torch.float8_e4m3fn:
        upcast += max(s.numel for s in linear) * 2
        upcast_attention += max(s.numel for s in attention) * 2
    return upcast, upcast_attention


def plan_memory(
    config: BagelConfig,
    settings: PlanSettings,
    device_bytes: int,
    *,
    prompt_tokens: int = PLAN_PROMPT_TOKENS,
    answer_tokens: int | None = None,
) -> MemoryPlan:
    """Predict the peak device memory of ``settings`` on a model of ``config`` (see the module docstring) and,
    when it does not fit ``device_bytes``, the cheapest setting that does (``suggestion``). ``prompt_tokens`` and
    ``answer_tokens`` (understanding) size the text (:func:`request_tokens`)."""
    import dataclasses

    plan = _predict(config, settings, device_bytes, prompt_tokens, answer_tokens)
    if plan.fits:
        return plan
    return dataclasses.replace(plan, suggestion=_suggest(config, settings, device_bytes))


def plan_without_suggestion(
    config: BagelConfig, settings: PlanSettings, device_bytes: int, tokens: RequestTokens | None = None
) -> MemoryPlan:
    """:func:`plan_memory` at the default text lengths (or of ``tokens``, a counted request) without searching for a
    setting that fits (what a search over settings calls)."""
    return _predict(config, settings, device_bytes, tokens=tokens)


def _predict(
    config: BagelConfig,
    settings: PlanSettings,
    device_bytes: int,
    prompt_tokens: int = PLAN_PROMPT_TOKENS,
    answer_tokens: int | None = None,
    tokens: RequestTokens | None = None,
) -> MemoryPlan:
    """:func:`plan_memory` without the suggestion (``tokens``: a request counted from its real texts instead)."""
    from ..checkpoint.loader import parse_dtype

    task = PLAN_TASKS[settings.task]
    dtype = parse_dtype(settings.dtype)
    images = tuple((int(w), int(h)) for w, h in settings.images) or None
    if tokens is None:
        tokens = request_tokens(config, task, settings.width, settings.height, prompt_tokens, answer_tokens, images)
    parts, _ = _weights(config, settings.weight_dtype, dtype, settings.offload)
    parts = dict(parts)
    parts["upcast"], parts["upcast_attention"] = _upcasts(config, settings.weight_dtype, parts["upcast"])
    kv_branches = tokens.kv_bytes(config, dtype)
    kv = kv_parts(config, dtype, tokens, settings.kv_method, checkpoint=settings.checkpoint)
    compressed = kv.pop("kv_compressed", None)
    parts.update(kv)
    work = request_memory_parts(
        config, dtype, tokens, taylor_order=settings.taylorseer_order if settings.taylorseer else None
    )
    parts["vae_working"] = work["vae"]
    if work["taylorseer"]:
        parts["taylorseer"] = work["taylorseer"]
        parts["taylorseer_official"] = work["taylorseer"] * config.llm.num_hidden_layers
    freed_heap, vae_heap = _runtime(parts, config, dtype, tokens, work, settings.device)
    llm_phases = kv_phases(config, dtype, tokens, settings.kv_method, checkpoint=settings.checkpoint)
    llm_peak(parts, llm_phases, config, dtype)
    parts["working"] = working_memory(parts, llm_phases, config, dtype, freed_heap, vae_heap)
    peak = sum(v for k, v in parts.items() if k not in NOT_IN_PEAK)
    vae_decode = "whole"
    if settings.device == "cuda" and peak > device_bytes:
        # the pipeline decodes in tiles when the whole decode runs out of device memory (.denoise)
        tiled = dict(parts, **cuda_runtime_parts(config, tokens, work, tiled=True))
        tiled["working"] = working_memory(tiled, llm_phases, config, dtype, 0, tiled["cuda_vae_workspace"])
        tiled_peak = sum(v for k, v in tiled.items() if k not in NOT_IN_PEAK)
        if tiled_peak < peak:
            parts, peak, vae_decode = tiled, tiled_peak, "tiled"
    if compressed is not None:
        parts["kv_compressed"] = compressed
    sizes = images if images is not None else ((settings.width, settings.height),)
    decode_tiled = vae_decode == "tiled"
    rows = _phase_bytes(parts, llm_phases, config, dtype, work, freed_heap, tokens, settings.device, decode_tiled)
    return MemoryPlan(
        peak_bytes=int(peak),
        breakdown=parts,
        device_bytes=int(device_bytes),
        fits=peak <= device_bytes,
        suggestion=None,
        settings=settings,
        kv_branches=kv_branches,
        vae_decode=vae_decode,
        kv_images=kv_per_image(
            config, dtype, tokens, sizes, kv_method=settings.kv_method, checkpoint=settings.checkpoint
        ),
        phases=tuple((name, size) for name, size, _ in rows),
        tensor_phases=tuple((name, tensors) for name, _, tensors in rows),
    )


def _phase_bytes(
    parts: dict[str, int],
    phases: list[KVPhase],
    config: BagelConfig,
    dtype: torch.dtype,
    work: dict[str, int],
    freed_heap: int,
    tokens: RequestTokens,
    device: str,
    tiled: bool,
) -> tuple[tuple[str, int, int], ...]:
    """Each phase's bytes on the device: the peak's fixed parts plus the phase's working memory (a VAE pass with its
    CUDA workspace or CPU heap, the decode whole or in tiles as the plan counts it), and the same without the
    runtime's own memory (kernels, heap, workspaces): what the tensors alone reach."""
    fixed = sum(v for k, v in parts.items() if k not in NOT_IN_PEAK and k != "working")
    pixels = config.latent_downsample**2
    decode = work["vae_decode_tiled" if tiled else "vae_decode"]
    encode_extra = decode_extra = parts.get("cpu_vae_heap", 0)
    if device == "cuda":
        encode_extra = CUDA_VAE_ENCODE_PER_PIXEL * tokens.largest_image()[0] * pixels
        decoded = tiled_tokens(config, tokens.latent) if tiled else tokens.latent
        decode_extra = CUDA_VAE_DECODE_PER_PIXEL * decoded * pixels
    runtime = parts.get("cpu_kernel_cache", 0) + parts.get("cuda_runtime", 0)
    rows: list[tuple[str, int, int]] = []  # (phase, bytes, bytes of the tensors alone)
    if any(vae for vae, _ in tokens.image_blocks()):
        rows.append(("vae:encode", fixed + work["vae_encode"] + encode_extra, fixed - runtime + work["vae_encode"]))
    for phase in phases:
        working = phase_working(phase, parts, config, dtype)
        rows.append((phase.name, fixed + working + freed_heap, fixed - runtime + working))
    if tokens.latent:
        rows.append(("vae:decode", fixed + decode + decode_extra, fixed - runtime + decode))
    return tuple(rows)


def _runtime(
    parts: dict[str, int], config: BagelConfig, dtype: torch.dtype, tokens: RequestTokens, work: dict, device: str
) -> tuple[int, int]:
    """Add the runtime's own memory on ``device`` to ``parts`` (module docstring); returns ``(freed_heap,
    vae_heap)``: the CPU heap an LLM forward keeps, and a VAE pass's heap or CUDA workspace."""
    if device == "cpu":
        cpu = cpu_runtime_parts(config, dtype, tokens)
        parts["cpu_kernel_cache"] = cpu["kernel_cache"]
        parts["cpu_freed_heap"], parts["cpu_vae_heap"] = cpu["freed_heap"], cpu["vae_heap"]
        return cpu["freed_heap"], cpu["vae_heap"]
    if device == "cuda":
        parts.update(cuda_runtime_parts(config, tokens, work))
        return 0, parts["cuda_vae_workspace"]
    return 0, 0


def tensor_peak_bytes(plan: MemoryPlan) -> int:
    """The plan's peak without the runtime's own memory (CPU or CUDA): what the tensors alone should reach."""
    return max(tensor_phase_bytes(plan).values())


def tensor_phase_bytes(plan: MemoryPlan) -> dict[str, int]:
    """Each phase's planned bytes without the runtime's own memory (CPU or CUDA heap, kernels, workspaces): what a
    tensor-accounting run measures phase by phase."""
    return dict(plan.tensor_phases)


def _suggest(config: BagelConfig, settings: PlanSettings, device_bytes: int) -> str:
    """The first of (weight dtype x offload) that fits, as flags; else a smaller size. With several input images,
    first how many of them fit with these settings (:func:`~.card_fit.fitting_images`)."""
    import dataclasses

    if len(settings.images) > 1:
        return suggest_fewer_images(
            settings,
            device_bytes,
            lambda trial: _predict(config, trial, device_bytes).fits,
            FALLBACK_WEIGHTS,
            lambda one: _suggest(config, one, device_bytes),
        )
    for offload in ("none", "layers"):
        for weight_dtype in FALLBACK_WEIGHTS:
            trial = dataclasses.replace(settings, weight_dtype=weight_dtype, offload=offload)
            if trial == settings:
                continue
            plan = _predict(config, trial, device_bytes)
            if plan.fits:
                return (
                    f"use --weight-dtype {weight_dtype} --offload {offload} (planned peak "
                    f"{plan.peak_bytes / 1e9:.1f} GB)"
                )
    return (
        f"no weight dtype or offload fits {device_bytes / 1e9:.1f} GB at {settings.width}x{settings.height}: "
        f"use a smaller --width/--height or a device with more memory"
    )


__all__ = [
    "CPU_CONV_KERNEL_BYTES",
    "CPU_MATMUL_KERNEL_BYTES",
    "CUDA_RUNTIME_BYTES",
    "CUDA_VAE_DECODE_PER_PIXEL",
    "CUDA_VAE_ENCODE_PER_PIXEL",
    "GLIBC_MMAP_THRESHOLD_MAX",
    "MemoryPlan",
    "NOT_IN_PEAK",
    "OFFICIAL_CHECKPOINT",
    "PlanSettings",
    "cpu_runtime_parts",
    "cuda_runtime_parts",
    "device_memory_bytes",
    "matmul_shapes",
    "official_config",
    "parse_memory_size",
    "plan_config",
    "plan_memory",
    "plan_without_suggestion",
    "request_tokens",
    "forward_bytes",
    "tensor_peak_bytes",
    "tensor_phase_bytes",
]
