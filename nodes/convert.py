"""ComfyUI tensor formats ↔ the engine's (the only place): IMAGE ``[B,H,W,C]`` float in [0, 1] ↔ PIL, and
BAGEL latents ↔ ComfyUI's FLUX-convention LATENT (``samples = bagel_latent / scale + shift``)."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from unicache_core.bagel import latents as latents_module


def check_image_batch(image, name: str = "image") -> torch.Tensor:
    """A ComfyUI IMAGE: a ``[B, H, W, C]`` tensor with C = 3 (RGBA: alpha dropped), else a ValueError."""
    if not isinstance(image, torch.Tensor) or image.ndim != 4 or image.shape[-1] not in (3, 4):
        shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise ValueError(f"`{name}` must be a ComfyUI IMAGE tensor [batch, height, width, 3], got {shape}")
    if image.shape[0] == 0 or image.shape[1] == 0 or image.shape[2] == 0:
        raise ValueError(f"`{name}` is empty (shape {tuple(image.shape)}); connect a node that outputs an image")
    finite = torch.isfinite(image[..., :3])
    if not bool(finite.all()):
        raise ValueError(f"`{name}` holds {int((~finite).sum())} NaN or infinite values; check the node that made it")
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


def to_comfy_latent(latents: torch.Tensor, config=None) -> torch.Tensor:
    """BAGEL latent ``[B, 16, H/8, W/8]`` (``scale * (raw - shift)``) → ComfyUI FLUX ``samples`` (``raw``).
    ``config``: the loaded checkpoint (its VAE constants); None = FLUX's."""
    return latents_module.to_comfy_latent(latents.float(), config)


def from_comfy_latent(samples: torch.Tensor, config=None) -> torch.Tensor:
    """ComfyUI FLUX ``samples`` → BAGEL's latent (inverse of :func:`to_comfy_latent`)."""
    return latents_module.from_comfy_latent(samples.float(), config)


class ComfyVAEAdapter:
    """ComfyUI's ``VAE`` (core VAELoader, FLUX ae.safetensors) as the engine's external VAE: ``encode``/``decode``
    in BAGEL's latent convention on ``[1, 3, H, W]`` images in [-1, 1]
    (:class:`unicache_core.bagel.latents.VAEAdapter`). ComfyUI loads and offloads the VAE itself inside its
    ``encode``/``decode``."""

    def __init__(self, vae, config=None):
        if not (callable(getattr(vae, "encode", None)) and callable(getattr(vae, "decode", None))):
            raise ValueError(f"`vae` must be a ComfyUI VAE (from the core VAELoader node), got {type(vae).__name__}")
        self.vae, self.config = vae, config

    def encode(self, image: torch.Tensor) -> torch.Tensor:
        pixels = ((image.float() + 1.0) / 2.0).clamp(0, 1).permute(0, 2, 3, 1).cpu()
        return from_comfy_latent(self.vae.encode(pixels).float().cpu(), self.config)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        pixels = self.vae.decode(to_comfy_latent(z, self.config)).float().cpu()  # [B, H, W, 3] in [0, 1]
        if pixels.ndim == 5:  # some ComfyUI VAEs return [B, T, H, W, C]
            pixels = pixels.reshape(-1, *pixels.shape[-3:])
        return pixels[..., :3].permute(0, 3, 1, 2) * 2.0 - 1.0


__all__ = [
    "ComfyVAEAdapter",
    "check_image_batch",
    "from_comfy_latent",
    "image_to_pils",
    "pils_to_image",
    "to_comfy_latent",
]
