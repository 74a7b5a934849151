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

import torch
from torch import Tensor

from ..kv.stores import KVStore, QuantizedStore

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
    return torch.nan_to_num(share, nan=0.0).mean(dim=(1, 2)).tolist()


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
    scores = None
    for start in range(0, tq, rows):
        stop = min(tq, start + rows)
        n = stop - start
        qh = q[start:stop].float().permute(1, 0, 2).reshape(hkv, group * n, d)
        logits = torch.bmm(qh, kf).mul_(scale).reshape(hkv, group, n, t)  # [Hkv, g, n, T]
        lse_c = lse[start:stop].float().t().reshape(hkv, group, n, 1)
        if counts is not None and count_above is not None:
            thr = count_above[start:stop].float().t().reshape(hkv, group, n, 1)
            above = logits >= thr
            if visible is not None:
                above &= visible[start:stop].to(keys.device)
            counts += above.sum(dim=(2, 3)).reshape(hq)
        probs = torch.exp(logits.sub_(lse_c))
        if visible is not None:
            probs.masked_fill_(~visible[start:stop].to(keys.device), 0.0)
        part = torch.nan_to_num(probs, nan=0.0).sum(dim=2).mean(dim=1)  # [Hkv, T]
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


__all__ = [
    "SCORE_ELEMENTS",
    "key_scores",
    "mass_from_lse",
    "masses_from_lse",
    "query_subsample",
    "row_max_logits",
    "scorable",
    "score_keys",
    "scored_rows",
]
