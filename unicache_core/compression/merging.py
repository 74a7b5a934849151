"""Merging evicted rows into the kept rows most like them (LOOK-M, docs/compression.md §14).

Pure functions over one pool of rows per KV head. An eviction keeps ``k`` of ``N`` rows; a merge then folds each
dropped row into the kept row whose key is the most similar to its own (cosine), so the kept rows carry what the
dropped ones held instead of losing it. The store keeps ``k`` rows either way: a merge changes what the kept rows
hold, never how many bytes they take.

The three rules of LOOK-M (Wan et al., Findings of EMNLP 2024, §3.3; official code ``SUSTechBruce/LOOK-M``), for a
kept row ``c`` and the dropped rows ``E_c`` whose pivot it is (keys and values alike, with the pivots found on
the keys):

- ``average``: ``c' = (c + Σ_{e in E_c} e) / (1 + |E_c|)``;
- ``pivot``: every dropped row is first averaged with its pivot, then averaged in:
  ``c' = (c + Σ_{e in E_c} (e + c) / 2) / (1 + |E_c|)``;
- ``weighted``: only dropped rows whose similarity ``s_e`` to their pivot is at least the mean similarity of the
  dropped rows (of the same KV head) are merged, each scaled by it:
  ``c' = (c + Σ_{e in F_c} s_e e) / (1 + |F_c|)``.

UniCache's rule (docs/compression.md §11.17), for rows it drops, at full precision or before quantizing the kept ones:

- ``mass``: each row weighs its attention mass ``w`` (its eviction score), so a kept row becomes the mass-weighted
  mean of itself and the dropped rows whose pivot it is: ``c' = (w_c c + Σ_{e in E_c} w_e e) / (w_c + Σ w_e)``.
  A dropped row the queries never attended moves nothing; one they attended as much as its pivot counts as much
  (attention-weighted merging, as CaM, Zhang et al., ICML 2024, merges values).

The pivots are found a chunk of dropped rows at a time, so the ``[Hkv, chunk, k]`` similarities stay under
:data:`PIVOT_ELEMENTS` whatever the segment's length.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: The merge rules (``none``: the dropped rows are only dropped, LOOK-M's text-prior eviction alone; ``mass``:
#: UniCache's, weighted by each row's attention mass).
MERGES: tuple[str, ...] = ("none", "average", "pivot", "weighted", "mass")
#: Most dropped rows compared with the kept rows at a time.
PIVOT_CHUNK = 4096
#: Most elements of one chunk's ``[Hkv, chunk, k]`` fp32 similarities (16 MiB): a long segment's chunks get fewer
#: rows (at least one).
PIVOT_ELEMENTS = 1 << 22


def dropped_positions(kept: Tensor, num_rows: int) -> Tensor:
    """``[Hkv, N - k]`` int64 positions (ascending) of the rows ``kept [Hkv, k]`` leaves out of ``num_rows``."""
    h = kept.shape[0]
    mask = torch.ones(h, num_rows, dtype=torch.bool, device=kept.device)
    mask.scatter_(1, kept.long(), False)
    return torch.nonzero(mask)[:, 1].reshape(h, num_rows - kept.shape[1])


def pivots(dropped_keys: Tensor, kept_keys: Tensor, chunk: int = PIVOT_CHUNK) -> tuple[Tensor, Tensor]:
    """For each dropped key, the kept key of highest cosine similarity and that similarity.

    Args:
        dropped_keys: ``[Hkv, m, d]``; kept_keys: ``[Hkv, k, d]`` (``k >= 1``).

    Returns:
        ``(index [Hkv, m] int64 into the kept rows, similarity [Hkv, m] fp32)``; a tie goes to the earlier kept row.
    """
    kept = torch.nn.functional.normalize(kept_keys.float(), dim=-1)
    chunk = max(1, min(chunk, PIVOT_ELEMENTS // max(1, kept.shape[0] * kept.shape[1])))
    index, sim = [], []
    for start in range(0, dropped_keys.shape[1], chunk):
        part = torch.nn.functional.normalize(dropped_keys[:, start : start + chunk].float(), dim=-1)
        best = torch.einsum("hmd,hkd->hmk", part, kept).max(dim=-1)
        index.append(best.indices)
        sim.append(best.values)
    if not index:
        h = dropped_keys.shape[0]
        return (
            torch.zeros(h, 0, dtype=torch.long, device=dropped_keys.device),
            torch.zeros(h, 0, dtype=torch.float32, device=dropped_keys.device),
        )
    return torch.cat(index, dim=1), torch.cat(sim, dim=1)


def merge_rows(
    keys: Tensor, values: Tensor, kept: Tensor, rule: str, mass: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The kept rows of a pool after ``rule`` merged the dropped rows into them.

    Args:
        keys, values: ``[Hkv, N, d]`` every row of the pool (dropped and kept), per KV head.
        kept: ``[Hkv, k]`` int64 positions (into ``N``) of the rows kept, the same count per head (any order).
        rule: one of :data:`MERGES`.
        mass: ``[Hkv, N]`` each row's attention mass (its eviction score; NaN and negatives count as none), needed
            by ``mass``.

    Returns:
        ``(keys [Hkv, k, d], values [Hkv, k, d])`` of the kept rows, in the order of ``kept`` and the dtype of
        ``keys`` (merged in fp32).
    """
    if rule not in MERGES:
        raise ValueError(f"unknown merge {rule!r}; choose one of {', '.join(MERGES)}")
    if rule == "mass" and mass is None:
        raise ValueError("the `mass` merge weighs each row by its attention mass: pass `mass` [Hkv, N]")
    h, n, d = keys.shape
    gather = kept.long().unsqueeze(-1).expand(-1, -1, d)
    kept_k, kept_v = torch.gather(keys, 1, gather), torch.gather(values, 1, gather)
    if rule == "none" or kept.shape[1] == 0 or kept.shape[1] >= n:
        return kept_k, kept_v
    drop = dropped_positions(kept, n)
    drop_gather = drop.unsqueeze(-1).expand(-1, -1, d)
    drop_k, drop_v = torch.gather(keys, 1, drop_gather).float(), torch.gather(values, 1, drop_gather).float()
    target, sim = pivots(drop_k, kept_k)  # [Hkv, m]
    base_k, base_v = kept_k.float(), kept_v.float()
    if rule == "mass":
        assert mass is not None
        return _mass_merge(base_k, base_v, drop_k, drop_v, target, mass, kept, drop, keys.dtype)
    weight = torch.ones_like(sim)
    if rule == "pivot":
        pivot_gather = target.unsqueeze(-1).expand(-1, -1, d)
        drop_k = (drop_k + torch.gather(base_k, 1, pivot_gather)) / 2
        drop_v = (drop_v + torch.gather(base_v, 1, pivot_gather)) / 2
    elif rule == "weighted":
        weight = (sim >= sim.mean(dim=1, keepdim=True)).float()  # only the rows nearer than average
        drop_k, drop_v = drop_k * sim.unsqueeze(-1), drop_v * sim.unsqueeze(-1)
    count = torch.ones(h, kept.shape[1], dtype=torch.float32, device=keys.device)
    count.scatter_add_(1, target, weight)
    scatter = target.unsqueeze(-1).expand(-1, -1, d)
    sum_k = base_k.scatter_add(1, scatter, drop_k * weight.unsqueeze(-1))
    sum_v = base_v.scatter_add(1, scatter, drop_v * weight.unsqueeze(-1))
    return (sum_k / count.unsqueeze(-1)).to(keys.dtype), (sum_v / count.unsqueeze(-1)).to(values.dtype)


