"""Every KV-compression method behind one seam, selectable by name or as an object.

A method is a small frozen object of settings (:mod:`.methods`: ``Full``, ``UniCache``, ``H2O``, ``SnapKV``,
``PyramidKV``, ``StreamingLLM``, ``KIVI``, ``VLCache``; the base and registry in :mod:`.method`) that plans from a
read-only view of a branch (:mod:`.view`) what the branch keeps (:mod:`.plan`). ``make_cache_factory(method)``
returns a :class:`~unicache_core.kv.cache.CacheFactory` whose sessions (:mod:`.session`) build a compressing cache
per branch (:mod:`.compressing_cache`), apply the plans through the physical operations of :mod:`.ops` and report
per step (:mod:`.report`). Default numbers live in :mod:`.defaults`; UniCache's (task, type) policy table in
:mod:`.policy_table`.
"""

from .compressing_cache import CompressingKVCache
from .defaults import DEFAULT_K90_THRESHOLD, DEFAULT_REDUCTION
from .method import METHODS, Method, method_from_name
from .methods import H2O, KIVI, Full, PyramidKV, SnapKV, StreamingLLM, UniCache, VLCache
from .policy_table import (
    CHECKPOINT_POLICY_FILE,
    PolicyTable,
    PolicyTableError,
    paper_policy_table,
    resolve_policy_table,
)
from .registry import make_cache_factory
from .report import REPORT_FORMAT
from .routing import PolicyKind, k90, route
from .schedule import RetentionSchedule
from .session import CompressionSession
from .stats import ChunkedAttentionStats
from .targets import parse_kv_target

__all__ = [
    "CHECKPOINT_POLICY_FILE",
    "DEFAULT_K90_THRESHOLD",
    "DEFAULT_REDUCTION",
    "H2O",
    "KIVI",
    "METHODS",
    "ChunkedAttentionStats",
    "CompressingKVCache",
    "CompressionSession",
    "Full",
    "Method",
    "PolicyKind",
    "PolicyTable",
    "PolicyTableError",
    "PyramidKV",
    "REPORT_FORMAT",
    "RetentionSchedule",
    "SnapKV",
    "StreamingLLM",
    "UniCache",
    "VLCache",
    "k90",
    "make_cache_factory",
    "method_from_name",
    "paper_policy_table",
    "parse_kv_target",
    "resolve_policy_table",
    "route",
]
