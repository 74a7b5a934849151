"""The one seam where a KV-cache implementation plugs into a model.

A :class:`KVCache` holds the cached keys/values of ONE context (BAGEL: the ``gen``, ``cfg_text`` or
``cfg_img`` context) for every layer, and answers attention for new queries. The model calls, per
forward pass::

    cache.begin_call(call)                 # once, before layer 0
    out = cache.attend(layer, q, k, v, call)  # per layer; appends k/v when call.update
    cache.end_call(call)                   # once, after the last layer

Keys are stored after QK-norm and RoPE, so a cache never needs RoPE positions to compute attention;
the RoPE positions and token types in :class:`AttentionCall` are metadata for compression policies.
(Rows of a cache are identified by their APPEND INDEX, ``token_index`` in :mod:`unicache_core.kv.stores`:
0 for the first row ever cached in the context. "Position" always means a RoPE id.)

Every cache of one pipeline request comes from one :class:`CacheSession`, started by a
:class:`CacheFactory`; the session sees every branch (``gen``, ``cfg_text``, ``cfg_img``, ``think``),
builds ``cfg_text`` (and the ``think`` branch) from its parent with :meth:`CacheSession.fork`,
is told when each denoising step / decoded token begins and ends and which branches run in it
(:class:`StepInfo`), and returns a JSON-serialisable report when the request ends.
Cached keys are always fully visible to new queries (BAGEL never masks earlier context); the new
block sees itself causally (text) or bidirectionally (image blocks, denoising latents).
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor
from torch.nn import functional as F

from ..validation import check_int
from .attention import attention_with_lse, merge_attention
from .token_types import BRANCHES, TASKS, Task

Phase = Literal["prefill", "decode", "denoise"]


@dataclass
class AttentionCall:
    """What one model forward pass does with its cache (shared by all layers of that pass).

    Attributes:
        token_types: ``[Tn]`` int8 :class:`TokenType` of each new (query) token.
        rope_positions: ``[Tn]`` int64 RoPE position ids of the new tokens.
        causal: the new block attends to itself causally (text) rather than bidirectionally.
        update: append the new keys/values to the cache after attention.
        phase: ``prefill`` (context building), ``decode`` (text generation), ``denoise``.
        step: decode-token index or denoising-step index (``None`` in prefill).
        timestep: flow time ``t`` of a denoising step.
        new_block_mask: optional ``[Tn, Tn]`` bool visibility among the new tokens (True = visible), for a
            call that packs several blocks (:func:`~unicache_core.kv.attention.block_causal_mask`); it
            replaces ``causal`` for the new block. Cached keys stay fully visible.
        image: the input image (0-based, in the request's order) whose rows an image block (VAE or ViT)
            appends, so a cache can keep and account each image's rows apart; ``None`` for text, latent and
            decoded tokens.
    """

    token_types: Tensor
    rope_positions: Tensor
    causal: bool
    update: bool
    phase: Phase = "prefill"
    step: int | None = None
    timestep: float | None = None
    new_block_mask: Tensor | None = None
    image: int | None = None


@dataclass(frozen=True)
class CacheRequest:
    """Which cache a plain callable factory (see :func:`as_cache_factory`) is asked for."""

    task: Task
    branch: str
    num_layers: int


@dataclass(frozen=True)
class RequestInfo:
    """One pipeline request, as a :class:`CacheFactory` sees it when it starts a session.

    Attributes:
        task: ``understanding``, ``t2i`` or ``edit``.
        num_layers: decoder layers of the model.
        num_steps: denoising steps that will run (``num_timesteps - 1``), or the most tokens that will be
            decoded (understanding); ``None`` when unknown.
        model_id: the model's id (a factory may pick settings made for that model with it), or ``""``.
        branch_weights: ``(branch, coefficient)`` pairs: each branch's coefficient in the output the request returns
            (classifier-free guidance combines the branches' outputs linearly; empty: every branch counts 1).
        segment_rows: the most rows one cached segment of the model can hold (its longest text, or one image's
            tokens), which bounds a method's sizes (a policy table's quantization groups); ``None`` when unknown.
    """

    task: Task
    num_layers: int
    num_steps: int | None = None
    model_id: str = ""
    branch_weights: tuple[tuple[str, float], ...] = ()
    segment_rows: int | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"`task` must be one of {TASKS}, got {self.task!r}")
        check_int("num_layers", self.num_layers, 1)
        if self.num_steps is not None:
            check_int("num_steps", self.num_steps, 0)
        if self.segment_rows is not None:
            check_int("segment_rows", self.segment_rows, 1)
        for name, coefficient in self.branch_weights:
            if name not in BRANCHES or not math.isfinite(coefficient):
                pair = (name, coefficient)
                raise ValueError(f"`branch_weights` must pair a branch of {BRANCHES} with a number, got {pair!r}")

    def branch_weight(self, branch: str) -> float:
        """The coefficient of ``branch`` in the request's output (1 when not given)."""
        return dict(self.branch_weights).get(branch, 1.0)


@dataclass(frozen=True)
class StepInfo:
    """One denoising step (``phase="denoise"``) or one decoded token (``phase="decode"``) of a request.

    Attributes:
        phase: ``denoise`` or ``decode``.
        step: 0-based index; total: steps (tokens: the most) of this phase.
        branches: the contexts whose output this step uses (CFG branches skip steps outside ``cfg_interval``;
            think-mode reasoning tokens run in ``think``).
        timestep: flow time ``t`` of a denoising step.
        forecast: the branches of ``branches`` whose output this step is forecast instead of computed
            (TaylorSeer, ``unicache_core/bagel/taylorseer.py``): their caches see no call in this step.
        next_full: for each branch of ``branches``, the next step at which its caches are called again (its
            next computed step), or ``None`` when they never are; the mapping itself is ``None`` when every
            branch is computed at every step (:meth:`next_call_step`).
    """

    phase: Phase
    step: int
    total: int
    branches: tuple[str, ...]
    timestep: float | None = None
    forecast: tuple[str, ...] = ()
    next_full: Mapping[str, int | None] | None = field(default=None, compare=False)

    def next_call_step(self, branch: str) -> int | None:
        """The next step at which the caches of ``branch`` are called (``step + 1`` unless :attr:`next_full` says
        otherwise), or ``None`` when this is the last."""
        if self.next_full is not None:
            return self.next_full.get(branch)
        return self.step + 1 if self.step + 1 < self.total else None


class KVCache(ABC):
    """Cache of one context across all layers.

    Subclasses implement :meth:`attend`; the rest has working defaults.
    """

    def __init__(self, num_layers: int, *, task: Task | None = None, branch: str | None = None):
        self.num_layers = check_int("num_layers", num_layers, 1)
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

    def clone(self, *, branch: str | None = None) -> KVCache:
        """Independent copy (BAGEL's ``deepcopy(gen)`` for the ``cfg_text`` context).

        The default deep-copies; caches whose tensors are never modified in place override it to share
        them (the rows ``gen`` and its clone hold identically are then stored once).
        """
        other = copy.deepcopy(self)
        if branch is not None:
            other.branch = branch
        return other

    def tensors(self) -> list[Tensor]:
        """Every tensor the cache holds (shared-storage-aware accounting: :func:`unique_nbytes`)."""
        return []


@dataclass
class _FullLayer:
    """One layer of a :class:`FullKVCache`: its keys and values as immutable chunks, or (empty) none.

    A chunk is a ``([t, Hkv, d] keys, [t, Hkv, d] values)`` pair, in append order. The first ``shared`` chunks are
    held by another cache too (a fork: copy on write); appends grow the last chunk only while it is this layer's
    own, so a branch holds at most its shared prefix and one chunk of its own.
    """

    chunks: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    token_types: Tensor | None = None  # [T] int8
    rope_positions: Tensor | None = None  # [T] int64 RoPE ids
    shared: int = 0

    @property
    def num_rows(self) -> int:
        return sum(k.shape[0] for k, _ in self.chunks)

    def joined(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Every key and value in ``dtype``, concatenated: a transient of this one layer while several chunks are
        held (the same numbers one tensor would give, so attention over them is bit-identical)."""
        keys = [k.to(dtype) for k, _ in self.chunks]
        values = [v.to(dtype) for _, v in self.chunks]
        return _joined(keys), _joined(values)  # type: ignore[return-value]

    def held(self) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        """``(keys, values, token_types, rope_positions)``, or ``None`` while the layer is empty."""
        if not self.chunks:
            return None
        assert self.token_types is not None and self.rope_positions is not None
        return (*self.joined(self.chunks[0][0].dtype), self.token_types, self.rope_positions)

    def fork(self) -> _FullLayer:
        """A copy holding the same chunks; from now on neither grows them (copy on write)."""
        self.shared = len(self.chunks)
        return _FullLayer(list(self.chunks), self.token_types, self.rope_positions, len(self.chunks))


def _joined(parts: list[Tensor]) -> Tensor | None:
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class FullKVCache(KVCache):
    """Uncompressed cache: exactly what BAGEL's ``NaiveCache`` + ``flash_attn_varlen_func`` compute.

    Rows a fork shares are held once (:meth:`clone`): each layer keeps its appended rows as chunks and
    concatenates a branch's chunks only for the attention call that reads them (one layer's K and V at a time).
    """

    def __init__(self, num_layers: int, *, task: Task | None = None, branch: str | None = None):
        super().__init__(num_layers, task=task, branch=branch)
        self.layers = [_FullLayer() for _ in range(num_layers)]

    def _check_layer(self, layer: int) -> _FullLayer:
        return self.layers[check_int("layer", layer, 0, self.num_layers - 1)]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tensor:
        state = self._check_layer(layer)
        if _prefer_fused_sdpa(q):
            out = self._attend_sdpa(state, q, k, v, call.causal, call.new_block_mask)
            if call.update:
                self.append(layer, k, v, call.token_types, call.rope_positions)
            return out
        parts = []
        if state.num_rows > 0:
            keys, values = state.joined(q.dtype)
            parts.append(attention_with_lse(q, keys, values))
            del keys, values
        if call.new_block_mask is not None:
            parts.append(attention_with_lse(q, k, v, mask=call.new_block_mask))
        else:
            parts.append(attention_with_lse(q, k, v, causal=call.causal))
        out, _ = merge_attention(parts)
        if call.update:
            self.append(layer, k, v, call.token_types, call.rope_positions)
        return out

    @staticmethod
    def _attend_sdpa(
        state: _FullLayer, q: Tensor, k: Tensor, v: Tensor, causal: bool, new_block_mask: Tensor | None = None
    ) -> Tensor:
        """One fused SDPA call over ``[cached ; new]`` keys, as BAGEL's ``flash_attn_varlen_func`` does.

        Used off-CPU, where torch dispatches to flash / memory-efficient kernels (no LSE needed since
        nothing is merged). ``causal`` masks the new block bottom-right aligned. Returns ``[Tn, Hq, d]``.
        """
        if state.num_rows > 0:
            keys = torch.cat([c.to(q.dtype) for c, _ in state.chunks] + [k])
            values = torch.cat([c.to(q.dtype) for _, c in state.chunks] + [v])
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
            q.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            enable_gqa=q.shape[1] != keys.shape[1],
        )
        return out.squeeze(0).transpose(0, 1)

    def append(self, layer: int, k: Tensor, v: Tensor, token_types: Tensor, rope_positions: Tensor) -> None:
        """Append ``[Tn, Hkv, d]`` keys/values with their ``[Tn]`` types and RoPE positions.

        Held tensors are never modified: the layer's own last chunk is replaced by a new, longer one
        (``torch.cat``), or a new chunk starts after the rows a fork shares.
        """
        state = self._check_layer(layer)
        if token_types.shape[0] != k.shape[0] or rope_positions.shape[0] != k.shape[0]:
            raise ValueError(
                f"token_types ({token_types.shape[0]}) and rope_positions ({rope_positions.shape[0]}) must "
                f"match the number of new keys ({k.shape[0]})"
            )
        if k.shape != v.shape:
            raise ValueError(f"keys {tuple(k.shape)} and values {tuple(v.shape)} must have the same shape")
        first = state.chunks[0][0] if state.chunks else None
        if first is not None and (k.shape[1:] != first.shape[1:] or k.device != first.device):
            raise ValueError(
                f"new keys [*, {k.shape[1]}, {k.shape[2]}] on {k.device} do not match layer {layer}'s "
                f"cache [*, {first.shape[1]}, {first.shape[2]}] on {first.device}"
            )
        types = token_types.to(torch.int8)
        if first is None:
            state.chunks = [(k.detach().clone(), v.detach().clone())]
            state.token_types, state.rope_positions = types.clone(), rope_positions.clone()
            return
        assert state.token_types is not None and state.rope_positions is not None
        dtype = first.dtype
        if len(state.chunks) > state.shared:  # the last chunk is this layer's own: grow it
            keys, values = state.chunks[-1]
            state.chunks[-1] = (torch.cat([keys, k.detach().to(dtype)]), torch.cat([values, v.detach().to(dtype)]))
        else:
            state.chunks.append((k.detach().to(dtype).clone(), v.detach().to(dtype).clone()))
        state.token_types = torch.cat([state.token_types, types.to(state.token_types.device)])
        state.rope_positions = torch.cat([state.rope_positions, rope_positions.to(state.rope_positions.device)])

    @property
    def num_tokens(self) -> int:
        return self.layers[0].num_rows

    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for state in self.layers for k, v in state.chunks)

    def layer_kv(self, layer: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(keys [T, Hkv, d], values, token_types [T], rope_positions [T])`` of one layer."""
        held = self._check_layer(layer).held()
        if held is None:
            raise ValueError(f"layer {layer} of this cache is empty")
        return held

    def clone(self, *, branch: str | None = None) -> FullKVCache:
        """A copy sharing the cached tensors: the rows held now are stored once for both (appends after the fork
        start chunks of each cache's own, so the two stay independent)."""
        other = copy.copy(self)  # same class (subclasses keep their behaviour), new layer list below
        other.layers = [state.fork() for state in self.layers]
        if branch is not None:
            other.branch = branch
        return other

    def tensors(self) -> list[Tensor]:
        return [t for state in self.layers for chunk in state.chunks for t in chunk]


def _prefer_fused_sdpa(q: Tensor) -> bool:
    """Off-CPU the full cache uses one fused SDPA call; on CPU the flash kernel + LSE merge (measured faster)."""
    return q.device.type != "cpu"


def unique_nbytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a tensor shared by two branch caches counts once)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        seen[(str(t.device), storage.data_ptr())] = max(
            seen.get((str(t.device), storage.data_ptr()), 0), storage.nbytes()
        )
    return sum(seen.values())


