"""What ComfyUI does with BAGEL on a card, planned: which weights its lowvram loading keeps on the card, which it
leaves on the offload device, and the bytes those stream to the card per denoising step (or per answer token).

ComfyUI places the model itself (the pack's nodes call ``comfy.model_management.load_models_gpu([patcher],
memory_required=...)``, :func:`nodes.host.load_to_device`). This module follows ComfyUI 0.3.75's rules, written
here from reading them (``comfy/model_management.py``, ``comfy/model_patcher.py``):

- ``load_models_gpu``: ``extra_mem = max(minimum_inference_memory(), memory_required + extra_reserved_memory())``;
  with the model not yet loaded, ``lowvram_model_memory = max(0, free - extra_mem, min(free *
  MIN_WEIGHT_MEMORY_RATIO, free - minimum_inference_memory()))`` (``MIN_WEIGHT_MEMORY_RATIO`` is 0 on NVIDIA, so
  the last term is never positive), 0.1 when that is 0; ``minimum_inference_memory()`` = 0.8 GiB +
  ``extra_reserved_memory()`` (``EXTRA_RESERVED_VRAM``: 400 MiB on Linux);
- ``ModelPatcher.partially_load``: a budget above the model's size loads it whole;
- ``ModelPatcher.load`` over ``_load_list()`` (every module with its own parameters, sizes by
  ``comfy.model_management.module_size``), sorted largest first (ties by name, descending): a module stays on the
  card while ``loaded + its size + max(buffer, its size x (NUM_STREAMS + 1)) < budget`` (``NUM_STREAMS`` = 2 on
  NVIDIA: async offload streams); a ComfyUI operation (``comfy_cast_weights``) that does not fit is left on the
  offload device and cast to the card at each call (``buffer`` then keeps that reservation).

The modules are those of the pack's model as ComfyUI's operations build it (:func:`comfy_modules`, from
:mod:`.weight_layout` without building anything): Linear, Embedding and the ViT's LayerNorms in the loader's
``weight_dtype`` (the output head at 16 bits under fp8), the VAE's convolutions and GroupNorms in fp32, BAGEL's own
RMSNorms and position tables in the compute dtype (not ComfyUI operations).

A denoising step runs the latent block of each CFG branch through every decoder layer, both experts (the block's
two boundary tokens take the understanding expert), so each left-behind layer streams once per branch; the
timestep embedder, ``vae2llm`` and the boundary tokens' embedding once per step, ``llm2vae`` once per branch. An
answer token runs the understanding expert, the embedding and the head once. Every figure is a plan; a "GB" card is
planned as that many 10^9 bytes free (docs/memory.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ..config import BagelConfig
from ..weight_layout import LLM_LAYERS, VIT_LAYERS, bagel_layout, vae_layout

GIB = 1 << 30
MIB = 1 << 20
#: ``comfy.model_management.EXTRA_RESERVED_VRAM`` on Linux (600 MiB on Windows, +100 MiB there for cards over 15 GiB).
EXTRA_RESERVED_VRAM = 400 * MIB
#: ``comfy.model_management.minimum_inference_memory()``.
MINIMUM_INFERENCE_MEMORY = int(0.8 * GIB) + EXTRA_RESERVED_VRAM
#: ``comfy.model_management.NUM_STREAMS`` on NVIDIA (async weight offloading).
NUM_STREAMS = 2
#: The ViT's LayerNorms, built from ComfyUI's operations (the decoder's RMSNorms are BAGEL's own).
_NAMESPACE_NORMS = ("layer_norm1", "layer_norm2", "post_layernorm")


@dataclass(frozen=True)
class ComfyModule:
    """One module of ComfyUI's ``_load_list``: ``name`` in the patcher's model, ``size`` bytes, ``castable``
    (a ComfyUI operation that can run from the offload device), ``calls`` per denoising step of a ``branches``
    generation (:func:`comfy_modules`) and per answer token."""

    name: str
    size: int
    castable: bool
    step_calls_per_branch: int
    step_calls_once: int
    token_calls: int


@dataclass(frozen=True)
class ComfyPlacement:
    """Where ComfyUI puts the model for one request (bytes): ``memory_required`` the pack passed,
    ``budget`` = ComfyUI's ``lowvram_model_memory`` (0: the whole model loaded), ``loaded`` and ``offloaded``
    weights, ``streamed_per_step`` (left-behind weights cast to the card per denoising step, or per answer token
    for understanding)."""

    memory_required: int
    free: int
    budget: int
    model: int
    loaded: int
    offloaded: int
    streamed_per_step: int

    @property
    def whole(self) -> bool:
        return self.offloaded == 0

    def to_dict(self) -> dict:
        return {**self.__dict__, "whole": self.whole}


def _module_of(spec_name: str) -> str:
    return spec_name.rsplit(".", 1)[0]


@functools.lru_cache(maxsize=16)
def comfy_modules(config: BagelConfig, weight_dtype: str, dtype: torch.dtype) -> tuple[ComfyModule, ...]:
    """The modules ComfyUI's lowvram loading places, for the loader's ``weight_dtype`` (``default``/``auto``:
    the compute dtype; an fp8 name) computing in ``dtype``."""
    from ..weights import WEIGHT_DTYPES, head_storage_dtype, parse_weight_dtype

    name = "auto" if weight_dtype == "default" else parse_weight_dtype(weight_dtype)
    storage = WEIGHT_DTYPES[name] or dtype
    head = head_storage_dtype(name, dtype) or storage
    layout = bagel_layout(config)
    modules: list[ComfyModule] = []

    def add(prefix: str, specs, count: int, step_branch, step_once, token) -> None:
        grouped: dict[str, list] = {}
        for spec in specs:
            if spec.role != "buffer":
                grouped.setdefault(_module_of(spec.name), []).append(spec)
        for module, members in grouped.items():
            leaf = module.rsplit(".", 1)[-1]
            namespace = leaf in _NAMESPACE_NORMS or any(s.role in ("linear", "embedding", "head") for s in members)
            kept = head if any(s.role == "head" for s in members) else storage if namespace else dtype
            size = sum(s.numel for s in members) * kept.itemsize
            for index in range(count):
                full = f"bagel.{prefix}{index}.{module}" if count > 1 or prefix else f"bagel.{module}"
                modules.append(
                    ComfyModule(full, size, namespace, step_branch(module), step_once(module), token(module))
                )

    def layer_token(module: str) -> int:  # an answer token runs the understanding expert
        return 0 if "moe_gen" in module else 1

    add(LLM_LAYERS, layout.llm_layer, layout.llm_count, lambda m: 1, lambda m: 0, layer_token)
    add(VIT_LAYERS, layout.vit_layer, layout.vit_count, lambda m: 0, lambda m: 0, lambda m: 0)
    once = ("language_model.model.embed_tokens", "time_embedder.mlp.0", "time_embedder.mlp.2", "vae2llm")
    add(
        "",
        layout.shared,
        1,
        lambda m: 1 if m == "llm2vae" else 0,
        lambda m: 1 if m in once else 0,
        lambda m: 1 if m in ("language_model.model.embed_tokens", "language_model.lm_head") else 0,
    )
    for module, members in _grouped(vae_layout(config.ae)).items():
        modules.append(ComfyModule(f"vae.{module}", sum(s.numel for s in members) * 4, True, 0, 0, 0))
    return tuple(modules)


def _grouped(specs) -> dict[str, list]:
    grouped: dict[str, list] = {}
    for spec in specs:
        grouped.setdefault(_module_of(spec.name), []).append(spec)
    return grouped


def memory_required(
    config: BagelConfig,
    dtype: torch.dtype,
    tokens,
    kv_method: Any = "full",
    *,
    taylor_order: int | None = None,
    checkpoint: str = "",
) -> int:
    """The ``memory_required`` a task node passes to ComfyUI for a request of ``tokens``
    (:class:`~.accounting.RequestTokens`) under ``kv_method``: the memory plan's peak above the weights on CUDA, with
    ComfyUI's operations (which cast one layer's weight per call, not a decoder layer's at once) and with the VAE
    decode that the pipeline falls back to in tiles when the whole one finds no room (the source's encode has no such
    fallback: it counts whole). The denoising's phases, not the one-off decode, then decide how many weights ComfyUI
    keeps on the card."""
    from .accounting import request_memory_parts
    from .plan import PlanSettings, plan_without_suggestion
    from .runtime import CUDA_RUNTIME_BYTES, CUDA_VAE_ENCODE_PER_PIXEL, cuda_runtime_parts

    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    settings = PlanSettings(
        task="und" if tokens.task == "understanding" else tokens.task,
        width=0,
        height=0,
        kv_method=kv_method,
        checkpoint=checkpoint,
        dtype=names[dtype],
        device="cuda",
        taylorseer=taylor_order is not None,
        taylorseer_order=taylor_order if taylor_order is not None else PlanSettings.taylorseer_order,
    )
    plan = plan_without_suggestion(config, settings, 1 << 60, tokens)
    parts = plan.breakdown
    fixed = plan.peak_bytes - parts["working"]
    layer = config.llm
    host_upcast = max(layer.intermediate_size, layer.num_attention_heads * layer.head_dim) * layer.hidden_size
    host_upcast *= dtype.itemsize
    llm = max(
        (size - fixed for name, size in plan.phases if not name.startswith("vae:")),
        default=0,
    )
    llm += host_upcast - parts["upcast"]
    work = request_memory_parts(config, dtype, tokens, taylor_order=taylor_order)
    pixels = tokens.largest_image()[0] * config.latent_downsample**2
    encode = work["vae_encode"] + CUDA_VAE_ENCODE_PER_PIXEL * pixels if pixels else 0
    tiled = cuda_runtime_parts(config, tokens, work, tiled=True)
    decode = tiled["vae_working"] + tiled["cuda_vae_workspace"] if tokens.latent else 0
    return int(max(llm, encode, decode) + CUDA_RUNTIME_BYTES)


def lowvram_budget(free: int, memory_required: int) -> int:
    """``load_models_gpu``'s ``lowvram_model_memory`` for a model not yet on the card (module docstring)."""
    extra_mem = max(MINIMUM_INFERENCE_MEMORY, memory_required + EXTRA_RESERVED_VRAM)
    return max(0, free - extra_mem)


