"""ComfyUI tensor formats ↔ the engine's (the only place): IMAGE ``[B,H,W,C]`` float in [0, 1] ↔ PIL, and
BAGEL latents ↔ ComfyUI's FLUX-convention LATENT (``samples = bagel_latent / scale + shift``)."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

#: BAGEL's FLUX VAE constants (``AEConfig`` defaults); used when no loaded VAE config is at hand.
FLUX_SCALE = 0.3611
FLUX_SHIFT = 0.1159


def check_image_batch(image, name: str = "image") -> torch.Tensor:
    """A ComfyUI IMAGE: a ``[B, H, W, C]`` tensor with C = 3 (RGBA: alpha dropped), else a ValueError."""
    if not isinstance(image, torch.Tensor) or image.ndim != 4 or image.shape[-1] not in (3, 4):
        shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise ValueError(f"`{name}` must be a ComfyUI IMAGE tensor [batch, height, width, 3], got {shape}")
    if image.shape[0] == 0 or image.shape[1] == 0 or image.shape[2] == 0:
        raise ValueError(f"`{name}` is empty (shape {tuple(image.shape)}); connect a node that outputs an image")
    return image[..., :3]


def image_to_pils(image: torch.Tensor, name: str = "image") -> list[Image.Image]:
    """IMAGE ``[B, H, W, C]`` → one RGB PIL image per batch item (values clamped to [0, 1])."""
    batch = check_image_batch(image, name)
    arrays = (batch.detach().float().clamp(0, 1).cpu().numpy() * 255.0).round().astype(np.uint8)
    return [Image.fromarray(a, mode="RGB") for a in arrays]


def pils_to_image(images: list[Image.Image]) -> torch.Tensor:
    """RGB PIL images of one size → IMAGE ``[B, H, W, 3]`` float32 in [0, 1]."""
    arrays = [np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0 for img in images]
    return torch.from_numpy(np.stack(arrays, axis=0))


def to_comfy_latent(latents: torch.Tensor, scale: float = FLUX_SCALE, shift: float = FLUX_SHIFT) -> torch.Tensor:
    """BAGEL latent ``[B, 16, H/8, W/8]`` (``scale * (z - shift)``) → ComfyUI FLUX ``samples`` (``z``)."""
    return latents.float() / scale + shift


def from_comfy_latent(samples: torch.Tensor, scale: float = FLUX_SCALE, shift: float = FLUX_SHIFT) -> torch.Tensor:
    """ComfyUI FLUX ``samples`` → BAGEL's scaled latent (inverse of :func:`to_comfy_latent`)."""
    return scale * (samples.float() - shift)


__all__ = ["FLUX_SCALE", "FLUX_SHIFT", "check_image_batch", "from_comfy_latent", "image_to_pils", "pils_to_image",
           "to_comfy_latent"]
