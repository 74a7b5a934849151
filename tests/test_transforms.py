"""Image pre/post-processing of BAGEL (bagel.md §3.1, §2.8)."""

import numpy as np
import pytest
import torch
from PIL import Image

from unicache_core.bagel.transforms import (
    MAX_PIXELS,
    VAE_TRANSFORM,
    VIT_TRANSFORM,
    check_image,
    image_from_tensor,
    pil_img2rgb,
    prepare_input_image,
    resize_size,
    to_tensor,
)


def test_small_image_goes_through_vae_rule_then_vit_rule():
    # bagel.md §3.1: 60x45 -> 688x512 (VAE rule) -> ViT 686x518 -> 49x37 = 1813 tokens.
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
