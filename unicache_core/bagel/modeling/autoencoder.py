"""FLUX autoencoder (BAGEL's VAE, docs/bagel.md §2.8), inference only, always run in fp32.

Names equal the keys of ``ae.safetensors`` (``encoder.*``, ``decoder.*``). GroupNorm uses 32 groups
and eps 1e-6; downsampling pads asymmetrically (right/bottom by one) before a stride-2 conv;
upsampling is nearest ×2 followed by a conv; the middle block has single-head self-attention. Convolutions
and GroupNorms come from the build's operations namespace (:mod:`.operations`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..config import AEConfig
from .operations import LayerBuilder, check_compute_dtype


def swish(x: Tensor) -> Tensor:
    return x * torch.sigmoid(x)


def _group_norm(channels: int, layers: LayerBuilder) -> nn.Module:
    return layers.group_norm(32, channels, eps=1e-6)


class AttnBlock(nn.Module):
    """Single-head spatial self-attention with 1×1 conv projections and a residual."""

    def __init__(self, channels: int, layers: LayerBuilder):
        super().__init__()
        self.norm = _group_norm(channels, layers)
        self.q = layers.conv2d(channels, channels, 1)
        self.k = layers.conv2d(channels, channels, 1)
        self.v = layers.conv2d(channels, channels, 1)
        self.proj_out = layers.conv2d(channels, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        """``x [B, C, h, w]`` → same shape."""
        b, c, h, w = x.shape
        hn = self.norm(x)
        q, k, v = (proj(hn).flatten(2).transpose(1, 2).unsqueeze(1) for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v)  # [B, 1, h*w, C]
        out = out.squeeze(1).transpose(1, 2).reshape(b, c, h, w)
        return x + self.proj_out(out)


class ResnetBlock(nn.Module):
    """GroupNorm → swish → conv, twice, plus a (1×1-projected when channels change) shortcut."""

    def __init__(self, in_channels: int, out_channels: int, layers: LayerBuilder):
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.norm1 = _group_norm(in_channels, layers)
        self.conv1 = layers.conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = _group_norm(out_channels, layers)
        self.conv2 = layers.conv2d(out_channels, out_channels, 3, padding=1)
        if in_channels != out_channels:
            self.nin_shortcut = layers.conv2d(in_channels, out_channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(swish(self.norm2(h)))
        if self.in_channels != self.out_channels:
            x = self.nin_shortcut(x)
        return x + h


class Downsample(nn.Module):
    """Zero-pad right/bottom by one, then 3×3 stride-2 conv: ``[B,C,H,W]`` → ``[B,C,H/2,W/2]``."""

    def __init__(self, channels: int, layers: LayerBuilder):
        super().__init__()
        self.conv = layers.conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1), mode="constant", value=0.0))


class Upsample(nn.Module):
    """Nearest ×2 then 3×3 conv."""

    def __init__(self, channels: int, layers: LayerBuilder):
        super().__init__()
        self.conv = layers.conv2d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class _Level(nn.Module):
    """One resolution level: ``block`` (ResnetBlocks), then its ``downsample`` (the encoder's levels but the last)
    or ``upsample`` (the decoder's levels but the first) when it has one."""

    def __init__(
        self, blocks: Sequence[nn.Module], *, downsample: nn.Module | None = None, upsample: nn.Module | None = None
    ):
        super().__init__()
        self.block = nn.ModuleList(blocks)
        # registered only when given (state-dict keys ``block.*`` then ``downsample.*``/``upsample.*``)
        self.downsample = downsample
        self.upsample = upsample


class _Mid(nn.Module):
    def __init__(self, channels: int, layers: LayerBuilder):
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels, layers)
        self.attn_1 = AttnBlock(channels, layers)
        self.block_2 = ResnetBlock(channels, channels, layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.block_2(self.attn_1(self.block_1(x)))


class Encoder(nn.Module):
    """Image ``[B, in_ch, H, W]`` → moments ``[B, 2*z, H/ds, W/ds]``."""

    def __init__(self, cfg: AEConfig, layers: LayerBuilder):
        super().__init__()
        self.conv_in = layers.conv2d(cfg.in_channels, cfg.ch, 3, padding=1)
        mults = (1,) + tuple(cfg.ch_mult)
        self.down = nn.ModuleList()
        block_in = cfg.ch
        for level, mult in enumerate(cfg.ch_mult):
            block_in = cfg.ch * mults[level]
            block_out = cfg.ch * mult
            blocks = []
            for _ in range(cfg.num_res_blocks):
                blocks.append(ResnetBlock(block_in, block_out, layers))
                block_in = block_out
            last = level == len(cfg.ch_mult) - 1
            self.down.append(_Level(blocks, downsample=None if last else Downsample(block_in, layers)))
        self.mid = _Mid(block_in, layers)
        self.norm_out = _group_norm(block_in, layers)
        self.conv_out = layers.conv2d(block_in, 2 * cfg.z_channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv_in(x)
        # stage by stage in this frame, so that each block's input is freed as soon as the block returns
        for stage in cast("list[_Level]", list(self.down)):  # built of _Level stages
            for block in stage.block:
                h = block(h)
            if stage.downsample is not None:
                h = stage.downsample(h)
        h = self.mid(h)
        return self.conv_out(swish(self.norm_out(h)))


class Decoder(nn.Module):
    """Latent ``[B, z, h, w]`` → image ``[B, out_ch, h*ds, w*ds]``."""

    def __init__(self, cfg: AEConfig, layers: LayerBuilder):
        super().__init__()
        n = len(cfg.ch_mult)
        block_in = cfg.ch * cfg.ch_mult[-1]
        self.conv_in = layers.conv2d(cfg.z_channels, block_in, 3, padding=1)
        self.mid = _Mid(block_in, layers)
        stages: list[_Level] = []
        for level in reversed(range(n)):
            block_out = cfg.ch * cfg.ch_mult[level]
            blocks = []
            for _ in range(cfg.num_res_blocks + 1):
                blocks.append(ResnetBlock(block_in, block_out, layers))
                block_in = block_out
            stages.insert(0, _Level(blocks, upsample=Upsample(block_in, layers) if level != 0 else None))
        self.up = nn.ModuleList(stages)
        self.norm_out = _group_norm(block_in, layers)
        self.conv_out = layers.conv2d(block_in, cfg.out_ch, 3, padding=1)

    def forward(self, z: Tensor) -> Tensor:
        h = self.mid(self.conv_in(z))
        for stage in reversed(cast("list[_Level]", list(self.up))):  # built of _Level stages, as in Encoder
            for block in stage.block:
                h = block(h)
            if stage.upsample is not None:
                h = stage.upsample(h)
        return self.conv_out(swish(self.norm_out(h)))


class AutoEncoder(nn.Module):
    """FLUX VAE with BAGEL's scale/shift (``z = scale * (sample - shift)``).

    ``operations``, ``dtype`` and ``device`` are as for :class:`~.bagel.Bagel`; ``compute_dtype`` (default
    ``dtype``, else torch's default dtype) is the dtype inputs are brought to before the network.
    """

    def __init__(
        self,
        config: AEConfig | None = None,
        *,
        operations: Any = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        compute_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        layers = LayerBuilder.create(operations, dtype, device, compute_dtype)
        self.compute_dtype = check_compute_dtype(layers.own_dtype)
        self.config = config or AEConfig()
        self.encoder = Encoder(self.config, layers)
        self.decoder = Decoder(self.config, layers)
        self.scale_factor = self.config.scale_factor
        self.shift_factor = self.config.shift_factor

    def encode_moments(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x [B, 3, H, W]`` in [-1, 1] → ``(mean, logvar)`` each ``[B, z, H/ds, W/ds]``."""
        mean, logvar = torch.chunk(self.encoder(x.to(self.compute_dtype)), 2, dim=1)
        return mean, logvar

    def encode(
        self,
        x: Tensor,
        *,
        noise: Tensor | None = None,
        generator: torch.Generator | None = None,
        sample: bool = True,
    ) -> Tensor:
        """Encode and sample a scaled latent.

        Args:
            x: ``[B, 3, H, W]`` image in [-1, 1]; H and W multiples of ``downsample``.
            noise: ``[B, z, H/ds, W/ds]`` standard-normal noise to use; drawn with
                ``torch.randn(mean.shape, generator=generator, dtype=mean.dtype)`` when ``None``.
            generator: RNG for the drawn noise (``None`` = global RNG, as the official code).
            sample: ``False`` returns the scaled mean (no noise).

        Returns:
            ``z [B, z, H/ds, W/ds]`` = ``scale * (mean + exp(0.5*logvar) * noise - shift)``.
        """
        if x.dim() != 4 or x.shape[1] != self.config.in_channels:
            raise ValueError(f"`x` must be [B, {self.config.in_channels}, H, W], got shape {tuple(x.shape)}")
        ds = self.config.downsample
        if x.shape[2] % ds or x.shape[3] % ds:
            raise ValueError(f"image height/width {tuple(x.shape[2:])} must be multiples of {ds}")
        mean, logvar = self.encode_moments(x)
        if sample:
            if noise is None:
                device = generator.device if generator is not None else mean.device
                noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype, device=device)
            elif noise.shape != mean.shape:
                raise ValueError(f"`noise` must have shape {tuple(mean.shape)}, got {tuple(noise.shape)}")
            z = mean + torch.exp(0.5 * logvar) * noise.to(mean.device, mean.dtype)
        else:
            z = mean
        return self.scale_factor * (z - self.shift_factor)

    def decode(self, z: Tensor) -> Tensor:
        """``z [B, z, h, w]`` → image ``[B, 3, h*ds, w*ds]`` in about [-1, 1]."""
        if z.dim() != 4 or z.shape[1] != self.config.z_channels:
            raise ValueError(f"`z` must be [B, {self.config.z_channels}, h, w], got shape {tuple(z.shape)}")
        z = z.to(self.compute_dtype)
        return self.decoder(z / self.scale_factor + self.shift_factor)


__all__ = ["AutoEncoder"]
