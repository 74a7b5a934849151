"""Dense references of the attention statistics: per-type mass and per-type K90 from a whole
``[Hq, Tq, T]`` probability tensor (the library measures both from the per-store LSE and per-key scores,
:mod:`unicache_core.compression.scoring`, without building that tensor)."""

from __future__ import annotations

import torch
from torch import Tensor

from unicache_core.compression.defaults import K90_COVERAGE
from unicache_core.kv.token_types import TokenType


def type_masses(probs: Tensor, token_types: Tensor, retained: Tensor | None = None) -> dict[TokenType, float]:
    """Attention mass on each type's retained keys, averaged over heads and queries.

    Args:
        probs: ``[Hq, Tq, T]`` probabilities over the resident keys, normalised over the *whole* resident
            context (pass ``lse`` to :func:`~unicache_core.kv.attention.attention_probabilities`).
        token_types: ``[T]`` :class:`TokenType` id of each key.
        retained: optional bool mask of retained keys, ``[T]``, ``[Hkv, T]`` or ``[Hq, T]`` (per KV head
            masks are repeated over the query heads of a group); default: all keys.

    Returns:
        ``{type: mass}`` for every type present in ``token_types``.
    """
    if probs.dim() != 3:
        raise ValueError(f"`probs` must be [Hq, Tq, T], got {tuple(probs.shape)}")
    hq, _, t = probs.shape
    if token_types.dim() != 1 or token_types.shape[0] != t:
        raise ValueError(f"`token_types` must be [T] with T={t}, got {tuple(token_types.shape)}")
    per_head = probs.float().mean(dim=1)  # [Hq, T]
    if retained is not None:
        if retained.dtype != torch.bool or retained.shape[-1] != t or retained.dim() not in (1, 2):
            raise ValueError(
                f"`retained` must be a bool [T], [Hkv, T] or [Hq, T] mask with T={t}, got "
                f"{retained.dtype} {tuple(retained.shape)}"
            )
        mask = retained
        if mask.dim() == 2:
            if mask.shape[0] == 0 or hq % mask.shape[0]:
                raise ValueError(f"`retained` heads ({mask.shape[0]}) must divide the query heads ({hq})")
            mask = mask.repeat_interleave(hq // mask.shape[0], dim=0)
        per_head = per_head * mask.to(per_head.dtype)
    per_token = per_head.mean(dim=0)  # [T]
    return {TokenType(int(v)): float(per_token[token_types == v].sum()) for v in torch.unique(token_types).tolist()}


def segment_k90(probs: Tensor, token_types: Tensor, coverage: float = K90_COVERAGE) -> dict[TokenType, float]:
    """K90 of every type present in ``token_types``.

    Args:
        probs: ``[Hq, Tq, T]`` attention probabilities; token_types: ``[T]`` :class:`TokenType` ids.
    """
    if probs.dim() != 3 or token_types.dim() != 1 or probs.shape[2] != token_types.shape[0]:
        raise ValueError(
            f"`probs` [Hq, Tq, T] and `token_types` [T] disagree: {tuple(probs.shape)} vs {tuple(token_types.shape)}"
        )
    per_token = probs.float().mean(dim=(0, 1))
    out: dict[TokenType, float] = {}
    for value in torch.unique(token_types).tolist():
        out[TokenType(int(value))] = coverage_fraction(per_token[token_types == value].tolist(), coverage)
    return out


def coverage_fraction(masses: list[float], coverage: float) -> float:
    """K90 as the UniCache paper defines it (docs/compression.md §8.4): the fewest of a segment's tokens, highest mass
    first, whose mass reaches ``coverage`` of the segment's, as a fraction of its tokens; a segment with no mass
    counts as dense (1.0). A plain running sum over the sorted masses (a relative 1e-9 tolerance so that
    ``0.1 * 9`` reaches 0.9)."""
    masses = [max(0.0, m) for m in masses]
    total = sum(masses)
    if not masses or total <= 0.0:
        return 1.0
    running, needed = 0.0, coverage * total * (1.0 - 1e-9)
    for count, mass in enumerate(sorted(masses, reverse=True), start=1):
        running += mass
        if running >= needed:
            return count / len(masses)
    return 1.0
