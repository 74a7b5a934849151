"""Every KV-compression method behind one seam, selectable by name.

``make_cache_factory(method, config)`` returns a :class:`~unicache_core.kv.cache.CacheFactory` whose
sessions build typed, compressing caches per branch (:mod:`.compressing_cache`), compress them with the method
(:mod:`.unicache`, :mod:`.baselines`) through the physical operations of :mod:`.ops`, and report per
step (:mod:`.report`). Methods: ``full``, ``unicache``, ``h2o``, ``snapkv``, ``pyramidkv``,
``streamingllm``, ``kivi``, ``vlcache``. Default numbers live in :mod:`.defaults`; the (task, type)
policy table of UniCache in :mod:`.policy_table`.
"""

from .compressing_cache import CompressingKVCache, CompressionSession
from .config import METHODS, KVConfig, parse_kv_target
from .defaults import DEFAULT_K90_THRESHOLD, DEFAULT_REDUCTION
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
from .stats import ChunkedAttentionStats

__all__ = [
    "CHECKPOINT_POLICY_FILE",
    "ChunkedAttentionStats",
    "CompressingKVCache",
    "CompressionSession",
    "DEFAULT_K90_THRESHOLD",
    "DEFAULT_REDUCTION",
    "KVConfig",
    "METHODS",
    "PolicyKind",
    "PolicyTable",
    "PolicyTableError",
    "REPORT_FORMAT",
    "RetentionSchedule",
    "k90",
    "make_cache_factory",
    "paper_policy_table",
    "parse_kv_target",
    "resolve_policy_table",
    "route",
]
