"""Hardening: no silent garbage, no hang, no traceback for any user mistake.

* non-finite values (weights, noise, logits, velocities, latents, pixels) raise one
  :class:`NumericalError` where they first appear, naming the tensor or the step and branch;
* finite but absurd settings are refused up front;
* configs are checked against the safetensors headers before any module is built;
* every seed in ``[0, 2**64 - 1]`` has its own noise, and seeds below ``2**32`` keep the official one.

The command line's answers to mistakes are in test_cli_errors.py.
"""

from __future__ import annotations

import math
import os
import re

import numpy as np
import pytest
import torch
from checkpoint_edits import edit_json, rewrite_tensors, set_value
from PIL import Image

from unicache_core.bagel import denoise as denoise_module
from unicache_core.bagel import numerics, seeding
from unicache_core.bagel.checkpoint import loader as loader_module
from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.config import load_bagel_config
from unicache_core.bagel.pipeline import BagelPipeline
from unicache_core.bagel.request import GivenLatents
from unicache_core.bagel.seeding import seeded_generator
from unicache_core.bagel.settings import (
    MAX_CFG_SCALE,
    MAX_NUM_TIMESTEPS,
    TEMPERATURE_RANGE,
    TIMESTEP_SHIFT_RANGE,
    GenerationSettings,
    check_output_size,
    preset,
)
from unicache_core.bagel.transforms import ImageTransforms
from unicache_core.errors import CheckpointError, NumericalError

#: A small, fast text-to-image request on the tiny checkpoint.
SMALL = preset("t2i", width=32, height=32, num_timesteps=2)


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return load_bagel(tiny_checkpoint, dtype="fp32")


@pytest.fixture(scope="module")
def pipe(loaded):
    return BagelPipeline(loaded)


# ------------------------------------------------------------------------------------ non-finite weights


@pytest.mark.parametrize("value, what", [(math.nan, "1 NaN"), (math.inf, "1 infinite"), (-math.inf, "1 infinite")])
@pytest.mark.parametrize(
    "file, name",
    [
        ("ema.safetensors", "language_model.model.layers.1.mlp.down_proj.weight"),
        ("ae.safetensors", "decoder.conv_out.weight"),
    ],
)
def test_non_finite_weight_names_tensor_and_file(tiny_checkpoint_copy, file, name, value, what):
    rewrite_tensors(tiny_checkpoint_copy / file, set_value(name, value))
    with pytest.raises(
        NumericalError,
        match=rf"{re.escape(file)}: tensor {re.escape(repr(name))} holds {what} of "
        rf"\d+ values in the file; the weights are corrupt: re-download {file}",
    ):
        load_bagel(tiny_checkpoint_copy, dtype="fp32")


def test_weight_overflowing_fp16_advises_bf16(tiny_checkpoint_copy):
    name = "language_model.model.layers.0.self_attn.o_proj.weight"
    rewrite_tensors(tiny_checkpoint_copy / "ema.safetensors", set_value(name, 1e5))
    with pytest.raises(
        NumericalError,
        match=rf"{re.escape(repr(name))} has values up to 100000, which overflow fp16 "
        r"\(largest finite value 65504\); keep fp16 out of the weights: dtype 'bf16' or 'fp32'",
    ):
        load_bagel(tiny_checkpoint_copy, dtype="fp16")
    assert load_bagel(tiny_checkpoint_copy, dtype="bf16").dtype == torch.bfloat16  # in range of bf16 and fp32


@pytest.fixture(scope="module")
def overflow_checkpoint(tmp_path_factory, tiny_checkpoint):
    """Finite fp16-representable weights (6e4) whose products overflow fp16 in the velocity and logits heads."""
    import shutil

    dst = tmp_path_factory.mktemp("overflow") / "ckpt"
    shutil.copytree(tiny_checkpoint, dst)

    def edit(tensors):
        for name in ("llm2vae.weight", "language_model.lm_head.weight"):
            tensors[name] = torch.full_like(tensors[name], 6e4)

    rewrite_tensors(dst / "ema.safetensors", edit)
    return dst


