"""The baselines UniCache is measured against, as global policies over all compressible KV.

Each keeps its paper's defaults (docs/compression.md §2-§7) and is adapted to BAGEL the way UniCache's
code compares them (§8.10): one policy over the whole conditioning KV (instruction, source-ViT and
source-VAE pooled), boundary and current-latent tokens protected, the selection made once after the
first (full-KV) denoising step of each branch, or after the prompt prefill for understanding, and
matched to the same byte target.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..kv.quant import SUPPORTED_BITS
from .allocator import allocate_integer
from .defaults import PYRAMID_BETA, RECENT_FRACTION, SINK_TOKENS, SNAPKV_KERNEL
from .family import FULL_BITS, JointChoice, QuantGeometry, Segment, lookup_order
from .method import CompressionMethod, GlobalEvictionMethod, candidate_indices
from .ops import floor_bytes, quantize, shared_rows
from .protocol import CompressibleBranch, MethodSession


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}, got {value!r}")


def pyramid_layer_budgets(
    total_tokens: int, window: int, compression: float, num_layers: int, beta: float = PYRAMID_BETA
) -> list[int]:
    """Per-layer token budgets of PyramidKV (kvpress 0.5.4 formula, docs/compression.md §5).

    With ``cap = w + T(1-c)``: ``min = (cap-w)/beta``, ``max = 2(cap-w) - min``; if ``max >= T - w``
    then ``max = T - w`` and ``min = 2(cap-w) - max``. Layer ``l`` keeps
    ``round(max - l (max-min)/(L-1))`` tokens (window included), so the mean over layers is
    ``T(1-c)`` up to rounding. If ``T >= max >= min >= w`` fails (short prompts, or one layer), every
    layer falls back to SnapKV's ``round(T(1-c))``.

    Args:
        total_tokens: prompt length ``T``; window: observation window ``w``;
        compression: removed fraction ``c`` in [0, 1); num_layers: ``L``; beta: pyramid steepness (>= 1).

    Returns:
        ``L`` integer budgets, non-increasing with depth.
    """
    _check_int("total_tokens", total_tokens, 0)
    _check_int("window", window, 0)
    _check_int("num_layers", num_layers, 1)
    if not 0.0 <= compression < 1.0:
        raise ValueError(f"`compression` must be in [0, 1), got {compression!r}")
    if not beta >= 1:
        raise ValueError(f"`beta` must be >= 1, got {beta!r}")
    kept = total_tokens * (1.0 - compression)
    fallback = [round(kept)] * num_layers
    min_num = kept / beta
    max_num = 2.0 * kept - min_num
    if max_num >= total_tokens - window:
        max_num = float(total_tokens - window)
        min_num = 2.0 * kept - max_num
    if num_layers == 1 or not (total_tokens >= max_num >= min_num >= window):
        return fallback
    step = (max_num - min_num) / (num_layers - 1)
    return [round(max_num - layer * step) for layer in range(num_layers)]


def vlcache_layer_budgets(sparsities: Sequence[float], total: int, num_tokens: int) -> list[int]:
    """Split ``total`` tokens across layers in proportion to density ``1 - gamma_l``.

    ``k_l = total (1 - gamma_l) / sum_j (1 - gamma_j)``, clipped to ``[1, num_tokens]``; what clipping
    removes or adds is redistributed so the budgets sum exactly to ``total`` (integer water-filling,
    each layer first gets its minimum of 1). All-zero density splits uniformly.

    Args:
        sparsities: ``gamma_l`` per layer, each in [0, 1].
        total: total budget over layers, in ``[L, L * num_tokens]``.
        num_tokens: prompt length ``T`` (per-layer cap).
    """
    n_layers = len(sparsities)
    if n_layers == 0:
        raise ValueError("`sparsities` must not be empty")
    for i, g in enumerate(sparsities):
        if not (isinstance(g, (int, float)) and math.isfinite(g) and 0.0 <= g <= 1.0):
            raise ValueError(f"`sparsities[{i}]` must be in [0, 1], got {g!r}")
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1:
        raise ValueError(f"`num_tokens` must be an int >= 1, got {num_tokens!r}")
    if not isinstance(total, int) or isinstance(total, bool) or not n_layers <= total <= n_layers * num_tokens:
        raise ValueError(
            f"`total` must be an int in [{n_layers}, {n_layers * num_tokens}] (1..T tokens per layer), got {total!r}"
        )
    extra = allocate_integer([num_tokens - 1] * n_layers, [1.0 - g for g in sparsities], total - n_layers)
    return [1 + e for e in extra]


def sink_recency_scores(num_rows: int, candidates: Tensor, num_sinks: int) -> Tensor:
    """StreamingLLM's ranking of ``num_rows`` appended rows: the ``num_sinks`` earliest candidate rows first
    (earliest highest), then every row by recency.

    Args:
        candidates: ``[num_rows]`` bool, the rows the eviction pool holds.

    Returns:
        ``[num_rows]`` fp32 scores (higher = keep).
    """
    idx = torch.arange(num_rows, dtype=torch.float32)
    sinks = torch.nonzero(candidates).squeeze(1)[:num_sinks]
    scores = idx.clone()
    scores[sinks] = 2.0 * num_rows + 1.0 - idx[sinks]
    return scores


class H2OMethod(GlobalEvictionMethod):
    """H2O (https://arxiv.org/abs/2306.14048): accumulated attention (every scored query so far) plus a
    recent window of 25% of the budget (UniCache's dynamic-budget split, heavy 0.375 / recent 0.125)."""

    name = "h2o"
    recent_fraction = RECENT_FRACTION

    def start(self, session: MethodSession) -> None:
        self.recent_fraction = session.config.recent_fraction


class SnapKVMethod(GlobalEvictionMethod):
    """SnapKV (https://arxiv.org/abs/2404.14469): attention of the last ``window`` (64) queries of the observed
    call, average-pooled along the keys (kernel 5); selection frozen afterwards. For understanding the
    window is the end of the prompt and its own keys are always kept (they are in the key set)."""

    name = "snapkv"
    window_queries = True
    smooth_kernel = SNAPKV_KERNEL

    def layer_scores(self, cache: CompressibleBranch, layer: int) -> Tensor | None:
        return cache.state[layer].last_scores

    def forced_rows(self, cache: CompressibleBranch, layer: int) -> Tensor | None:
        if cache.session.request.task != "understanding":
            return None  # denoising latents are not in the key set
        n = cache.layer(layer).appended_tokens
        forced = torch.zeros(n, dtype=torch.bool)
        forced[max(0, n - cache.session.config.window) :] = True
        return forced


class PyramidKVMethod(SnapKVMethod):
    """PyramidKV (https://arxiv.org/abs/2406.02069): SnapKV scores, per-layer budgets decreasing with depth
    (beta 20) whose mean equals the matched budget."""

    name = "pyramidkv"
    beta = PYRAMID_BETA

    def layer_rows(self, cache: CompressibleBranch, budgets: list[int], rows: list[int]) -> list[int]:
        if not rows or max(rows) == 0 or sum(budgets) == 0:
            return budgets  # nothing to keep anywhere (a budget below one row per layer): no pyramid to shape
        total = rows[0]
        keep = sum(budgets) / len(budgets)
        window = min(cache.session.config.window, total)
        pyramid = (
            pyramid_layer_budgets(total, window, 1.0 - min(1.0, keep / total), len(rows), self.beta)
            if keep < total
            else [total] * len(rows)
        )
        # never above the matched mean in total: trim the rounding surplus from the deepest layers
        surplus = sum(pyramid) - sum(budgets)
        layer = len(pyramid) - 1
        while surplus > 0 and layer >= 0:
            cut = min(surplus, pyramid[layer])
            pyramid[layer] -= cut
            surplus -= cut
            layer -= 1
        return [min(p, r) for p, r in zip(pyramid, rows)]


class StreamingLLMMethod(GlobalEvictionMethod):
    """StreamingLLM (https://arxiv.org/abs/2309.17453): the first 4 compressible tokens (sinks) and the most
    recent ones; no scores, original positions kept (no re-rotation, BAGEL's image tokens share RoPE ids)."""

    name = "streamingllm"
    needs_scores = False
    n_sink = SINK_TOKENS

    def layer_scores(self, cache: CompressibleBranch, layer: int) -> Tensor:
        n = cache.layer(layer).appended_tokens
        hkv = cache.layer(layer)._kv_meta[0]
        cand = torch.zeros(n, dtype=torch.bool)
        for i in candidate_indices(cache, layer):
            index = cache.layer(layer).stores[i].token_index.long()
            cand[index.reshape(-1)] = True
        scores = sink_recency_scores(n, cand, self.n_sink)
        return scores[:, None].expand(n, hkv).contiguous()


class VLCacheMethod(GlobalEvictionMethod):
    """VL-Cache (https://arxiv.org/abs/2410.23317): post-modality attention scores (the question after the image
    for understanding; the latent queries after the conditioning when denoising), layer budgets in
    proportion to each layer's density ``1 - sparsity`` (ThresholdFilter p = 1%)."""

    name = "vlcache"
    needs_sparsity = True

    def layer_scores(self, cache: CompressibleBranch, layer: int) -> Tensor | None:
        return cache.state[layer].last_scores

    def layer_rows(self, cache: CompressibleBranch, budgets: list[int], rows: list[int]) -> list[int]:
        total = sum(budgets)
        if not rows or min(rows) == 0 or total < len(rows):
            return budgets
        sparsity = [cache.state[i].sparsity if cache.state[i].sparsity is not None else 0.0 for i in range(len(rows))]
        cap = min(rows)
        total = min(total, cap * len(rows))
        return vlcache_layer_budgets(sparsity, total, cap)


class KIVIMethod(CompressionMethod):
    """KIVI (https://arxiv.org/abs/2402.02750) over all compressible KV: keys per channel, values per token;
    every row at the most precise (bits, group) whose real bytes fit the target, the newest rows in full
    precision with the bytes left (docs/compression.md §11.2: the same settings UniCache's quantize route
    takes, without scores). A pool that no setting fits is quantized at the smallest one when that still
    shrinks it, else left as it is (flagged either way)."""

    name = "kivi"
    needs_scores = False

    def compress_layers(self, session: MethodSession, cache: CompressibleBranch) -> None:
        ratio = session.resolve_target()
        geometry = session.config.quant_geometry(QuantGeometry())
        for layer in range(cache.num_layers):
            st = cache.layer(layer)
            idx = candidate_indices(cache, layer)
            if not idx or st._kv_meta is None:
                continue
            h, d, _, _ = st._kv_meta
            stores = [st.stores[i] for i in idx]
            n = sum(s.num_tokens for s in stores)
            segment = Segment(
                full_rows=n,
                held_rows=n,
                held_bits=FULL_BITS,
                held_bytes=sum(s.nbytes() for s in stores),
                shared_rows=shared_rows(stores),
                num_kv_heads=h,
                head_dim=d,
                elem=cache.row_bytes(layer) // (2 * h * d),
            )
            budget = floor_bytes(ratio, cache.managed_full_bytes(layer))
            cache.state[layer].budgets = {"candidate": budget}
            if ratio >= 1.0:
                continue  # the target keeps everything: nothing is quantized
            choice = next(
                (
                    c
                    for bits, group in lookup_order(geometry)
                    if (c := segment.quantized(n, bits, group, geometry, budget)) is not None
                ),
                None,
            )
            if choice is None:
                choice = JointChoice(n, min(SUPPORTED_BITS), max(geometry.groups), 0)
                need = segment.choice_bytes(choice)
                kept = "it is used" if need < segment.held_bytes else "the rows stay as they are (it would hold more)"
                cache.state[layer].flags["candidate"] = (
                    f"no KIVI setting fits {budget} B for {n} rows: the smallest is {choice.bits}-bit, "
                    f"G{choice.group}, R0 ({need} B); {kept}"
                )
            if segment.choice_bytes(choice) < segment.held_bytes:  # never a store that holds more
                quantize(st, idx, choice.bits, choice.group, choice.residual)


__all__ = [
    "H2OMethod",
    "KIVIMethod",
    "PyramidKVMethod",
    "SnapKVMethod",
    "StreamingLLMMethod",
    "VLCacheMethod",
    "pyramid_layer_budgets",
    "sink_recency_scores",
    "vlcache_layer_budgets",
]
