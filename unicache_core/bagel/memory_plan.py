"""The device memory a BAGEL run will need, predicted before anything loads, and whether it fits.

:func:`plan_memory` adds up, for one request shape and one choice of settings:

- ``weights_device_<dtype>``: the bytes of BAGEL's weights on the compute device per stored dtype (counted on
  a model built on the meta device with that ``weight_dtype``, so the figure is what the loaded tensors hold);
  with ``offload="layers"`` only two decoder layers (the running one and the prefetched one) are there and
  the rest is ``weights_host``;
- ``vae``: the fp32 VAE's weights;
- ``working``: the larger of the two phases that never overlap (:func:`~.accounting.request_memory_parts`):
  - the LLM's: ``kv_full``, the uncompressed KV of every branch (:mod:`.accounting`; compression runs after
    the first step or the prompt, so the LLM phase's peak holds it), plus its largest forward (``upcast`` +
    ``attention`` + ``mlp``) and TaylorSeer's factors (``taylorseer``, :func:`~.accounting.taylorseer_bytes`).
    ``upcast`` is, with low-precision storage, the largest weights upcast at once to the compute dtype (one
    decoder layer inside :func:`~.modeling.operations.shared_upcasts`, or ``lm_head``);
  - the VAE's encode or decode (``vae_working``): an edit's source is encoded before any image or prompt
    token is cached, and the pipeline releases the caches before it decodes, so no KV is held beside it.
  ``kv_compressed`` (a detail) is what the method keeps after its first compression.

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

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .accounting import (
    BOUNDARY_TOKENS,
    GENERATION_BRANCHES,
    RequestTokens,
    image_tokens,
    request_memory_parts,
    tiled_tokens,
)
from .config import BagelConfig, bagel_config_from_dicts, load_bagel_config
from .settings import T2I_DEFAULTS, UNDERSTANDING_DEFAULTS
from .taylorseer import describe_factors

logger = logging.getLogger(__name__)

#: The ``--checkpoint`` name that plans BAGEL-7B-MoT's geometry from its published configs (no files).
OFFICIAL_CHECKPOINT = "bagel-7b-mot"
#: Prompt tokens a plan assumes (a long instruction; the prompt is small beside the image tokens).
PLAN_PROMPT_TOKENS = 64
#: Breakdown entries that detail the peak's parts or lie outside it (the rest add up to ``peak_bytes``).
NOT_IN_PEAK = (
    "weights_host",
    "kv_full",
    "kv_compressed",
    "upcast",
    "attention",
    "mlp",
    "vae_working",
    "cpu_freed_heap",
    "cpu_vae_heap",
    "cuda_vae_workspace",
    "taylorseer",
    "taylorseer_official",
)
#: Bytes oneDNN keeps per bf16 matrix-product shape it has run (its compiled kernel): 0.55-0.61 MB measured
#: for 40 row counts each of four weight shapes (64x128 to 1792x896), 0.15-1.1 MB for row counts near 1300.
CPU_MATMUL_KERNEL_BYTES = 600_000
#: Bytes oneDNN keeps per fp32 convolution shape it has run: 0.36 MB (32 channels) and 0.10 MB (64 channels)
#: measured over 16 image sizes each.
CPU_CONV_KERNEL_BYTES = 250_000
#: glibc's largest dynamic mmap threshold on 64-bit systems (``DEFAULT_MMAP_THRESHOLD_MAX``): blocks at least
#: this large are always mapped apart and given back when freed; smaller ones come from the heap, which keeps them.
GLIBC_MMAP_THRESHOLD_MAX = 32 << 20
#: Bytes CUDA allocates for a request beside its tensors (cuBLAS's and cuBLASLt's workspaces, taken from
#: PyTorch's caching allocator): at the VAE decode's start of a 1024 px edit at BAGEL-7B-MoT's geometry on an H200
#: (torch 2.11), 88 MB were allocated beyond the weights and the latent without offload, 43 MB with layer offload
#: (benchmarks/gpu_real_size.py; the larger is kept).
CUDA_RUNTIME_BYTES = 88_000_000
#: Bytes per image pixel the fp32 VAE's decode takes on CUDA beyond its tensors (cuDNN's workspaces): measured 274
#: (1024 px decode: 4.58 GB against 4.30 GB of tensors) and 265 (512 px) on an H200.
CUDA_VAE_DECODE_PER_PIXEL = 274
#: The same for the encode of an edit's source: 520 measured (1024 px: 3.24 GB above the phase's start against
#: 2.70 GB of tensors, the same with and without offload; one size measured).
CUDA_VAE_ENCODE_PER_PIXEL = 520
#: Tasks a plan accepts (the CLI's names).
PLAN_TASKS = {"und": "understanding", "understand": "understanding", "t2i": "t2i", "edit": "edit"}
#: Weight dtypes tried, in order, when the chosen settings do not fit (cheapest in quality first).
_FALLBACK_WEIGHTS = ("bf16", "fp8_e4m3fn", "int8")
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def official_config() -> BagelConfig:
    """BAGEL-7B-MoT's configuration (the published ``llm_config.json`` / ``vit_config.json``, kept once in
    :mod:`.checkpoint.single_file`)."""
    from .checkpoint.single_file import OFFICIAL_LLM_CONFIG, OFFICIAL_VIT_CONFIG

    return bagel_config_from_dicts(dict(OFFICIAL_LLM_CONFIG), dict(OFFICIAL_VIT_CONFIG), source=OFFICIAL_CHECKPOINT)


def plan_config(checkpoint: str | Path) -> BagelConfig:
    """The configuration a plan uses: :func:`official_config` for ``bagel-7b-mot``, else the folder's JSON."""
    if str(checkpoint).lower() == OFFICIAL_CHECKPOINT:
        return official_config()
    return load_bagel_config(checkpoint)


