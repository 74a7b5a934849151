"""Split a token budget across types (or layers) in proportion to attention mass, with caps.

Implements the pseudocode of docs/compression.md §8.6: water-filling with redistribution of what
saturated types cannot take. Pure functions over plain sequences.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def _check(capacities: Sequence[float], weights: Sequence[float], total: float) -> None:
    if len(capacities) != len(weights):
        raise ValueError(f"`capacities` ({len(capacities)}) and `weights` ({len(weights)}) must have the same length")
    for i, cap in enumerate(capacities):
        if not math.isfinite(cap) or cap < 0:
            raise ValueError(f"`capacities[{i}]` must be finite and >= 0, got {cap!r}")
    for i, w in enumerate(weights):
        if not math.isfinite(w):
            raise ValueError(f"`weights[{i}]` must be finite, got {w!r}")
    if not math.isfinite(total) or total < 0:
        raise ValueError(f"`total` must be finite and >= 0, got {total!r}")


def allocate(capacities: Sequence[float], weights: Sequence[float], total: float) -> list[float]:
    """Share ``total`` among items in proportion to ``weights``, never giving item ``i`` more than ``capacities[i]``.

    Items whose proportional share reaches their cap get exactly the cap and leave; the rest is
    re-shared among the others. Negative weights count as 0. While some active item has positive
    weight, zero-weight items get nothing; when every active weight is 0 the share is uniform (so
    zero-weight items only receive what positive-weight items could not take).

    Returns:
        Float allocations summing to ``min(total, sum(capacities))`` (up to rounding).
    """
    _check(capacities, weights, total)
    n = len(capacities)
    alloc = [0.0] * n
    active = list(range(n))
    remaining = min(float(total), float(sum(capacities)))
    while active and remaining > 0:
        pos = {i: max(float(weights[i]), 0.0) for i in active}
        w_sum = sum(pos.values())
        if w_sum <= 0:
            pos = {i: 1.0 for i in active}
            w_sum = float(len(active))
        proposal = {i: remaining * pos[i] / w_sum for i in active}
        saturated = [i for i in active if proposal[i] >= capacities[i] - alloc[i]]
        if not saturated:
            for i in active:
                alloc[i] += proposal[i]
            break
        for i in saturated:
            give = capacities[i] - alloc[i]
            alloc[i] += give
            remaining -= give
        active = [i for i in active if i not in saturated]
    return alloc


def allocate_integer(capacities: Sequence[int], weights: Sequence[float], total: int) -> list[int]:
    """Integer version of :func:`allocate` (largest-remainder rounding).

    Returns integers ``0 <= k_i <= capacities[i]`` summing exactly to ``min(total, sum(capacities))``;
    remainders are handed out largest first, ties to the lower index.
    """
    for i, cap in enumerate(capacities):
        if not isinstance(cap, int) or isinstance(cap, bool):
            raise ValueError(f"`capacities[{i}]` must be an int, got {cap!r}")
    if not isinstance(total, int) or isinstance(total, bool):
        raise ValueError(f"`total` must be an int, got {total!r}")
    floats = allocate(capacities, weights, total)
    target = min(total, sum(capacities))
    ints = [min(cap, max(0, math.floor(a + 1e-9))) for a, cap in zip(floats, capacities)]
    rema = [a - k for a, k in zip(floats, ints)]
    diff = target - sum(ints)
    if diff > 0:
        order = sorted(range(len(ints)), key=lambda i: (-rema[i], i))
        while diff > 0:
            for i in order:
                if diff == 0:
                    break
                if ints[i] < capacities[i]:
                    ints[i] += 1
                    diff -= 1
    elif diff < 0:
        order = sorted(range(len(ints)), key=lambda i: (rema[i], -i))
        while diff < 0:
            for i in order:
                if diff == 0:
                    break
                if ints[i] > 0:
                    ints[i] -= 1
                    diff += 1
    return ints


def allocate_types(capacities: dict, weights: dict, total: float) -> dict:
    """:func:`allocate` over mappings keyed by type; a type missing from ``weights`` has weight 0."""
    keys = list(capacities)
    alloc = allocate([float(capacities[k]) for k in keys], [float(weights.get(k, 0.0)) for k in keys], total)
    return dict(zip(keys, alloc))


def allocate_with_floors(caps: dict, weights: dict, total: float, floors: dict) -> dict:
    """Mass-proportional, capped shares of ``total`` (:func:`allocate_types`) as retained ratios ``alloc / cap``, in
    which no type of ``floors`` gets less than its floor ratio (a quantized type's every row at 2 bits; below it the
    type must drop rows). What the floors take is taken from the other types. When the floors alone exceed the
    total, the plain shares are kept (the quantized types then keep a subset of their rows at 2 bits)."""
    fixed: dict = {}
    while True:
        free = {t: c for t, c in caps.items() if t not in fixed}
        left = total - sum(floors[t] * caps[t] for t in fixed)
        if left < 0:
            alloc = allocate_types(caps, weights, total)
            return {t: min(1.0, alloc[t] / caps[t]) for t in caps}
        alloc = allocate_types(free, {t: weights.get(t, 0.0) for t in free}, left)
        below = [t for t in free if t in floors and alloc[t] < floors[t] * caps[t] - 1e-9]
        if not below:
            ratios = {t: min(1.0, alloc[t] / caps[t]) for t in free}
            ratios.update({t: min(1.0, floors[t]) for t in fixed})
            return ratios
        fixed.update({t: True for t in below})


def mass_shares(masses: dict, rows: dict) -> dict:
    """Each key's share of a pooled store's attention mass: of their ``masses``, or of their ``rows`` without any."""
    total = sum(masses.values())
    weights = masses if total > 0 else rows
    total = sum(weights.values())
    return {t: w / total for t, w in weights.items()}
