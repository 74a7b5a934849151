"""The edit node with a core ``VAEEncode`` LATENT of any size (stubbed host, tiny checkpoint): the output follows
the latent's size on BAGEL's 16-px grid, the ViT sees the image resized to it, and only a latent that cannot fit
BAGEL's position table (or is smaller than one token) is refused, before the model is placed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from comfy_stubs import TINY_NAME, NodeCall, host_stubs  # noqa: F401  (host_stubs: a fixture)
from PIL import Image

EDIT_ARGS = ("make it blue", 2, 0, 4.0, 2.0, 0.0, 1.0, 3.0, 0.0, "text_channel", False)


def _load():
    import nodes

    (model,) = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheBagelLoader"]).load(TINY_NAME, "fp32", "auto")
    return model


def _image(width: int, height: int) -> torch.Tensor:
    """A deterministic ComfyUI IMAGE ``[1, height, width, 3]``."""
    y, x = torch.meshgrid(torch.linspace(0, 1, height), torch.linspace(0, 1, width), indexing="ij")
    return torch.stack([x, y, (x * y).sqrt()], dim=-1)[None]


def _vae_encode(model, image: torch.Tensor) -> dict:
    """What core VAEEncode does with the FLUX VAE: centre-crop to multiples of 8 px, encode, the posterior mean as
    the raw latent (ComfyUI's convention)."""
    _, height, width, _ = image.shape
    top, left = (height % 8) // 2, (width % 8) // 2
    pixels = image[:, top : top + height - height % 8, left : left + width - width % 8]
    with torch.no_grad():
        return {"samples": model.loaded.vae.encode_moments(pixels.permute(0, 3, 1, 2) * 2 - 1)[0]}


def test_output_follows_any_size_latent_and_the_vit_sees_the_image_resized(host_stubs):
    import nodes
    from nodes.convert import from_comfy_latent, image_to_pils
    from unicache_core.bagel import BagelPipeline, GivenLatents, ImageTransforms, preset

    model = _load()
    source = _image(100, 75)
    # BAGEL's own resize of 100x75 on the tiny checkpoint (VAE rule 128/64/16) is 96x80; VAEEncode gives 12x9 cells
    rule = ImageTransforms.from_config(model.loaded.config).vae.resize.size_for(100, 75)
    assert rule == (96, 80)
    latent = _vae_encode(model, source)
    assert latent["samples"].shape == (1, 16, 9, 12)
    edit = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheImageEdit"])
    image, out_latent, _, report = edit.edit(model, source, *EDIT_ARGS, latent=latent)
    # 9 rows of 8-px cells: the odd last row is dropped (BAGEL packs 2x2 cells), so the edit is 96x64
    assert image.shape == (1, 64, 96, 3) and out_latent["samples"].shape == (1, 16, 8, 12)
    assert float(image.std()) > 0.01 and report["steps"]
    mm = host_stubs["comfy.model_management"]
    assert mm.loads[-1][1] > 0  # the request memory was counted at the latent's size

    # the same edit through the library with the image resized to 96x64 by the caller (where BAGEL's own rule
    # keeps 96x64): equal, so the node fed the ViT the image resized to the latent's size
    resized = image_to_pils(source)[0].resize((96, 64), Image.BICUBIC)
    assert ImageTransforms.from_config(model.loaded.config).vae.resize.size_for(96, 64) == (96, 64)
    pipe = BagelPipeline(model.runtime())
    given = GivenLatents(source_latent=from_comfy_latent(latent["samples"][..., :8, :], model.loaded))
    reference = pipe.edit(
        "make it blue",
        resized,
        preset(
            "edit",
            num_timesteps=2,
            cfg_text_scale=4.0,
            cfg_img_scale=2.0,
            cfg_interval=(0.0, 1.0),
            timestep_shift=3.0,
            cfg_renorm_min=0.0,
            cfg_renorm_type="text_channel",
        ),
        seed=0,
        given=given,
    )
    expected = np.asarray(reference.image, dtype=np.float32) / 255.0
    assert np.abs(image[0].numpy() - expected).max() <= 0.5 / 255


def test_latent_at_bagels_own_resize_gives_the_result_of_encoding_here(host_stubs):
    """A latent already at BAGEL's resize of the image keeps the former path: the ViT sees BAGEL's resize of the
    image (not a second resize), as when the node encodes the image itself."""
    import nodes
    from nodes.convert import from_comfy_latent, image_to_pils
    from unicache_core.bagel import BagelPipeline, GivenLatents, preset

    model = _load()
    source = _image(60, 45)  # BAGEL's rule on the tiny checkpoint: 80x64
    from unicache_core.bagel import ImageTransforms

    transforms = ImageTransforms.from_config(model.loaded.config)
    pil = image_to_pils(source)[0]
    resized = transforms.prepare(pil)
    assert resized.size == (80, 64)
    at_rule = _vae_encode(model, torch.from_numpy(np.asarray(resized, dtype=np.float32) / 255.0)[None])
    edit = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheImageEdit"])
    image, *_ = edit.edit(model, source, *EDIT_ARGS, latent=at_rule)
    assert image.shape == (1, 64, 80, 3)
    pipe = BagelPipeline(model.runtime())
    settings = preset(
        "edit",
        num_timesteps=2,
        cfg_text_scale=4.0,
        cfg_img_scale=2.0,
        cfg_interval=(0.0, 1.0),
        timestep_shift=3.0,
        cfg_renorm_min=0.0,
        cfg_renorm_type="text_channel",
    )
    given = GivenLatents(source_latent=from_comfy_latent(at_rule["samples"], model.loaded))
    reference = pipe.edit("make it blue", pil, settings, seed=0, given=given)
    assert np.abs(image[0].numpy() - np.asarray(reference.image, dtype=np.float32) / 255.0).max() <= 0.5 / 255


@pytest.mark.parametrize(
    "cells, needle",
    [
        ((130, 4), "holds at most 128 cells (1024 px) per side: scale the image down before VAEEncode"),
        ((1, 6), "smaller than one BAGEL token (2x2 cells, 16 px)"),
    ],
)
def test_latent_that_cannot_fit_is_one_line_before_the_model_is_placed(host_stubs, cells, needle):
    import nodes

    model = _load()
    samples = torch.randn(1, 16, *cells, generator=torch.Generator().manual_seed(0))
    mm = host_stubs["comfy.model_management"]
    loads = len(mm.loads)
    with pytest.raises(ValueError) as caught:
        NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheImageEdit"]).edit(
            model, _image(64, 64), *EDIT_ARGS, latent={"samples": samples}
        )
    message = str(caught.value)
    assert needle in message and "`latent`" in message and "\n" not in message, message
    assert len(mm.loads) == loads


