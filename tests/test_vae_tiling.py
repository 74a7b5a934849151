"""The tiled VAE decode: covers the image, stays close to the whole decode, holds less, and is what a decode that
runs out of device memory falls back to; the memory plan counts it where the whole decode would not fit."""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import pytest
import torch

from unicache_core.bagel import load_bagel
from unicache_core.bagel.denoise import decode_latents
from unicache_core.bagel.memory.plan import PlanSettings, official_config, plan_memory
from unicache_core.bagel.memory.trace import TensorMemoryTracker
from unicache_core.bagel.modeling import vae_tiling
from unicache_core.bagel.modeling.vae_tiling import decode_tiled, tile_starts
from unicache_core.bagel.sampling import pack_latent
from unicache_core.bagel.settings import BUNDLED_CHECKPOINT_DIR

GB = 10**9


@pytest.fixture(scope="module")
def loaded():
    return load_bagel(BUNDLED_CHECKPOINT_DIR, dtype=torch.float32)


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    return 10 * math.log10(4.0 / float((a - b).pow(2).mean()))  # pixels in [-1, 1]


@pytest.mark.parametrize("length,tile,overlap", [(128, 64, 16), (100, 64, 16), (64, 64, 16), (40, 16, 4), (17, 8, 0)])
def test_tiles_cover_the_latent_and_overlap_as_asked(length, tile, overlap):
    starts = tile_starts(length, tile, overlap)
    assert starts[0] == 0 and min(starts[-1] + tile, length) == length
    for a, b in zip(starts, starts[1:]):
        assert a < b and a + tile - b >= overlap  # neighbours share at least the overlap, no gap


def test_a_bad_overlap_is_refused():
    with pytest.raises(ValueError, match="overlap"):
        tile_starts(100, 16, 16)


def test_tiled_decode_is_close_to_the_whole_one_and_exact_in_one_tile(loaded):
    vae = loaded.vae
    z = torch.randn(1, 16, 48, 40, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        whole = vae.decode(z)
        assert torch.equal(decode_tiled(vae, z, tile=64, overlap=16), whole)  # one tile: the whole decode
        coarse, fine = _psnr(decode_tiled(vae, z, tile=16, overlap=4), whole), _psnr(decode_tiled(vae, z, 32, 8), whole)
    assert tuple(decode_tiled(vae, z, 16, 4).shape) == tuple(whole.shape)
    assert 25.0 < coarse < fine < 100.0  # close, not equal, and closer with larger tiles


def test_tiled_decode_holds_less_than_the_whole_one(loaded):
    vae = loaded.vae
    z = torch.randn(1, 16, 48, 48, generator=torch.Generator().manual_seed(1))
    peaks = {}
    for name, run in (("whole", lambda: vae.decode(z)), ("tiled", lambda: decode_tiled(vae, z, 16, 4))):
        with torch.inference_mode(), TensorMemoryTracker() as tracker:
            run()
        peaks[name] = tracker.peak_bytes
    assert peaks["tiled"] < 0.4 * peaks["whole"], peaks


def test_a_decode_out_of_device_memory_falls_back_to_tiles(loaded, monkeypatch, caplog):
    """A whole decode larger than one tile (16 latent cells a side here) raises CUDA's out-of-memory error: the image
    still comes out, from the tiled decode, with one warning."""
    monkeypatch.setattr(vae_tiling, "TILE_CELLS", 16)
    monkeypatch.setattr(vae_tiling, "OVERLAP_CELLS", 4)
    vae = loaded.vae
    real_decode = vae.decode

    def small_only(z):
        if z.shape[2] * z.shape[3] > 16 * 16:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return real_decode(z)

    monkeypatch.setattr(vae, "decode", small_only)
    latent = torch.randn(1, 16, 40, 40, generator=torch.Generator().manual_seed(2))
    packed = pack_latent(latent[0], loaded.config.latent_patch_size)
    with caplog.at_level(logging.WARNING, logger="unicache_core.bagel.denoise"):
        _, image = decode_latents(loaded, packed, 40 * 8, 40 * 8, vae)
    assert image.size == (320, 320)
    assert len(caplog.records) == 1 and "tiles" in caplog.records[0].getMessage()
    with torch.inference_mode():
        expected = decode_tiled(vae, latent, 16, 4)
    pixels = torch.from_numpy(np.array(image)).float()
    reference = (expected[0].permute(1, 2, 0).clamp(-1, 1) + 1) * 127.5
    assert float((pixels - reference).abs().max()) <= 1.0  # the same tiles, up to uint8 rounding


def test_the_plan_counts_a_tiled_decode_where_the_whole_one_would_not_fit():
    """BAGEL-7B-MoT, 1024 px edit, fp8 weights with layer offload: 8.1 GB with the whole decode (does not fit 8 GB),
    under 8 GB with the tiled one; with room for the whole decode the plan keeps it."""
    settings = PlanSettings(
        task="edit", width=1024, height=1024, kv_method="unicache", weight_dtype="fp8_e4m3fn", offload="layers"
    )
    roomy, tight = plan_memory(official_config(), settings, 24 * GB), plan_memory(official_config(), settings, 8 * GB)
    assert roomy.vae_decode == "whole" and roomy.peak_bytes > 8 * GB
    assert tight.vae_decode == "tiled" and tight.fits and tight.peak_bytes < roomy.peak_bytes - GB
    assert tight.breakdown["vae_working"] < roomy.breakdown["vae_working"]
    cpu = plan_memory(official_config(), dataclasses.replace(settings, device="cpu"), 8 * GB)
    assert cpu.vae_decode == "whole"  # planned on CUDA only, where the allocator refuses what the device lacks
