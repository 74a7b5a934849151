"""Shared machinery of the reference eviction policies: score inputs, dense attention and validation.

The reference policies are *pure*: they score tokens and return the indices to keep. Everything uses
BAGEL's packed layout:

- keys ``[T, Hkv, d]`` (after QK-norm and RoPE, original positions);
- observation queries ``[Tq, Hq, d]`` with grouped-query attention, ``Hq = g * Hkv`` and query head ``h``
  reading KV head ``h // g``.

They score with the DENSE attention of :func:`observation_attention` (the whole ``[Hq, Tq, T]``
probability tensor at once, docs/compression.md §4, §9.1), independently of the library's chunked scorer
(:mod:`unicache_core.compression.scoring`) that they check.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, eq=False)
class ScoreInputs:
    """Everything a policy may look at to score the tokens of one segment in one layer.

    Attributes:
        keys: ``[T, Hkv, d]`` cached keys of the segment (after RoPE).
        queries: ``[Tq, Hq, d]`` observation queries (last prompt window, the decode query, or the
            current-latent queries during denoising), or ``None``.
        accumulated: ``[T, Hkv]`` running H2O scores, or ``None``.
        query_lse: ``[Tq, Hq]`` log-sum-exp of the queries over the *whole* resident context; when given,
            attention is measured as shares of the full softmax (pre-eviction mass, §9.1).
        force_keep: optional ``[T]`` or ``[T, Hkv]`` bool mask of tokens the caller forces to keep (they
            count inside the budget).
        layer: layer index, ``0 <= layer < num_layers``.
        num_layers: number of layers of the model.
        scale: softmax scale, default ``1/sqrt(d)``.
    """

    keys: Tensor
    queries: Tensor | None = None
    accumulated: Tensor | None = None
    query_lse: Tensor | None = None
    force_keep: Tensor | None = None
    layer: int = 0
    num_layers: int = 1
    scale: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.keys, Tensor) or self.keys.dim() != 3:
            shape = tuple(self.keys.shape) if isinstance(self.keys, Tensor) else type(self.keys).__name__
            raise ValueError(f"`keys` must be a [T, Hkv, d] tensor, got {shape}")
        t, hkv, d = self.keys.shape
        if hkv == 0:
            raise ValueError("`keys` must have at least one KV head, got shape with Hkv = 0")
        if self.queries is not None:
            if self.queries.dim() != 3:
                raise ValueError(f"`queries` must be [Tq, Hq, d], got {tuple(self.queries.shape)}")
            hq, dq = self.queries.shape[1], self.queries.shape[2]
            if dq != d:
                raise ValueError(f"`queries` head dim {dq} differs from `keys` head dim {d}")
            if hq == 0 or hq % hkv:
                raise ValueError(f"`queries` heads ({hq}) must be a positive multiple of KV heads ({hkv})")
        if self.accumulated is not None and tuple(self.accumulated.shape) != (t, hkv):
            raise ValueError(f"`accumulated` must be [T, Hkv] = {(t, hkv)}, got {tuple(self.accumulated.shape)}")
        if self.query_lse is not None:
            if self.queries is None:
                raise ValueError("`query_lse` was given without `queries`")
            want = tuple(self.queries.shape[:2])
            if tuple(self.query_lse.shape) != want:
                raise ValueError(f"`query_lse` must be [Tq, Hq] = {want}, got {tuple(self.query_lse.shape)}")
        if self.force_keep is not None:
            shape = tuple(self.force_keep.shape)
            if self.force_keep.dtype != torch.bool or shape not in ((t,), (t, hkv)):
                raise ValueError(
                    f"`force_keep` must be a bool [T] or [T, Hkv] mask with T={t}, Hkv={hkv}; got "
                    f"{self.force_keep.dtype} {shape}"
                )
        if not _is_int(self.num_layers) or self.num_layers < 1:
            raise ValueError(f"`num_layers` must be an int >= 1, got {self.num_layers!r}")
        if not _is_int(self.layer) or not 0 <= self.layer < self.num_layers:
            raise ValueError(f"`layer` must be an int in [0, {self.num_layers}), got {self.layer!r}")

    @property
    def num_tokens(self) -> int:
        return int(self.keys.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.keys.shape[1])

    def require_queries(self, policy: str) -> Tensor:
        """The observation queries, or a ValueError naming `queries` when they are missing."""
        if self.queries is None:
            raise ValueError(f"{policy} needs observation `queries` [Tq, Hq, d]; got queries=None")
        return self.queries


def budget_from_ratio(ratio: float, num_tokens: int) -> int:
    """Integer token budget for a retention ``ratio`` of ``num_tokens`` tokens.

    Rounds half up (``floor(ratio * T + 0.5)``, not Python's banker's rounding) and clips to ``[0, T]``.
    """
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0.0 <= float(ratio) <= 1.0:
        raise ValueError(f"`ratio` must be a number in [0, 1], got {ratio!r}")
    if not _is_int(num_tokens) or num_tokens < 0:
        raise ValueError(f"`num_tokens` must be an int >= 0, got {num_tokens!r}")
    return max(0, min(num_tokens, math.floor(float(ratio) * num_tokens + 0.5)))


def observation_attention(inputs: ScoreInputs, *, causal: bool = False, per_query_head: bool = False) -> Tensor:
    """Softmax attention of the observation queries over the segment keys.

    Args:
        inputs: must carry ``queries``.
        causal: the queries are the last ``Tq`` keys of the segment (a prompt window) and query ``i``
            only sees keys ``0 .. T - Tq + i`` (bottom-right aligned).
        per_query_head: return ``[Hq, Tq, T]`` instead of the group mean.

    Returns:
        ``[Hkv, Tq, T]`` fp32 probabilities averaged over the ``g`` query heads of each KV group
        (docs/compression.md §4), or ``[Hq, Tq, T]`` when ``per_query_head``. With ``query_lse`` they are
        shares of the full resident softmax; otherwise they are normalised over these keys.
    """
    q = inputs.require_queries("observation attention")
    k = inputs.keys
    tq, hq, d = q.shape
    t, hkv = k.shape[0], k.shape[1]
    if not causal:
        probs = attention_probabilities(q, k, scale=inputs.scale, lse=inputs.query_lse)
    else:
        if tq > t:
            raise ValueError(f"causal observation needs `queries` ({tq}) to be at most the number of keys ({t})")
        g = hq // hkv
        scale = 1.0 / math.sqrt(d) if inputs.scale is None else float(inputs.scale)
        qh = q.float().permute(1, 0, 2).reshape(hkv, g * tq, d)
        logits = (torch.matmul(qh, k.float().permute(1, 2, 0)) * scale).reshape(hq, tq, t)
        visible = torch.ones(tq, t, dtype=torch.bool, device=k.device).tril(diagonal=t - tq)
        logits = logits.masked_fill(~visible, float("-inf"))
        if inputs.query_lse is None:
            probs = torch.softmax(logits, dim=-1)
        else:
            probs = torch.exp(logits - inputs.query_lse.float().permute(1, 0).unsqueeze(-1))
    if per_query_head:
        return probs
    return probs.reshape(hkv, hq // hkv, tq, t).mean(dim=1)


def attention_probabilities(q: Tensor, k: Tensor, *, scale: float | None = None, lse: Tensor | None = None) -> Tensor:
    """Softmax probabilities of queries over keys, per query head (for scoring and statistics).

    Args:
        q: ``[Tq, Hq, d]`` queries; k: ``[Tk, Hkv, d]`` keys.
        lse: optional ``[Tq, Hq]`` log-sum-exp over the *whole* resident context; when given, the
            returned probabilities are shares of the full softmax (pre-eviction mass), otherwise
            they are normalised over ``k`` alone.

    Returns:
        ``[Hq, Tq, Tk]`` fp32 probabilities.
    """
    tq, hq, d = q.shape
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qh = q.float().permute(1, 0, 2).reshape(hkv, group * tq, d)
    scores = torch.matmul(qh, k.float().permute(1, 2, 0)) * scale  # [Hkv, g*Tq, Tk]
    scores = scores.reshape(hq, tq, -1)
    if lse is None:
        return torch.softmax(scores, dim=-1)
    return torch.exp(scores - lse.float().permute(1, 0).unsqueeze(-1))


@dataclass(frozen=True)
class EvictionPolicy(ABC):
    """Base of every token-eviction policy: :meth:`score` then exact-budget :meth:`select`.

    Subclasses implement :meth:`score` and may override :meth:`forced_keep` (recent window, sinks,
    observation window); forced tokens count inside the budget.
    """

    needs_queries: ClassVar[bool] = True

    @abstractmethod
    def score(self, inputs: ScoreInputs) -> Tensor:
        """Return ``[T, Hkv]`` float scores, higher = keep."""

    def forced_keep(self, inputs: ScoreInputs, budget: int) -> Tensor | None:
        """Optional ``[T, Hkv]`` bool mask of tokens this policy always keeps (inside ``budget``)."""
        return None

    def select(self, inputs: ScoreInputs, budget: int) -> Tensor:
        """Indices to keep per KV head.

        Args:
            inputs: the segment keys and observation.
            budget: tokens to keep per KV head (``>= 0``); ``min(budget, T)`` are returned.

        Returns:
            ``[Hkv, n]`` int64, ascending per head, ``n = min(budget, T)``.
        """
        if not _is_int(budget) or budget < 0:
            raise ValueError(f"`budget` must be an int >= 0, got {budget!r}")
        if self.needs_queries:
            inputs.require_queries(type(self).__name__)
        t, hkv = inputs.num_tokens, inputs.num_kv_heads
        n = min(budget, t)
        scores = self.score(inputs)
        if tuple(scores.shape) != (t, hkv):
            raise ValueError(f"{type(self).__name__}.score returned {tuple(scores.shape)}, expected {(t, hkv)}")
        forced = self.forced_keep(inputs, n)
        if inputs.force_keep is not None:
            extra = inputs.force_keep if inputs.force_keep.dim() == 2 else inputs.force_keep[:, None].expand(t, hkv)
            forced = extra if forced is None else (forced | extra)
        return top_rows_per_head(scores, n, forced)


def top_rows_per_head(scores: Tensor, n: int, forced: Tensor | None = None) -> Tensor:
    """The ``n`` rows each KV head keeps, by the rule the papers state: rows a policy always keeps first, then the
    highest score, and on a tie the more recent row (a NaN score ranks below every number). Written as a plain
    sort of ``(forced, score, position)`` keys per head, independently of the library's vectorised selection.

    Args:
        scores: ``[T, Hkv]``; forced: optional bool ``[T, Hkv]``.

    Returns:
        ``[Hkv, n]`` int64 row positions, ascending per head.
    """
    t, hkv = scores.shape
    n = max(0, min(int(n), t))
    kept = []
    for head in range(hkv):
        column = [float(v) for v in scores[:, head].float().tolist()]
        rank = [(-math.inf if math.isnan(v) else v) for v in column]
        always = [False] * t if forced is None else [bool(f) for f in forced[:, head].tolist()]
        order = sorted(range(t), key=lambda row: (always[row], rank[row], row), reverse=True)
        kept.append(sorted(order[:n]))
    return torch.tensor(kept, dtype=torch.int64).reshape(hkv, n)


def recent_mask(num_tokens: int, num_kv_heads: int, count: int, device: torch.device | str | None = None) -> Tensor:
    """``[T, Hkv]`` bool mask of the last ``count`` tokens."""
    mask = torch.zeros(num_tokens, num_kv_heads, dtype=torch.bool, device=device)
    if count > 0:
        mask[max(0, num_tokens - count) :] = True
    return mask
