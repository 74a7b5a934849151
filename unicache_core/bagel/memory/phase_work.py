"""The working memory of a plan's phases (:mod:`.plan`): what a forward of an LLM phase holds beside its KV, and which
phase is the largest (the VAE's passes are :mod:`.vae`'s)."""

from __future__ import annotations

import torch

from ..config import BagelConfig
from .plan_kv import KVPhase


def forward_bytes(config: BagelConfig, dtype: torch.dtype, rows: int, branches: int) -> tuple[int, int]:
    """``(attention, mlp)`` bytes of a forward of ``rows`` rows (:func:`~.accounting.request_memory_parts`'s
    formulas): the fp32 partial outputs and their merge; gate, up, their product and ``4 + branches`` hidden-size
    tensors (the branches of a denoising step run through each layer together)."""
    llm = config.llm
    attention = rows * 2 * llm.num_attention_heads * llm.head_dim * 4
    mlp = rows * (3 * llm.intermediate_size + (4 + branches) * llm.hidden_size) * dtype.itemsize
    return attention, mlp


def phase_working(phase: KVPhase, parts: dict[str, int], config: BagelConfig, dtype: torch.dtype) -> int:
    """One LLM phase's working memory: its KV, TaylorSeer's factors while denoising, and the larger of a layer's two
    halves: its attention call (the attention's upcast weights, the outputs, the gathered layer and the layer's new
    rows, a key scorer's transient) or its MLP (the whole layer's upcast weights and the MLP's activations; measured
    on the CPU at BAGEL-7B's widths: UniCache's scorer did not raise the peak the MLP sets, docs/memory.md)."""
    if not phase.tokens:  # a compression between calls: no forward beside it
        return phase.kv
    attention, mlp = forward_bytes(config, dtype, phase.tokens, phase.branches)
    seer = parts.get("taylorseer", 0) if phase.name.startswith("denoise") else 0
    # the branches of a step run each layer in turn: from the second on, its attention call finds every weight upcast
    upcast = parts["upcast"] if phase.branches > 1 else parts["upcast_attention"]
    call = upcast + attention + phase.transient + phase.scoring
    return phase.kv + max(call, parts["upcast"] + mlp) + seer


def llm_peak(parts: dict[str, int], phases: list[KVPhase], config: BagelConfig, dtype: torch.dtype) -> None:
    """Record the largest LLM phase's terms in ``parts`` (``kv_held``, ``kv_transient``, ``kv_scoring``,
    ``attention``, ``mlp``)."""
    top = max(phases, key=lambda phase: phase_working(phase, parts, config, dtype))
    attention, mlp = forward_bytes(config, dtype, top.tokens, top.branches)
    parts.update(kv_held=top.kv, kv_transient=top.transient, attention=attention, mlp=mlp)
    if top.scoring:
        parts["kv_scoring"] = top.scoring


def working_memory(
    parts: dict[str, int],
    phases: list[KVPhase],
    config: BagelConfig,
    dtype: torch.dtype,
    freed_heap: int = 0,
    vae_heap: int = 0,
) -> int:
    """The working memory of the largest phase: an LLM phase's (:func:`phase_working`, and on the CPU the heap its
    forward keeps) or a VAE pass's (and its heap or workspace)."""
    llm = max(phase_working(phase, parts, config, dtype) for phase in phases)
    return max(llm + freed_heap, parts["vae_working"] + vae_heap)


__all__ = ["forward_bytes", "llm_peak", "phase_working", "working_memory"]
