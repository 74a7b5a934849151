"""UniCache's task- and type-aware machinery: routing, statistics, allocation, schedule, keep sets.

Paper: https://arxiv.org/abs/2609.32831; design: docs/compression.md §8. Pure helpers, no side effects.
"""

from .allocator import allocate, allocate_integer, allocate_types, target_ratios
from .keepsets import MonotonicKeepSet, split_eviction_budget
from .routing import DEFAULT_K90_THRESHOLD, PolicyKind, PolicyTable, PolicyTableError, k90, route, segment_k90
from .schedule import RetentionSchedule
from .stats import (
    FALLBACK_BUDGET_RATIO,
    ChunkedAttentionStats,
    fallback_budget_ratio,
    layer_chunk,
    step_chunk,
    type_masses,
)

__all__ = [
    "ChunkedAttentionStats",
    "DEFAULT_K90_THRESHOLD",
    "FALLBACK_BUDGET_RATIO",
    "MonotonicKeepSet",
    "PolicyKind",
    "PolicyTable",
    "PolicyTableError",
    "RetentionSchedule",
    "allocate",
    "allocate_integer",
    "allocate_types",
    "fallback_budget_ratio",
    "k90",
    "layer_chunk",
    "route",
    "segment_k90",
    "split_eviction_budget",
    "step_chunk",
    "target_ratios",
    "type_masses",
]