def test_fp16_overflow_in_denoising_names_step_and_branch(overflow_checkpoint):
    pipe16 = BagelPipeline(load_bagel(overflow_checkpoint, dtype="fp16"))
    with pytest.raises(
        NumericalError,
        match=r"denoising step 1 of 2: the velocity of the 'gen' branch holds \d+ "
        r"infinite of \d+ values; the model runs in fp16.*run it in bf16",
    ):
        pipe16.text_to_image("x", preset("t2i", width=32, height=32, num_timesteps=3))
    with pytest.raises(NumericalError, match=r"text decoding step 1 of at most 3: the next-token logits hold .*fp16"):
        pipe16.understand("x", None, preset("understanding", max_new_tokens=3))
    pipe32 = BagelPipeline(load_bagel(overflow_checkpoint, dtype="fp32"))
    assert len(pipe32.understand("x", None, preset("understanding", max_new_tokens=2)).token_ids) <= 2  # fp32: in range


# ------------------------------------------------------------------------------------ non-finite values at run time


def test_nan_in_one_branch_names_that_branch_and_step(pipe, monkeypatch):
    original = denoise_module.branch_velocities

    def poisoned(loaded, contexts, x, t, *, step=0, branches=("gen", "cfg_text", "cfg_img"), **kwargs):
        raw = original(loaded, contexts, x, t, step=step, branches=branches, **kwargs)
        if step == 1 and "cfg_text" in raw:
            raw["cfg_text"] = raw["cfg_text"] * math.nan
        return raw

    monkeypatch.setattr(denoise_module, "branch_velocities", poisoned)
    with pytest.raises(
        NumericalError,
        match=r"denoising step 2 of 3: the velocity of the 'cfg_text' branch holds "
        r"256 NaN of 256 values; the model runs in fp32",
    ):
        pipe.text_to_image("x", preset("t2i", width=32, height=32, num_timesteps=4, cfg_interval=(0.0, 1.0)))


def test_non_finite_guided_velocity_advises_lower_scales(pipe, monkeypatch):
    monkeypatch.setattr(denoise_module, "combine_cfg", lambda v, *a, **k: v * math.inf)
    with pytest.raises(
        NumericalError,
        match=r"denoising step 1 of 2: the branch velocities are finite but the "
        r"CFG-guided velocity holds .*cfg_text_scale=7.*lower the guidance",
    ):
        pipe.text_to_image("x", preset("t2i", width=32, height=32, num_timesteps=3, cfg_text_scale=7.0))


