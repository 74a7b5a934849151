"""The VAE decode in overlapping tiles: a large image's decode within a small device's memory.

A whole decode of a 1024 px image holds 4.3 GB of fp32 activations (4.6 GB on CUDA); one of :data:`TILE_CELLS`
latent cells a side (512 px) holds a quarter of that. Tiles overlap by :data:`OVERLAP_CELLS` cells and are
blended with linear ramps across the overlap, the way ComfyUI's tiled VAE decode works (its defaults: 64 cells,
16 overlap). The result is close to the whole decode, not equal: the decoder's middle block attends over the
tile instead of the whole latent, and its GroupNorms take their statistics per tile.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Latent cells per tile side (x 8 px with FLUX's VAE: 512 px tiles).
TILE_CELLS = 64
#: Latent cells two neighbouring tiles share (blended by linear ramps).
OVERLAP_CELLS = 16


def tile_starts(length: int, tile: int = TILE_CELLS, overlap: int = OVERLAP_CELLS) -> list[int]:
    """Start offsets of tiles of ``tile`` cells that cover ``length`` cells, neighbours sharing ``overlap``
    (the last tile ends at ``length``; one tile when ``length <= tile``)."""
    if not 0 <= overlap < tile:
        raise ValueError(f"a tile overlap must be in [0, tile), got overlap {overlap} for tile {tile}")
    if length <= tile:
        return [0]
    starts = list(range(0, length - tile, tile - overlap))
    return starts + [length - tile] if starts[-1] != length - tile else starts


def _ramp(size: int, fade_in: int, fade_out: int, device: torch.device) -> Tensor:
    """``[size]`` blend weights: rising over the first ``fade_in`` samples, falling over the last ``fade_out``,
    1 between (0 widths at the image's border)."""
    weight = torch.ones(size, device=device)
    position = torch.arange(size, device=device, dtype=torch.float32)
    if fade_in:
        weight = torch.minimum(weight, (position + 0.5) / fade_in)
    if fade_out:
        weight = torch.minimum(weight, (size - position - 0.5) / fade_out)
    return weight


def decode_tiled(vae, z: Tensor, tile: int = TILE_CELLS, overlap: int = OVERLAP_CELLS) -> Tensor:
    """``vae.decode`` of ``z`` ``[B, C, h, w]`` tile by tile → ``[B, 3, h*ds, w*ds]`` (``ds`` = the VAE's
    downsample), blending the overlaps. Holds one tile's decode at a time besides the fp32 output."""
    batch, _, height, width = z.shape
    ds = vae.config.downsample
    rows, cols = tile_starts(height, tile, overlap), tile_starts(width, tile, overlap)
    out: Tensor | None = None
    weights: Tensor | None = None
    for top in rows:
        for left in cols:
            bottom, right = min(top + tile, height), min(left + tile, width)
            pixels = vae.decode(z[:, :, top:bottom, left:right]).float()
            if out is None or weights is None:  # the first tile: the output's channels are known now
                out = torch.zeros(batch, pixels.shape[1], height * ds, width * ds, device=pixels.device)
                weights = torch.zeros(1, 1, height * ds, width * ds, device=pixels.device)
            fade = overlap * ds
            w_rows = _ramp(pixels.shape[2], fade if top else 0, fade if bottom < height else 0, pixels.device)
            w_cols = _ramp(pixels.shape[3], fade if left else 0, fade if right < width else 0, pixels.device)
            blend = w_rows[:, None] * w_cols[None, :]
            out[:, :, top * ds : bottom * ds, left * ds : right * ds] += pixels * blend
            weights[:, :, top * ds : bottom * ds, left * ds : right * ds] += blend
            del pixels
    assert out is not None and weights is not None  # tile_starts gives at least one tile a side
    return out / weights


def tiled_decode_extra_bytes(height_px: int, width_px: int, channels: int = 3) -> int:
    """Bytes a tiled decode holds besides one tile's decode: the fp32 output and its blend weights."""
    return (channels + 1) * height_px * width_px * 4


__all__ = ["OVERLAP_CELLS", "TILE_CELLS", "decode_tiled", "tile_starts", "tiled_decode_extra_bytes"]
