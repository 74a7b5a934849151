"""The one seam where a KV-cache implementation plugs into a model.

A :class:`KVCache` holds the cached keys/values of ONE context (BAGEL: the ``gen``, ``cfg_text`` or
``cfg_img`` context) for every layer, and answers attention for new queries. The model calls, per
forward pass::

    cache.begin_call(call)                 # once, before layer 0
    out = cache.attend(layer, q, k, v, call)  # per layer; appends k/v when call.update
    cache.end_call(call)                   # once, after the last layer

Keys are stored after QK-norm and RoPE, so a cache never needs positions to compute attention; the
positions and token types in :class:`AttentionCall` are metadata for compression policies.
Cached keys are always fully visible to new queries (BAGEL never masks earlier context); the new
block sees itself causally (text) or bidirectionally (image blocks, denoising latents).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch
from torch import Tensor
from torch.nn import functional as F

from .attention import attention_with_lse, merge_attention
from .segments import TokenType

Phase = Literal["prefill", "decode", "denoise"]
Task = Literal["understanding", "t2i", "edit"]
Branch = Literal["gen", "cfg_text", "cfg_img"]


@dataclass
class AttentionCall:
    """What one model forward pass does with its cache (shared by all layers of that pass).

    Attributes:
        token_types: ``[Tn]`` int8 :class:`TokenType` of each new (query) token.
        positions: ``[Tn]`` int64 RoPE position ids of the new tokens.
        causal: the new block attends to itself causally (text) rather than bidirectionally.
        update: append the new keys/values to the cache after attention.
        phase: ``prefill`` (context building), ``decode`` (text generation), ``denoise``.
        step: decode-token index or denoising-step index (``None`` in prefill).
        timestep: flow time ``t`` of a denoising step.
        new_block_mask: optional ``[Tn, Tn]`` bool visibility among the new tokens (True = visible), for a
            call that packs several blocks (:func:`~unicache_core.attention.block_causal_mask`); it
            replaces ``causal`` for the new block. Cached keys stay fully visible.
    """

    token_types: Tensor
    positions: Tensor
    causal: bool
    update: bool
    phase: Phase = "prefill"
    step: int | None = None
    timestep: float | None = None
    new_block_mask: Tensor | None = None


@dataclass(frozen=True)
class CacheRequest:
    """Which cache a pipeline asks a :data:`CacheFactory` for."""

    task: Task
    branch: Branch
    num_layers: int


class KVCache(ABC):
    """Cache of one context across all layers.

    Subclasses implement :meth:`attend`; the rest has working defaults.
    """

    def __init__(self, num_layers: int, *, task: Task | None = None, branch: Branch | None = None):
        if num_layers <= 0:
            raise ValueError(f"`num_layers` must be > 0, got {num_layers}")
        self.num_layers = num_layers
        self.task = task
        self.branch = branch

    def begin_call(self, call: AttentionCall) -> None:
        """Hook run once before layer 0 of a forward pass."""

    def end_call(self, call: AttentionCall) -> None:
        """Hook run once after the last layer of a forward pass."""

    @abstractmethod
    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tensor:
        """Attention of the new queries over (cached keys of ``layer``) ∪ (the new block).

        Args:
            layer: layer index in ``[0, num_layers)``.
            q: ``[Tn, Hq, d]`` queries of the new tokens.
            k, v: ``[Tn, Hkv, d]`` keys (already normed and rotated) and values of the new tokens.
            call: the forward pass description; when ``call.update`` the new k/v are cached.

        Returns:
            ``[Tn, Hq, d]`` attention output in ``q.dtype``.
        """

    @property
    @abstractmethod
    def num_tokens(self) -> int:
        """Number of context tokens cached (per layer)."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of the tensors this cache actually holds, over all layers."""

    def clone(self, *, branch: Branch | None = None) -> "KVCache":
        """Independent deep copy (BAGEL's ``deepcopy(gen)`` for the ``cfg_text`` context)."""
        other = copy.deepcopy(self)
        if branch is not None:
            other.branch = branch
        return other


@dataclass
class _FullLayer:
    keys: Tensor | None = None  # [T, Hkv, d]
    values: Tensor | None = None
    token_types: Tensor | None = None  # [T] int8
    positions: Tensor | None = None  # [T] int64


