"""A run's measurements are typed records (unicache_core/bagel/run_info.py) that also read as mappings of the same
values, TaylorSeer's entries present only when it ran."""

from __future__ import annotations

import dataclasses
import json

import pytest

from unicache_core.bagel.run_info import GenerationInfo, UnderstandingInfo


def _info(**changes) -> GenerationInfo:
    values = dict(
        context_tokens={"gen": 40, "cfg_text": 30, "cfg_img": 20},
        cache_bytes={"gen": 4000, "cfg_text": 3000, "cfg_img": 2000},
        forwards={"gen": 3, "cfg_text": 2, "cfg_img": 2},
        source_latent="checkpoint_vae",
        source_latents=["checkpoint_vae"],
        images=1,
        prefill_s=0.5,
        think_s=0.0,
        denoise_s=2.0,
        decode_s=0.25,
        vae="checkpoint",
        latent_format={"convention": "bagel", "scale_factor": 0.3611, "shift_factor": 0.1159},
    )
    return GenerationInfo(**{**values, **changes})


def test_attributes_and_mapping_agree():
    info = _info()
    assert info.forwards == info["forwards"] == {"gen": 3, "cfg_text": 2, "cfg_img": 2}
    assert dict(info) == info.as_dict() and len(info) == len(info.as_dict())
    assert "forecasts" not in info and info.get("taylorseer_peak_bytes") is None  # TaylorSeer did not run
    assert json.loads(json.dumps(info.as_dict()))["cache_bytes"]["gen"] == 4000
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.forwards = {}  # type: ignore[misc]


def test_taylorseer_entries_appear_when_it_ran():
    info = _info(forecasts={"gen": 5, "cfg_text": 5, "cfg_img": 5}, taylorseer_peak_bytes=1 << 20)
    assert info["forecasts"]["gen"] == 5 and info["taylorseer_peak_bytes"] == 1 << 20
    answer = UnderstandingInfo(prefill_s=0.1, decode_s=0.2, context_tokens={"gen": 12}, cache_bytes=960, images=0)
    assert answer["cache_bytes"] == answer.cache_bytes == 960 and set(answer) == {
        f.name for f in dataclasses.fields(answer)
    }
