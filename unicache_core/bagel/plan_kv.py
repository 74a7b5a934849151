"""The KV terms of a memory plan (:mod:`.memory_plan`): what the branches hold, per image, while compressing and
while scoring.

- ``kv_full``: every branch's uncompressed KV (:meth:`~.accounting.RequestTokens.kv_bytes`);
- ``kv_held``: what the branches hold together before the first compression. ``full`` holds every branch apart (a
  :class:`~unicache_core.kv.cache.FullKVCache` builds new tensors of ``gen``'s rows when the prompt is appended after
  the ``cfg_text`` fork); a compressing method's segmented caches share the input images' rows between ``gen`` and
  ``cfg_text`` until the first compression (measured on the H200: the 1024 px edit's denoising started 520.5 MB
  lower with UniCache than with full KV, 515.9 MB planned; docs/results/gpu_real_size.json);
- ``kv_compressing``: when the first of ``gen`` and ``cfg_text`` is compressed, its compressed copy beside the rows
  the other still shares (``gen``'s KV times the method's target ratio);
- ``kv_scoring``: a key-scoring method scores a layer's keys inside a forward (:func:`scoring_bytes`);
- ``kv_compressed``: what the method keeps after its first compression, ``kv_full`` times its default target
  ratio for the task (it assumes the ratio of the compressible rows holds for every row; the protected boundary
  rows are few).
"""

from __future__ import annotations

from typing import Any

import torch

from .accounting import BOUNDARY_TOKENS, RequestTokens, kv_bytes_per_token
from .config import BagelConfig

#: Methods that score keys (:func:`unicache_core.compression.scoring.key_scores`) at their observed calls: every
#: method but ``full``, ``streamingllm`` and ``kivi`` (``CompressionMethod.needs_scores``).
SCORING_METHODS = ("unicache", "h2o", "snapkv", "pyramidkv", "vlcache")


def kv_parts(config: BagelConfig, dtype: torch.dtype, tokens: RequestTokens, kv_method: str) -> dict[str, int]:
    """``kv_full``, ``kv_held`` and, as they apply, ``kv_compressing``, ``kv_scoring``, ``kv_compressed`` bytes
    (module docstring) of ``tokens`` under ``kv_method``."""
    from ..compression import method_from_name

    branches = tokens.kv_bytes(config, dtype)
    full = sum(branches.values())
    shared = 0 if kv_method == "full" else tokens.shared_fork_tokens() * kv_bytes_per_token(config, dtype)
    parts = {"kv_full": full, "kv_held": full - shared}
    if kv_method == "full":
        return parts
    target = method_from_name(kv_method).target(tokens.task)
    ratio = float(target) if isinstance(target, float) else 1.0
    if shared:
        parts["kv_compressing"] = int(branches["gen"] * ratio)
    if kv_method in SCORING_METHODS:
        parts["kv_scoring"] = scoring_bytes(config, max(tokens.branches().values()))
    parts["kv_compressed"] = int(full * ratio)
    return parts


def scoring_bytes(config: BagelConfig, context_tokens: int) -> int:
    """Most bytes :func:`~unicache_core.compression.scoring.key_scores` holds while it scores one layer's
    ``context_tokens`` keys during a forward: a chunk of fp32 logits of its query subsample (at most
    :data:`~unicache_core.compression.scoring.SCORE_ELEMENTS`), their exp and its NaN-cleaned copy, and the keys in
    fp32. Measured at BAGEL-7B's widths on the CPU (2 layers, 256 px sources): UniCache's denoising peaked 22 MB
    above full KV's with one image and 171 MB with four (docs/results/real_width_images.json); this bound is the
    larger of the two."""
    from ..compression.defaults import SCORE_QUERIES
    from ..compression.scoring import SCORE_ELEMENTS

    llm = config.llm
    logits = min(SCORE_ELEMENTS, llm.num_attention_heads * SCORE_QUERIES * context_tokens)
    return 3 * logits * 4 + context_tokens * llm.num_key_value_heads * llm.head_dim * 4


def kv_per_image(
    config: BagelConfig, dtype: torch.dtype, tokens: RequestTokens, sizes, *, shared: bool
) -> tuple[dict[str, Any], ...]:
    """Each input image's uncompressed KV bytes per branch (its blocks, boundaries included, in ``gen`` and, for a
    generation, in ``cfg_text``, which holds every image when the prompt comes last) and ``held_bytes``, what the
    branches hold of it together (``shared``: a compressing method's ``cfg_text`` shares the image's content rows
    with ``gen``)."""
    per_token = kv_bytes_per_token(config, dtype)
    rows = []
    for size, (vae, vit) in zip(sizes, tokens.image_blocks()):
        blocks = vit + BOUNDARY_TOKENS + (vae + BOUNDARY_TOKENS if vae else 0)
        branches = ("gen",) if tokens.task == "understanding" else ("gen", "cfg_text")
        held = len(branches) * blocks - (vae + vit if shared and len(branches) > 1 else 0)
        rows.append(
            {
                "size": list(size),
                "vae_tokens": vae,
                "vit_tokens": vit,
                "bytes_per_branch": {name: blocks * per_token for name in branches},
                "held_bytes": held * per_token,
            }
        )
    return tuple(rows)


__all__ = ["SCORING_METHODS", "kv_parts", "kv_per_image", "scoring_bytes"]