def parse_memory_size(value: str) -> int:
    """``"24GB"``, ``"24 GiB"``, ``"1.5e10"`` → bytes (decimal units for kB/MB/GB, binary for KiB/MiB/GiB)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if match is None or match.group(2).lower() not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"--device-memory {value!r} is not a memory size; write e.g. 24GB, 12GiB or 8e9")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


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
    kv_method: str = "full"
    weight_dtype: str = "auto"
    dtype: str = "bf16"
    offload: str = "none"
    #: the device type planned for; ``"cpu"`` adds the CPU runtime's own memory (:func:`cpu_runtime_parts`)
    device: str = "cuda"
    #: TaylorSeer on (t2i and edit), keeping Taylor factors up to ``taylorseer_order``
    taylorseer: bool = False
    taylorseer_order: int = T2I_DEFAULTS.taylorseer_order

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


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

    def to_json(self) -> dict[str, Any]:
        return {
            "peak_bytes": self.peak_bytes,
            "breakdown": dict(self.breakdown),
            "device_bytes": self.device_bytes,
            "fits": self.fits,
            "suggestion": self.suggestion,
            "vae_decode": self.vae_decode,
            "settings": {**self.settings.to_dict(), "kv_branches": dict(self.kv_branches)},
        }


def request_tokens(
    config: BagelConfig,
    task: str,
    width: int,
    height: int,
    prompt_tokens: int = PLAN_PROMPT_TOKENS,
    answer_tokens: int | None = None,
) -> RequestTokens:
    """The tokens of a plan's request: a ``prompt_tokens`` prompt and a ``width x height`` image (the input of
    ``und``/``edit``, none for an ``und`` of size 0, the output of ``t2i``), default settings (no think mode);
    an ``und`` answer of ``answer_tokens`` (default: the most the default settings decode)."""
    vae, vit = image_tokens(config, (width, height)) if width and height else (0, 0)
    step = config.latent_downsample
    if task == "understanding":
        return RequestTokens(
            task="understanding",
            prompt=prompt_tokens,
            vit=vit,
            decoded=UNDERSTANDING_DEFAULTS.max_new_tokens if answer_tokens is None else answer_tokens,
        )
    if task == "edit":
        return RequestTokens(task="edit", prompt=prompt_tokens, vit=vit, vae=vae, latent=vae)
    return RequestTokens(task="t2i", prompt=prompt_tokens, latent=(width // step) * (height // step))


def _weights(config: BagelConfig, weight_dtype: str, dtype: torch.dtype, offload: str) -> tuple[dict[str, int], int]:
    """(``weights_device_<dtype>``, ``weights_host``, ``vae``, ``upcast`` bytes, the largest upcast block)."""
    from .modeling import AutoEncoder
    from .modeling.operations import is_low_precision
    from .weights import build_bagel

    model = build_bagel(config, weight_dtype=weight_dtype, dtype=dtype, device="meta")
    layers = list(model.language_model.model.layers)
    kept_on_host = (
        {id(t) for layer in layers[2:] for t in list(layer.parameters()) + list(layer.buffers())}
        if offload == "layers"
        else set()
    )
    parts: dict[str, int] = {}
    host = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        size = tensor.numel() * tensor.element_size()
        if id(tensor) in kept_on_host:
            host += size
        else:
            key = f"weights_device_{str(tensor.dtype).removeprefix('torch.')}"
            parts[key] = parts.get(key, 0) + size
    parts["weights_host"] = host
    with torch.device("meta"):
        vae = AutoEncoder(config.ae)
    parts["vae"] = sum(t.numel() * t.element_size() for t in vae.parameters())
    element = torch.empty((), dtype=dtype).element_size()

    def upcast_of(module: torch.nn.Module) -> int:
        return sum(m.weight.numel() * element for m in module.modules() if is_low_precision(m))

    parts["upcast"] = max(upcast_of(layers[0]) if layers else 0, upcast_of(model.language_model.lm_head))
    return parts, element


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


def _predict(
    config: BagelConfig,
    settings: PlanSettings,
    device_bytes: int,
    prompt_tokens: int = PLAN_PROMPT_TOKENS,
    answer_tokens: int | None = None,
) -> MemoryPlan:
    """:func:`plan_memory` without the suggestion."""
    from ..compression import method_from_name
    from .checkpoint.loader import parse_dtype

    task = PLAN_TASKS[settings.task]
    dtype = parse_dtype(settings.dtype)
    tokens = request_tokens(config, task, settings.width, settings.height, prompt_tokens, answer_tokens)
    parts, _ = _weights(config, settings.weight_dtype, dtype, settings.offload)
    kv_branches = tokens.kv_bytes(config, dtype)
    parts["kv_full"] = sum(kv_branches.values())
    work = request_memory_parts(
        config, dtype, tokens, taylor_order=settings.taylorseer_order if settings.taylorseer else None
    )
    parts.update(attention=work["attention"], mlp=work["mlp"], vae_working=work["vae"])
    if work["taylorseer"]:
        parts["taylorseer"] = work["taylorseer"]
        parts["taylorseer_official"] = work["taylorseer"] * config.llm.num_hidden_layers
    freed_heap = vae_heap = 0
    if settings.device == "cpu":
        cpu = cpu_runtime_parts(config, dtype, tokens)
        parts["cpu_kernel_cache"] = cpu["kernel_cache"]
        freed_heap = parts["cpu_freed_heap"] = cpu["freed_heap"]
        vae_heap = parts["cpu_vae_heap"] = cpu["vae_heap"]
    elif settings.device == "cuda":
        parts.update(cuda_runtime_parts(config, tokens, work))
        vae_heap = parts["cuda_vae_workspace"]
    parts["working"] = _working(parts, freed_heap, vae_heap)
    peak = sum(v for k, v in parts.items() if k not in NOT_IN_PEAK)
    vae_decode = "whole"
    if settings.device == "cuda" and peak > device_bytes:
        # the pipeline decodes in tiles when the whole decode runs out of device memory (.denoise)
        tiled = dict(parts, **cuda_runtime_parts(config, tokens, work, tiled=True))
        tiled["working"] = _working(tiled, 0, tiled["cuda_vae_workspace"])
        tiled_peak = sum(v for k, v in tiled.items() if k not in NOT_IN_PEAK)
        if tiled_peak < peak:
            parts, peak, vae_decode = tiled, tiled_peak, "tiled"
    if settings.kv_method != "full":
        target = method_from_name(settings.kv_method).target(task)
        ratio = float(target) if isinstance(target, float) else 1.0
        parts["kv_compressed"] = int(parts["kv_full"] * ratio)
    return MemoryPlan(
        peak_bytes=int(peak),
        breakdown=parts,
        device_bytes=int(device_bytes),
        fits=peak <= device_bytes,
        suggestion=None,
        settings=settings,
        kv_branches=kv_branches,
        vae_decode=vae_decode,
    )


def _working(parts: dict[str, int], freed_heap: int = 0, vae_heap: int = 0) -> int:
    """The working memory of the larger phase: the LLM's (the full KV and a decoder layer's upcast weights,
    attention and MLP, TaylorSeer's factors, and on the CPU the heap its forward keeps) or a VAE pass's (and on
    the CPU its heap)."""
    llm = parts["kv_full"] + parts["upcast"] + parts["attention"] + parts["mlp"] + parts.get("taylorseer", 0)
    return max(llm + freed_heap, parts["vae_working"] + vae_heap)


def tensor_peak_bytes(plan: MemoryPlan) -> int:
    """The plan's peak without the runtime's own memory (CPU or CUDA): what the tensors alone should reach."""
    parts = plan.breakdown
    runtime = parts.get("cpu_kernel_cache", 0) + parts.get("cuda_runtime", 0)
    return plan.peak_bytes - runtime - (parts["working"] - _working(parts))


def cuda_runtime_parts(
    config: BagelConfig, tokens: RequestTokens, work: dict[str, int], *, tiled: bool = False
) -> dict[str, int]:
    """CUDA's own memory beside the tensors (module docstring): ``cuda_runtime``, and of the VAE pass that needs
    more on CUDA (the source's encode or the output's decode, whole or, when ``tiled``, one tile of it) its
    tensors (``vae_working``, from ``work`` = :func:`~.accounting.request_memory_parts`) and
    ``cuda_vae_workspace``."""
    pixels_per_token = config.latent_downsample**2
    decoded = tiled_tokens(config, tokens.latent) if tiled else tokens.latent
    encode = (work["vae_encode"], CUDA_VAE_ENCODE_PER_PIXEL * tokens.vae * pixels_per_token)
    decode = (
        work["vae_decode_tiled" if tiled else "vae_decode"],
        CUDA_VAE_DECODE_PER_PIXEL * decoded * pixels_per_token,
    )
    tensors, workspace = max(encode, decode, key=sum)
    return {"vae_working": tensors, "cuda_runtime": CUDA_RUNTIME_BYTES, "cuda_vae_workspace": workspace}


def matmul_shapes(config: BagelConfig, tokens: RequestTokens) -> set[tuple[int, int, int, bool]]:
    """The distinct ``(rows, in_features, out_features, bias)`` of the linear layers a request runs (oneDNN keeps
    one kernel for each).

    Each context block runs every decoder layer's projections at its own row count (the CFG branches one after
    the other, each block's und tokens and gen tokens apart); the ViT and the connector run at the ViT's token
    count, the latent heads and the timestep embedder at the latent count, ``lm_head`` at one row per answer
    token.
    """
    llm, vit = config.llm, config.vit
    hidden, q_out, kv_out = (
        llm.hidden_size,
        llm.num_attention_heads * llm.head_dim,
        llm.num_key_value_heads * llm.head_dim,
    )
    decoder = {
        (hidden, q_out, True),
        (hidden, kv_out, True),
        (q_out, hidden, False),
        (hidden, llm.intermediate_size, False),
        (llm.intermediate_size, hidden, False),
    }
    rows = {tokens.prompt + BOUNDARY_TOKENS}
    if tokens.system:
        rows.add(tokens.system + BOUNDARY_TOKENS)
    if tokens.vit:
        rows.add(tokens.vit + BOUNDARY_TOKENS)
    for gen_tokens in (tokens.vae, tokens.latent):
        if gen_tokens:
            rows.update((gen_tokens, BOUNDARY_TOKENS))
    if tokens.decoded:
        rows.add(1)
    shapes = {(n, k, o, bias) for n in rows for k, o, bias in decoder}
    if tokens.vit:
        patch = 3 * vit.patch_size**2
        shapes.update(
            (tokens.vit, k, o, True)
            for k, o in (
                (patch, vit.hidden_size),
                (vit.hidden_size, vit.hidden_size),
                (vit.hidden_size, vit.intermediate_size),
                (vit.intermediate_size, vit.hidden_size),
                (vit.hidden_size, hidden),
                (hidden, hidden),
            )
        )
    for gen_tokens in {tokens.vae, tokens.latent} - {0}:
        shapes.add((gen_tokens, config.patch_latent_dim, hidden, True))
    if tokens.latent:
        shapes.update(
            (tokens.latent, k, o, True) for k, o in ((hidden, config.patch_latent_dim), (256, hidden), (hidden, hidden))
        )
    if tokens.decoded:
        shapes.add((1, hidden, llm.vocab_size, False))
    return shapes


def cpu_runtime_parts(config: BagelConfig, dtype: torch.dtype, tokens: RequestTokens) -> dict[str, int]:
    """The CPU runtime's own memory beside the tensors (module docstring): ``kernel_cache``, ``freed_heap`` and
    ``vae_heap``.

    ``kernel_cache`` = :data:`CPU_MATMUL_KERNEL_BYTES` x :func:`matmul_shapes` (bf16/fp16 compute: fp32 products
    go to MKL, which keeps none) + :data:`CPU_CONV_KERNEL_BYTES` x the VAE's distinct convolutions
    (:func:`~.accounting.vae_convolution_shapes`). ``freed_heap``: the LLM forward's activations
    (:func:`~.accounting.request_memory_parts`) whose single tensors stay under :data:`GLIBC_MMAP_THRESHOLD_MAX`.
    ``vae_heap``: two of the VAE decode's largest activations under that threshold
    (:func:`~.accounting.vae_activation_below`), and for an edit two of its encode's as well.

    Measured on the medium checkpoint's 512 px understanding (1298-token ViT block): the first decoder layer
    raised the resident set by 47-66 MB and the next by 4-15 MB for 35 MB of planned activations; every new
    shape of the bundled model's understanding added its kernel (+2.9 MB for the prompt block's 5 shapes); a VAE
    decode alone raised it 7-12 MB above its tensors on the bundled model (4.2 MB activations at 128-256 px) and
    10 MB on the medium one at 512 px (33.5 MB full-size activations, mapped apart; 8.4 MB at half size). An
    edit's process entered its decode holding 31 MB more than a text-to-image's (medium, 512 px; 9 MB of it the
    larger KV) and its decode then raised it 48 MB more: the plan without the encode's term fell 6-16% short of
    the edit's resident set in four runs, with it the error is -5.5 to +8% (the table in docs/memory.md).
    """
    from .accounting import vae_activation_below, vae_convolution_shapes

    products = len(matmul_shapes(config, tokens)) if dtype != torch.float32 else 0
    convolutions = len(
        vae_convolution_shapes(config, tokens.vae, decode=False)
        | vae_convolution_shapes(config, tokens.latent, decode=True)
    )
    llm = config.llm
    element = torch.empty((), dtype=dtype).element_size()
    queries = tokens.largest_block()
    branches = 1 if tokens.task == "understanding" else 3
    blocks = [
        (2, queries * llm.num_attention_heads * llm.head_dim * 4),
        (3, queries * llm.intermediate_size * element),
        (4 + branches, queries * llm.hidden_size * element),
    ]
    freed_heap = sum(count * size for count, size in blocks if size < GLIBC_MMAP_THRESHOLD_MAX)
    # the decode's own heap, plus what an edit's encode left resident under it (long-lived tensors made after the
    # encode, the source latent and the prefill's KV, sit between its freed blocks)
    vae_heap = 2 * (
        vae_activation_below(config, tokens.vae, GLIBC_MMAP_THRESHOLD_MAX, decode=False)
        + vae_activation_below(config, tokens.latent, GLIBC_MMAP_THRESHOLD_MAX, decode=True)
    )
    return {
        "kernel_cache": products * CPU_MATMUL_KERNEL_BYTES + convolutions * CPU_CONV_KERNEL_BYTES,
        "freed_heap": int(freed_heap),
        "vae_heap": int(vae_heap),
    }


def _suggest(config: BagelConfig, settings: PlanSettings, device_bytes: int) -> str:
    """The first of (weight dtype x offload) that fits, as flags; else a smaller size."""
    import dataclasses

    for offload in ("none", "layers"):
        for weight_dtype in _FALLBACK_WEIGHTS:
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


def describe(plan: MemoryPlan) -> str:
    """The plan as a few human-readable lines (for the CLI's stdout)."""
    gb = 1e9
    seer = f", TaylorSeer order {plan.settings.taylorseer_order}" if plan.settings.taylorseer else ""
    lines = [
        f"{plan.settings.task} {plan.settings.width}x{plan.settings.height}, weights {plan.settings.weight_dtype}"
        f" (compute {plan.settings.dtype}), KV {plan.settings.kv_method}, offload {plan.settings.offload}{seer}:",
        f"  peak {plan.peak_bytes / gb:.2f} GB of {plan.device_bytes / gb:.2f} GB -> "
        + ("fits" if plan.fits else f"does not fit: {plan.suggestion}"),
    ]
    if plan.vae_decode == "tiled":
        lines.append("  the VAE decodes in tiles (the whole decode would not fit; close to it, not equal)")
    lines += [
        f"  {name:<28} {size / gb:8.3f} GB" + ("  (detail, not added)" if name in NOT_IN_PEAK else "")
        for name, size in plan.breakdown.items()
    ]
    if "taylorseer" in plan.breakdown:
        parts, branches = plan.breakdown, GENERATION_BRANCHES
        lines.append(describe_factors(parts["taylorseer"], parts["taylorseer_official"], plan.settings, branches))
    return "\n".join(lines)


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
    "describe",
    "device_memory_bytes",
    "matmul_shapes",
    "official_config",
    "parse_memory_size",
    "plan_config",
    "plan_memory",
    "request_tokens",
    "tensor_peak_bytes",
]
