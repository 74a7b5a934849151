"""The device memory a BAGEL run will need, predicted before anything loads, and whether it fits.

:func:`plan_memory` adds up, for one request shape and one choice of settings:

- ``weights_device_<dtype>``: the bytes of BAGEL's weights on the compute device per stored dtype (counted on
  a model built on the meta device with that ``weight_dtype``, so the figure is what the loaded tensors hold);
  with ``offload="layers"`` only two decoder layers (the running one and the prefetched one) are there and
  the rest is ``weights_host``;
- ``vae``: the fp32 VAE's weights;
- ``kv_full``: the uncompressed KV of every branch (:mod:`.accounting`): compression runs after the first step
  (or the prompt), so the peak holds it; ``kv_compressed`` (not in the peak) is what the method keeps after;
- ``working``: the larger of the two phases that never overlap: the LLM's largest forward (``upcast`` +
  ``attention`` + ``mlp``) and the VAE's encode or decode (``vae_working``)
  (:func:`~.accounting.request_memory_parts`). ``upcast`` is, with low-precision storage, the largest weights
  upcast at once to the compute dtype (one decoder layer inside :func:`~.modeling.operations.shared_upcasts`,
  or ``lm_head``).

The peak is the sum of the parts not in :data:`NOT_IN_PEAK`. On CPU it is within 10% of a run's tensor
accounting and resident set on the bundled and the medium checkpoints (``python -m benchmarks.memory_plan_check``).
``bagel-7b-mot`` plans BAGEL-7B-MoT's geometry without any file (:data:`OFFICIAL_CHECKPOINT`).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .accounting import RequestTokens, image_tokens, kv_bytes_per_token, request_memory_parts
from .config import BagelConfig, bagel_config_from_dicts, load_bagel_config
from .settings import UNDERSTANDING_DEFAULTS

logger = logging.getLogger(__name__)

#: The ``--checkpoint`` name that plans BAGEL-7B-MoT's geometry from its published configs (no files).
OFFICIAL_CHECKPOINT = "bagel-7b-mot"
#: Prompt tokens a plan assumes (a long instruction; the prompt is small beside the image tokens).
PLAN_PROMPT_TOKENS = 64
#: Breakdown entries that detail the peak's parts or lie outside it (the rest add up to ``peak_bytes``).
NOT_IN_PEAK = ("weights_host", "kv_compressed", "upcast", "attention", "mlp", "vae_working")
#: Tasks a plan accepts (the CLI's names).
PLAN_TASKS = {"und": "understanding", "understand": "understanding", "t2i": "t2i", "edit": "edit"}
#: Weight dtypes tried, in order, when the chosen settings do not fit (cheapest in quality first).
_FALLBACK_WEIGHTS = ("bf16", "fp8_e4m3fn", "int8")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}


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

    def to_json(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak_bytes, "breakdown": dict(self.breakdown), "device_bytes": self.device_bytes,
                "fits": self.fits, "suggestion": self.suggestion,
                "settings": {**self.settings.to_dict(), "kv_branches": dict(self.kv_branches)}}


def request_tokens(config: BagelConfig, task: str, width: int, height: int,
                   prompt_tokens: int = PLAN_PROMPT_TOKENS, answer_tokens: int | None = None) -> RequestTokens:
    """The tokens of a plan's request: a ``prompt_tokens`` prompt and a ``width x height`` image (the input of
    ``und``/``edit``, none for an ``und`` of size 0, the output of ``t2i``), default settings (no think mode);
    an ``und`` answer of ``answer_tokens`` (default: the most the default settings decode)."""
    vae, vit = image_tokens(config, (width, height)) if width and height else (0, 0)
    step = config.latent_downsample
    if task == "understanding":
        return RequestTokens(task="understanding", prompt=prompt_tokens, vit=vit,
                             decoded=UNDERSTANDING_DEFAULTS.max_new_tokens if answer_tokens is None else answer_tokens)
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
    kept_on_host = {id(t) for layer in layers[2:] for t in list(layer.parameters()) + list(layer.buffers())} \
        if offload == "layers" else set()
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


def plan_memory(config: BagelConfig, settings: PlanSettings, device_bytes: int, *,
                prompt_tokens: int = PLAN_PROMPT_TOKENS, answer_tokens: int | None = None) -> MemoryPlan:
    """Predict the peak device memory of ``settings`` on a model of ``config`` (see the module docstring) and,
    when it does not fit ``device_bytes``, the cheapest setting that does (``suggestion``). ``prompt_tokens`` and
    ``answer_tokens`` (understanding) size the text (:func:`request_tokens`)."""
    import dataclasses

    plan = _predict(config, settings, device_bytes, prompt_tokens, answer_tokens)
    if plan.fits:
        return plan
    return dataclasses.replace(plan, suggestion=_suggest(config, settings, device_bytes))


def _predict(config: BagelConfig, settings: PlanSettings, device_bytes: int,
             prompt_tokens: int = PLAN_PROMPT_TOKENS, answer_tokens: int | None = None) -> MemoryPlan:
    """:func:`plan_memory` without the suggestion."""
    from ..compression import KVConfig
    from .checkpoint.loader import parse_dtype

    task = PLAN_TASKS[settings.task]
    dtype = parse_dtype(settings.dtype)
    tokens = request_tokens(config, task, settings.width, settings.height, prompt_tokens, answer_tokens)
    parts, _ = _weights(config, settings.weight_dtype, dtype, settings.offload)
    kv_branches = tokens.kv_bytes(config, dtype)
    parts["kv_full"] = sum(kv_branches.values())
    work = request_memory_parts(config, dtype, tokens)
    parts.update(attention=work["attention"], mlp=work["mlp"], vae_working=work["vae"])
    parts["working"] = max(parts["upcast"] + work["attention"] + work["mlp"], work["vae"])
    peak = sum(v for k, v in parts.items() if k not in NOT_IN_PEAK)
    if settings.kv_method != "full":
        target = KVConfig(method=settings.kv_method).target_ratio(task)
        ratio = float(target) if isinstance(target, float) else 1.0
        parts["kv_compressed"] = int(parts["kv_full"] * ratio)
    return MemoryPlan(peak_bytes=int(peak), breakdown=parts, device_bytes=int(device_bytes),
                      fits=peak <= device_bytes, suggestion=None, settings=settings, kv_branches=kv_branches)


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
                return (f"use --weight-dtype {weight_dtype} --offload {offload} (planned peak "
                        f"{plan.peak_bytes / 1e9:.1f} GB)")
    return (f"no weight dtype or offload fits {device_bytes / 1e9:.1f} GB at {settings.width}x{settings.height}: "
            f"use a smaller --width/--height or a device with more memory")


def describe(plan: MemoryPlan) -> str:
    """The plan as a few human-readable lines (for the CLI's stdout)."""
    gb = 1e9
    lines = [f"{plan.settings.task} {plan.settings.width}x{plan.settings.height}, weights {plan.settings.weight_dtype}"
             f" (compute {plan.settings.dtype}), KV {plan.settings.kv_method}, offload {plan.settings.offload}:",
             f"  peak {plan.peak_bytes / gb:.2f} GB of {plan.device_bytes / gb:.2f} GB -> "
             + ("fits" if plan.fits else f"does not fit: {plan.suggestion}")]
    lines += [f"  {name:<28} {size / gb:8.3f} GB" for name, size in plan.breakdown.items()]
    return "\n".join(lines)


__all__ = ["MemoryPlan", "NOT_IN_PEAK", "OFFICIAL_CHECKPOINT", "PlanSettings", "describe", "device_memory_bytes",
           "official_config", "parse_memory_size", "plan_config", "plan_memory", "request_tokens"]
