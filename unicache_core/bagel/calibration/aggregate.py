"""Aggregation of the observe-only records into per-type K90 samples and per-cell rows (docs/compression.md §8.5)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from ...compression.stats import layer_chunk, step_chunk
from ...kv.token_types import TokenType


def median(values: Sequence[float]) -> float:
    """The median of ``values`` as a float."""
    return float(statistics.median(values))


def aggregate(records_per_prompt: Sequence[Sequence[Sequence]]) -> dict:
    """Group the calibration records (§8.5 chunks) per (type, layer chunk, step chunk).

    Args:
        records_per_prompt: per prompt, the records ``[branch, layer, step, type, k90, mass]`` of
            :class:`~unicache_core.compression.calibration.CalibrationSession` (``step`` None = prefill).

    Returns:
        ``{"k90s": {type: [per-(prompt, cell) mean K90]}, "cells": [...], "per_branch": {...}, "mass": {...}}``.
    """
    per_prompt_cells: dict[tuple, list[tuple[list[float], list[float]]]] = {}
    branch_k90: dict[str, dict[str, list[float]]] = {}
    for records in records_per_prompt:
        cells: dict[tuple, tuple[list[float], list[float]]] = {}
        for branch, layer, step, ttype, k, mass in records:
            s = "prefill" if step is None else step_chunk(int(step))
            key = (ttype, layer_chunk(int(layer)), s)
            ks, ms = cells.setdefault(key, ([], []))
            ks.append(float(k))
            ms.append(float(mass))
            branch_k90.setdefault(ttype, {}).setdefault(branch, []).append(float(k))
        for key, (ks, ms) in cells.items():
            per_prompt_cells.setdefault(key, []).append((ks, ms))
    k90s: dict[str, list[float]] = {}
    masses: dict[str, list[float]] = {}
    rows = []

    def order(key):
        ttype, c, s = key
        return (int(TokenType.parse(ttype)), c, -1 if s == "prefill" else s)

    for key in sorted(per_prompt_cells, key=order):
        ttype, c, s = key
        cell_k90 = [statistics.fmean(ks) for ks, _ in per_prompt_cells[key]]
        cell_mass = [statistics.fmean(ms) for _, ms in per_prompt_cells[key]]
        k90s.setdefault(ttype, []).extend(cell_k90)
        masses.setdefault(ttype, []).extend(cell_mass)
        rows.append(
            {
                "type": ttype,
                "layer_chunk": c,
                "step_chunk": s,
                "k90": round(median(cell_k90), 6),
                "mass": round(statistics.fmean(cell_mass), 6),
                "prompts": len(cell_k90),
                "samples": sum(len(ks) for ks, _ in per_prompt_cells[key]),
            }
        )
    per_branch = {t: {b: round(median(v), 6) for b, v in sorted(by.items())} for t, by in branch_k90.items()}
    return {
        "k90s": k90s,
        "cells": rows,
        "per_branch": per_branch,
        "mass": {t: round(statistics.fmean(v), 6) for t, v in masses.items()},
    }


__all__ = ["aggregate", "median"]
