"""The baselines UniCache is measured against, as global policies over all compressible KV.

Each keeps its paper's defaults (docs/compression.md §2-§7) and is adapted to BAGEL the way UniCache's
code compares them (§8.10): one policy over the whole conditioning KV (instruction, source-ViT and
source-VAE pooled), boundary and current-latent tokens protected, the selection made once after the
first (full-KV) denoising step of each branch, or after the prompt prefill for understanding, and
matched to the same byte target.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..policies.pyramidkv import pyramid_layer_budgets
from ..policies.vlcache import vlcache_layer_budgets
from .method import CompressionMethod, GlobalEvictionMethod, candidate_indices
from .ops import best_kivi_setting, floor_bytes, quantize

if TYPE_CHECKING:  # pragma: no cover
    from .compressing_cache import CompressingKVCache, CompressionSession


class H2OMethod(GlobalEvictionMethod):
    """H2O (https://arxiv.org/abs/2306.14048): accumulated attention (every scored query so far) plus a
    recent window of 25% of the budget (UniCache's dynamic-budget split, heavy 0.375 / recent 0.125)."""

    name = "h2o"
    recent_fraction = 0.25

    def start(self, session: "CompressionSession") -> None:
        self.recent_fraction = session.config.recent_fraction


class SnapKVMethod(GlobalEvictionMethod):
    """SnapKV (https://arxiv.org/abs/2404.14469): attention of the last ``window`` (64) queries of the observed
    call, average-pooled along the keys (kernel 5); selection frozen afterwards. For understanding the
    window is the end of the prompt and its own keys are always kept (they are in the key set)."""

    name = "snapkv"
    window_queries = True
    smooth_kernel = 5

    def layer_scores(self, cache: "CompressingKVCache", layer: int):
        return cache.state[layer].last_scores

    def forced_rows(self, cache: "CompressingKVCache", layer: int):
        if cache.session.request.task != "understanding":
            return None  # denoising latents are not in the key set
        n = cache.layer(layer).appended_tokens
        forced = torch.zeros(n, dtype=torch.bool)
        forced[max(0, n - cache.session.config.window):] = True
        return forced


class PyramidKVMethod(SnapKVMethod):
    """PyramidKV (https://arxiv.org/abs/2406.02069): SnapKV scores, per-layer budgets decreasing with depth
    (beta 20) whose mean equals the matched budget."""

    name = "pyramidkv"
    beta = 20.0

    def layer_rows(self, cache, budgets, rows):
        if not rows or max(rows) == 0:
            return budgets
        total = rows[0]
        keep = sum(budgets) / len(budgets)
        window = min(cache.session.config.window, total)
        pyramid = pyramid_layer_budgets(total, window, 1.0 - min(1.0, keep / total), len(rows), self.beta) \
            if keep < total else [total] * len(rows)
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
    n_sink = 4

    def layer_scores(self, cache: "CompressingKVCache", layer: int):
        n = cache.layer(layer).appended_tokens
        hkv = cache.layer(layer)._kv_meta[0]
        idx = torch.arange(n, dtype=torch.float32)
        cand = torch.zeros(n, dtype=torch.bool)
        for i in candidate_indices(cache, layer):
            index = cache.layer(layer).stores[i].token_index.long()
            cand[index.reshape(-1)] = True
        # sinks = the n_sink earliest compressible rows; then recency
        order = torch.nonzero(cand).squeeze(1)
        scores = idx.clone()
        scores[order[: self.n_sink]] = 2.0 * n + 1.0 - idx[order[: self.n_sink]]
        return scores[:, None].expand(n, hkv).contiguous()


class VLCacheMethod(GlobalEvictionMethod):
    """VL-Cache (https://arxiv.org/abs/2410.23317): post-modality attention scores (the question after the image
    for understanding; the latent queries after the conditioning when denoising), layer budgets in
    proportion to each layer's density ``1 - sparsity`` (ThresholdFilter p = 1%)."""

    name = "vlcache"
    needs_sparsity = True

    def layer_scores(self, cache: "CompressingKVCache", layer: int):
        return cache.state[layer].last_scores

    def layer_rows(self, cache, budgets, rows):
        total = sum(budgets)
        if not rows or min(rows) == 0 or total < len(rows):
            return budgets
        sparsity = [cache.state[i].sparsity if cache.state[i].sparsity is not None else 0.0
                    for i in range(len(rows))]
        cap = min(rows)
        total = min(total, cap * len(rows))
        return vlcache_layer_budgets(sparsity, total, cap)


class KIVIMethod(CompressionMethod):
    """KIVI (https://arxiv.org/abs/2402.02750) over all compressible KV: keys per channel, values per token;
    the (bits, group, residual) whose real bytes are the largest at or under the target (reported)."""

    name = "kivi"
    needs_scores = False

    def compress_layers(self, session: "CompressionSession", cache: "CompressingKVCache") -> None:
        ratio = session.resolve_target()
        for layer in range(cache.num_layers):
            st = cache.layer(layer)
            idx = candidate_indices(cache, layer)
            if not idx or st._kv_meta is None:
                continue
            h, d, _, _ = st._kv_meta
            elem = cache.row_bytes(layer) // (2 * h * d)
            n = sum(st.stores[i].num_tokens for i in idx)
            budget = floor_bytes(ratio, cache.managed_full_bytes(layer))
            (bits, group, residual), fits = best_kivi_setting(budget, n, h, d, elem)
            cache.state[layer].budgets = {"candidate": budget}
            if not fits:
                cache.state[layer].flags["candidate"] = (
                    f"no KIVI setting fits {budget} B for {n} rows: the smallest "
                    f"({bits}-bit, G{group}, R{residual}) is used")
            quantize(st, idx, bits, group, residual)


__all__ = ["H2OMethod", "KIVIMethod", "PyramidKVMethod", "SnapKVMethod", "StreamingLLMMethod", "VLCacheMethod"]
