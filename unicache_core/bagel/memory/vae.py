"""The VAE's working memory of a request, from its latent size alone: a whole encode or decode, and the tiled
decode of :mod:`.modeling.vae_tiling` (the memory plan's ``vae_working`` and the node's estimate).
"""

from __future__ import annotations

import functools
import math

import torch

from ..config import BagelConfig


def tiled_tokens(config: BagelConfig, latent_tokens: int) -> int:
    """BAGEL latent tokens of one tile of :func:`~.modeling.vae_tiling.decode_tiled` (at most the image's)."""
    from ..modeling.vae_tiling import TILE_CELLS

    side = TILE_CELLS * config.ae.downsample // config.latent_downsample
    return min(latent_tokens, side * side)


def tiled_decode_bytes(config: BagelConfig, latent_tokens: int) -> int:
    """Peak bytes of the tiled decode of ``latent_tokens`` BAGEL latent tokens: one tile's decode plus the fp32
    output and blend weights of the whole image (:func:`~.modeling.vae_tiling.tiled_decode_extra_bytes`)."""
    from ..modeling.vae_tiling import tiled_decode_extra_bytes

    if latent_tokens <= 0:
        return 0
    pixels = latent_tokens * config.latent_downsample**2
    return vae_working_bytes(config, tiled_tokens(config, latent_tokens), decode=True) + tiled_decode_extra_bytes(
        pixels, 1
    )


def _latent_grid(latent_tokens: int, latent_downsample: int, vae_downsample: int) -> tuple[int, int]:
    """A ``(height, width)`` in VAE latent cells holding ``latent_tokens`` BAGEL latent tokens, as square as the
    count allows (a convolution's memory depends on the area only)."""
    rows = max(d for d in range(1, math.isqrt(latent_tokens) + 1) if latent_tokens % d == 0)
    cells = latent_downsample // vae_downsample
    return rows * cells, (latent_tokens // rows) * cells


@functools.lru_cache(maxsize=64)
def _vae_trace(config: BagelConfig, latent_tokens: int, decode: bool):
    """The VAE's decode (or encode) of ``latent_tokens`` (> 0) BAGEL latent tokens, run once on meta tensors
    (:func:`~.trace.meta_trace`: nothing is allocated)."""
    from ..modeling import AutoEncoder
    from .trace import meta_trace

    ae = config.ae
    height, width = _latent_grid(latent_tokens, config.latent_downsample, ae.downsample)
    with torch.device("meta"):
        vae = AutoEncoder(ae)
    if decode:
        latent = torch.zeros(1, ae.z_channels, height, width, device="meta")
        return meta_trace(lambda: vae.decode(latent))
    image = torch.zeros(1, ae.in_channels, height * ae.downsample, width * ae.downsample, device="meta")
    return meta_trace(lambda: vae.encode(image, sample=False))


def vae_working_bytes(config: BagelConfig, latent_tokens: int, *, decode: bool) -> int:
    """Peak bytes of the fp32 tensors the VAE creates decoding (or encoding) an image of ``latent_tokens``
    BAGEL latent tokens (``16 x 16`` pixels each), measured on meta tensors (nothing is allocated)."""
    return _vae_trace(config, latent_tokens, decode).peak_bytes if latent_tokens > 0 else 0


def vae_activation_below(config: BagelConfig, latent_tokens: int, limit: int, *, decode: bool) -> int:
    """Bytes of the largest tensor under ``limit`` bytes that the VAE's decode (or encode) of ``latent_tokens``
    BAGEL latent tokens creates (recorded on meta tensors; 0 without any)."""
    if latent_tokens <= 0:
        return 0
    return max((size for size in _vae_trace(config, latent_tokens, decode).storage_sizes if size < limit), default=0)


def vae_convolution_shapes(config: BagelConfig, latent_tokens: int, *, decode: bool) -> frozenset:
    """The distinct convolutions (input shape, weight shape, stride, padding) of the VAE's decode (or encode) of
    ``latent_tokens`` BAGEL latent tokens, recorded on meta tensors."""
    return _vae_trace(config, latent_tokens, decode).convolutions if latent_tokens > 0 else frozenset()


__all__ = [
    "tiled_decode_bytes",
    "tiled_tokens",
    "vae_activation_below",
    "vae_convolution_shapes",
    "vae_working_bytes",
]
