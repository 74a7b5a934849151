"""BAGEL latents and ComfyUI's FLUX ``LATENT`` convention; the external-VAE protocol of the pipeline.

Two conventions for the same ``[1, 16, H/8, W/8]`` FLUX VAE latent:

* **BAGEL's** (this engine, :class:`~.modeling.AutoEncoder`, ``GenerationResult.latents``):
  ``z = scale_factor * (raw - shift_factor)``, what BAGEL's flow model generates (patchified 2x2 to
  64 channels inside);
* **ComfyUI's** ``LATENT["samples"]`` for FLUX: the *raw* VAE latent (``VAEEncode`` outputs it,
  ``VAEDecode`` takes it; ComfyUI applies the scale/shift itself inside its samplers), so
  ``raw = z / scale_factor + shift_factor``.

The FLUX constants are ``scale_factor = 0.3611`` and ``shift_factor = 0.1159`` (BAGEL hard-codes
them in ``load_ae``); a checkpoint whose ``ae_config.json`` sets others uses its own: pass the
config (a :class:`~.config.BagelConfig`, :class:`~.config.AEConfig` or a loaded checkpoint) to the helpers.

Note: ComfyUI's ``VAEEncode`` gives the posterior **mean**, while BAGEL's official edit encodes with a
**sample** (``mean + std * noise``); with the real VAE's tiny posterior std the two differ little, but
an edit from a ComfyUI latent is not bit-identical to the official one.

An external VAE (e.g. ComfyUI's ``VAE`` wrapped by the node pack) is any object with
:class:`VAEAdapter`'s two methods, in BAGEL's convention. A wrapper of ComfyUI's VAE looks like::

    class ComfyVAE:
        def __init__(self, vae):
            self.vae = vae
        def encode(self, image):            # [1,3,H,W] in [-1,1] -> [1,16,H/8,W/8] (BAGEL)
            raw = self.vae.encode(((image + 1) / 2).permute(0, 2, 3, 1))
            return from_comfy_latent(raw)
        def decode(self, z):                # [1,16,h,w] (BAGEL) -> [1,3,8h,8w] in [-1,1]
            pixels = self.vae.decode(to_comfy_latent(z))        # [1,H,W,3] in [0,1]
            return pixels.permute(0, 3, 1, 2) * 2 - 1
"""

from __future__ import annotations

from typing import Any, Protocol, TypeGuard, runtime_checkable

from torch import Tensor

#: FLUX VAE latent scale and shift (BAGEL's ``load_ae``; ComfyUI's ``latent_formats.Flux``).
FLUX_SCALE_FACTOR = 0.3611
FLUX_SHIFT_FACTOR = 0.1159


@runtime_checkable
class VAEAdapter(Protocol):
    """An external VAE for :class:`~.pipeline.BagelPipeline` (used instead of the checkpoint's own).

    Both methods work in BAGEL's latent convention (see the module docstring) on float tensors; the
    pipeline passes CPU fp32 tensors and moves the results where it needs them.
    """

    def encode(self, image: Tensor) -> Tensor:
        """``[1, 3, H, W]`` image in ``[-1, 1]`` → ``[1, 16, H/8, W/8]`` latent (posterior mean or a sample)."""
        ...

    def decode(self, z: Tensor) -> Tensor:
        """``[1, 16, h, w]`` latent → ``[1, 3, 8h, 8w]`` image in about ``[-1, 1]``."""
        ...


def _is_number(value: object) -> TypeGuard[int | float]:
    """A Python int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def latent_factors(config: Any = None) -> tuple[float, float]:
    """``(scale_factor, shift_factor)`` of ``config``, FLUX's when ``config`` is None.

    ``config``: an :class:`~.config.AEConfig`, a :class:`~.config.BagelConfig` (its ``ae``), a loaded
    checkpoint (its ``config.ae``) or an :class:`~.modeling.AutoEncoder`.
    """
    if config is None:
        return FLUX_SCALE_FACTOR, FLUX_SHIFT_FACTOR
    obj = config
    for _ in range(3):  # LoadedBagel -> BagelConfig -> AEConfig
        if hasattr(obj, "scale_factor"):
            break
        obj = getattr(obj, "ae", None) if hasattr(obj, "ae") else getattr(obj, "config", None)
    scale, shift = getattr(obj, "scale_factor", None), getattr(obj, "shift_factor", None)
    if not (_is_number(scale) and _is_number(shift)) or scale <= 0:
        raise ValueError(
            f"`config` ({type(config).__name__}) has no usable scale_factor/shift_factor; pass an "
            f"AEConfig, a BagelConfig, a loaded checkpoint or None (FLUX's constants)"
        )
    return float(scale), float(shift)


def _check(name: str, z: object) -> Tensor:
    if not isinstance(z, Tensor) or not z.is_floating_point():
        raise ValueError(f"`{name}` must be a floating-point torch.Tensor, got {type(z).__name__}")
    return z


def to_comfy_latent(z: Tensor, config: Any = None) -> Tensor:
    """BAGEL latent → ComfyUI ``LATENT["samples"]``: ``z / scale_factor + shift_factor`` (FLUX: 0.3611, 0.1159)."""
    scale, shift = latent_factors(config)
    return _check("z", z) / scale + shift


def from_comfy_latent(samples: Tensor, config: Any = None) -> Tensor:
    """ComfyUI ``LATENT["samples"]`` → BAGEL latent: ``scale_factor * (samples - shift_factor)``."""
    scale, shift = latent_factors(config)
    return scale * (_check("samples", samples) - shift)


__all__ = [
    "FLUX_SCALE_FACTOR",
    "FLUX_SHIFT_FACTOR",
    "VAEAdapter",
    "from_comfy_latent",
    "latent_factors",
    "to_comfy_latent",
]