def test_decoded_image_nan_is_not_converted(pipe, loaded, monkeypatch):
    monkeypatch.setattr(loaded.vae, "decode", lambda z: torch.full((1, 3, 32, 32), math.nan))
    with pytest.raises(
        NumericalError,
        match=r"the decoded image \(VAE output, before the uint8 conversion\) holds "
        r"3072 NaN.*ae.safetensors",
    ):
        pipe.text_to_image("x", preset("t2i", width=32, height=32, num_timesteps=2))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_injected_noise_must_be_finite(pipe, loaded, bad):
    noise = torch.randn(4, 64)
    noise[2, 3] = bad
    with pytest.raises(NumericalError, match=r"`initial_noise` holds 1 (NaN|infinite) of 256 values"):
        pipe.text_to_image("x", SMALL, given=GivenLatents(initial_noise=noise))
    source = Image.new("RGB", (512, 512))
    width, height = ImageTransforms.from_config(loaded.config).prepare(source).size  # the checkpoint's resize rule
    vae_noise = torch.randn(1, 16, height // 8, width // 8)
    vae_noise[0, 0, 0, 0] = bad
    with pytest.raises(NumericalError, match=r"`vae_noise` holds 1 (NaN|infinite)"):
        pipe.edit("x", source, preset("edit", num_timesteps=2), given=GivenLatents(vae_noise=vae_noise))


@pytest.mark.parametrize(
    "noise, match",
    [
        (np.zeros((4, 64), np.float32), "must be a torch.Tensor.*ndarray"),
        (torch.zeros(4, 64, dtype=torch.int64), "floating-point tensor.*int64"),
        (torch.zeros(4, 63), r"shape \(4, 64\), got \(4, 63\)"),
    ],
)
def test_injected_noise_type_and_shape(pipe, noise, match):
    with pytest.raises(ValueError, match=rf"`initial_noise` .*{match}"):
        pipe.text_to_image("x", SMALL, given=GivenLatents(initial_noise=noise))


def test_vae_noise_that_is_not_a_tensor(pipe):
    """A numpy array of the right shape is refused by its type (it is not a tensor), with the name of the input."""
    with pytest.raises(ValueError, match="`vae_noise` must be a torch.Tensor"):
        pipe.edit(
            "x",
            Image.new("RGB", (512, 512)),
            preset("edit", num_timesteps=2),
            given=GivenLatents(vae_noise=np.zeros((1, 16, 64, 64))),
        )


def test_all_finite_fast_path_and_overflowing_sum():
    big = torch.full((1000,), 60000.0, dtype=torch.float16)
    assert not torch.isfinite(big.sum()) and numerics.all_finite(big)  # the sum overflows, the values do not
    big[500] = math.nan
    assert not numerics.all_finite(big)
    assert numerics.all_finite(torch.arange(5)) and numerics.all_finite(torch.empty(0))
    assert numerics.describe_non_finite(torch.tensor([math.nan, math.inf, 1.0, -math.inf])) == (
        "1 NaN and 2 infinite of 4 values"
    )


def test_check_velocities_order_and_fp16_advice():
    ok = torch.ones(4, 64)
    numerics.check_velocities(
        {"gen": ok, "cfg_text": ok}, ok, step=0, total=5, dtype=torch.float32, cfg_text_scale=4.0, cfg_img_scale=1.5
    )
    halves = torch.full((4, 64), 60000.0, dtype=torch.float16)  # sums overflow, values are finite: no error
    numerics.check_velocities(
        {"gen": halves}, halves, step=0, total=5, dtype=torch.float16, cfg_text_scale=1.0, cfg_img_scale=1.0
    )
    bad = ok.clone()
    bad[0, 0] = math.inf
    with pytest.raises(NumericalError, match=r"step 3 of 5: the velocity of the 'cfg_img' branch.*fp16"):
        numerics.check_velocities(
            {"gen": ok, "cfg_text": ok, "cfg_img": bad},
            bad,
            step=2,
            total=5,
            dtype=torch.float16,
            cfg_text_scale=4.0,
            cfg_img_scale=1.5,
        )
    with pytest.raises(NumericalError, match=r"guided velocity.*lower the guidance scales or load the model with"):
        numerics.check_velocities(
            {"gen": ok}, bad, step=0, total=5, dtype=torch.float16, cfg_text_scale=4.0, cfg_img_scale=1.5
        )


# ------------------------------------------------------------------------------------ absurd settings


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(cfg_text_scale=MAX_CFG_SCALE + 0.5), "cfg_text_scale"),
        (dict(cfg_img_scale=1e30), "cfg_img_scale"),
        (dict(timestep_shift=TIMESTEP_SHIFT_RANGE[0] / 2), "timestep_shift"),
        (dict(timestep_shift=1e-30), "timestep_shift"),
        (dict(timestep_shift=TIMESTEP_SHIFT_RANGE[1] + 1), "timestep_shift"),
        (dict(num_timesteps=MAX_NUM_TIMESTEPS + 1), "num_timesteps"),
        (dict(num_timesteps=10**8), "num_timesteps"),
        (dict(think=True, think_do_sample=True, think_temperature=1e-30), "think_temperature"),
        (dict(think=True, think_do_sample=True, think_temperature=TEMPERATURE_RANGE[1] * 2), "think_temperature"),
    ],
)
def test_absurd_finite_settings_are_refused(kwargs, name):
    with pytest.raises(ValueError, match=rf"`{name}` must be .*<= .*got"):
        SMALL.replace(**kwargs)


@pytest.mark.parametrize("temperature", [1e-30, TEMPERATURE_RANGE[0] / 2, 1e6])
def test_absurd_temperature_is_refused(temperature):
    with pytest.raises(ValueError, match=r"`temperature` must be a finite number >= 0.001 and <= 100.0"):
        preset("understanding", max_new_tokens=2, do_sample=True, temperature=temperature)


def test_bounds_keep_defaults_and_edges():
    for defaults in [
        dict(cfg_img_scale=1.5, cfg_interval=(0.4, 1.0), cfg_renorm_type="global"),
        dict(cfg_img_scale=2.0, cfg_interval=(0.0, 1.0), cfg_renorm_type="text_channel"),
    ]:
        GenerationSettings(
            num_timesteps=50, timestep_shift=3.0, cfg_text_scale=4.0, cfg_renorm_min=0.0, **defaults
        )  # the official T2I and edit defaults
    GenerationSettings(
        num_timesteps=MAX_NUM_TIMESTEPS,
        timestep_shift=TIMESTEP_SHIFT_RANGE[0],
        cfg_text_scale=MAX_CFG_SCALE,
        cfg_img_scale=MAX_CFG_SCALE,
        cfg_interval=(0, 1),
        cfg_renorm_min=1,
        cfg_renorm_type="channel",
    )
    GenerationSettings(
        num_timesteps=2,
        timestep_shift=TIMESTEP_SHIFT_RANGE[1],
        cfg_text_scale=0.0,
        cfg_img_scale=0.0,
        cfg_interval=(0.5, 0.5),
        cfg_renorm_min=0.0,
        cfg_renorm_type="global",
    )


