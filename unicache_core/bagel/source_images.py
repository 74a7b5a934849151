"""An input image made ready for its blocks: resized as the official code does and, for generation, VAE-encoded.

Every input image is converted to RGB and resized by the checkpoint's VAE rule (``interleave_inference`` does it to
every image, understanding included); the ViT then sees that picture resized by its own rule. A generation also
needs the image's clean latent: encoded by the chosen VAE (the checkpoint's :class:`~.modeling.AutoEncoder`,
sampling with given noise or noise drawn from the request's generator, or an external :class:`~.latents.VAEAdapter`),
or given (a ComfyUI ``VAEEncode`` latent, any size on BAGEL's grid: the block follows its size and the ViT sees the
image resized to it). :func:`prepare_image` does one image; the request encodes its images in item order, so the
seeded generator's draws are the official ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from PIL import Image
from torch import Tensor

from .checkpoint.loader import LoadedBagel
from .contexts import encode_vae_latent, release_between_phases
from .modeling import AutoEncoder
from .numerics import check_finite, check_noise
from .sampling import pack_latent
from .settings import source_latent_size
from .transforms import ImageTransforms, pil_img2rgb, to_tensor


@dataclass(frozen=True)
class ImageNames:
    """How error messages name an image and its given tensors (``image``/``source_latent``/``vae_noise`` for the
    single-image calls, ``items[i]``... for an item list)."""

    image: str = "image"
    latent: str = "source_latent"
    noise: str = "vae_noise"

    @classmethod
    def of_item(cls, index: int) -> ImageNames:
        return cls(f"items[{index}]", f"items[{index}].latent", f"items[{index}].vae_noise")


SINGLE_IMAGE_NAMES = ImageNames()


@dataclass(frozen=True)
class PreparedImage:
    """One input image ready for its blocks.

    Attributes:
        picture: the RGB picture the ViT block sees (resized by the VAE rule, or to its given latent's size).
        width, height: its size in pixels (the output size when it is a generation's last image).
        latent: generation only: its clean latent, packed ``[h*w, 64]`` fp32 (None for understanding).
        grid: generation only: ``(h, w)``, the latent's rows and columns of tokens (``H/16``, ``W/16``).
        how: how the latent was made (``"checkpoint_vae"``, ``"external_vae"``, ``"given"``; None for understanding).
    """

    picture: Image.Image
    width: int
    height: int
    latent: Tensor | None = None
    grid: tuple[int, int] = (0, 0)
    how: str | None = None


def prepare_image(
    loaded: LoadedBagel,
    image: Image.Image,
    *,
    generation: bool,
    latent: Tensor | None = None,
    vae_noise: Tensor | None = None,
    vae=None,
    generator: torch.Generator | None = None,
    names: ImageNames = SINGLE_IMAGE_NAMES,
) -> PreparedImage:
    """``image`` resized as ``interleave_inference`` does and, when ``generation``, its source latent (``latent``
    when given, else ``vae``'s encode; the built-in encode samples with ``vae_noise`` or noise drawn from
    ``generator``, which draws that noise in every case so a seed gives the same later draws)."""
    transforms = ImageTransforms.from_config(loaded.config)
    picture = transforms.prepare(image, names.image)
    if not generation:
        return PreparedImage(picture, *picture.size)
    vae_input = transforms.vae(picture)
    latent_size = given_latent_size(loaded, latent, names.latent)
    if latent_size not in (None, picture.size):
        # the block follows the given latent; the ViT sees the image resized to the latent's pixel size
        picture = pil_img2rgb(image, names.image).resize(latent_size, Image.Resampling.BICUBIC)
        vae_input = to_tensor(picture)
    packed, how = source_latent(
        loaded, vae_input, vae=vae, latent=latent, vae_noise=vae_noise, generator=generator, names=names
    )
    release_between_phases(loaded)  # the encoder's activations, before the prefill's
    step = loaded.config.latent_downsample
    grid = (vae_input.shape[1] // step, vae_input.shape[2] // step)
    return PreparedImage(picture, *picture.size, latent=packed, grid=grid, how=how)


def check_given(
    loaded: LoadedBagel, image: Image.Image, latent: object, vae_noise: object, *, external_vae: bool, names: ImageNames
) -> None:
    """Refuse an image's given latent or encode noise before anything runs (the encode of an earlier image
    included): a latent off BAGEL's grid or not finite, noise of the wrong shape or with a latent or an external
    VAE adapter (``external_vae``), which never sample it."""
    given_latent_size(loaded, latent, names.latent)
    if isinstance(latent, Tensor):  # given_latent_size refused any other non-None latent
        advice = "pass a finite latent (e.g. from_comfy_latent of VAEEncode's samples)"
        check_finite(latent, "the source latent" if names == SINGLE_IMAGE_NAMES else f"`{names.latent}`", advice)
    if vae_noise is None:
        return
    if latent is not None or external_vae:
        raise ValueError(
            f"`{names.noise}` is the sampling noise of the built-in VAE encode; it is not used with "
            f"`{names.latent}` or an external VAE: leave it None"
        )
    width, height = ImageTransforms.from_config(loaded.config).vae.resize.size_for(*image.size)
    ds = loaded.config.ae.downsample
    check_noise(names.noise, vae_noise, (1, loaded.config.ae.z_channels, height // ds, width // ds))


def given_latent_size(loaded: LoadedBagel, z: object, name: str = "source_latent") -> tuple[int, int] | None:
    """Output ``(width, height)`` of an edit given the source latent ``z`` ``[1, C, H/8, W/8]`` (``None`` when
    ``z`` is None): its cells times ``ae.downsample``, checked against BAGEL's grid
    (:func:`~.settings.source_latent_size`)."""
    if z is None:
        return None
    channels = loaded.config.ae.z_channels
    if not isinstance(z, Tensor) or not z.is_floating_point() or z.ndim != 4 or tuple(z.shape[:2]) != (1, channels):
        got: str | tuple[int, ...] | torch.dtype
        if not isinstance(z, Tensor):
            got = type(z).__name__
        else:
            got = tuple(z.shape) if z.is_floating_point() else z.dtype
        raise ValueError(
            f"`{name}` must be one floating-point latent [1, {channels}, H/8, W/8] in BAGEL's convention, got {got}"
        )
    return source_latent_size(loaded.config, z.shape[2], z.shape[3], name=name)


def _check_latent_tensor(name: str, z: object, shape: tuple[int, ...], width: int, height: int) -> Tensor:
    """A caller's or external VAE's source latent: a float tensor of ``shape`` (finiteness checked after)."""
    if not isinstance(z, Tensor) or not z.is_floating_point():
        raise ValueError(
            f"`{name}` must be a floating-point torch.Tensor of shape {shape}, got "
            f"{type(z).__name__ if not isinstance(z, Tensor) else z.dtype}"
        )
    if tuple(z.shape) != shape:
        raise ValueError(
            f"`{name}` has shape {tuple(z.shape)}, but the source image is resized to {width}x{height} (BAGEL's VAE "
            f"transform), whose latent is {shape}; encode the image at {width}x{height} (e.g. resize it before "
            f"VAEEncode) or leave it None to encode here"
        )
    return z.detach().to("cpu", torch.float32)


def source_latent(
    loaded: LoadedBagel,
    vae_input: Tensor,
    *,
    vae,
    latent: Tensor | None,
    vae_noise: Tensor | None,
    generator: torch.Generator | None,
    names: ImageNames = SINGLE_IMAGE_NAMES,
) -> tuple[Tensor, str]:
    """Packed ``[(H/16)*(W/16), 64]`` clean latent of a source ``[3, H, W]`` and how it was made.

    ``vae``: the VAE that encodes (ignored when ``latent`` is given).
    """
    cfg = loaded.config
    ds = cfg.ae.downsample
    height, width = vae_input.shape[1], vae_input.shape[2]
    shape = (1, cfg.ae.z_channels, height // ds, width // ds)
    chosen = None if latent is not None else vae
    if isinstance(chosen, AutoEncoder):
        if vae_noise is not None:
            check_noise(names.noise, vae_noise, shape)
        packed = encode_vae_latent(loaded, vae_input, noise=vae_noise, generator=generator, vae=chosen)
        how = "checkpoint_vae" if chosen is loaded.vae else "external_vae"
        check_finite(
            packed,
            "the VAE encoding of the source image",
            "check ae.safetensors (re-download it); the VAE always runs in fp32",
        )
        return packed, how
    if vae_noise is not None:
        raise ValueError(
            f"`{names.noise}` is the sampling noise of the built-in VAE encode; it is not used with "
            f"`{names.latent}` or an external VAE: leave it None"
        )
    if generator is not None:  # the draw the built-in encode makes, so the seed gives the same later noise
        torch.randn(shape, generator=generator, dtype=torch.float32)
    if latent is not None:
        z, how = _check_latent_tensor(names.latent, latent, shape, width, height), "given"
        advice = "pass a finite latent (e.g. from_comfy_latent of VAEEncode's samples)"
    else:
        if chosen is None:
            raise ValueError("source_latent needs `vae` (an encoder) when no `latent` is given")
        with torch.inference_mode():
            z = chosen.encode(vae_input.unsqueeze(0).float().cpu())
        z, how = _check_latent_tensor("the external VAE's encode", z, shape, width, height), "external_vae"
        advice = "check the external VAE (its encode must return a finite [1, 16, H/8, W/8] latent)"
    check_finite(z, "the source latent" if how == "given" else "the external VAE encoding of the source image", advice)
    return pack_latent(z[0].float(), cfg.latent_patch_size), how


__all__ = [
    "ImageNames",
    "PreparedImage",
    "SINGLE_IMAGE_NAMES",
    "check_given",
    "given_latent_size",
    "prepare_image",
    "source_latent",
]
