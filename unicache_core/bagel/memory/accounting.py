"""Memory accounting of a BAGEL request, from its token counts alone (no forward runs).

The tokens each branch holds come from :mod:`unicache_core.bagel.tokens` (:class:`RequestTokens`, counted once
when a request is checked; the names are re-exported here); this module turns them into the device memory a request
needs besides the weights (:func:`request_memory_bytes`; the VAE's working memory: :mod:`.vae`; TaylorSeer's
factors while it is on: :func:`taylorseer_bytes`), and counts a plan's request from its sizes
(:func:`request_tokens`).
"""

from __future__ import annotations

import torch

from ...kv.cache import Task
from ..config import BagelConfig
from ..settings import UNDERSTANDING_DEFAULTS
from ..taylorseer import GENERATION_BRANCHES, factor_bytes
from ..tokens import (
    BOUNDARY_TOKENS,
    RequestTokens,
    check_image_positions,
    check_item_positions,
    check_positions,
    count_items,
    count_request,
    generation_positions,
    image_tokens,
    item_positions,
    kv_bytes_per_token,
    understanding_positions,
)
from .vae import tiled_decode_bytes, vae_working_bytes

#: Prompt tokens a plan assumes (a long instruction; the prompt is small beside the image tokens).
PLAN_PROMPT_TOKENS = 64


# ----------------------------------------------------------------------------------------- a plan's request


