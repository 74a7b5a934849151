"""Qwen2 Mixture-of-Transformers decoder (BAGEL's language model), inference only.

Every decoder layer holds two experts with identical shapes: the understanding ("und") weights, named
as in Qwen2, and the generation ("gen") weights, named with a ``_moe_gen`` suffix. Each token of a
packed block is routed to one expert by a boolean ``gen_mask`` (docs/bagel.md §2.3); attention is joint over
all tokens. Attention goes only through :meth:`unicache_core.kv.cache.KVCache.attend`, so the cache
implementation decides how new queries see the cached context.

Module and parameter names equal the ``language_model.*`` keys of BAGEL's ``ema.safetensors``. The
projections, MLPs, ``embed_tokens`` and ``lm_head`` come from the build's operations namespace
(:mod:`.operations`); the RMSNorms are this module's own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ...kv.cache import AttentionCall, KVCache
from ..config import LLMConfig
from .operations import LayerBuilder, shared_upcasts


class Qwen2RMSNorm(nn.Module):
    """RMSNorm: statistics in fp32, normalised value cast back to the input dtype, then ``* weight``.

    The weight (built in the compute dtype) is brought to the input's device at each call, so a host that
    leaves this small module on its offload device still computes on the input's device.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, layers: LayerBuilder | None = None):
        super().__init__()
        layers = layers or LayerBuilder()
        self.weight = layers.own_parameter((hidden_size,), 1.0)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """``x [..., hidden]`` → same shape; dtype follows ``weight * x``."""
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.device) * normed.to(x.dtype)


class Qwen2RotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE, half-split layout; ``inv_freq`` is a non-persistent buffer."""

    def __init__(self, head_dim: int, theta: float, device: torch.device | str | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.register_buffer("inv_freq", self.compute_inv_freq(device), persistent=False)

    def compute_inv_freq(self, device: torch.device | str | None = None) -> Tensor:
        """``[d/2]`` fp32: ``1 / theta^(2i/d)``."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
        return 1.0 / (self.theta**exponents)

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute ``inv_freq`` (needed after building on the meta device)."""
        self.inv_freq = self.compute_inv_freq(device)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``positions [T]`` int → ``(cos, sin)`` each ``[T, d]``, computed in fp32 then cast to ``dtype``."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device, torch.float32)[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """``[..., d]`` → ``cat(-x[..., d/2:], x[..., :d/2])``."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [T, heads, d]`` with ``cos/sin [T, d]``."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


