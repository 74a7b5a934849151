"""Append indices as runs: an uncompressed store names its rows by a few ``(start, length)`` runs of consecutive
append indices instead of a per-row int32 index (docs/compression.md §11.1)."""

from __future__ import annotations

import torch
from torch import Tensor


def index_runs(token_index: Tensor) -> tuple[tuple[int, int], ...]:
    """``((start, length), ...)``: ``token_index [T]`` as maximal runs of consecutive append indices, in order."""
    if token_index.numel() == 0:
        return ()
    idx = token_index.detach().to("cpu", torch.int64)
    breaks = torch.nonzero(idx[1:] - idx[:-1] != 1).squeeze(1) + 1
    bounds = [0, *breaks.tolist(), idx.shape[0]]
    return tuple((int(idx[a]), b - a) for a, b in zip(bounds, bounds[1:]))


def runs_index(runs: tuple[tuple[int, int], ...], device: torch.device | str = "cpu") -> Tensor:
    """The ``[T]`` int32 append indices of :func:`index_runs`' runs."""
    if not runs:
        return torch.zeros(0, dtype=torch.int32, device=device)
    return torch.cat([torch.arange(a, a + n, dtype=torch.int32, device=device) for a, n in runs])


__all__ = ["index_runs", "runs_index"]