def test_size_must_be_a_multiple_of_the_configs_latent_patch(tiny_checkpoint):
    import dataclasses

    config = load_bagel_config(tiny_checkpoint)
    assert check_output_size(config, 1024, 16) == (1024, 16)
    coarse = dataclasses.replace(config, ae=dataclasses.replace(config.ae, downsample=16))  # 32-px latent tokens
    with pytest.raises(ValueError, match=r"`width` must be a positive multiple of 32 and <= 2048, got 48"):
        check_output_size(coarse, 48, 64)


# ------------------------------------------------------------------------------------ seeds


def test_seeds_above_32_bits_have_their_own_noise():
    def noise(seed):
        return torch.randn(1000, generator=seeded_generator(seed))

    # what torch alone does: the CPU Mersenne Twister keeps only the low 32 bits of the seed
    assert torch.equal(
        torch.randn(8, generator=torch.Generator().manual_seed(2**32)),
        torch.randn(8, generator=torch.Generator().manual_seed(0)),
    )
    assert not torch.equal(noise(2**32), noise(0))
    assert torch.equal(noise(5), torch.randn(1000, generator=torch.Generator().manual_seed(5)))  # official stream
    assert torch.equal(noise(2**32 - 1), torch.randn(1000, generator=torch.Generator().manual_seed(2**32 - 1)))
    streams = [noise(s) for s in (0, 2**32, 2**32 + 1, 2**33, 5 + 2**32, 2**64 - 1)]
    assert len({tuple(s[:4].tolist()) for s in streams}) == len(streams)
    assert torch.equal(noise(2**40 + 3), noise(2**40 + 3))  # still deterministic
    assert seeded_generator(2**64 - 1).initial_seed() == 2**64 - 1
    for bad in (-1, 2**64, 1.0, True):
        with pytest.raises(ValueError, match="`seed`"):
            seeded_generator(bad)


def test_seed_mapping_refuses_an_unknown_state_layout(monkeypatch):
    monkeypatch.setattr(seeding, "_layout_ok", lambda: False)
    with pytest.raises(ValueError, match=r"`seed` 4294967296 >= 2\*\*32 .*use a seed below 2\*\*32"):
        seeded_generator(2**32)
    assert seeded_generator(7).initial_seed() == 7  # the official path needs no layout knowledge


def test_pipeline_seeds_2_32_apart_give_different_images(pipe):
    settings = SMALL.replace(cfg_text_scale=1.0)  # one branch: fast
    low, high = pipe.text_to_image("x", settings, seed=5), pipe.text_to_image("x", settings, seed=5 + 2**32)
    assert high.seed == 5 + 2**32 and not torch.equal(low.latents, high.latents)
    noise = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    injected = pipe.text_to_image("x", settings, given=GivenLatents(initial_noise=noise))
    assert torch.equal(low.latents, injected.latents)  # seeds < 2**32: exactly the official manual_seed noise


# ------------------------------------------------------------------------------------ configs vs headers


