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
from torch.nn import functional as F

from ...kvcache import AttentionCall, KVCache


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
        """``q [T, Hq, d]``, ``k, v [T, Hkv, d]`` → ``[T, Hq, d]`` (T = the packed length of all groups)."""
        groups = q.shape[1] // k.shape[1]
        outs = []
        for g in self.groups:
            sl = slice(g.offset, g.offset + g.count * g.length)
            qg = q[sl].view(g.count, g.length, q.shape[1], q.shape[2]).transpose(1, 2)
            kg = k[sl].view(g.count, g.length, k.shape[1], k.shape[2]).transpose(1, 2)
            vg = v[sl].view(g.count, g.length, v.shape[1], v.shape[2]).transpose(1, 2)
            if groups > 1:
                kg = kg.repeat_interleave(groups, dim=1)
                vg = vg.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask[:, None])
            outs.append(out.transpose(1, 2).reshape(g.count * g.length, q.shape[1], q.shape[2]))
        return torch.cat(outs)

    @property
    def num_tokens(self) -> int:
        return 0

    def nbytes(self) -> int:
        return 0
