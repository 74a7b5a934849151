"""UniCache core: framework-free KV-cache compression and a BAGEL engine.

Importing this package has no side effects and never imports ComfyUI.
"""

from .errors import CancelledError, CheckpointError, NumericalError, UniCacheError
from .kv.attention import attention_with_lse, block_causal_mask, merge_attention
from .kv.cache import AttentionCall, CacheFactory, CacheRequest, FullKVCache, KVCache, full_cache_factory
from .kv.token_types import CANDIDATE_TYPES, PROTECTED_TYPES, TASKS, TokenType

__version__ = "0.1.0"

__all__ = [
    "AttentionCall",
    "CANDIDATE_TYPES",
    "CacheFactory",
    "CacheRequest",
    "CancelledError",
    "CheckpointError",
    "FullKVCache",
    "KVCache",
    "full_cache_factory",
    "NumericalError",
    "PROTECTED_TYPES",
    "TASKS",
    "TokenType",
    "UniCacheError",
    "__version__",
    "attention_with_lse",
    "block_causal_mask",
    "merge_attention",
]