class Qwen2MLP(nn.Module):
    """SiLU-gated MLP without biases: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, layers: LayerBuilder | None = None):
        super().__init__()
        layers = layers or LayerBuilder()
        self.gate_proj = layers.linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = layers.linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = layers.linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass(frozen=True)
class Routing:
    """Which tokens of a packed block use the und / gen expert.

    ``kind`` is ``"und"`` (all und), ``"gen"`` (all gen) or ``"mixed"``; for ``"mixed"`` the index
    tensors ``und_idx`` / ``gen_idx`` (int64 ``[n_und]`` / ``[n_gen]``) partition ``0..T-1``, and
    ``order [T]`` gives each token's row in ``cat(und outputs, gen outputs)``.
    """

    kind: str
    und_idx: Tensor | None = None
    gen_idx: Tensor | None = None
    order: Tensor | None = None

    @classmethod
    def from_mask(cls, gen_mask: Tensor | None, num_tokens: int) -> Routing:
        if gen_mask is None:
            return cls("und")
        if gen_mask.dim() != 1 or gen_mask.shape[0] != num_tokens:
            raise ValueError(
                f"`gen_mask` must be a 1-D bool tensor of length {num_tokens}, got shape {tuple(gen_mask.shape)}"
            )
        mask = gen_mask.to(torch.bool)
        n_gen = int(mask.sum())
        if n_gen == 0:
            return cls("und")
        if n_gen == num_tokens:
            return cls("gen")
        und_idx, gen_idx = torch.nonzero(~mask).squeeze(1), torch.nonzero(mask).squeeze(1)
        order = torch.empty(num_tokens, dtype=torch.long, device=mask.device)
        order[torch.cat([und_idx, gen_idx])] = torch.arange(num_tokens, device=mask.device)
        return cls("mixed", und_idx, gen_idx, order)

    def apply(self, und_fn: Callable[[Tensor], Tensor], gen_fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
        """Run ``und_fn`` on the und tokens and ``gen_fn`` on the gen tokens of ``x [T, ...]``."""
        if self.kind == "und":
            return und_fn(x)
        if self.kind == "gen":
            return gen_fn(x)
        und_idx, gen_idx, order = self.und_idx, self.gen_idx, self.order
        if und_idx is None or gen_idx is None or order is None:
            raise ValueError("a mixed Routing needs und_idx, gen_idx and order (Routing.from_mask makes them)")
        out_und = und_fn(x.index_select(0, und_idx.to(x.device)))
        out_gen = gen_fn(x.index_select(0, gen_idx.to(x.device)))
        # one gather back into token order (its backward is one scatter): ~7% faster per training step
        # than two index_put writes into an empty tensor, the same values
        return torch.cat([out_und, out_gen.to(out_und.dtype)]).index_select(0, order.to(x.device))


class PackedAttentionMoT(nn.Module):
    """Self-attention with und/gen projections and QK-norm; attention itself is done by the cache."""

    def __init__(self, config: LLMConfig, layer_idx: int, layers: LayerBuilder | None = None):
        super().__init__()
        layers = layers or LayerBuilder()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        h, d = config.hidden_size, config.head_dim
        q_out, kv_out = self.num_heads * d, self.num_kv_heads * d
        self.q_proj = layers.linear(h, q_out, bias=True)
        self.k_proj = layers.linear(h, kv_out, bias=True)
        self.v_proj = layers.linear(h, kv_out, bias=True)
        self.o_proj = layers.linear(q_out, h, bias=False)
        self.q_proj_moe_gen = layers.linear(h, q_out, bias=True)
        self.k_proj_moe_gen = layers.linear(h, kv_out, bias=True)
        self.v_proj_moe_gen = layers.linear(h, kv_out, bias=True)
        self.o_proj_moe_gen = layers.linear(q_out, h, bias=False)
        if config.qk_norm:  # else identities
            self.q_norm: nn.Module = Qwen2RMSNorm(d, config.rms_norm_eps, layers)
            self.k_norm: nn.Module = Qwen2RMSNorm(d, config.rms_norm_eps, layers)
            self.q_norm_moe_gen: nn.Module = Qwen2RMSNorm(d, config.rms_norm_eps, layers)
            self.k_norm_moe_gen: nn.Module = Qwen2RMSNorm(d, config.rms_norm_eps, layers)
        else:
            self.q_norm = self.k_norm = nn.Identity()
            self.q_norm_moe_gen = self.k_norm_moe_gen = nn.Identity()

    def project_qkv(self, x: Tensor, cos: Tensor, sin: Tensor, routing: Routing) -> tuple[Tensor, Tensor, Tensor]:
        """``x [T, H]`` (already input-normed) → ``q [T, Hq, d]``, ``k, v [T, Hkv, d]``; q/k normed then rotated."""
        d = self.head_dim

        def und(z: Tensor) -> Tensor:
            q = self.q_norm(self.q_proj(z).view(-1, self.num_heads, d))
            k = self.k_norm(self.k_proj(z).view(-1, self.num_kv_heads, d))
            v = self.v_proj(z).view(-1, self.num_kv_heads, d)
            return torch.cat([q, k, v], dim=1)

        def gen(z: Tensor) -> Tensor:
            q = self.q_norm_moe_gen(self.q_proj_moe_gen(z).view(-1, self.num_heads, d))
            k = self.k_norm_moe_gen(self.k_proj_moe_gen(z).view(-1, self.num_kv_heads, d))
            v = self.v_proj_moe_gen(z).view(-1, self.num_kv_heads, d)
            return torch.cat([q, k, v], dim=1)

        qkv = routing.apply(und, gen, x)  # [T, Hq + 2*Hkv, d]
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        q = apply_rope(q, cos.to(q.dtype), sin.to(q.dtype))
        k = apply_rope(k, cos.to(k.dtype), sin.to(k.dtype))
        return q.contiguous(), k.contiguous(), v.contiguous()

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, routing: Routing, cache: KVCache, call: AttentionCall
    ) -> Tensor:
        """``x [T, H]`` → attention output after ``o_proj`` ``[T, H]``."""
        q, k, v = self.project_qkv(x, cos, sin, routing)
        out = cache.attend(self.layer_idx, q, k, v, call)
        out = out.reshape(out.shape[0], self.num_heads * self.head_dim).to(x.dtype)
        return routing.apply(self.o_proj, self.o_proj_moe_gen, out)


class Qwen2MoTDecoderLayer(nn.Module):
    """Pre-norm decoder layer with und/gen experts (norms, attention projections, MLP)."""

    def __init__(self, config: LLMConfig, layer_idx: int, layers: LayerBuilder | None = None):
        super().__init__()
        layers = layers or LayerBuilder()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = PackedAttentionMoT(config, layer_idx, layers)
        self.mlp = Qwen2MLP(h, config.intermediate_size, layers)
        self.mlp_moe_gen = Qwen2MLP(h, config.intermediate_size, layers)
        self.input_layernorm = Qwen2RMSNorm(h, eps, layers)
        self.input_layernorm_moe_gen = Qwen2RMSNorm(h, eps, layers)
        self.post_attention_layernorm = Qwen2RMSNorm(h, eps, layers)
        self.post_attention_layernorm_moe_gen = Qwen2RMSNorm(h, eps, layers)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, routing: Routing, cache: KVCache, call: AttentionCall
    ) -> Tensor:
        """``x [T, H]`` → ``[T, H]``."""
        h = routing.apply(self.input_layernorm, self.input_layernorm_moe_gen, x)
        x = x + self.self_attn(h, cos, sin, routing, cache, call)
        h = routing.apply(
            lambda z: self.mlp(self.post_attention_layernorm(z)),
            lambda z: self.mlp_moe_gen(self.post_attention_layernorm_moe_gen(z)),
            x,
        )
        return x + h


@dataclass(frozen=True)
class BranchInput:
    """One packed block of new tokens for one context, as :meth:`Qwen2Model.forward` takes it.

    Attributes:
        embeds: ``[T, H]`` input embeddings of the new tokens.
        positions: ``[T]`` int RoPE positions.
        cache: the context's cache; ``begin_call``/``attend``/``end_call`` are called on it.
        call: what this pass does with the cache.
        gen_mask: ``[T]`` bool, True = token uses the gen expert; ``None`` = all und.
    """

    embeds: Tensor
    positions: Tensor
    cache: KVCache
    call: AttentionCall
    gen_mask: Tensor | None = None


class Qwen2Model(nn.Module):
    """Token embedding, decoder layers and the final norms (``norm`` / ``norm_moe_gen``)."""

    def __init__(self, config: LLMConfig, layers: LayerBuilder | None = None):
        super().__init__()
        layers = layers or LayerBuilder()
        self.config = config
        self.embed_tokens = layers.embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen2MoTDecoderLayer(config, i, layers) for i in range(config.num_hidden_layers))
        self.norm = Qwen2RMSNorm(config.hidden_size, config.rms_norm_eps, layers)
        self.norm_moe_gen = Qwen2RMSNorm(config.hidden_size, config.rms_norm_eps, layers)
        self.rotary_emb = Qwen2RotaryEmbedding(config.head_dim, config.rope_theta, layers.device)

    def forward(
        self,
        embeds: Tensor,
        positions: Tensor,
        cache: KVCache,
        call: AttentionCall,
        gen_mask: Tensor | None = None,
    ) -> Tensor:
        """Run one packed block of new tokens through every layer (arguments as in :class:`BranchInput`).

        Returns:
            ``[T, H]`` final-normed hidden states.
        """
        return self.forward_branches([BranchInput(embeds, positions, cache, call, gen_mask)])[0]

    def forward_branches(
        self, branches: Sequence[BranchInput], *, last_layer_hook: Callable[[int, Tensor], None] | None = None
    ) -> list[Tensor]:
        """Run several blocks, each over its own cache, through the layers together (layer by layer).

        Each block sees exactly what :meth:`forward` would give it alone (same operations on the same
        values); the difference is the order: layer ``i`` runs for every block before layer ``i + 1``, inside
        one :func:`~.operations.shared_upcasts` scope, so a low-precision layer upcasts its weight once for
        all blocks and at most one layer's upcast weights are alive. Caches see ``begin_call`` for every block
        first, then ``attend`` layer by layer, then ``end_call`` for every block (also after an error).
        ``last_layer_hook(b, hidden)``: called with each block's index and its last decoder layer's output
        ``[T_b, H]`` (before the final norm; the hook must not modify it), e.g. to keep it for TaylorSeer.

        Returns:
            ``[T_b, H]`` final-normed hidden states per block, in order.
        """
        caches = [b.cache for b in branches]
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("each block of `forward_branches` needs its own cache; the same cache was given twice")
        prepared = []
        for b in branches:
            if b.embeds.dim() != 2 or b.embeds.shape[1] != self.config.hidden_size:
                raise ValueError(f"`embeds` must be [T, {self.config.hidden_size}], got shape {tuple(b.embeds.shape)}")
            if b.positions.dim() != 1 or b.positions.shape[0] != b.embeds.shape[0]:
                raise ValueError(
                    f"`positions` must be 1-D of length {b.embeds.shape[0]}, got shape {tuple(b.positions.shape)}"
                )
            routing = Routing.from_mask(b.gen_mask, b.embeds.shape[0])
            cos, sin = self.rotary_emb(b.positions.to(b.embeds.device), b.embeds.dtype)
            prepared.append((routing, cos, sin))
        states = [b.embeds for b in branches]
        begun: list[BranchInput] = []
        try:
            for b in branches:
                b.cache.begin_call(b.call)
                begun.append(b)
            for layer in self.layers:
                with shared_upcasts():
                    states = [
                        layer(x, cos, sin, routing, b.cache, b.call)
                        for x, b, (routing, cos, sin) in zip(states, branches, prepared)
                    ]
        finally:
            for b in begun:
                b.cache.end_call(b.call)
        if last_layer_hook is not None:
            for index, x in enumerate(states):
                last_layer_hook(index, x)
        return [routing.apply(self.norm, self.norm_moe_gen, x) for x, (routing, _, _) in zip(states, prepared)]

    def final_norm(self, hidden: Tensor, gen_mask: Tensor | None = None) -> Tensor:
        """The final norms (``norm`` for und tokens, ``norm_moe_gen`` for gen tokens) of a last decoder layer's output
        ``hidden [T, H]`` (``gen_mask`` as in :class:`BranchInput`): what :meth:`forward_branches` returns for it."""
        return Routing.from_mask(gen_mask, hidden.shape[0]).apply(self.norm, self.norm_moe_gen, hidden)


class Qwen2ForCausalLM(nn.Module):
    """``model`` + untied ``lm_head`` (names ``language_model.model.*`` / ``language_model.lm_head``)."""

    def __init__(self, config: LLMConfig, layers: LayerBuilder | None = None):
        super().__init__()
        layers = layers or LayerBuilder()
        self.config = config
        self.model = Qwen2Model(config, layers)
        self.lm_head = layers.output_head(config.hidden_size, config.vocab_size)

    def forward(self, hidden: Tensor) -> Tensor:
        """Final-normed ``hidden [n, H]`` → logits ``[n, V]``."""
        return self.lm_head(hidden)


__all__ = [
    "BranchInput",
    "PackedAttentionMoT",
    "Qwen2ForCausalLM",
    "Qwen2MLP",
    "Qwen2MoTDecoderLayer",
    "Qwen2Model",
    "Qwen2RMSNorm",
    "Qwen2RotaryEmbedding",
    "Routing",
    "apply_rope",
    "rotate_half",
]
