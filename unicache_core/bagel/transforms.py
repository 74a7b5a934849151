"""Image pre- and post-processing of BAGEL (``data/transforms.py`` and ``inferencer.py`` of github
ByteDance-Seed/Bagel).

Every input image is converted to RGB (transparent pixels composited on white), resized with the
VAE rule, and only then passed to the ViT transform and/or the VAE transform (``interleave_inference``
does ``vae_transform.resize_transform(pil_img2rgb(image))`` first). The sizes come from the model's
:class:`~unicache_core.bagel.config.TransformConfig` (``transform_config.json``, see docs/engine.md,
"Running it"); the official ones, :data:`OFFICIAL_TRANSFORMS`, are VAE
``MaxLongEdgeMinShortEdgeResize(1024, 512, 16)`` and ViT (980, 224, 14), with a pixel budget of
``14*14*9*1024``. Tensors produced here are ``[3, H, W]`` fp32 in ``[-1, 1]``.

Resizing is PIL bicubic, exactly what ``torchvision.transforms.functional.resize`` does on a PIL image.

Kept official behaviours (deliberately, for parity): EXIF orientation is NOT applied (the stored pixel
grid is used, as the official code never calls ``ImageOps.exif_transpose``; transpose the image first
if you want the displayed orientation); a 1x1 image is upscaled to 512x512 by the official resize rule.

Where the official ``convert("RGB")`` gives a wrong image, the conversion differs: high-bit-depth
single-band images are scaled to 8 bits instead of clipped at 255 (a 16-bit gradient gives the 8-bit
gradient, not an all-white image; :func:`scaled_to_8bit`); every mode with an alpha band (``LA``,
``PA``, ``RGBa``) is composited on white like RGBA, instead of dropping the alpha.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from .config import OFFICIAL_MAX_PIXELS, BagelConfig, ResizeConfig, TransformConfig

#: Pixel budget of the official transforms (14*14*9*1024).
MAX_PIXELS = OFFICIAL_MAX_PIXELS


def check_image(image: object, name: str = "image") -> Image.Image:
    """Return ``image`` if it is a non-empty PIL image, else raise ``ValueError`` naming ``name``."""
    if not isinstance(image, Image.Image):
        raise ValueError(f"`{name}` must be a PIL.Image.Image, got {type(image).__name__}")
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ValueError(f"`{name}` has zero size ({width}x{height}); a non-empty image is required")
    return image


#: Full scales a high-bit-depth single-band mode may have, smallest first: the pixels are scaled by 255 / the
#: smallest one that holds every value. ``I;16*`` is 16-bit storage; ``I`` and ``F`` carry no range of their own
#: (``I`` from a 32-bit file or from ``convert("I")`` of an 8-bit image; ``F`` in [0, 1] or on an integer scale).
HIGH_BIT_DEPTH_FULL_SCALE = {
    "I;16": (65535,),
    "I;16L": (65535,),
    "I;16B": (65535,),
    "I;16N": (65535,),
    "I": (255, 65535),
    "F": (1.0, 255, 65535),
}
#: Modes with an alpha band that PIL converts to RGBA (composited on white like RGBA).
ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa")


def scaled_to_8bit(image: Image.Image, name: str = "image") -> Image.Image:
    """A high-bit-depth single-band image (:data:`HIGH_BIT_DEPTH_FULL_SCALE`) → mode ``L``, scaled by 255 / its full
    scale and rounded. A value outside ``[0, largest full scale]`` (or not finite) has no 8-bit meaning and is
    refused with a ValueError.
    """
    scales = HIGH_BIT_DEPTH_FULL_SCALE[image.mode]
    values = np.asarray(image, dtype=np.float64)  # [H, W]
    finite = bool(np.isfinite(values).all())
    lo, hi = (float(values.min()), float(values.max())) if finite else (float("nan"), float("nan"))
    if not finite or lo < 0 or hi > scales[-1]:
        shown = "non-finite values" if not finite else f"values in [{lo:g}, {hi:g}]"
        raise ValueError(
            f"`{name}` is a {image.mode!r} image with {shown}, outside its full scale [0, {scales[-1]:g}]; save it "
            f"as an 8- or 16-bit image (or scale it into [0, {scales[-1]:g}]) first"
        )
    full = next(scale for scale in scales if hi <= scale)
    return Image.fromarray(np.rint(values * (255.0 / full)).astype(np.uint8), mode="L")


def pil_img2rgb(image: Image.Image, name: str = "image") -> Image.Image:
    """Convert to RGB; images with an alpha band or a ``transparency`` entry are composited on white.

    The official rule composites RGBA and ``transparency`` images and converts other modes with a plain
    ``convert("RGB")``; here other alpha modes are composited too, and high-bit-depth single-band images are
    scaled (:func:`scaled_to_8bit`) instead of clipped.
    """
    image = check_image(image, name)
    if image.mode in HIGH_BIT_DEPTH_FULL_SCALE:
        return scaled_to_8bit(image, name).convert("RGB")
    try:
        if image.mode in ALPHA_MODES or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGB", rgba.size, (255, 255, 255))
            white.paste(rgba, mask=rgba.split()[3])
            return white
        return image.convert("RGB")
    except ValueError as exc:  # PIL cannot convert some rare modes ('La', 'I;16L' with alpha, ...)
        raise ValueError(
            f"`{name}` has mode {image.mode!r}, which PIL cannot convert to RGB ({exc}); convert it to RGB or "
            f"RGBA first"
        ) from None


def _make_divisible(value: float, stride: int) -> int:
    return max(stride, int(round(value / stride) * stride))


def _apply_scale(width: int, height: int, scale: float, stride: int) -> tuple[int, int]:
    return _make_divisible(round(width * scale), stride), _make_divisible(round(height * scale), stride)


def resize_size(
    width: int, height: int, max_size: int, min_size: int, stride: int, max_pixels: int = MAX_PIXELS
) -> tuple[int, int]:
    """Target ``(width, height)`` of ``MaxLongEdgeMinShortEdgeResize`` for a ``width x height`` image.

    ``scale = max(min(max_size/long, 1), min_size/short)``; each side becomes ``round(side*scale)``
    snapped to ``max(stride, round(v/stride)*stride)`` (Python rounding, half to even); then the
    pixel budget and the long-edge limit are enforced by rescaling and snapping again.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    scale = min(max_size / max(width, height), 1.0)
    scale = max(scale, min_size / min(width, height))
    new_w, new_h = _apply_scale(width, height, scale, stride)
    if new_w * new_h > max_pixels:
        new_w, new_h = _apply_scale(new_w, new_h, max_pixels / (new_w * new_h), stride)
    if max(new_w, new_h) > max_size:
        new_w, new_h = _apply_scale(new_w, new_h, max_size / max(new_w, new_h), stride)
    return new_w, new_h


