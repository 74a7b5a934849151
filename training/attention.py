"""Attention for training: whole packed sequences with a block mask instead of a KV cache.

The model's layers call ``cache.attend(layer, q, k, v, call)`` (the inference seam); at training time
every token of a sample is in one forward pass, so :class:`MaskedAttention` plays that role: it runs
exact attention of each sample over its own tokens under the visibility mask BAGEL trains with (text
causal, an image block bidirectional, every block sees all earlier blocks of its sample).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from unicache_core.kv.cache import AttentionCall, KVCache


@dataclass(frozen=True)
class SampleGroup:
    """``count`` samples padded to ``length`` tokens, stored back to back from ``offset`` in the packed
    sequence; ``mask [count, length, length]`` bool (True = query row may see key column)."""

    offset: int
    count: int
    length: int
    mask: Tensor


class MaskedAttention(KVCache):
    """A stand-in "cache" that holds nothing and attends within each sample under its mask."""

    def __init__(self, num_layers: int, groups: list[SampleGroup]):
        super().__init__(num_layers)
        self.groups = groups

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tensor:
        """``q [T, Hq, d]``, ``k, v [T, Hkv, d]`` → ``[T, Hq, d]`` (T = the packed length of all groups).

        Exact attention written out (scores, masked softmax in fp32, weighted sum) rather than through
        ``scaled_dot_product_attention``: on the CPU the flash kernel's backward took 5x its forward (35% of a
        training step); this form compiles into two matmuls and one fused softmax, and under bf16 autocast its
        matmuls run in bf16. The query heads that share a KV head are stacked along the query axis, so K and V
        are never repeated.
        """
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        per_kv = hq // hkv
        outs = []
        for g in self.groups:
            sl = slice(g.offset, g.offset + g.count * g.length)
            n, length = g.count, g.length
            qg = q[sl].view(n, length, hkv, per_kv, d).permute(0, 2, 3, 1, 4).reshape(n, hkv, per_kv * length, d)
            kg = k[sl].view(n, length, hkv, d).transpose(1, 2)
            vg = v[sl].view(n, length, hkv, d).transpose(1, 2)
            scores = torch.matmul(qg, kg.transpose(-1, -2)).view(n, hkv, per_kv, length, length).float()
            scores = (scores * d**-0.5).masked_fill(~g.mask[:, None, None], float("-inf"))
            weights = scores.softmax(-1).to(vg.dtype).view(n, hkv, per_kv * length, length)
            out = torch.matmul(weights, vg).view(n, hkv, per_kv, length, d)
            outs.append(out.permute(0, 3, 1, 2, 4).reshape(n * length, hq, d))
        return torch.cat(outs)

    @property
    def num_tokens(self) -> int:
        return 0

    def nbytes(self) -> int:
        return 0