class CacheSession:
    """The caches of ONE pipeline request, and whatever state they share (statistics, schedules, records).

    The default session builds independent caches with ``build(branch)`` and reports nothing.
    Compressing sessions (:mod:`unicache_core.compression`) override the hooks.
    """

    def __init__(self, request: RequestInfo, build: Callable[[str], KVCache] | None = None):
        self.request = request
        self._build = build
        self.caches: dict[str, KVCache] = {}

    def new_cache(self, branch: str) -> KVCache:
        """An empty cache for context ``branch``."""
        if branch not in BRANCHES:
            raise ValueError(f"`branch` must be one of {BRANCHES}, got {branch!r}")
        if self._build is None:
            cache: KVCache = FullKVCache(self.request.num_layers, task=self.request.task, branch=branch)
        else:
            cache = self._build(branch)
        self.caches[branch] = cache
        return cache

    def fork(self, parent: KVCache, branch: str) -> KVCache:
        """The cache of ``branch`` as a copy of ``parent`` taken now (official ``deepcopy(gen)``).

        The copy starts with the parent's state and then lives on its own.
        """
        if branch not in BRANCHES:
            raise ValueError(f"`branch` must be one of {BRANCHES}, got {branch!r}")
        cache = parent.clone(branch=branch)
        self.caches[branch] = cache
        return cache

    def begin_step(self, step: StepInfo) -> None:
        """Called before the forwards of one denoising step or decoded token."""

    def end_step(self, step: StepInfo) -> None:
        """Called after them (also when a later step is never reached)."""

    def release(self, branch: str) -> None:
        """The pipeline dropped the context of ``branch`` (e.g. the think text after decoding)."""
        self.caches.pop(branch, None)

    def finish(self) -> dict | None:
        """End of the request: a JSON-serialisable report, or ``None``."""
        return None