@dataclass(frozen=True)
class MaxLongEdgeMinShortEdgeResize:
    """Resize a PIL image so both sides are multiples of ``stride`` within the size limits (bicubic)."""

    max_size: int
    min_size: int
    stride: int
    max_pixels: int = MAX_PIXELS

    def size_for(self, width: int, height: int) -> tuple[int, int]:
        """Target ``(width, height)`` for an input of that size."""
        return resize_size(width, height, self.max_size, self.min_size, self.stride, self.max_pixels)

    def __call__(self, image: Image.Image) -> Image.Image:
        image = check_image(image)
        size = self.size_for(*image.size)
        if size == image.size:
            # torchvision's PIL resize returns a resampled copy even at equal size; PIL bicubic at
            # scale 1 is the identity, so returning a copy is the same result.
            return image.copy()
        return image.resize(size, Image.Resampling.BICUBIC)


def to_tensor(image: Image.Image) -> Tensor:
    """RGB PIL image → ``[3, H, W]`` fp32 in ``[-1, 1]`` (ToTensor, then Normalize(0.5, 0.5))."""
    if image.mode != "RGB":
        raise ValueError(f"`image` must be RGB at this point, got mode {image.mode!r}")
    array = np.asarray(image, dtype=np.uint8).copy()  # [H, W, 3]
    tensor = torch.from_numpy(array).permute(2, 0, 1).contiguous().float().div(255)
    return tensor.sub_(0.5).div_(0.5)