@pytest.fixture
def no_model_build(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a module was built before the config was checked against the headers")

    monkeypatch.setattr(loader_module, "build_bagel", boom)
    monkeypatch.setattr(loader_module, "AutoEncoder", boom)


@pytest.mark.parametrize(
    "file, changes, match",
    [
        (
            "llm_config.json",
            dict(num_hidden_layers=10_000_000),
            r"num_hidden_layers = 10000000 layers, but "
            r"ema.safetensors holds 2 \(language_model.model.layers.0 to language_model.model.layers.1\)",
        ),
        ("llm_config.json", dict(num_hidden_layers=1), "num_hidden_layers = 1 layers, but ema.safetensors holds 2"),
        (
            "llm_config.json",
            dict(hidden_size=2**40),
            r"vocab_size and hidden_size give .*embed_tokens.weight the "
            r"shape \(\d+, 1099511627776\), but ema.safetensors stores \(\d+, 64\)",
        ),
        ("llm_config.json", dict(intermediate_size=2**40), "intermediate_size and hidden_size give"),
        ("llm_config.json", dict(vocab_size=2**40), "vocab_size and hidden_size give"),
        ("llm_config.json", dict(num_key_value_heads=4), "num_key_value_heads and hidden_size give"),
        ("vit_config.json", dict(num_hidden_layers=10_000_000), "num_hidden_layers = 10000000 means 9999999 built"),
        ("vit_config.json", dict(hidden_size=2**30, num_attention_heads=2), "patch_embedding"),
        ("vit_config.json", dict(image_size=14 * 10**5), "position_embedding"),
        # (10_000_000 blocks is refused by the config itself: tests/test_checks_before_builds.py)
        ("ae_config.json", dict(num_res_blocks=30), "num_res_blocks = 30 blocks per level, but ae.safetensors holds 2"),
        ("ae_config.json", dict(ch_mult=[1, 1, 1], downsample=4), "ch_mult has 3 levels, but ae.safetensors holds 4"),
        ("ae_config.json", dict(z_channels=2**20), "z_channels, ch and ch_mult"),
    ],
)
def test_config_is_checked_against_the_headers_before_building(
    tiny_checkpoint_copy, no_model_build, file, changes, match
):
    edit_json(tiny_checkpoint_copy / file, **changes)
    with pytest.raises(CheckpointError, match=match) as info:  # no_model_build: refused before any build
        load_bagel(tiny_checkpoint_copy, dtype="fp32")
    assert "do not belong to these weights" in str(info.value) and file in str(info.value)


def test_builtin_vae_config_named_when_ae_config_is_absent(tiny_checkpoint_copy, no_model_build):
    (tiny_checkpoint_copy / "ae_config.json").unlink()  # the real FLUX defaults do not describe the tiny VAE
    with pytest.raises(CheckpointError, match="the built-in FLUX VAE config does not match the weights"):
        load_bagel(tiny_checkpoint_copy, dtype="fp32")


def test_model_build_failure_is_a_checkpoint_error(tiny_checkpoint, monkeypatch):
    def overflow(*args, **kwargs):
        raise RuntimeError("Storage size calculation overflowed with sizes=[1099511627776, 1099511627776]")

    monkeypatch.setattr(loader_module, "build_bagel", overflow)  # the loader builds through it
    with pytest.raises(CheckpointError, match="cannot build the model described by the config files.*overflowed"):
        load_bagel(tiny_checkpoint, dtype="fp32")


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda p: p.write_text("[" * 100_000 + "]" * 100_000), "RecursionError"),
        (lambda p: p.write_text('{"hidden_size": ' + "9" * 5000 + "}"), "ValueError: Exceeds the limit"),
        (lambda p: p.write_text('{"x": "' + "a" * (2 << 20) + '"}'), r"bytes, more than the \d+ a config can need"),
        (lambda p: p.write_bytes(b'{"hidden_size": 64, "x": "\xff"}'), "UnicodeDecodeError"),
        (lambda p: (p.unlink(), p.mkdir()), "is a directory"),
        (lambda p: (p.unlink(), os.mkfifo(p)), "is not a regular file"),  # never opened: a FIFO would block
    ],
)
def test_hostile_config_files(tiny_checkpoint_copy, corrupt, match):
    corrupt(tiny_checkpoint_copy / "llm_config.json")
    with pytest.raises(CheckpointError, match=match):
        load_bagel_config(tiny_checkpoint_copy)


@pytest.mark.parametrize(
    "file, changes, match",
    [
        ("llm_config.json", dict(max_position_embeddings=10**18), "max_position_embeddings.*must be <= 16777216"),
        ("ae_config.json", dict(scale_factor=0.0), "'scale_factor' = 0.0 must be > 0"),
    ],
)
def test_config_values_without_a_weight_to_check_against(tiny_checkpoint_copy, file, changes, match):
    edit_json(tiny_checkpoint_copy / file, **changes)
    with pytest.raises(CheckpointError, match=match):
        load_bagel_config(tiny_checkpoint_copy)


@pytest.mark.parametrize("name", ["vocab.json", "ema.safetensors"])
@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_checkpoint_file_that_is_a_folder_or_fifo(tiny_checkpoint_copy, name, kind):
    path = tiny_checkpoint_copy / name
    path.unlink()
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    expected = "is a directory" if kind == "directory" else "is not a regular file"
    with pytest.raises(CheckpointError, match=re.escape(name) + f" {expected}"):
        load_bagel(tiny_checkpoint_copy, dtype="fp32")
