"""Which rows an eviction keeps and which rows a quantized store keeps in full precision, per KV head.

Pure functions over score tensors: the ranking rules every method shares (docs/compression.md §2-§5): top rows
per head with deterministic ties (the newer row wins), H2O's recent window, SnapKV's forced observation window
and pooled scores, and the residual order of a KIVI store.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def topk_per_head(scores: Tensor, n: int, forced: Tensor | None = None) -> Tensor:
    """Deterministic top-``n`` rows per KV head.

    Order: forced rows first, then higher score, then the more recent (higher index) row on ties.
    NaN scores rank lowest.

    Args:
        scores: ``[T, Hkv]``; forced: optional bool ``[T, Hkv]``.

    Returns:
        ``[Hkv, n]`` int64 indices, ascending per head.
    """
    s = torch.nan_to_num(scores.t().float(), nan=float("-inf"))  # [Hkv, T]
    if forced is None:
        return _top_rows(s, n)
    t = s.shape[1]
    order = (t - 1) - torch.sort(torch.flip(s, dims=[1]), dim=1, descending=True, stable=True).indices
    flags = forced.t().gather(1, order).to(torch.int8)
    order = order.gather(1, torch.sort(flags, dim=1, descending=True, stable=True).indices)
    return order[:, :n].sort(dim=1).values


def _top_rows(ranked: Tensor, n: int) -> Tensor:
    """``[Hkv, n]`` int64 positions of the ``n`` highest of ``ranked [Hkv, T]`` (no NaN) per head, ascending; on
    ties the higher position wins. An ascending stable sort keeps tied rows in position order, so its last ``n``
    are the highest values with the later rows of a tie."""
    t = ranked.shape[1]
    n = max(0, min(int(n), t))
    order = torch.sort(ranked, dim=1, stable=True).indices[:, t - n :]
    return order.sort(dim=1).values


def pool_scores(scores: Tensor, kernel_size: int, pooling: str = "avgpool") -> Tensor:
    """Smooth ``[Hkv, T]`` scores along ``T`` with a stride-1, same-length pool (SnapKV; zero / -inf padding).

    ``pooling``: ``"avgpool"`` or ``"maxpool"``; ``kernel_size`` odd (1 = unchanged).
    """
    if kernel_size == 1 or scores.shape[1] == 0:
        return scores
    x = scores.unsqueeze(1)  # [Hkv, 1, T]
    if pooling == "avgpool":
        x = F.avg_pool1d(x, kernel_size, stride=1, padding=kernel_size // 2)
    else:
        x = F.max_pool1d(x, kernel_size, stride=1, padding=kernel_size // 2)
    return x.squeeze(1)


def select_rows(
    scores: Tensor, keep: int, *, recent: int = 0, forced: Tensor | None = None, smooth_kernel: int = 1
) -> Tensor:
    """The rows an eviction keeps out of a pool of ``N`` rows in append order, per KV head.

    Args:
        scores: ``[Hkv, N]`` fp32 score of each pooled row (higher = keep); NaN ranks lowest.
        keep: rows kept per head (clipped to ``[0, N]``).
        recent: the ``recent`` most recent rows of each head are always kept (H2O's window).
        forced: optional ``[Hkv, N]`` bool of rows always kept (SnapKV's observation window).
        smooth_kernel: SnapKV's 1-D average pooling of the scores along the append order.

    Returns:
        ``[Hkv, keep]`` int64 positions in the pool, ascending.
    """
    h, n = scores.shape
    keep = max(0, min(int(keep), n))
    if smooth_kernel > 1:
        scores = pool_scores(scores, smooth_kernel, "avgpool")
    if forced is None:
        # the recent window alone is forced: it never exceeds ``keep``, so ranking its rows above every score
        # (+inf) keeps the same rows as forcing them (NaN still ranks lowest; ties still go to the newer row)
        ranked = torch.nan_to_num(scores.float(), nan=float("-inf"))
        if recent > 0 and keep > 0:
            ranked[:, max(0, n - min(recent, keep)) :].fill_(float("inf"))
        return _top_rows(ranked, keep)
    mask = torch.zeros(h, n, dtype=torch.bool, device=scores.device)
    if recent > 0:
        mask[:, max(0, n - min(recent, keep)) :] = True
    mask |= forced
    return topk_per_head(scores.t(), keep, mask.t())


def residual_last(scores: Tensor, residual: int) -> Tensor:
    """Row order that puts the ``residual`` best-scored rows last (the ones a quantized store keeps in full
    precision), each part in its original order.

    Args:
        scores: ``[..., N]`` scores of the rows (higher = more attended).

    Returns:
        ``[..., N]`` int64 permutation.
    """
    n = scores.shape[-1]
    residual = max(0, min(int(residual), n))
    top = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if residual:
        best = torch.topk(torch.nan_to_num(scores.float(), nan=float("-inf")), residual, dim=-1).indices
        top.scatter_(-1, best, True)
    position = torch.arange(n, device=scores.device).expand(scores.shape)
    return torch.sort(top.long() * n + position, dim=-1).indices


__all__ = ["pool_scores", "residual_last", "select_rows", "topk_per_head"]
