"""Bytes moved between a request's branches and layers (docs/compression.md §11.8): a pure function of what each
(branch, layer) needs and of how much an error there weighs in the request's output.

A request's budget is its branches' together. Each (branch, layer) unit has its own budget (its schedule's retention
of its rows) and, for its quantized rows, a ladder of levels: every row at 2 bits (its floor), 4 bits, 8 bits, full
precision, each with the least bytes that hold it (the largest group, no residual) and its expected error
(:func:`~unicache_core.compression.family.choice_error`: a row at ``b`` bits loses ``4**-b`` of its share). The
grants are decided in two steps:

1. **Floors.** Units whose budget is under their floor are paid for by the units above theirs, in proportion to what
   those have above (an edit's image-free CFG branch holds only its instruction, whose 2-bit floor is more than its
   share).
2. **Sensitivity.** What the units with a ladder hold above their floors is pooled and spent again on the steepest
   steps of their ladders first (greedy marginal error reduction per byte): a step's steepness is
   ``weight * (error drop) / (bytes it costs)``, and between two rungs the error is taken to fall linearly with the
   bytes (what the plan buys with them: finer groups, a residual). A unit's weight is the square of its branch's
   coefficient in the request's output (the guided velocity of classifier-free guidance: an edit's ``gen`` error is
   amplified 8 times, ``cfg_text``'s 6, ``cfg_img``'s once), which the engine hands down as data
   (:attr:`~unicache_core.kv.cache.RequestInfo.branch_weights`). Steps of equal steepness are filled in proportion
   to their bytes, so units alike keep what they had.

The request never holds more than its budget: every grant is rounded so that the grants sum to at most 0. No unit
is given more than its full bytes (the ladder's top), and a unit without a ladder (a layer with rows the table
evicts, whose bytes the ladder does not describe) only takes part in step 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple


class Level(NamedTuple):
    """One rung of a unit's ladder: ``bytes`` that hold its quantized rows at some bits, and the ``error`` then."""

    bytes: int
    error: float


class UnitNeed(NamedTuple):
    """What one (branch, layer) unit has and needs.

    Attributes:
        budget: bytes its schedule gives it.
        levels: its ladder, cheapest first (``levels[0]``: the 2-bit floor of its quantized rows, ``(0, 0.0)`` when it
            has none); a single rung: no ladder (only the floor counts, step 1).
    """

    budget: int
    levels: tuple[Level, ...]

    @property
    def floor(self) -> int:
        return self.levels[0].bytes if self.levels else 0


Needs = Mapping[str, Mapping[int, UnitNeed]]


def _floor_step(needs: Needs) -> dict[tuple[str, int], int]:
    """Step 1: each unit's grant so every unit can keep its floor, paid for by the units above theirs."""
    units = {(b, layer): need for b, plan in needs.items() for layer, need in plan.items()}
    deficit = {u: max(0, n.floor - n.budget) for u, n in units.items()}
    surplus = {u: max(0, n.budget - n.floor) for u, n in units.items()}
    short, spare = sum(deficit.values()), sum(surplus.values())
    moved = min(short, spare)
    if moved == 0:
        return dict.fromkeys(units, 0)
    return {u: (deficit[u] * moved) // short - -((-surplus[u] * moved) // spare) for u in units}


def _rungs(need: UnitNeed, weight: float) -> list[tuple[float, int]]:
    """The ``(error drop per byte, bytes)`` of each step up a unit's ladder, on its lower convex hull (each step's
    rate at most the one before: a rung not worth its bytes is passed over to the next one)."""
    hull = [need.levels[0]]
    for level in need.levels[1:]:
        if level.bytes <= hull[-1].bytes or level.error >= hull[-1].error:
            continue
        hull.append(level)
        while len(hull) > 2:
            a, b, c = hull[-3], hull[-2], hull[-1]
            if (a.error - b.error) * (c.bytes - b.bytes) >= (b.error - c.error) * (b.bytes - a.bytes):
                break
            del hull[-2]  # b lies above the chord from a to c
    return [
        (weight * (lo.error - hi.error) / (hi.bytes - lo.bytes), hi.bytes - lo.bytes) for lo, hi in zip(hull, hull[1:])
    ]


def _fill(
    held: Mapping[tuple[str, int], int], needs: Mapping[tuple[str, int], UnitNeed], weights: Mapping[str, float]
) -> dict[tuple[str, int], int]:
    """Step 2: the bytes of every laddered unit: its floor, then what they hold above their floors spent on the
    steepest steps of their ladders first. Between two rungs the error is taken to fall linearly with the bytes (the
    finer groups and the residual the plan buys with them); steps of equal steepness are filled in proportion to
    their bytes, so equal units keep equal shares."""
    left = sum(max(0, held[u] - n.floor) for u, n in needs.items())
    out = {u: n.floor for u, n in needs.items()}
    steps = sorted(
        ((rate, size, u) for u, n in needs.items() for rate, size in _rungs(n, weights.get(u[0], 1.0))),
        key=lambda step: -step[0],
    )
    i = 0
    while i < len(steps) and left > 0:
        j = i
        while j < len(steps) and steps[j][0] >= steps[i][0] * (1 - 1e-9):
            j += 1
        group, i = steps[i:j], j
        size = sum(s for _, s, _ in group)
        share = min(left, size)
        for _, s, u in group:
            out[u] += (share * s) // size
        left -= share
    return out


def branch_grants(needs: Needs, weights: Mapping[str, float] | None = None) -> dict[str, dict[int, int]]:
    """Bytes each (branch, layer) receives (> 0) or gives (< 0): floors first, then by sensitivity (see the module
    docstring). The grants sum to at most 0, and no unit is given more than its full bytes.

    Args:
        needs: per branch, per layer, the unit's budget and ladder at the least retention the branch can reach.
        weights: per branch, the weight of an error there (the square of its coefficient in the output; 1 when not
            given).
    """
    grant = _floor_step(needs)
    units = {(b, layer): need for b, plan in needs.items() for layer, need in plan.items()}
    held = {u: n.budget + grant[u] for u, n in units.items()}
    laddered = {u: n for u, n in units.items() if len(n.levels) > 1 and held[u] >= n.floor}
    for u, got in _fill(held, laddered, weights or {}).items():
        grant[u] = got - units[u].budget
    out: dict[str, dict[int, int]] = {}
    for (b, layer), g in grant.items():
        out.setdefault(b, {})[layer] = g
    return {b: plan for b, plan in out.items() if any(plan.values())}


def pass_on(
    grants: Mapping[str, Mapping[int, int]], giver: tuple[str, int], taker: tuple[str, int], nbytes: int
) -> dict[str, dict[int, int]]:
    """The grants with ``nbytes`` more moved from the unit ``giver`` (a ``(branch, layer)`` whose plan left them) to
    ``taker`` (one not planned yet): bytes one unit cannot use go to the others of the request's one budget, and the
    grants still sum to at most 0 (docs/compression.md §11.15)."""
    out = {b: dict(plan) for b, plan in grants.items()}
    if nbytes <= 0 or giver == taker:
        return out
    for (branch, layer), delta in ((giver, -nbytes), (taker, nbytes)):
        out.setdefault(branch, {})[layer] = out.get(branch, {}).get(layer, 0) + delta
    return out


__all__ = ["Level", "UnitNeed", "branch_grants", "pass_on"]