def test_fit_source_latent_rounds_down_to_the_grid(tiny_checkpoint):
    from nodes.validation import fit_source_latent
    from unicache_core.bagel.config import load_bagel_config

    config = load_bagel_config(tiny_checkpoint)
    samples = torch.randn(2, 16, 37, 50)  # core VAEEncode of a 400x300 image (cropped to 400x296)
    fitted, size = fit_source_latent(samples, config)
    assert fitted.shape == (2, 16, 36, 50) and size == (400, 288)
    assert torch.equal(fitted, samples[..., :36, :])
    fitted, size = fit_source_latent(samples[..., :36, :50], config)
    assert fitted.shape == (2, 16, 36, 50) and size == (400, 288)  # on the grid already: unchanged


def test_library_refuses_an_off_grid_source_latent(host_stubs):
    from unicache_core.bagel import BagelPipeline, GivenLatents, preset

    model = _load()
    pipe = BagelPipeline(model.runtime())
    pil = Image.new("RGB", (64, 64), (200, 30, 30))
    with pytest.raises(ValueError, match=r"`source_latent` is 9x12 latent cells .* crop it to 8x12"):
        pipe.edit(
            "x", pil, preset("edit", num_timesteps=2), given=GivenLatents(source_latent=torch.zeros(1, 16, 9, 12))
        )
    with pytest.raises(ValueError, match=r"must be one floating-point latent \[1, 16, H/8, W/8\]"):
        pipe.edit("x", pil, preset("edit", num_timesteps=2), given=GivenLatents(source_latent=torch.zeros(16, 8, 8)))
