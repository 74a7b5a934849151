"""Image pre/post-processing of BAGEL (``data/transforms.py`` and ``inferencer.py`` of ByteDance-Seed/Bagel)
and the optional ``transform_config.json`` that sets a checkpoint's transform sizes."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from training.tiny import TINY_TRANSFORMS, tiny_config
from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.cli.checks import open_image
from unicache_core.bagel.config import (
    TRANSFORM_CONFIG_FILE,
    BagelConfig,
    ResizeConfig,
    TransformConfig,
    load_bagel_config,
)
from unicache_core.bagel.pipeline import BagelPipeline
from unicache_core.bagel.settings import preset
from unicache_core.bagel.transforms import (
    MAX_PIXELS,
    OFFICIAL_TRANSFORMS,
    VAE_TRANSFORM,
    VIT_TRANSFORM,
    ImageTransform,
    ImageTransforms,
    check_image,
    image_from_tensor,
    pil_img2rgb,
    prepare_input_image,
    resize_size,
    to_tensor,
)
from unicache_core.errors import CheckpointError


def test_small_image_goes_through_vae_rule_then_vit_rule():
    # official rules: 60x45 -> 688x512 (VAE rule) -> ViT 686x518 -> 49x37 = 1813 tokens.
    resized = prepare_input_image(Image.new("RGB", (60, 45), (10, 20, 30)))
    assert resized.size == (688, 512)
    vit = VIT_TRANSFORM(resized)
    assert vit.shape == (3, 518, 686)
    assert (vit.shape[1] // 14) * (vit.shape[2] // 14) == 1813
    vae = VAE_TRANSFORM(resized)
    assert vae.shape == (3, 512, 688)


@pytest.mark.parametrize(
    "size, rule, expected",
    [
        ((2000, 1000), (1024, 512, 16), (1024, 512)),  # long edge capped, short edge exactly at min
        ((1024, 1024), (1024, 512, 16), (1024, 1024)),  # unchanged
        ((1024, 1024), (980, 224, 14), (980, 980)),
        ((300, 700), (980, 224, 14), (294, 700)),  # no rescale; 300/14=21.43 -> 21*14
        # pixel budget then long edge: 5000x100 -> 25600x512 -> *0.1378125 -> 3528 (=220.5*16, rounds
        # half to even -> 3520) x 64 -> long edge 1024 -> 1024x16
        ((5000, 100), (1024, 512, 16), (1024, 16)),
    ],
)
def test_resize_rule(size, rule, expected):
    assert resize_size(*size, *rule) == expected


def test_resize_rule_respects_limits_on_many_sizes():
    rng = np.random.default_rng(0)
    for w, h in rng.integers(1, 3000, size=(200, 2)):
        nw, nh = resize_size(int(w), int(h), 1024, 512, 16)
        assert nw % 16 == 0 and nh % 16 == 0
        assert max(nw, nh) <= 1024 and nw * nh <= MAX_PIXELS


def test_resample_is_pil_bicubic():
    rng = np.random.default_rng(1)
    img = Image.fromarray(rng.integers(0, 256, size=(45, 60, 3), dtype=np.uint8))
    expected = img.resize((688, 512), Image.BICUBIC)
    assert np.array_equal(np.asarray(VAE_TRANSFORM.resize(img)), np.asarray(expected))


def test_to_tensor_range_and_layout():
    arr = np.zeros((2, 3, 3), dtype=np.uint8)
    arr[0, 1] = (255, 0, 51)
    t = to_tensor(Image.fromarray(arr))
    assert t.shape == (3, 2, 3) and t.dtype == torch.float32
    assert t[0, 0, 1] == 1.0 and t[1, 0, 1] == -1.0
    assert torch.isclose(t[2, 0, 1], torch.tensor(51 / 255 * 2 - 1))
    assert t[:, 1].eq(-1).all()


def test_pil_img2rgb_composites_transparency_on_white():
    rgba = Image.new("RGBA", (2, 1))
    rgba.putpixel((0, 0), (255, 0, 0, 0))  # fully transparent red -> white
    rgba.putpixel((1, 0), (0, 0, 255, 255))  # opaque blue stays blue
    out = pil_img2rgb(rgba)
    assert out.mode == "RGB"
    assert out.getpixel((0, 0)) == (255, 255, 255) and out.getpixel((1, 0)) == (0, 0, 255)

    pal = Image.new("P", (2, 1))
    pal.putpalette([0, 0, 0, 200, 10, 10] + [0] * 762)
    pal.putpixel((0, 0), 0)
    pal.putpixel((1, 0), 1)
    pal.info["transparency"] = 0
    out = pil_img2rgb(pal)
    assert out.getpixel((0, 0)) == (255, 255, 255) and out.getpixel((1, 0)) == (200, 10, 10)

    gray = pil_img2rgb(Image.new("L", (1, 1), 77))
    assert gray.mode == "RGB" and gray.getpixel((0, 0)) == (77, 77, 77)


def test_bad_images_raise_value_error_naming_the_input():
    with pytest.raises(ValueError, match="source_image"):
        check_image(np.zeros((4, 4, 3)), "source_image")
    with pytest.raises(ValueError, match="`image` has zero size"):
        prepare_input_image(Image.new("RGB", (0, 5)))
    with pytest.raises(ValueError, match="image"):
        pil_img2rgb("not an image")


def test_output_conversion_truncates():
    # 127.9 must become 127 (truncation, not rounding); values outside [-1, 1] clamp.
    x = torch.tensor([2 * 127.9 / 255 - 1, 1.5, -3.0]).reshape(1, 1, 3).expand(3, 1, 3)
    img = image_from_tensor(x.unsqueeze(0))
    assert img.size == (3, 1) and img.mode == "RGB"
    assert [img.getpixel((i, 0))[0] for i in range(3)] == [127, 255, 0]
    with pytest.raises(ValueError, match="image"):
        image_from_tensor(torch.zeros(2, 3, 4, 4))


# ------------------------------------------------------------------------------------ transform_config.json


def _source(width: int = 60, height: int = 45) -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))


def test_official_transforms_are_the_config_defaults():
    assert TransformConfig() == TransformConfig(
        ResizeConfig(1024, 512, 16, 14 * 14 * 9 * 1024), ResizeConfig(980, 224, 14, 14 * 14 * 9 * 1024)
    )
    assert VAE_TRANSFORM == ImageTransform(1024, 512, 16) and VIT_TRANSFORM == ImageTransform(980, 224, 14)
    assert OFFICIAL_TRANSFORMS == ImageTransforms(VAE_TRANSFORM, VIT_TRANSFORM)
    assert ImageTransforms.from_config(TransformConfig()) == OFFICIAL_TRANSFORMS
    cfg = tiny_config(10)
    assert ImageTransforms.from_config(cfg) == ImageTransforms.from_config(TINY_TRANSFORMS)
    image = _source()
    official = prepare_input_image(image, transforms=OFFICIAL_TRANSFORMS)
    assert official.tobytes() == prepare_input_image(image).tobytes()


def test_absent_file_gives_the_official_transforms(tiny_checkpoint_copy: Path):
    (tiny_checkpoint_copy / TRANSFORM_CONFIG_FILE).unlink()
    cfg = load_bagel_config(tiny_checkpoint_copy)
    assert cfg.transforms == TransformConfig() and ImageTransforms.from_config(cfg) == OFFICIAL_TRANSFORMS
    # the pipeline uses them: a 60x45 image gives the official 49x37 = 1813 ViT tokens
    pipe = BagelPipeline(load_bagel(tiny_checkpoint_copy, dtype=torch.float32))
    plain = pipe.build_understanding_context(None, "Describe.")
    with_image = pipe.build_understanding_context(_source(), "Describe.")
    # + the <|vision_start|> / <|vision_end|> boundaries
    assert with_image.cache.num_tokens - plain.cache.num_tokens == 1813 + 2


def test_tiny_checkpoint_writes_its_small_transforms(tiny_checkpoint: Path):
    data = json.loads((tiny_checkpoint / TRANSFORM_CONFIG_FILE).read_text())
    assert data["vae"] == {"max_size": 128, "min_size": 64, "stride": 16, "max_pixels": MAX_PIXELS}
    assert data["vit"] == {"max_size": 112, "min_size": 56, "stride": 14, "max_pixels": MAX_PIXELS}
    assert load_bagel_config(tiny_checkpoint).transforms == TINY_TRANSFORMS


def test_file_is_read_and_used_by_the_pipeline(tiny_checkpoint_copy: Path):
    # only some fields given: the others keep their official values (max_pixels here)
    rule = {"max_size": 96, "min_size": 48, "stride": 32}
    (tiny_checkpoint_copy / TRANSFORM_CONFIG_FILE).write_text(
        json.dumps({"vae": rule, "vit": {"max_size": 70, "min_size": 28}})
    )
    loaded = load_bagel(tiny_checkpoint_copy, dtype=torch.float32)
    assert loaded.config.transforms == TransformConfig(ResizeConfig(96, 48, 32), ResizeConfig(70, 28, 14))
    image = _source()
    expected = resize_size(60, 45, 96, 48, 32)
    assert expected == (64, 64)  # 60x45 -> 64x48 -> 48/32 = 1.5 rounds half to even -> 2 -> 64
    pipe = BagelPipeline(loaded)
    res = pipe.edit("make it blue", image, preset("edit", num_timesteps=2), seed=0)
    assert res.image.size == expected and res.latents.shape == (1, 16, 8, 8)
    # the ViT rule too: 64x64 -> (70, 28, 14) -> 70x70 = 5x5 patches
    plain = pipe.build_understanding_context(None, "Describe.")
    with_image = pipe.build_understanding_context(image, "Describe.")
    assert with_image.cache.num_tokens - plain.cache.num_tokens == 5 * 5 + 2


def test_invalid_transform_json_names_the_file(tiny_checkpoint_copy: Path):
    (tiny_checkpoint_copy / TRANSFORM_CONFIG_FILE).write_text("{ not json")
    with pytest.raises(CheckpointError, match=re.escape(TRANSFORM_CONFIG_FILE)):
        load_bagel_config(tiny_checkpoint_copy)


@pytest.mark.parametrize(
    "data, key, value, hint",
    [
        ({"vae": {"max_size": "128"}}, "vae.max_size", "'128'", "int > 0"),
        ({"vae": {"min_size": True}}, "vae.min_size", "True", "int > 0"),
        ({"vit": {"max_size": 112.0}}, "vit.max_size", "112.0", "int > 0"),
        ({"vae": {"stride": 0}}, "vae.stride", "0", "int > 0"),
        ({"vit": {"min_size": -56}}, "vit.min_size", "-56", "int > 0"),
        ({"vae": {"max_pixels": 0}}, "vae.max_pixels", "0", "int > 0"),
        ({"vae": {"max_size": 64, "min_size": 128}}, "vae.max_size", "64", ">= 'vae.min_size' = 128"),
        ({"vit": {"max_size": 112}}, "vit.max_size", "112", ">= 'vit.min_size' = 224"),  # official min 224
        ({"vae": {"stride": 24}}, "vae.stride", "24", "multiple of 16"),
        ({"vit": {"stride": 16}}, "vit.stride", "16", "equal the ViT patch_size 14"),
        ({"vae": {"max_size": 1040}}, "vae.max_size", "1040", "65 latent tokens, more than max_latent_size"),
        ({"vit": {"max_size": 994}}, "vit.max_size", "994", "71 patches per side"),
        ({"vae": [128, 64, 16]}, "vae", "[128, 64, 16]", "must be an object"),
        ({"vae": {"max": 128}}, "vae.max", "", "unknown fields"),
        ({"input": {"max_size": 128}}, "input", "", "unknown fields"),
    ],
)
def test_bad_transform_value_is_one_clear_error(tiny_checkpoint_copy: Path, data, key, value, hint):
    (tiny_checkpoint_copy / TRANSFORM_CONFIG_FILE).write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as info:
        load_bagel_config(tiny_checkpoint_copy)
    message = str(info.value)
    assert "\n" not in message
    assert str(tiny_checkpoint_copy / TRANSFORM_CONFIG_FILE) in message
    assert f"'{key}'" in message and hint in message
    if value:
        assert f"'{key}' = {value}" in message
        assert "remove the field" in message or "set both" in message  # says what to do


def test_absent_file_checks_the_official_values_against_the_model(tiny_checkpoint_copy: Path):
    (tiny_checkpoint_copy / TRANSFORM_CONFIG_FILE).unlink()
    path = tiny_checkpoint_copy / "vit_config.json"
    data = json.loads(path.read_text())
    data.update(patch_size=16, image_size=1120)
    path.write_text(json.dumps(data))
    match = (
        r"transform_config\.json \(absent, so the official values are used\): "
        r"field 'vit\.stride' = 14 must equal the ViT patch_size 16.*write transform_config\.json"
    )
    with pytest.raises(CheckpointError, match=match):
        load_bagel_config(tiny_checkpoint_copy)


def test_configs_built_in_code_default_to_the_official_transforms():
    cfg = tiny_config(10)
    assert BagelConfig(llm=cfg.llm, vit=cfg.vit, ae=cfg.ae).transforms == TransformConfig()


# ------------------------------------------------------------------------------------ odd input images


def test_zero_area_and_one_pixel_images():
    with pytest.raises(ValueError, match=r"`image` has zero size \(0x10\)"):
        prepare_input_image(Image.new("RGB", (0, 10)))
    assert prepare_input_image(Image.new("RGB", (1, 1))).size == (512, 512)  # official rule: short side 512


@pytest.mark.parametrize("mode", ["1", "L", "P", "LA", "PA", "I", "I;16", "F", "CMYK", "YCbCr", "RGBa"])
def test_image_modes_convert_like_official(mode):
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, size=(12, 10, 3), dtype=np.uint8)).convert(mode)
    out = pil_img2rgb(image)
    assert out.mode == "RGB" and out.size == (10, 12)
    if mode in ("I;16", "F"):  # I;16: 16-bit storage, scaled by 255/65535 (the official convert("RGB") clips at
        # 255 instead); F here holds fractional 0..255 luminance, rounded (PIL's convert truncates)
        scale = 255 / 65535 if mode == "I;16" else 1.0
        expected = np.rint(np.asarray(image, dtype=np.float64) * scale).astype(np.uint8)
        np.testing.assert_array_equal(np.asarray(out)[:, :, 0], expected)
    elif mode not in ("LA", "PA"):  # plain convert("RGB"), as the official code (I holds 0..255 values here)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(image.convert("RGB")))


def test_16_bit_image_is_scaled_not_clipped():
    values = np.array([[0, 100, 255, 256, 32768, 65535]], dtype=np.uint16)
    out = np.asarray(pil_img2rgb(Image.fromarray(values)))
    # PIL's I;16 -> RGB conversion (the official convert("RGB")) would give [0, 100, 255, 255, 255, 255]
    assert out[0, :, 0].tolist() == [0, 0, 1, 1, 128, 255]


def test_unconvertible_mode_names_the_mode():
    image = Image.new("La", (4, 4))
    with pytest.raises(ValueError, match=r"`image`.*mode 'La'.*RGB"):
        pil_img2rgb(image)


def test_rgba_composited_on_white():
    image = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    assert np.asarray(pil_img2rgb(image)).min() == 255


def _exif_rotated_jpeg(path: Path) -> Path:
    image = Image.new("RGB", (40, 30), (200, 10, 10))
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 CW to display
    image.save(path, format="JPEG", exif=exif.tobytes())
    return path


def test_exif_orientation_is_not_applied(tmp_path):
    """The official pipeline never calls ``exif_transpose``: the stored pixel grid is used as is."""
    image = open_image(_exif_rotated_jpeg(tmp_path / "rot.jpg"))
    assert image.getexif().get(0x0112) == 6 and image.size == (40, 30)
    assert prepare_input_image(image).size == (688, 512)  # the 40x30 grid, not the displayed 30x40
