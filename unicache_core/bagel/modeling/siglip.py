"""SigLIP NaViT vision encoder as BAGEL uses it (docs/bagel.md §2.4), inference only.

Input is a packed sequence of flattened patches ``[N, p*p*3]`` (feature order ``(row, col, channel)``
inside a patch) with one learned absolute position id per patch (``row * 70 + col``). Several images
can be packed; attention is full (bidirectional) inside each image only.

Names equal the ``vit_model.*`` keys of ``ema.safetensors``: the patch embedding is stored as a Linear
``[Hv, 3*p*p]`` (BAGEL converts the conv before saving). Every layer comes from the build's operations
namespace (:mod:`.operations`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..config import ViTConfig
from .operations import LayerBuilder


def gelu_activation(name: str):
    """``gelu_pytorch_tanh`` → tanh-approximated GELU; ``gelu`` → exact GELU."""
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    raise ValueError(f"unsupported activation {name!r}; allowed: 'gelu_pytorch_tanh', 'gelu'")


class SiglipVisionEmbeddings(nn.Module):
    """Linear patch embedding + learned position table ``[(image_size/patch)^2, Hv]``."""

    def __init__(self, config: ViTConfig, layers: LayerBuilder | None = None):
        super().__init__()
        layers = layers or LayerBuilder()
        self.patch_embedding = layers.linear(config.num_channels * config.patch_size**2, config.hidden_size)
        self.position_embedding = layers.embedding(config.num_positions, config.hidden_size)

    def forward(self, patches: Tensor, position_ids: Tensor) -> Tensor:
        """``patches [N, 3*p*p]``, ``position_ids [N]`` → ``[N, Hv]``."""
        x = self.patch_embedding(patches)
        return x + self.position_embedding(position_ids, out_dtype=x.dtype)


class SiglipAttention(nn.Module):
    """Multi-head self-attention with biases, bidirectional within each packed image."""

    def __init__(self, config: ViTConfig, layers: LayerBuilder | None = None):
        super().__init__()
        layers = layers or LayerBuilder()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        hv = config.hidden_size
        self.q_proj = layers.linear(hv, hv)
        self.k_proj = layers.linear(hv, hv)
        self.v_proj = layers.linear(hv, hv)
        self.out_proj = layers.linear(hv, hv)

    def forward(self, x: Tensor, seqlens: Sequence[int]) -> Tensor:
        """``x [N, Hv]`` packed over images of lengths ``seqlens`` → ``[N, Hv]``."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(n, self.num_heads, self.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(n, self.num_heads, self.head_dim).transpose(0, 1)
        lengths = set(seqlens)
        if len(lengths) == 1:  # images of one size (a training batch): one call over [images, heads, L, d]
            length = lengths.pop()

            def split(t: Tensor) -> Tensor:
                return t.reshape(self.num_heads, n // length, length, self.head_dim).transpose(0, 1)

            out = F.scaled_dot_product_attention(split(q), split(k), split(v))  # [images, heads, L, d]
            out = out.transpose(0, 1).reshape(self.num_heads, n, self.head_dim)
        else:
            outs = []
            start = 0
            for length in seqlens:
                sl = slice(start, start + length)
                outs.append(F.scaled_dot_product_attention(q[:, sl], k[:, sl], v[:, sl]))
                start += length
            out = torch.cat(outs, dim=1)
        return self.out_proj(out.transpose(0, 1).reshape(n, -1))


class SiglipMLP(nn.Module):
    """``fc2(gelu_tanh(fc1(x)))``."""

    def __init__(self, config: ViTConfig, layers: LayerBuilder | None = None):
        super().__init__()
        layers = layers or LayerBuilder()
        self.act = gelu_activation(config.hidden_act)
        self.fc1 = layers.linear(config.hidden_size, config.intermediate_size)
        self.fc2 = layers.linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    """Pre-LN transformer layer."""

    def __init__(self, config: ViTConfig, layers: LayerBuilder | None = None):
        super().__init__()
        layers = layers or LayerBuilder()
        self.layer_norm1 = layers.layer_norm(config.hidden_size, config.layer_norm_eps)
        self.self_attn = SiglipAttention(config, layers)
        self.layer_norm2 = layers.layer_norm(config.hidden_size, config.layer_norm_eps)
        self.mlp = SiglipMLP(config, layers)

    def forward(self, x: Tensor, seqlens: Sequence[int]) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x), seqlens)
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, config: ViTConfig, layers: LayerBuilder | None = None):
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(config, layers) for _ in range(config.num_hidden_layers))

    def forward(self, x: Tensor, seqlens: Sequence[int]) -> Tensor:
        for layer in self.layers:
            x = layer(x, seqlens)
        return x


class SiglipVisionTransformer(nn.Module):
    """embeddings → encoder → post_layernorm."""

    def __init__(self, config: ViTConfig, layers: LayerBuilder | None = None):
        super().__init__()
        layers = layers or LayerBuilder()
        self.embeddings = SiglipVisionEmbeddings(config, layers)
        self.encoder = SiglipEncoder(config, layers)
        self.post_layernorm = layers.layer_norm(config.hidden_size, config.layer_norm_eps)

    def forward(self, patches: Tensor, position_ids: Tensor, seqlens: Sequence[int]) -> Tensor:
        return self.post_layernorm(self.encoder(self.embeddings(patches, position_ids), seqlens))


class SiglipVisionModel(nn.Module):
    """Wrapper holding ``vision_model`` (so keys read ``vit_model.vision_model.*``)."""

    def __init__(self, config: ViTConfig, layers: LayerBuilder | None = None):
        super().__init__()
        self.config = config
        self.vision_model = SiglipVisionTransformer(config, layers)

    def forward(self, patches: Tensor, position_ids: Tensor, seqlens: Sequence[int] | None = None) -> Tensor:
        """Encode packed patches.

        Args:
            patches: ``[N, 3*p*p]`` flattened patches (``(row, col, channel)`` order within a patch).
            position_ids: ``[N]`` int ids into the learned position table.
            seqlens: tokens per image (sum = N); ``None`` = one image.

        Returns:
            ``[N, Hv]`` post-layernormed features.
        """
        if patches.dim() != 2:
            raise ValueError(f"`patches` must be [N, 3*p*p], got shape {tuple(patches.shape)}")
        if seqlens is None:
            seqlens = [patches.shape[0]]
        if sum(seqlens) != patches.shape[0]:
            raise ValueError(f"`seqlens` {list(seqlens)} must sum to the number of patches {patches.shape[0]}")
        return self.vision_model(patches, position_ids, seqlens)


__all__ = ["SiglipVisionModel", "gelu_activation"]
