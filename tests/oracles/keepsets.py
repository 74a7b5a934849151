"""Monotonic keep sets: an evicted token never comes back (docs/compression.md §8.6, §9.4)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def split_eviction_budget(keep: int, recent_fraction: float = 0.25) -> tuple[int, int]:
    """``(recent, heavy)`` with ``recent = round_half_up(keep * recent_fraction)`` and ``heavy = keep - recent``."""
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
        raise ValueError(f"`keep` must be an int >= 0, got {keep!r}")
    if not 0.0 <= recent_fraction <= 1.0:
        raise ValueError(f"`recent_fraction` must be in [0, 1], got {recent_fraction!r}")
    recent = min(keep, math.floor(keep * recent_fraction + 0.5))
    return recent, keep - recent


class MonotonicKeepSet:
    """Kept token indices of one segment in one layer, per KV head, that can only shrink.

    Indices refer to a fixed token order of the segment (its original positions ``0..T-1``); the
    segment must not grow between updates (conditioning caches are frozen while being compressed).
    """

    def __init__(self, num_tokens: int, num_kv_heads: int):
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"`num_tokens` must be an int >= 0, got {num_tokens!r}")
        if not isinstance(num_kv_heads, int) or num_kv_heads < 1:
            raise ValueError(f"`num_kv_heads` must be an int >= 1, got {num_kv_heads!r}")
        self.num_tokens = num_tokens
        self.num_kv_heads = num_kv_heads
        self._mask = torch.ones(num_kv_heads, num_tokens, dtype=torch.bool)  # [Hkv, T]

    @property
    def mask(self) -> Tensor:
        """``[Hkv, T]`` bool, True = still kept."""
        return self._mask.clone()

    @property
    def counts(self) -> list[int]:
        """Kept tokens per KV head."""
        return self._mask.sum(dim=1).tolist()

    def indices(self) -> Tensor:
        """``[Hkv, n]`` int64 ascending kept indices (every head keeps the same count after an update)."""
        n = min(self.counts) if self.num_kv_heads else 0
        order = torch.sort(self._mask.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :n]
        return order.sort(dim=1).values

    def clamp_budget(self, budget: int) -> int:
        """``min(budget, minimum retained count over heads)``: a budget can never grow back."""
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise ValueError(f"`budget` must be an int >= 0, got {budget!r}")
        return min(budget, min(self.counts))

    def update(self, selection: Tensor, scores: Tensor | None = None) -> Tensor:
        """Intersect a new selection with the current keep set, keeping exactly ``n`` tokens per head.

        Args:
            selection: ``[Hkv, n]`` indices chosen by a policy (ideally with a clamped budget).
            scores: optional ``[T, Hkv]`` policy scores; when the intersection is smaller than
                ``m = min(n, clamp)``, the head is refilled from its previously kept tokens by highest
                score (then most recent); without scores by recency.

        Returns:
            ``[Hkv, m]`` int64 ascending indices, each a subset of the previous keep set.
        """
        if selection.dim() != 2 or selection.shape[0] != self.num_kv_heads:
            raise ValueError(f"`selection` must be [Hkv={self.num_kv_heads}, n], got {tuple(selection.shape)}")
        if selection.numel() and (int(selection.min()) < 0 or int(selection.max()) >= self.num_tokens):
            raise ValueError(
                f"`selection` indices must be in [0, {self.num_tokens}), got "
                f"[{int(selection.min())}, {int(selection.max())}]"
            )
        if scores is not None and tuple(scores.shape) != (self.num_tokens, self.num_kv_heads):
            raise ValueError(
                f"`scores` must be [T, Hkv] = {(self.num_tokens, self.num_kv_heads)}, got {tuple(scores.shape)}"
            )
        m = self.clamp_budget(int(selection.shape[1]))
        chosen = torch.zeros_like(self._mask)
        chosen.scatter_(1, selection.long().cpu(), True)
        t = self.num_tokens
        recency = torch.arange(t, dtype=torch.float64)
        # Priority: in the new selection (and still kept), then score, then recency; never a dropped token.
        prio_score = (
            scores.t().double().cpu() if scores is not None else torch.zeros(self.num_kv_heads, t, dtype=torch.float64)
        )
        prio_score = torch.nan_to_num(prio_score, nan=float("-inf"))
        new_mask = torch.zeros_like(self._mask)
        for h in range(self.num_kv_heads):
            cand = torch.nonzero(self._mask[h], as_tuple=False).squeeze(1)
            key_sel = (chosen[h, cand]).double()
            # lexicographic sort: selected desc, score desc, index desc (stable sorts, least key first)
            order = torch.sort(recency[cand], descending=True, stable=True).indices
            order = order[torch.sort(prio_score[h, cand][order], descending=True, stable=True).indices]
            order = order[torch.sort(key_sel[order], descending=True, stable=True).indices]
            new_mask[h, cand[order[:m]]] = True
        self._mask = new_mask
        return self.indices()