class CacheFactory:
    """Starts one :class:`CacheSession` per pipeline request. The default builds full caches (a compressing
    factory holds its method object as ``method``: :class:`~unicache_core.compression.registry.MethodCacheFactory`).
    """

    def start(self, request: RequestInfo) -> CacheSession:
        return CacheSession(request)


class _CallableFactory(CacheFactory):
    def __init__(self, fn: Callable[[CacheRequest], KVCache]):
        self.fn = fn

    def start(self, request: RequestInfo) -> CacheSession:
        return CacheSession(request, lambda branch: self.fn(CacheRequest(request.task, branch, request.num_layers)))


def as_cache_factory(factory: CacheFactory | Callable[[CacheRequest], KVCache]) -> CacheFactory:
    """A :class:`CacheFactory` as is, or a plain ``fn(CacheRequest) -> KVCache`` wrapped in one."""
    if isinstance(factory, CacheFactory):
        return factory
    if callable(factory):
        return _CallableFactory(factory)
    raise ValueError(
        f"`cache_factory` must be a CacheFactory or a callable(CacheRequest) -> KVCache, got {type(factory).__name__}"
    )


#: The default factory: uncompressed caches.
full_cache_factory = CacheFactory()


__all__ = [
    "AttentionCall",
    "CacheFactory",
    "CacheRequest",
    "CacheSession",
    "FullKVCache",
    "KVCache",
    "RequestInfo",
    "StepInfo",
    "as_cache_factory",
    "full_cache_factory",
    "unique_nbytes",
]