class FullKVCache(KVCache):
    """Uncompressed cache: exactly what BAGEL's ``NaiveCache`` + ``flash_attn_varlen_func`` compute."""

    def __init__(self, num_layers: int, *, task: Task | None = None, branch: Branch | None = None):
        super().__init__(num_layers, task=task, branch=branch)
        self.layers = [_FullLayer() for _ in range(num_layers)]

    def _check_layer(self, layer: int) -> _FullLayer:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"`layer` must be in [0, {self.num_layers}), got {layer}")
        return self.layers[layer]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tensor:
        state = self._check_layer(layer)
        if _prefer_fused_sdpa(q):
            out = self._attend_sdpa(state, q, k, v, call.causal, call.new_block_mask)
            if call.update:
                self.append(layer, k, v, call.token_types, call.positions)
            return out
        parts = []
        if state.keys is not None and state.keys.shape[0] > 0:
            parts.append(attention_with_lse(q, state.keys.to(q.dtype), state.values.to(q.dtype)))
        if call.new_block_mask is not None:
            parts.append(attention_with_lse(q, k, v, mask=call.new_block_mask))
        else:
            parts.append(attention_with_lse(q, k, v, causal=call.causal))
        out, _ = merge_attention(parts)
        if call.update:
            self.append(layer, k, v, call.token_types, call.positions)
        return out

    @staticmethod
    def _attend_sdpa(
        state: "_FullLayer", q: Tensor, k: Tensor, v: Tensor, causal: bool, new_block_mask: Tensor | None = None
    ) -> Tensor:
        """One fused SDPA call over ``[cached ; new]`` keys, as BAGEL's ``flash_attn_varlen_func`` does.

        Used off-CPU, where torch dispatches to flash / memory-efficient kernels (no LSE needed since
        nothing is merged). ``causal`` masks the new block bottom-right aligned. Returns ``[Tn, Hq, d]``.
        """
        if state.keys is not None and state.keys.shape[0] > 0:
            keys = torch.cat([state.keys.to(q.dtype), k])
            values = torch.cat([state.values.to(q.dtype), v])
        else:
            keys, values = k, v
        tq, tk = q.shape[0], keys.shape[0]
        mask = None
        if new_block_mask is not None:
            cached = torch.ones(tq, tk - tq, dtype=torch.bool, device=q.device)
            mask = torch.cat([cached, new_block_mask.to(device=q.device, dtype=torch.bool)], dim=1)
        elif causal and tq > 1:
            rows = torch.arange(tq, device=q.device)[:, None] + (tk - tq)
            mask = torch.arange(tk, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, enable_gqa=q.shape[1] != keys.shape[1],
        )
        return out.squeeze(0).transpose(0, 1)

    def append(self, layer: int, k: Tensor, v: Tensor, token_types: Tensor, positions: Tensor) -> None:
        """Append ``[Tn, Hkv, d]`` keys/values with their ``[Tn]`` types and positions."""
        state = self._check_layer(layer)
        if token_types.shape[0] != k.shape[0] or positions.shape[0] != k.shape[0]:
            raise ValueError(
                f"token_types ({token_types.shape[0]}) and positions ({positions.shape[0]}) must "
                f"match the number of new keys ({k.shape[0]})"
            )
        types = token_types.to(torch.int8)
        if state.keys is None:
            state.keys, state.values = k.detach().clone(), v.detach().clone()
            state.token_types, state.positions = types.clone(), positions.clone()
        else:
            state.keys = torch.cat([state.keys, k.detach()])
            state.values = torch.cat([state.values, v.detach()])
            state.token_types = torch.cat([state.token_types, types])
            state.positions = torch.cat([state.positions, positions])

    @property
    def num_tokens(self) -> int:
        keys = self.layers[0].keys
        return 0 if keys is None else int(keys.shape[0])

    def nbytes(self) -> int:
        total = 0
        for state in self.layers:
            if state.keys is not None:
                total += state.keys.nbytes + state.values.nbytes
        return total

    def layer_kv(self, layer: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(keys [T, Hkv, d], values, token_types [T], positions [T])`` of one layer."""
        state = self._check_layer(layer)
        if state.keys is None:
            raise ValueError(f"layer {layer} of this cache is empty")
        return state.keys, state.values, state.token_types, state.positions


def _prefer_fused_sdpa(q: Tensor) -> bool:
    """Off-CPU the full cache uses one fused SDPA call; on CPU the flash kernel + LSE merge (measured faster)."""
    return q.device.type != "cpu"


#: Builds the cache of one context; pipelines call it for every context they create.
CacheFactory = Callable[[CacheRequest], KVCache]


def full_cache_factory(request: CacheRequest) -> KVCache:
    """The default :data:`CacheFactory`: uncompressed caches."""
    return FullKVCache(request.num_layers, task=request.task, branch=request.branch)


__all__ = [
    "AttentionCall",
    "CacheFactory",
    "CacheRequest",
    "FullKVCache",
    "KVCache",
    "TokenType",
    "full_cache_factory",
]