def comfy_placement(
    config: BagelConfig,
    weight_dtype: str,
    dtype: torch.dtype,
    free: int,
    memory_required: int,
    *,
    task: str = "edit",
    branches: int = 3,
) -> ComfyPlacement:
    """ComfyUI's placement of BAGEL on a card with ``free`` bytes for a request that passes ``memory_required``
    (module docstring); ``branches``: the CFG branches of a denoising step (``task`` understanding: per token)."""
    modules = comfy_modules(config, weight_dtype, dtype)
    model = sum(m.size for m in modules)
    budget = lowvram_budget(free, memory_required)
    left: list[ComfyModule] = []
    loaded = 0
    if budget <= model:  # partially_load: a budget above the model's size loads it whole
        budget = budget or 1  # ComfyUI's 0.1: nothing fits
        buffer = 0
        for module in sorted(modules, key=lambda m: (m.size, m.size, m.name), reverse=True):
            reserve = max(buffer, module.size * (NUM_STREAMS + 1))
            if loaded + module.size + reserve < budget:
                loaded += module.size
                continue
            buffer = reserve
            left.append(module)
    else:
        loaded = model
    if task == "understanding":
        streamed = sum(m.size * m.token_calls for m in left)
    else:
        streamed = sum(m.size * (m.step_calls_per_branch * branches + m.step_calls_once) for m in left)
    return ComfyPlacement(
        memory_required=int(memory_required),
        free=int(free),
        budget=int(budget) if left else 0,
        model=int(model),
        loaded=int(loaded),
        offloaded=int(sum(m.size for m in left)),
        streamed_per_step=int(streamed),
    )


__all__ = [
    "EXTRA_RESERVED_VRAM",
    "MINIMUM_INFERENCE_MEMORY",
    "NUM_STREAMS",
    "ComfyModule",
    "ComfyPlacement",
    "comfy_modules",
    "comfy_placement",
    "lowvram_budget",
    "memory_required",
]