def request_tokens(
    config: BagelConfig,
    task: Task,
    width: int,
    height: int,
    prompt_tokens: int = PLAN_PROMPT_TOKENS,
    answer_tokens: int | None = None,
    images: tuple[tuple[int, int], ...] | None = None,
) -> RequestTokens:
    """The tokens of a plan's request: its input ``images`` (``(width, height)`` each, in order, then a
    ``prompt_tokens`` prompt; None: one ``width x height`` input image for ``und``/``edit``, none for an ``und`` of
    size 0 or ``t2i``), default settings (no think mode); the output of an edit is its last image, of ``t2i``
    ``width x height``; an ``und`` answer of ``answer_tokens`` (default: the most the default settings decode)."""
    if images is None:
        images = ((width, height),) if width and height and task != "t2i" else ()
    blocks = tuple(image_tokens(config, size) for size in images)
    if task == "understanding":
        blocks = tuple((0, vit) for _, vit in blocks)
    step = config.latent_downsample
    latent = 0
    if task == "edit":
        latent = blocks[-1][0] if blocks else 0
    elif task == "t2i":
        latent = (width // step) * (height // step)
    return RequestTokens(
        task=task,
        prompt=prompt_tokens,
        vit=sum(vit for _, vit in blocks),
        vae=sum(vae for vae, _ in blocks),
        latent=latent,
        decoded=(UNDERSTANDING_DEFAULTS.max_new_tokens if answer_tokens is None else answer_tokens)
        if task == "understanding"
        else 0,
        images=blocks if len(blocks) > 1 else (),
    )


# ----------------------------------------------------------------------------------------- memory


def taylorseer_bytes(config: BagelConfig, dtype: torch.dtype, tokens: RequestTokens, order: int | None) -> int:
    """Bytes TaylorSeer's factors hold at most (0 when ``order`` is ``None`` or the task is understanding): per CFG
    branch, ``order + 1`` tensors of the latent block ``[latent + 2, hidden]`` in the model dtype
    (:func:`~.taylorseer.factor_bytes`; this engine keeps them for the last decoder layer only, the official code
    for every layer: ``num_hidden_layers`` times as many)."""
    if order is None or tokens.task == "understanding" or not tokens.latent:
        return 0
    element = torch.empty((), dtype=dtype).element_size()
    return GENERATION_BRANCHES * factor_bytes(config.llm.hidden_size, tokens.latent, order, element)


def request_memory_bytes(
    config: BagelConfig, dtype: torch.dtype, tokens: RequestTokens, *, taylor_order: int | None = None
) -> int:
    """Estimate of the device memory one request needs besides the weights (:func:`request_memory_parts`).

    The larger of the two phases, which never run at the same time: the LLM's (the uncompressed KV of every
    branch, which compression starts from after the first step, plus its largest forward, ``attention`` +
    ``mlp``, plus TaylorSeer's factors with ``taylor_order``, :func:`~.taylorseer.taylorseer_order`) or the fp32 VAE
    encode/decode (``vae``: the source is encoded before anything is cached and the pipeline releases the caches
    and the factors before it decodes).
    """
    parts = request_memory_parts(config, dtype, tokens, taylor_order=taylor_order)
    return int(max(parts["kv"] + parts["attention"] + parts["mlp"] + parts["taylorseer"], parts["vae"]))


def request_memory_parts(
    config: BagelConfig, dtype: torch.dtype, tokens: RequestTokens, *, taylor_order: int | None = None
) -> dict[str, int]:
    """The parts of :func:`request_memory_bytes`: ``kv``, ``attention``, ``mlp``, ``taylorseer``
    (:func:`taylorseer_bytes` of ``taylor_order``) and ``vae`` bytes.

    For the largest block of ``T`` tokens (:meth:`RequestTokens.largest_block`) in the compute dtype of ``e``
    bytes, hidden size ``H``, MLP width ``I``, ``Hq`` query heads of dimension ``d``:

    * ``attention = T * 2 * Hq * d * 4``: the fp32 partial outputs of the cached and the new keys and their
      log-sum-exp merge. Scores are never materialised whole: on the CPU every block this estimate covers
      (image and latent blocks, decoding) goes through the flash kernel, which streams the keys in tiles; a
      text block after a cached context takes the chunked reference path, whose scores are bounded by
      :data:`~unicache_core.kv.attention.REFERENCE_SCORE_ELEMENTS` and are small beside a prompt's other
      memory; on a GPU the fused SDPA kernels hold no scores either.
    * ``mlp = T * (3 * I + (4 + B) * H) * e``: gate, up and their product alive together, four hidden-size
      tensors of the layer (residual, norm, attention output, projection) and the ``B`` blocks of a step's
      branches run together through each layer (1 for understanding, 3 for generation).
    * ``vae``: the peak of the fp32 VAE encoding the source or decoding the output, found by running the VAE
      on meta tensors under a :class:`~.trace.TensorMemoryTracker` (:func:`vae_working_bytes`);
      ``vae_encode`` and ``vae_decode`` apart, and ``vae_decode_tiled``: the decode in tiles
      (:func:`tiled_decode_bytes`).

    Checked against a tensor-accounting run on CPU by ``benchmarks/memory_plan_check.py``.
    """
    llm = config.llm
    element = torch.empty((), dtype=dtype).element_size()
    kv = sum(tokens.kv_bytes(config, dtype).values())
    queries = tokens.largest_block()
    branches = 1 if tokens.task == "understanding" else GENERATION_BRANCHES
    attention = queries * 2 * llm.num_attention_heads * llm.head_dim * 4
    mlp = queries * (3 * llm.intermediate_size + (4 + branches) * llm.hidden_size) * element
    encode = vae_working_bytes(config, tokens.largest_image()[0], decode=False)
    decode = vae_working_bytes(config, tokens.latent, decode=True)
    return {
        "kv": int(kv),
        "attention": int(attention),
        "mlp": int(mlp),
        "taylorseer": taylorseer_bytes(config, dtype, tokens, taylor_order),
        "vae": int(max(encode, decode)),
        "vae_encode": int(encode),
        "vae_decode": int(decode),
        "vae_decode_tiled": tiled_decode_bytes(config, tokens.latent),
    }


__all__ = [
    "BOUNDARY_TOKENS",
    "PLAN_PROMPT_TOKENS",
    "RequestTokens",
    "check_positions",
    "check_image_positions",
    "check_item_positions",
    "count_items",
    "count_request",
    "generation_positions",
    "image_tokens",
    "item_positions",
    "kv_bytes_per_token",
    "request_memory_bytes",
    "request_memory_parts",
    "request_tokens",
    "understanding_positions",
]
