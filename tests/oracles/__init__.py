"""Test oracles: dense, kvpress-style reference implementations the library is checked against.

- eviction policies (pure: score and select, never mutate storage) that score with the whole
  ``[Hq, Tq, T]`` attention tensor (:func:`~oracles.base.observation_attention`), while the library scores
  with its one chunked scorer (:mod:`unicache_core.compression.scoring`): each baseline method must keep
  the rows its policy keeps;
- KIVI as a segment-level policy, monotonic keep sets, per-type masses and K90 from dense probabilities,
  typed spans over a packed context.

Layout: keys ``[T, Hkv, d]``, observation queries ``[Tq, Hq, d]`` (GQA), selections ``[Hkv, n]``.
"""

from .base import (
    EvictionPolicy,
    ScoreInputs,
    attention_probabilities,
    budget_from_ratio,
    observation_attention,
    recent_mask,
)
from .h2o import H2OPolicy
from .kivi import KIVIPolicy
from .pyramidkv import PyramidKVPolicy
from .snapkv import SnapKVPolicy
from .streaming_llm import StreamingLLMPolicy
from .vlcache import VLCachePolicy, layer_sparsity

__all__ = [
    "EvictionPolicy",
    "H2OPolicy",
    "KIVIPolicy",
    "PyramidKVPolicy",
    "ScoreInputs",
    "SnapKVPolicy",
    "StreamingLLMPolicy",
    "VLCachePolicy",
    "attention_probabilities",
    "budget_from_ratio",
    "layer_sparsity",
    "observation_attention",
    "recent_mask",
]