@dataclass(frozen=True)
class ImageTransform:
    """``MaxLongEdgeMinShortEdgeResize`` → ToTensor → Normalize(0.5, 0.5); output ``[3, H, W]``."""

    max_size: int
    min_size: int
    stride: int
    max_pixels: int = MAX_PIXELS

    @property
    def resize(self) -> MaxLongEdgeMinShortEdgeResize:
        return MaxLongEdgeMinShortEdgeResize(self.max_size, self.min_size, self.stride, self.max_pixels)

    def __call__(self, image: Image.Image) -> Tensor:
        """RGB PIL image → resized ``[3, H, W]`` fp32 in ``[-1, 1]`` (sides multiples of ``stride``)."""
        return to_tensor(self.resize(image))

    @classmethod
    def from_config(cls, rule: ResizeConfig) -> ImageTransform:
        """The transform of one configured resize rule."""
        return cls(rule.max_size, rule.min_size, rule.stride, rule.max_pixels)


@dataclass(frozen=True)
class ImageTransforms:
    """A model's two image transforms; ``vae.resize`` is also the input resize rule (:meth:`prepare`)."""

    vae: ImageTransform
    vit: ImageTransform

    @classmethod
    def from_config(cls, config: BagelConfig | TransformConfig) -> ImageTransforms:
        """The transforms of a loaded model's config (``loaded.config``) or of a :class:`TransformConfig`."""
        tf = config.transforms if isinstance(config, BagelConfig) else config
        return cls(vae=ImageTransform.from_config(tf.vae), vit=ImageTransform.from_config(tf.vit))

    def prepare(self, image: Image.Image, name: str = "image") -> Image.Image:
        """What ``interleave_inference`` does to every input image: RGB + the VAE resize rule.

        Returns the resized RGB PIL image; its size is the output size of an edit.
        """
        return self.vae.resize(pil_img2rgb(image, name))


#: The official transforms (the defaults of :class:`~unicache_core.bagel.config.TransformConfig`).
OFFICIAL_TRANSFORMS = ImageTransforms.from_config(TransformConfig())
#: The official VAE transform (sides multiples of 16, short side >= 512, long side <= 1024).
VAE_TRANSFORM = OFFICIAL_TRANSFORMS.vae
#: The official ViT transform (sides multiples of 14, short side >= 224, long side <= 980).
VIT_TRANSFORM = OFFICIAL_TRANSFORMS.vit


def prepare_input_image(
    image: Image.Image, name: str = "image", transforms: ImageTransforms | None = None
) -> Image.Image:
    """What ``interleave_inference`` does to every input image: RGB + the VAE resize rule.

    Args:
        image: any PIL image (``name`` is used in error messages).
        transforms: the model's transforms (:meth:`ImageTransforms.from_config` of ``loaded.config``);
            ``None`` = the official ones.

    Returns the resized RGB PIL image; its size is the output size of an edit.
    """
    return (transforms or OFFICIAL_TRANSFORMS).prepare(image, name)


def image_from_tensor(image: Tensor) -> Image.Image:
    """``[3, H, W]`` or ``[1, 3, H, W]`` tensor in about ``[-1, 1]`` → RGB PIL image.

    Uses the official conversion ``((x*0.5+0.5).clamp(0,1)*255).to(uint8)`` (truncation, no rounding).
    """
    if image.dim() == 4:
        if image.shape[0] != 1:
            raise ValueError(f"`image` batch must be 1, got shape {tuple(image.shape)}")
        image = image[0]
    if image.dim() != 3 or image.shape[0] != 3:
        raise ValueError(f"`image` must have shape [3, H, W] or [1, 3, H, W], got {tuple(image.shape)}")
    pixels = ((image.float() * 0.5 + 0.5).clamp(0, 1).permute(1, 2, 0) * 255).to(torch.uint8)
    return Image.fromarray(pixels.cpu().numpy())
