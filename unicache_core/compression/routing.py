"""K90 routing: which policy family (evict / quantize / protect) a token type's attention calls for.

docs/compression.md §8.1 and §8.4: a segment whose attention is concentrated (K90 <= 0.3) is evicted
with H2O; a diffuse one is quantized with KIVI. The resulting (task, type) assignment is a
:class:`~unicache_core.compression.policy_table.PolicyTable`.
"""

from __future__ import annotations

import math
from enum import StrEnum

import torch
from torch import Tensor

from ..validation import check_ratio
from .defaults import DEFAULT_K90_THRESHOLD, K90_COVERAGE


class Kind(StrEnum):
    """A token type's policy family in a task. ``JOINT``: rows kept by score at calibrated bits per budget level
    (docs/compression.md §11); K90 routing itself only ever gives ``EVICT`` or ``QUANTIZE``. A member equals its
    string (``Kind.EVICT == "evict"``), which is how policy tables store it."""

    EVICT = "evict"
    QUANTIZE = "quantize"
    JOINT = "joint"
    PROTECT = "protect"


#: The policy kind's former name (a type alias kept for callers).
PolicyKind = Kind
#: Every kind's name, as policy tables write them.
POLICY_KINDS: tuple[str, ...] = tuple(kind.value for kind in Kind)


def k90(mass: Tensor, coverage: float = K90_COVERAGE) -> float:
    """Fraction of tokens needed to cover ``coverage`` of a segment's attention mass.

    Args:
        mass: ``[n]`` non-negative attention mass per token (already averaged over heads and queries).
        coverage: mass fraction to cover (0.9 for K90).

    Returns:
        ``k / n`` with ``k`` the fewest highest-mass tokens whose sum reaches ``coverage`` of the total;
        1.0 for an empty or zero-mass segment (counted as dense).
    """
    if mass.dim() != 1:
        raise ValueError(f"`mass` must be a 1-D [n] tensor, got {tuple(mass.shape)}")
    if not 0.0 < coverage <= 1.0:
        raise ValueError(f"`coverage` must be in (0, 1], got {coverage!r}")
    n = mass.shape[0]
    m = mass.double().clamp_min(0.0)
    total = float(m.sum()) if n else 0.0
    if n == 0 or total <= 0.0 or not math.isfinite(total):
        return 1.0
    csum = torch.cumsum(torch.sort(m, descending=True).values, dim=0)
    need = coverage * total * (1.0 - 1e-9)  # tolerance: 0.1 * 9 must count as 0.9
    k = int(torch.searchsorted(csum, torch.tensor([need], dtype=csum.dtype)).item()) + 1
    return min(k, n) / n


def route(k90_value: float, threshold: float = DEFAULT_K90_THRESHOLD) -> PolicyKind:
    """:attr:`Kind.EVICT` when ``k90_value <= threshold`` (concentrated attention), else :attr:`Kind.QUANTIZE`."""
    check_ratio("k90_value", k90_value, allow_zero=True)
    check_ratio("threshold", threshold, allow_zero=True)
    return Kind.EVICT if k90_value <= threshold else Kind.QUANTIZE


__all__ = ["POLICY_KINDS", "Kind", "PolicyKind", "k90", "route"]
