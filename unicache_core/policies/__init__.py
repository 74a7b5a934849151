"""Token-eviction policies (pure: score and select, never mutate storage).

Layout: keys ``[T, Hkv, d]``, observation queries ``[Tq, Hq, d]`` (GQA), selections ``[Hkv, n]``.
"""

from .base import EvictionPolicy, ScoreInputs, budget_from_ratio, observation_attention, topk_per_head
from .h2o import H2OPolicy
from .kivi import KIVIPolicy
from .pyramidkv import PyramidKVPolicy, pyramid_layer_budgets
from .snapkv import SnapKVPolicy
from .streaming_llm import StreamingLLMPolicy
from .vlcache import VLCachePolicy, layer_sparsity, vlcache_layer_budgets

__all__ = [
    "EvictionPolicy",
    "H2OPolicy",
    "KIVIPolicy",
    "PyramidKVPolicy",
    "ScoreInputs",
    "SnapKVPolicy",
    "StreamingLLMPolicy",
    "VLCachePolicy",
    "budget_from_ratio",
    "layer_sparsity",
    "observation_attention",
    "pyramid_layer_budgets",
    "topk_per_head",
    "vlcache_layer_budgets",
]
