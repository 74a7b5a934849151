"""The KV terms of a memory plan (:mod:`.memory_plan`), phase by phase, as the caches fill and compress.

The request's context is prefilled block by block (each input image's VAE block and ViT block, each text), then
denoised (generation) or answered (understanding). :func:`kv_phases` gives, for each phase, what the caches hold
and what a forward of that phase holds beside them (docs/memory.md, "The peak, phase by phase"):

- ``prefill:item<j>``: after block ``j``'s forward, the blocks before it at the size they are stored in while the
  context fills, and block ``j`` itself; beside them one layer's rows of the branch gathered at the compute dtype
  for the attention call (:data:`GATHER`: ``full`` concatenates a layer's chunks, a compressing cache dequantizes
  its stores into one workspace) and, for a method that stores rows compressed as they are written, the new
  block's rows of one layer uncompressed (``kv_layer_rows``);
- ``denoise:first`` (generation): every branch's rows before the first compression, the gathered layer of the
  largest branch and a key-scoring method's scoring transient (:func:`scoring_bytes`);
- ``decode`` (understanding): the context after the instruction's prefill (a method that evicts by the
  instruction's attention has evicted by then), the answer's rows and the gathered layer.

Every method holds what is identical once (copy on write, ``full`` included): the input images' rows that
``cfg_text`` forks from ``gen`` are one store for both branches, before and after compression.

How rows are stored while the context fills (:func:`prefill_ratios`): as the method does it (:func:`written_kinds`,
read from the method): a method that compresses as written (UniCache) stores each image's rows at once, the types
its policy quantizes at the bytes of the method's target ratio (the bits the row keeps) and, where it says so, the
types it evicts at those bytes too, or at the lowest bits of its lookup
(:data:`~unicache_core.compression.defaults.KIVI_FLOOR`) where the target is under them, until the scores to evict
them exist; the other methods keep them whole until their first compression. Text and boundary
rows stay whole until then.

``kv_full`` is what the official code holds (every branch apart, uncompressed); ``kv_compressed`` what the method
keeps after its first compression (``kv_full`` less the shared rows, times its target ratio).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..config import BagelConfig
from ..taylorseer import GENERATION_BRANCHES
from .accounting import BOUNDARY_TOKENS, RequestTokens, kv_bytes_per_token

#: A forward's attention call holds one layer's rows of its branch at the compute dtype (``full``: the layer's
#: chunks concatenated; a compressing cache: its stores gathered and dequantized).
GATHER = True


@dataclass(frozen=True)
class KVPhase:
    """What one phase holds: ``kv`` bytes of caches, ``transient`` bytes beside them (a gathered layer and a
    layer's new rows), ``scoring`` bytes (a key scorer), and the rows and branches of its forward."""

    name: str
    kv: int
    transient: int
    scoring: int
    tokens: int
    branches: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def floor_ratio(config: BagelConfig, rows: int) -> float:
    """Bytes of ``rows`` rows at UniCache's lowest lookup setting (2 bits, largest group, no residual) over their
    uncompressed bytes."""
    from ...compression.defaults import KIVI_FLOOR
    from ...kv.quant import quantized_kv_nbytes

    if rows <= 0:
        return 1.0
    llm = config.llm
    bits, group = KIVI_FLOOR
    packed = quantized_kv_nbytes(rows, llm.num_key_value_heads, llm.head_dim, bits, group, 0, 2)
    return min(1.0, packed / (rows * llm.num_key_value_heads * llm.head_dim * 2 * 2))


def _method(kv_method: Any) -> Any:
    """The method object of a name (or the object itself): what the plan reads of it, never its name."""
    from ...compression import method_from_name

    return method_from_name(kv_method)


def target_ratio(kv_method: str, task: str) -> float:
    """The method's default target ratio for ``task`` (1.0 for a method that never compresses, or a byte target)."""
    method = _method(kv_method)
    target = method.target(task) if method.compresses else 1.0
    return float(target) if isinstance(target, float) else 1.0


def written_kinds(kv_method: str) -> tuple[str, ...]:
    """The policy kinds whose image rows ``kv_method`` stores compressed as they are written: its ``written_kinds``
    (``"evict"`` ones at the target's bytes, at least the floor's, until the eviction), else ``("quantize",)`` when it
    compresses as written (``compresses_written``), else none."""
    method = _method(kv_method)
    default = ("quantize",) if getattr(method, "compresses_written", False) else ()
    return tuple(getattr(method, "written_kinds", default))


def prefill_ratios(config: BagelConfig, kv_method: str, task: str, rows: int) -> dict[str, float]:
    """Stored bytes over uncompressed bytes of an image's ``vae`` and ``vit`` content rows (``rows`` of each, for
    the floor's groups) while the context fills, under ``kv_method`` (module docstring): the kinds of
    :func:`written_kinds` by the shipped policy table (a ``quantize`` type at the target ratio, an ``evict`` type at
    the target ratio or the floor, whichever is more), every other type whole."""
    kinds = written_kinds(kv_method)
    if not kinds:
        return {"vae": 1.0, "vit": 1.0}
    target = target_ratio(kv_method, task)
    from ...compression.policy_table import paper_policy_table
    from ...kv.token_types import TokenType

    table = paper_policy_table()
    ratios = {}
    for name, token_type in (("vae", TokenType.SOURCE_VAE), ("vit", TokenType.SOURCE_VIT)):
        kind = table.kind(task, token_type)
        ratio = 1.0
        if kind in kinds:
            floor = floor_ratio(config, rows)
            ratio = target if kind == "quantize" else max(target, floor) if kind == "evict" else 1.0
        ratios[name] = ratio
    return ratios


def _stored(content: int, ratio: float) -> float:
    """Rows-equivalent of a block stored at ``ratio``: its content compressed, its boundaries whole."""
    return content * ratio + BOUNDARY_TOKENS


def kv_phases(config: BagelConfig, dtype: torch.dtype, tokens: RequestTokens, kv_method: str) -> list[KVPhase]:
    """The LLM phases of ``tokens`` under ``kv_method`` (module docstring), in the order they run."""
    per_token = kv_bytes_per_token(config, dtype)
    per_layer = per_token // max(1, config.llm.num_hidden_layers)
    method = _method(kv_method)
    compressing = bool(written_kinds(kv_method))
    largest = max((max(vae, vit) for vae, vit in tokens.image_blocks()), default=0)
    ratios = prefill_ratios(config, kv_method, tokens.task, largest)
    understanding = tokens.task == "understanding"
    blocks: list[tuple[int, float, bool]] = []  # (tokens, stored rows, stored compressed as written)
    if tokens.system:
        blocks.append((tokens.system + BOUNDARY_TOKENS, tokens.system + BOUNDARY_TOKENS, False))
    for vae, vit in tokens.image_blocks():
        if vae and not understanding:
            blocks.append((vae + BOUNDARY_TOKENS, _stored(vae, ratios["vae"]), compressing and ratios["vae"] < 1))
        if vit:
            blocks.append((vit + BOUNDARY_TOKENS, _stored(vit, ratios["vit"]), compressing and ratios["vit"] < 1))
    text = tokens.prompt + BOUNDARY_TOKENS * tokens.texts
    blocks.append((text, float(text), False))
    phases = []
    held = 0.0
    rows = 0
    for index, (count, stored, as_written) in enumerate(blocks):
        held += stored
        rows += count
        transient = (rows if GATHER else 0) + (count if as_written else 0)
        scoring = scoring_bytes(config, rows) if method.measures_prefill else 0
        prompt_scored = method.text_prior or (method.measures_prompt and not understanding)
        if index == len(blocks) - 1 and prompt_scored and len(blocks) > 1:
            scoring = scoring_bytes(config, rows)  # the instruction's attention to the images (its prefill window)
        phases.append(KVPhase(f"prefill:item{index}", int(held * per_token), transient * per_layer, scoring, count, 1))
    scoring = scoring_bytes(config, rows) if method.needs_scores else 0
    if understanding:
        evicted = held
        if method.text_prior:  # the text prior evicted the ViT rows at the instruction's prefill
            target = target_ratio(kv_method, tokens.task)
            vit = sum(v for _, v in tokens.image_blocks())
            evicted -= vit * ratios["vit"] * (1 - target)
        answer = tokens.decoded
        decode_scoring = 0 if method.text_prior else scoring
        phases.append(
            KVPhase("decode", int((evicted + answer) * per_token), (rows + answer) * per_layer, decode_scoring, 1, 1)
        )
        return phases
    # cfg_text is a fork of gen: it shares every row gen held at the fork (copy on write); cfg_img holds its text
    cfg_img = tokens.branches()["cfg_img"]
    plan = tokens.decoded + BOUNDARY_TOKENS if tokens.system else 0  # think mode: the plan appended to gen
    total = held + cfg_img + plan
    phases.append(
        KVPhase(
            "denoise:first",
            int(total * per_token),
            rows * per_layer if GATHER else 0,
            scoring,
            tokens.latent + BOUNDARY_TOKENS,
            GENERATION_BRANCHES,
        )
    )
    return phases


def kv_parts(config: BagelConfig, dtype: torch.dtype, tokens: RequestTokens, kv_method: str) -> dict[str, int]:
    """``kv_full`` (the official code's: every branch apart, uncompressed), ``kv_shared`` (what every method holds
    before compressing: the images' rows once), ``kv_compressed`` (after the first compression; not for ``full``)."""
    branches = tokens.kv_bytes(config, dtype)
    full = sum(branches.values())
    shared = full - branches.get("cfg_text", 0)  # cfg_text is a fork of gen: every row it holds is gen's
    parts = {"kv_full": full, "kv_shared": shared}
    if _method(kv_method).compresses:
        parts["kv_compressed"] = int(shared * target_ratio(kv_method, tokens.task))
    return parts


def scoring_bytes(config: BagelConfig, context_tokens: int) -> int:
    """Most bytes :func:`~unicache_core.compression.scoring.key_scores` holds while it scores one layer's
    ``context_tokens`` keys during a forward: two fp32 copies of a chunk of logits of its query subsample (at most
    :data:`~unicache_core.compression.scoring.SCORE_ELEMENTS`: the logits and their exp; the NaN-cleaned copy takes
    the place of one) and the keys in fp32. Sized on CPU tensor accounting at BAGEL-7B's widths (2 layers, four
    256 px sources: the first step peaked 86 MB above the layer's upcast weights, for 72 MB of one logits chunk and
    the keys; docs/results/real_width_images.json)."""
    from ...compression.defaults import SCORE_QUERIES
    from ...compression.scoring import SCORE_ELEMENTS

    llm = config.llm
    logits = min(SCORE_ELEMENTS, llm.num_attention_heads * SCORE_QUERIES * context_tokens)
    return 2 * logits * 4 + context_tokens * llm.num_key_value_heads * llm.head_dim * 4


def kv_per_image(
    config: BagelConfig, dtype: torch.dtype, tokens: RequestTokens, sizes, *, kv_method: str = "full"
) -> tuple[dict[str, Any], ...]:
    """Each input image's uncompressed KV bytes per branch (its blocks, boundaries included, in ``gen`` and, for a
    generation, in ``cfg_text``, which holds every image when the prompt comes last) and ``held_bytes``, what the
    branches hold of it together while the context fills (one store for both branches, at :func:`prefill_ratios`)."""
    per_token = kv_bytes_per_token(config, dtype)
    largest = max((max(vae, vit) for vae, vit in tokens.image_blocks()), default=0)
    ratios = prefill_ratios(config, kv_method, tokens.task, largest)
    rows = []
    for size, (vae, vit) in zip(sizes, tokens.image_blocks()):
        blocks = vit + BOUNDARY_TOKENS + (vae + BOUNDARY_TOKENS if vae else 0)
        branches = ("gen",) if tokens.task == "understanding" else ("gen", "cfg_text")
        held = _stored(vit, ratios["vit"]) + (_stored(vae, ratios["vae"]) if vae else 0)
        rows.append(
            {
                "size": list(size),
                "vae_tokens": vae,
                "vit_tokens": vit,
                "bytes_per_branch": {name: blocks * per_token for name in branches},
                "held_bytes": int(held * per_token),
            }
        )
    return tuple(rows)


__all__ = [
    "GATHER",
    "KVPhase",
    "written_kinds",
    "floor_ratio",
    "kv_parts",
    "kv_per_image",
    "kv_phases",
    "prefill_ratios",
    "scoring_bytes",
    "target_ratio",
]