def _mass_merge(
    kept_k: Tensor, kept_v: Tensor, drop_k: Tensor, drop_v: Tensor, target: Tensor, mass: Tensor, kept: Tensor,
    drop: Tensor, dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The ``mass`` rule (module docstring): ``kept_* [Hkv, k, d]`` and ``drop_* [Hkv, m, d]`` fp32, ``target
    [Hkv, m]`` each dropped row's pivot, ``mass [Hkv, N]``, ``kept [Hkv, k]`` and ``drop [Hkv, m]`` positions into
    ``N``. A kept row whose weights are all zero stays as it is."""
    weight = mass.float().nan_to_num(0.0).clamp_min(0.0)
    w_kept, w_drop = torch.gather(weight, 1, kept.long()), torch.gather(weight, 1, drop)
    total = w_kept.scatter_add(1, target, w_drop)  # [Hkv, k]
    scatter = target.unsqueeze(-1).expand(-1, -1, kept_k.shape[-1])
    sum_k = (kept_k * w_kept.unsqueeze(-1)).scatter_add(1, scatter, drop_k * w_drop.unsqueeze(-1))
    sum_v = (kept_v * w_kept.unsqueeze(-1)).scatter_add(1, scatter, drop_v * w_drop.unsqueeze(-1))
    some = (total > 0).unsqueeze(-1)
    scale = total.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)
    merged_k = torch.where(some, sum_k / scale, kept_k)
    merged_v = torch.where(some, sum_v / scale, kept_v)
    return merged_k.to(dtype), merged_v.to(dtype)


__all__ = ["MERGES", "PIVOT_CHUNK", "PIVOT_ELEMENTS", "dropped_positions", "merge_rows", "pivots"]
