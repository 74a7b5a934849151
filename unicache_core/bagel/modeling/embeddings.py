"""BAGEL's small heads: 2-D sin-cos position tables, the timestep embedder and the ViT connector.

Names equal the checkpoint keys: ``vit_pos_embed.pos_embed``, ``latent_pos_embed.pos_embed``,
``time_embedder.mlp.{0,2}.*``, ``connector.fc{1,2}.*`` (docs/bagel.md §1.2, §2.5–2.6).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor, nn

from .operations import LayerBuilder
from .siglip import gelu_activation


def sincos_1d(embed_dim: int, pos: np.ndarray) -> np.ndarray:
    """``pos [M]`` → ``[M, embed_dim]`` = ``[sin(pos*ω), cos(pos*ω)]``, ``ω_j = 10000^(-j/(embed_dim/2))``."""
    if embed_dim % 2:
        raise ValueError(f"`embed_dim` must be even, got {embed_dim}")
    omega = np.arange(embed_dim // 2, dtype=np.float64) / (embed_dim / 2.0)
    omega = 1.0 / 10000**omega
    angles = np.outer(pos.reshape(-1).astype(np.float64), omega)
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)


def sincos_2d_table(embed_dim: int, grid_size: int) -> np.ndarray:
    """2-D sin-cos table ``[grid_size**2, embed_dim]`` (float64), row index ``k = row*G + col``.

    Matches the official ``get_2d_sincos_pos_embed``: its meshgrid puts the *column* coordinate
    first, so the first ``embed_dim/2`` channels encode the column and the last half the row.
    """
    if embed_dim % 4:
        raise ValueError(f"`embed_dim` must be a multiple of 4, got {embed_dim}")
    rows, cols = np.meshgrid(np.arange(grid_size), np.arange(grid_size), indexing="ij")
    first = sincos_1d(embed_dim // 2, cols.astype(np.float32))
    second = sincos_1d(embed_dim // 2, rows.astype(np.float32))
    return np.concatenate([first, second], axis=1)


class PositionEmbedding(nn.Module):
    """Frozen 2-D sin-cos table ``pos_embed [G*G, H]`` (stored in the checkpoint, kept in the compute dtype).

    The rows are looked up where the table is and moved to the ids' device, so a host that leaves the table
    on its offload device moves only the rows a call needs.
    """

    def __init__(self, max_num_patch_per_side: int, hidden_size: int, layers: LayerBuilder | None = None):
        super().__init__()
        layers = layers or LayerBuilder()
        self.max_num_patch_per_side = max_num_patch_per_side
        self.hidden_size = hidden_size
        self.pos_embed = layers.own_parameter((max_num_patch_per_side**2, hidden_size), 0.0, trainable=False)

    def reset_table(self) -> None:
        """Fill ``pos_embed`` with the exact sin-cos values (fp32, then the parameter's dtype)."""
        table = torch.from_numpy(sincos_2d_table(self.hidden_size, self.max_num_patch_per_side)).float()
        with torch.no_grad():
            self.pos_embed.copy_(table.to(self.pos_embed.dtype))

    def forward(self, position_ids: Tensor) -> Tensor:
        """``position_ids [N]`` → ``[N, H]`` on ``position_ids``' device."""
        table = self.pos_embed
        return table[position_ids.to(table.device)].to(position_ids.device)


class TimestepEmbedder(nn.Module):
    """DiT timestep embedder: ``[cos(t*f), sin(t*f)]`` (256 dims) → Linear → SiLU → Linear."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256, layers: LayerBuilder | None = None):
        super().__init__()
        layers = layers or LayerBuilder()
        self.frequency_embedding_size = frequency_embedding_size
        self.mlp = nn.Sequential(
            layers.linear(frequency_embedding_size, hidden_size),
            nn.SiLU(),
            layers.linear(hidden_size, hidden_size),
        )

    @staticmethod
    def frequency_embedding(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
        """``t [N]`` (flow time, not scaled) → fp32 ``[N, dim]``, cosines first."""
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t.float()[:, None] * freqs[None]
        emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
        return emb

    def forward(self, t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """``t [N]`` → ``[N, H]``, computed in ``dtype`` (``None``: the fp32 frequency embedding as it is)."""
        freq = self.frequency_embedding(t, self.frequency_embedding_size)
        return self.mlp(freq if dtype is None else freq.to(dtype))


class MLPconnector(nn.Module):
    """ViT → LLM connector ``fc2(act(fc1(x)))`` (Hv → H → H)."""

    def __init__(self, in_dim: int, out_dim: int, hidden_act: str, layers: LayerBuilder | None = None):
        super().__init__()
        layers = layers or LayerBuilder()
        self.act = gelu_activation(hidden_act)
        self.fc1 = layers.linear(in_dim, out_dim)
        self.fc2 = layers.linear(out_dim, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


__all__ = ["MLPconnector", "PositionEmbedding", "TimestepEmbedder", "sincos_1d", "sincos_2d_table"]
