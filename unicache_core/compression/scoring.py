"""Attention statistics from the log-sum-exp attention already returns (docs/compression.md §8.5, §9.1).

Nothing here builds a ``[Hq, Tq, T]`` probability tensor: the mass on a store is
``exp(lse_store - lse_total)`` (per query and head, free once attention ran store by store), and per-key
scores are computed over a subsample of the queries, chunked so that at most
:data:`SCORE_ELEMENTS` fp32 logits exist at once. Probabilities are shares of the FULL resident softmax
(pre-eviction mass), because ``lse_total`` covers every resident key and the new block.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..kv.cache import AttentionCall
from ..kv.quantized_store import QuantizedStore
from ..kv.segmented_cache import LayerAttention
from ..kv.stores import KVStore
from ..kv.token_types import PROTECTED_TYPES

#: fp32 logits materialised at once by :func:`key_scores` (64 MiB).
SCORE_ELEMENTS = 1 << 24


def mass_from_lse(part_lse: Tensor, total_lse: Tensor) -> float:
    """Mean over queries and heads of the attention share of one key set: ``mean(exp(part - total))``.

    Args:
        part_lse, total_lse: ``[Tq, Hq]`` fp32.
    """
    return masses_from_lse([part_lse], total_lse)[0]


def masses_from_lse(part_lses: list[Tensor], total_lse: Tensor) -> list[float]:
    """:func:`mass_from_lse` of several key sets of one call at once (one exp and one mean for all of them,
    one host sync).

    Args:
        part_lses: ``k`` tensors ``[Tq, Hq]`` fp32; total_lse: ``[Tq, Hq]`` fp32.

    Returns:
        ``k`` masses, in the order given.
    """
    if not part_lses:
        return []
    share = torch.exp(torch.stack(part_lses).float() - total_lse.float())  # [k, Tq, Hq]
    return share.nan_to_num_(nan=0.0).mean(dim=(1, 2)).tolist()


def query_subsample(num_queries: int, limit: int, *, last: bool, device: torch.device) -> Tensor:
    """``[n]`` indices of at most ``limit`` queries: the last ones (``last``: an observation window) or an
    evenly strided subset (denoising latents, all alike)."""
    return _query_subsample(num_queries, limit, last, torch.device(device)).clone()


@functools.lru_cache(maxsize=64)
def _query_subsample(num_queries: int, limit: int, last: bool, device: torch.device) -> Tensor:
    # a call's query count repeats at every observed layer and step: computed once per (count, limit, device)
    if limit <= 0 or num_queries <= limit:
        return torch.arange(num_queries, device=device)
    if last:
        return torch.arange(num_queries - limit, num_queries, device=device)
    return torch.linspace(0, num_queries - 1, limit, device=device).round().long().unique()


def key_scores(
    q: Tensor,
    keys: Tensor,
    lse: Tensor,
    *,
    scale: float | None = None,
    visible: Tensor | None = None,
    count_above: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Attention each key receives, summed over the given queries and averaged over each KV group's heads.

    Args:
        q: ``[Tq, Hq, d]`` (a subsample of) the call's queries.
        keys: ``[T, Hkv, d]`` keys (row ``i`` of head ``h`` may be any token: evicted stores).
        lse: ``[Tq, Hq]`` fp32 log-sum-exp of those queries over the whole resident context.
        visible: optional ``[Tq, T]`` bool (the new block's causal/block mask).
        count_above: optional ``[Tq, Hq]`` fp32 logit thresholds; also count, per query head, the entries
            whose logit is >= the threshold (VL-Cache's relative ThresholdFilter).

    Returns:
        ``(scores [T, Hkv] fp32, counts [Hq] int64 or None)``.
    """
    tq, hq, d = q.shape
    t, hkv = keys.shape[0], keys.shape[1]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    counts = None if count_above is None else torch.zeros(hq, dtype=torch.int64, device=keys.device)
    if t == 0 or tq == 0:
        return torch.zeros(t, hkv, dtype=torch.float32, device=keys.device), counts
    kf = keys.float().permute(1, 2, 0)  # [Hkv, d, T]
    rows = max(1, SCORE_ELEMENTS // max(1, hq * t))
    # a query that sees no key has lse -inf: clamped, its logits (all -inf) still give exp 0, never NaN
    finite = lse.float().clamp_min(torch.finfo(torch.float32).min)
    scores = None
    for start in range(0, tq, rows):
        stop = min(tq, start + rows)
        n = stop - start
        qh = q[start:stop].float().permute(1, 0, 2).reshape(hkv, group * n, d)
        shift = finite[start:stop].t().reshape(hkv, group * n, 1).neg()
        # logits - lse in one pass: [Hkv, g*n, T], then [Hkv, g, n, T]
        logits = torch.baddbmm(shift, qh, kf, alpha=scale).view(hkv, group, n, t)
        if visible is not None:
            logits.masked_fill_(~visible[start:stop].to(keys.device), float("-inf"))
        if counts is not None and count_above is not None:
            thr = (count_above[start:stop].float() - finite[start:stop]).t().reshape(hkv, group, n, 1)
            counts += (logits >= thr).sum(dim=(2, 3)).reshape(hq)
        part = logits.exp_().sum(dim=2).mean(dim=1)  # [Hkv, T]
        scores = part if scores is None else scores.add_(part)  # the first chunk's sums start the total
    assert scores is not None  # tq > 0: at least one chunk ran
    return scores.t().contiguous(), counts


def row_max_logits(q: Tensor, keys: Tensor, *, scale: float | None = None, visible: Tensor | None = None) -> Tensor:
    """``[Tq, Hq]`` fp32 largest logit of each query over ``keys [T, Hkv, d]`` (``-inf`` if none is visible)."""
    tq, hq, d = q.shape
    t, hkv = keys.shape[0], keys.shape[1]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = torch.full((tq, hq), float("-inf"), dtype=torch.float32, device=keys.device)
    if t == 0:
        return out
    kf = keys.float().permute(1, 2, 0)
    rows = max(1, SCORE_ELEMENTS // max(1, hq * t))
    for start in range(0, tq, rows):
        stop = min(tq, start + rows)
        n = stop - start
        qh = q[start:stop].float().permute(1, 0, 2).reshape(hkv, group * n, d)
        logits = torch.bmm(qh, kf).mul_(scale).reshape(hkv, group, n, t)
        if visible is not None:
            logits.masked_fill_(~visible[start:stop].to(keys.device), float("-inf"))
        out[start:stop] = logits.amax(dim=-1).reshape(hq, n).t()
    return out


def scorable(store: KVStore) -> bool:
    """Whether :func:`score_keys` has keys for ``store``."""
    return isinstance(store, QuantizedStore) and not store.per_head_rows or store.score_keys() is not None


def score_keys(store: KVStore) -> Tensor | None:
    """``[num_tokens, Hkv, d]`` keys to score ``store``'s rows with: its own, or a quantized store's dequantized keys
    (rows quantized as they were written, docs/compression.md §13; a transient of this call), ``None`` for a store
    whose heads hold different rows."""
    keys = store.score_keys()
    if keys is None and isinstance(store, QuantizedStore) and not store.per_head_rows:
        keys = store.dequantize()[0]
    return keys


def scored_rows(stores: list[KVStore], num_kv_heads: int) -> tuple[Tensor | None, Tensor | None]:
    """The rows of ``stores`` that scoring reads, as one key set: ``(keys [N, Hkv, d], append index [N, Hkv] int64)``
    (row ``i`` of head ``h`` is the key of append index ``index[i, h]``), or ``(None, None)`` without stores."""
    if not stores:
        return None, None
    keys: list[Tensor] = []
    index: list[Tensor] = []
    for store in stores:
        store_keys = score_keys(store)
        assert store_keys is not None, "only scorable stores are scored"
        keys.append(store_keys)
        rows = store.token_index.long()
        index.append(rows.unsqueeze(1).expand(-1, num_kv_heads) if rows.dim() == 1 else rows.t())
    if len(stores) == 1:
        return keys[0], index[0]
    return torch.cat(keys), torch.cat(index)


@dataclass(frozen=True)
class KeyScores:
    """One scoring pass over a layer of a call (:meth:`CallProbe.key_scores`).

    Attributes:
        scores: ``[T_appended, Hkv]`` fp32 attention per appended row (the new block's included when it was
            appended), summed over the scored queries, averaged over each KV group's heads.
        queries: how many queries were scored.
        counts: ``[Hq]`` int64 entries at or above the relative threshold per query head (``None``: not counted).
        entries: how many (query, key) entries per head the counts are out of.
    """

    scores: Tensor
    queries: int
    counts: Tensor | None = None
    entries: int = 0


@dataclass(frozen=True)
class CallProbe:
    """What one layer of an attention call exposes to a method's measurement, read-only: the call, its queries and
    new keys, the attention it computed store by store (log-sum-exps), and the layer's resident stores.

    Attributes:
        layer: the layer index.
        call: the attention call (phase, step, token types, image index, masks).
        q: ``[Tq, Hq, d]`` the call's queries; k_new: ``[Tn, Hkv, d]`` its new keys.
        attention: the layer's attention result (``lse [Tq, Hq]``, the per-store log-sum-exps).
        stores: the layer's resident stores, before the new block is appended.
        appended: rows appended to the layer before this call (the new block's rows follow them).
    """

    layer: int
    call: AttentionCall
    q: Tensor
    k_new: Tensor
    attention: LayerAttention
    stores: tuple[KVStore, ...]
    appended: int

    @property
    def windowed(self) -> bool:
        """Whether a subsample of the call's queries is its last ones (a text's observation window) rather than an
        evenly strided subset: a bidirectional block (an image's rows as they are prefilled, the latents of a denoising
        step) has no order its queries are read in, and its last queries are its bottom rows."""
        return self.call.phase != "denoise" and self.call.image is None

    def key_scores(self, num_queries: int, *, last: bool, relative_threshold: float | None = None) -> KeyScores:
        """Attention of a query subsample to every resident row (protected rows left out unless counted) and, with
        ``update``, to the new block's rows, in one pass. ``num_queries``: most queries scored (0: all); ``last``: the
        last queries (an observation window) rather than an evenly strided subset; ``relative_threshold``: also
        count, per query head, the entries whose probability is at least this share of their row's largest."""
        q, call, k_new = self.q, self.call, self.k_new
        if 0 < num_queries < q.shape[0]:
            idx = query_subsample(q.shape[0], num_queries, last=last, device=q.device)
            qs, lse = q.index_select(0, idx), self.attention.lse.index_select(0, idx)
        else:  # every query is scored: no subsample to gather
            idx, qs, lse = None, q, self.attention.lse
        tn = k_new.shape[0] if call.update else 0
        total, hkv = self.appended + tn, k_new.shape[1]
        dense = torch.zeros(total, hkv, dtype=torch.float32, device=q.device)
        visible = _new_block_visibility(call, q, idx, tn)
        counting = relative_threshold is not None
        scored = [  # every resident row that can be scored (protected rows only when counted)
            s for s in self.stores if s.num_tokens and scorable(s) and (counting or s.token_type not in PROTECTED_TYPES)
        ]
        keys, index = scored_rows(scored, hkv)
        merged = call.update and visible is None and tn > 0
        if merged:  # every query sees the whole new block: its keys are scored in the same pass
            new_index = torch.arange(self.appended, total, device=q.device).unsqueeze(1).expand(-1, hkv)
            keys = k_new if keys is None else torch.cat([keys, k_new.to(keys.dtype)])
            index = new_index if index is None else torch.cat([index.to(q.device), new_index])
        thresholds = None
        if relative_threshold is not None:
            rowmax = torch.full(lse.shape, float("-inf"), device=q.device)
            if keys is not None:
                rowmax = torch.maximum(rowmax, row_max_logits(qs, keys))
            if call.update and not merged:
                rowmax = torch.maximum(rowmax, row_max_logits(qs, k_new, visible=visible))
            thresholds = rowmax + math.log(relative_threshold)
        counts = torch.zeros(q.shape[1], dtype=torch.int64, device=q.device)
        valid = 0
        if keys is not None and index is not None:
            scores, c = key_scores(qs, keys, lse, count_above=thresholds)
            dense.scatter_add_(0, index.to(q.device), scores)
            if c is not None:
                counts += c
                valid += qs.shape[0] * keys.shape[0]
        if call.update and not merged:
            scores, c = key_scores(qs, k_new, lse, visible=visible, count_above=thresholds)
            dense[self.appended :] += scores
            if c is not None:
                counts += c
                valid += int(visible.sum()) if visible is not None else qs.shape[0] * tn
        return KeyScores(dense, int(qs.shape[0]), counts if counting else None, valid)


def _new_block_visibility(call: AttentionCall, q: Tensor, idx: Tensor | None, tn: int) -> Tensor | None:
    """``[Tq_scored, Tn]`` bool: which new keys each scored query sees (``None``: all of them, or no new block)."""
    if not call.update:
        return None
    if call.new_block_mask is not None:
        visible = call.new_block_mask.to(q.device)
        return visible if idx is None else visible.index_select(0, idx)
    if call.causal:
        rows = torch.arange(q.shape[0], device=q.device) if idx is None else idx
        return torch.arange(tn, device=q.device)[None, :] <= rows[:, None]
    return None


__all__ = [
    "SCORE_ELEMENTS",
    "CallProbe",
    "KeyScores",
    "key_scores",
    "mass_from_lse",
    "masses_from_lse",
    "query_subsample",
    "row_max_logits",
    "scorable",
    "score_keys",
    "scored_rows",
]
