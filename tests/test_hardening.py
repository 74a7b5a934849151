"""Hardening: no silent garbage, no hang, no traceback for any user mistake (issue F).

* non-finite values (weights, noise, logits, velocities, latents, pixels) raise one
  :class:`NumericalError` where they first appear, naming the tensor or the step and branch;
* finite but absurd settings are refused up front;
* configs are checked against the safetensors headers before any module is built;
* every seed in ``[0, 2**64 - 1]`` has its own noise, and seeds below ``2**32`` keep the official one;
* the CLI checks every argument before loading weights and answers every mistake, and Ctrl-C, with
  one ``error: ...`` line (exit 2, or 130 for Ctrl-C).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from unicache_core.bagel import __main__ as cli
from unicache_core.bagel.checkpoint import loader as loader_module
from unicache_core.bagel import numerics, seeding
from unicache_core.bagel import pipeline as pipeline_module
from unicache_core.bagel.cli_checks import read_prompt_file, save_image
from unicache_core.bagel.config import load_bagel_config
from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.pipeline import (
    MAX_CFG_SCALE, MAX_NUM_TIMESTEPS, TEMPERATURE_RANGE, TIMESTEP_SHIFT_RANGE, BagelPipeline, FlowSettings,
    check_output_size,
)
from unicache_core.bagel.seeding import seeded_generator
from unicache_core.bagel.transforms import ImageTransforms
from unicache_core.errors import CheckpointError, NumericalError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return load_bagel(tiny_checkpoint, dtype="fp32")


@pytest.fixture(scope="module")
def pipe(loaded):
    return BagelPipeline(loaded)


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _rewrite(path: Path, edit) -> None:
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def _set(name: str, value: float, *, everywhere: bool = False):
    def edit(tensors):
        if everywhere:
            tensors[name] = torch.full_like(tensors[name], value)
        else:
            tensors[name].view(-1)[0] = value

    return edit


# ------------------------------------------------------------------------------------ non-finite weights


@pytest.mark.parametrize("value, what", [(math.nan, "1 NaN"), (math.inf, "1 infinite"), (-math.inf, "1 infinite")])
@pytest.mark.parametrize(
    "file, name",
    [("ema.safetensors", "language_model.model.layers.1.mlp.down_proj.weight"),
     ("ae.safetensors", "decoder.conv_out.weight")],
)
def test_non_finite_weight_names_tensor_and_file(tiny_checkpoint_copy, file, name, value, what):
    _rewrite(tiny_checkpoint_copy / file, _set(name, value))
    with pytest.raises(NumericalError, match=rf"{re.escape(file)}: tensor {re.escape(repr(name))} holds {what} of "
                                             rf"\d+ values in the file; the weights are corrupt: re-download {file}"):
        load_bagel(tiny_checkpoint_copy, dtype="fp32")


def test_weight_overflowing_fp16_advises_bf16(tiny_checkpoint_copy):
    name = "language_model.model.layers.0.self_attn.o_proj.weight"
    _rewrite(tiny_checkpoint_copy / "ema.safetensors", _set(name, 1e5))
    with pytest.raises(NumericalError, match=rf"{re.escape(repr(name))} has values up to 100000, which overflow fp16 "
                                             r"\(largest finite value 65504\); load the model with dtype='bf16'"):
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

    _rewrite(dst / "ema.safetensors", edit)
    return dst


def test_fp16_overflow_in_denoising_names_step_and_branch(overflow_checkpoint):
    pipe16 = BagelPipeline(load_bagel(overflow_checkpoint, dtype="fp16"))
    with pytest.raises(NumericalError, match=r"denoising step 1 of 2: the velocity of the 'gen' branch holds \d+ "
                                             r"infinite of \d+ values; the model runs in fp16.*dtype='bf16'"):
        pipe16.text_to_image("x", width=32, height=32, num_timesteps=3)
    with pytest.raises(NumericalError, match=r"text decoding step 1 of at most 3: the next-token logits hold .*fp16"):
        pipe16.understand(None, "x", max_new_tokens=3)
    pipe32 = BagelPipeline(load_bagel(overflow_checkpoint, dtype="fp32"))
    assert len(pipe32.understand(None, "x", max_new_tokens=2).token_ids) <= 2  # fp32 has the range


# ------------------------------------------------------------------------------------ non-finite values at run time


def test_nan_in_one_branch_names_that_branch_and_step(pipe, monkeypatch):
    original = BagelPipeline.branch_velocities

    def poisoned(self, contexts, x, t, *, step=0, branches=("gen", "cfg_text", "cfg_img")):
        raw = original(self, contexts, x, t, step=step, branches=branches)
        if step == 1 and "cfg_text" in raw:
            raw["cfg_text"] = raw["cfg_text"] * math.nan
        return raw

    monkeypatch.setattr(BagelPipeline, "branch_velocities", poisoned)
    with pytest.raises(NumericalError, match=r"denoising step 2 of 3: the velocity of the 'cfg_text' branch holds "
                                             r"256 NaN of 256 values; the model runs in fp32"):
        pipe.text_to_image("x", width=32, height=32, num_timesteps=4, cfg_interval=(0.0, 1.0))


def test_non_finite_guided_velocity_advises_lower_scales(pipe, monkeypatch):
    monkeypatch.setattr(pipeline_module, "combine_cfg", lambda v, *a, **k: v * math.inf)
    with pytest.raises(NumericalError, match=r"denoising step 1 of 2: the branch velocities are finite but the "
                                             r"CFG-guided velocity holds .*cfg_text_scale=7.*lower the guidance"):
        pipe.text_to_image("x", width=32, height=32, num_timesteps=3, cfg_text_scale=7.0)


def test_decoded_image_nan_is_not_converted(pipe, loaded, monkeypatch):
    monkeypatch.setattr(loaded.vae, "decode", lambda z: torch.full((1, 3, 32, 32), math.nan))
    with pytest.raises(NumericalError, match=r"the decoded image \(VAE output, before the uint8 conversion\) holds "
                                             r"3072 NaN.*ae.safetensors"):
        pipe.text_to_image("x", width=32, height=32, num_timesteps=2)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_injected_noise_must_be_finite(pipe, loaded, bad):
    noise = torch.randn(4, 64)
    noise[2, 3] = bad
    with pytest.raises(NumericalError, match=r"`initial_noise` holds 1 (NaN|infinite) of 256 values"):
        pipe.text_to_image("x", width=32, height=32, num_timesteps=2, initial_noise=noise)
    source = Image.new("RGB", (512, 512))
    width, height = ImageTransforms.from_config(loaded.config).prepare(source).size  # the checkpoint's resize rule
    vae_noise = torch.randn(1, 16, height // 8, width // 8)
    vae_noise[0, 0, 0, 0] = bad
    with pytest.raises(NumericalError, match=r"`vae_noise` holds 1 (NaN|infinite)"):
        pipe.edit(source, "x", num_timesteps=2, vae_noise=vae_noise)


@pytest.mark.parametrize(
    "noise, match",
    [(np.zeros((4, 64), np.float32), "must be a torch.Tensor.*ndarray"),
     (torch.zeros(4, 64, dtype=torch.int64), "floating-point tensor.*int64"),
     (torch.zeros(4, 63), r"shape \(4, 64\), got \(4, 63\)")],
)
def test_injected_noise_type_and_shape(pipe, noise, match):
    with pytest.raises(ValueError, match=rf"`initial_noise` .*{match}"):
        pipe.text_to_image("x", width=32, height=32, num_timesteps=2, initial_noise=noise)


def test_vae_noise_that_is_not_a_tensor(pipe):
    """Before: a numpy array of the right shape passed the shape test and crashed with AttributeError."""
    with pytest.raises(ValueError, match="`vae_noise` must be a torch.Tensor"):
        pipe.edit(Image.new("RGB", (512, 512)), "x", num_timesteps=2, vae_noise=np.zeros((1, 16, 64, 64)))


def test_all_finite_fast_path_and_overflowing_sum():
    big = torch.full((1000,), 60000.0, dtype=torch.float16)
    assert not torch.isfinite(big.sum()) and numerics.all_finite(big)  # the sum overflows, the values do not
    big[500] = math.nan
    assert not numerics.all_finite(big)
    assert numerics.all_finite(torch.arange(5)) and numerics.all_finite(torch.empty(0))
    assert numerics.describe_non_finite(torch.tensor([math.nan, math.inf, 1.0, -math.inf])) == (
        "1 NaN and 2 infinite of 4 values")


def test_check_velocities_order_and_fp16_advice():
    ok = torch.ones(4, 64)
    numerics.check_velocities({"gen": ok, "cfg_text": ok}, ok, step=0, total=5, dtype=torch.float32,
                              cfg_text_scale=4.0, cfg_img_scale=1.5)
    halves = torch.full((4, 64), 60000.0, dtype=torch.float16)  # sums overflow, values are finite: no error
    numerics.check_velocities({"gen": halves}, halves, step=0, total=5, dtype=torch.float16, cfg_text_scale=1.0,
                              cfg_img_scale=1.0)
    bad = ok.clone()
    bad[0, 0] = math.inf
    with pytest.raises(NumericalError, match=r"step 3 of 5: the velocity of the 'cfg_img' branch.*fp16"):
        numerics.check_velocities({"gen": ok, "cfg_text": ok, "cfg_img": bad}, bad, step=2, total=5,
                                  dtype=torch.float16, cfg_text_scale=4.0, cfg_img_scale=1.5)
    with pytest.raises(NumericalError, match=r"guided velocity.*lower the guidance scales or load the model with"):
        numerics.check_velocities({"gen": ok}, bad, step=0, total=5, dtype=torch.float16, cfg_text_scale=4.0,
                                  cfg_img_scale=1.5)


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
def test_absurd_finite_settings_are_refused(pipe, kwargs, name):
    kwargs = {"width": 32, "height": 32, "num_timesteps": 2, **kwargs}
    with pytest.raises(ValueError, match=rf"`{name}` must be .*<= .*got"):
        pipe.text_to_image("x", **kwargs)


@pytest.mark.parametrize("temperature", [1e-30, TEMPERATURE_RANGE[0] / 2, 1e6])
def test_absurd_temperature_is_refused(pipe, temperature):
    with pytest.raises(ValueError, match=r"`temperature` must be a finite number >= 0.001 and <= 100.0"):
        pipe.understand(None, "x", max_new_tokens=2, do_sample=True, temperature=temperature)


def test_bounds_keep_defaults_and_edges():
    for defaults in [(50, 3.0, 4.0, 1.5, (0.4, 1.0), 0.0, "global"), (50, 3.0, 4.0, 2.0, (0.0, 1.0), 0.0, "text_channel")]:
        FlowSettings.create(*defaults)  # the official T2I and edit defaults
    FlowSettings.create(MAX_NUM_TIMESTEPS, TIMESTEP_SHIFT_RANGE[0], MAX_CFG_SCALE, MAX_CFG_SCALE, (0, 1), 1, "channel")
    FlowSettings.create(2, TIMESTEP_SHIFT_RANGE[1], 0.0, 0.0, (0.5, 0.5), 0.0, "global")


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
    assert torch.equal(torch.randn(8, generator=torch.Generator().manual_seed(2**32)),
                       torch.randn(8, generator=torch.Generator().manual_seed(0)))
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
    kw = dict(width=32, height=32, num_timesteps=2, cfg_text_scale=1.0)  # one branch: fast
    low, high = pipe.text_to_image("x", seed=5, **kw), pipe.text_to_image("x", seed=5 + 2**32, **kw)
    assert high.seed == 5 + 2**32 and not torch.equal(low.latents, high.latents)
    injected = pipe.text_to_image("x", initial_noise=torch.randn(4, 64, generator=torch.Generator().manual_seed(5)),
                                  **kw)
    assert torch.equal(low.latents, injected.latents)  # seeds < 2**32: exactly the official manual_seed noise


# ------------------------------------------------------------------------------------ configs vs headers


@pytest.fixture
def no_model_build(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a module was built before the config was checked against the headers")

    monkeypatch.setattr(loader_module, "Bagel", boom)
    monkeypatch.setattr(loader_module, "AutoEncoder", boom)


@pytest.mark.parametrize(
    "file, changes, match",
    [
        ("llm_config.json", dict(num_hidden_layers=10_000_000), r"num_hidden_layers = 10000000 layers, but "
         r"ema.safetensors holds 2 \(language_model.model.layers.0 to language_model.model.layers.1\)"),
        ("llm_config.json", dict(num_hidden_layers=1), "num_hidden_layers = 1 layers, but ema.safetensors holds 2"),
        ("llm_config.json", dict(hidden_size=2**40), r"vocab_size and hidden_size give .*embed_tokens.weight the "
         r"shape \(\d+, 1099511627776\), but ema.safetensors stores \(\d+, 64\)"),
        ("llm_config.json", dict(intermediate_size=2**40), "intermediate_size and hidden_size give"),
        ("llm_config.json", dict(vocab_size=2**40), "vocab_size and hidden_size give"),
        ("llm_config.json", dict(num_key_value_heads=4), "num_key_value_heads and hidden_size give"),
        ("vit_config.json", dict(num_hidden_layers=10_000_000), "num_hidden_layers = 10000000 means 9999999 built"),
        ("vit_config.json", dict(hidden_size=2**30, num_attention_heads=2), "patch_embedding"),
        ("vit_config.json", dict(image_size=14 * 10**5), "position_embedding"),
        ("ae_config.json", dict(num_res_blocks=10_000_000), "num_res_blocks = 10000000 blocks per level, but "
         "ae.safetensors holds 2"),
        ("ae_config.json", dict(ch_mult=[1, 1, 1], downsample=4), "ch_mult has 3 levels, but ae.safetensors holds 4"),
        ("ae_config.json", dict(z_channels=2**20), "z_channels, ch and ch_mult"),
    ],
)
def test_config_is_checked_against_the_headers_before_building(tiny_checkpoint_copy, no_model_build, file, changes,
                                                               match):
    _edit_json(tiny_checkpoint_copy / file, **changes)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=match) as info:
        load_bagel(tiny_checkpoint_copy, dtype="fp32")
    assert time.perf_counter() - start < 5
    assert "do not belong to these weights" in str(info.value) and file in str(info.value)


def test_builtin_vae_config_named_when_ae_config_is_absent(tiny_checkpoint_copy, no_model_build):
    (tiny_checkpoint_copy / "ae_config.json").unlink()  # the real FLUX defaults do not describe the tiny VAE
    with pytest.raises(CheckpointError, match="the built-in FLUX VAE config does not match the weights"):
        load_bagel(tiny_checkpoint_copy, dtype="fp32")


def test_model_build_failure_is_a_checkpoint_error(tiny_checkpoint, monkeypatch):
    def overflow(*args, **kwargs):
        raise RuntimeError("Storage size calculation overflowed with sizes=[1099511627776, 1099511627776]")

    monkeypatch.setattr(loader_module, "Bagel", overflow)
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
    [("llm_config.json", dict(max_position_embeddings=10**18), "max_position_embeddings.*must be <= 16777216"),
     ("ae_config.json", dict(scale_factor=0.0), "'scale_factor' = 0.0 must be > 0")],
)
def test_config_values_without_a_weight_to_check_against(tiny_checkpoint_copy, file, changes, match):
    _edit_json(tiny_checkpoint_copy / file, **changes)
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


# ------------------------------------------------------------------------------------ CLI: before loading


@pytest.fixture
def no_weights(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("weights were loaded before the arguments were checked")

    monkeypatch.setattr(loader_module, "load_bagel", boom)


def _exit_code(argv) -> int:
    """``cli.main(argv)``; argparse mistakes raise SystemExit, whose code is returned instead."""
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return exc.code


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def _t2i(checkpoint, *extra):
    return ["t2i", "--checkpoint", str(checkpoint), "--prompt", "x", "--width", "32", "--height", "32", "--steps",
            "2", "--dtype", "fp32", "-q", *extra]


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--seed", "-1"], r"--seed: `seed` must be an integer in \[0, 2\*\*64 - 1\]"),
        (["--seed", str(2**64)], "--seed: `seed`"),
        (["--steps", "1"], "--steps: `num_timesteps` must be an integer >= 2 and <= 1000, got 1"),
        (["--steps", "100000000"], "--steps: `num_timesteps`.*got 100000000"),
        (["--width", "40"], "--width: `width` must be a positive multiple of 16 and <= 1024, got 40"),
        (["--height", "2048"], "--height: `height`.*got 2048"),
        (["--width", "0"], "--width:"),
        (["--cfg-text-scale", "1e30"], "--cfg-text-scale: `cfg_text_scale` must be a finite number >= 0.0 and <= 100"),
        (["--cfg-img-scale", "nan"], "--cfg-img-scale:"),
        (["--timestep-shift", "1e-30"], "--timestep-shift: `timestep_shift` must be a finite number >= 0.01"),
        (["--timestep-shift", "inf"], "--timestep-shift:"),
        (["--cfg-interval", "0.9", "0.1"], "--cfg-interval: `cfg_interval` must satisfy lo <= hi"),
        (["--cfg-renorm-type", "Global"], "--cfg-renorm-type:"),
        (["--cfg-renorm-min", "2"], "--cfg-renorm-min:"),
        (["--think", "--do-sample", "--temperature", "1e-30"], "--temperature: `think_temperature`"),
        (["--think", "--max-new-tokens", "0"], "--max-new-tokens: `think_max_new_tokens`"),
        (["--think", "--max-new-tokens", "1000000000"], "--max-new-tokens: `think_max_new_tokens` is too long"),
        (["--device", "bogus"], "--device: `device` 'bogus' is not a torch device"),
        (["--seed", "abc"], r"argument --seed: invalid int value: 'abc' \(see .* --help\)"),
        (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    ],
)
def test_cli_bad_argument_fails_before_loading(tiny_checkpoint, no_weights, capsys, extra, match):
    assert _exit_code(_t2i(tiny_checkpoint, *extra)) == 2
    assert re.search(match, _one_line_error(capsys))


@pytest.mark.parametrize(
    "argv, match",
    [
        (["understand", "--prompt", "x", "--do-sample", "--temperature", "0"], "--temperature: `temperature`"),
        (["understand", "--prompt", "x", "--max-new-tokens", "40000"], "--max-new-tokens: `max_new_tokens` is too long"),
        (["understand", "--prompt", "x", "--seed", "-5"], "--seed:"),
        (["understand", "--prompt", "x", "--image", "{tmp}"], "--image: .* is a directory; pass an image file"),
        (["understand", "--prompt", "x", "--image", "{tmp}/nope.png"], "--image: file not found"),
        (["edit", "--prompt", "x", "--image", "{tmp}/notes.txt", "--out", "{tmp}/e.png"], "--image: cannot read"),
        (["edit", "--prompt", "x", "--image", "{tmp}/cut.png", "--out", "{tmp}/e.png"], "--image: cannot read"),
        (["edit", "--prompt", "x", "--image", "{tmp}/ok.png", "--out", "{tmp}/e.png", "--steps", "1"], "--steps:"),
        (["t2i", "--prompt", "x", "--out", "{tmp}"], "--out: .* is a directory"),
        (["t2i", "--prompt", "x", "--out", "{tmp}/notes.txt/o.png"], "--out: .*notes.txt is not a directory"),
        (["t2i", "--prompt", "x", "--out", "{tmp}/o.gif"], "--out: unsupported image suffix '.gif'"),
        (["t2i", "--prompt", "x", "--out", "/dev/null"], "--out: /dev/null exists and is not a regular file"),
        (["t2i", "--prompt-file", "{tmp}/nope.txt"], "--prompt-file: file not found"),
        (["t2i", "--prompt-file", "{tmp}"], "--prompt-file: .* is a directory"),
        (["t2i", "--prompt-file", "{tmp}/latin1.txt"], r"--prompt-file: .*latin1.txt is not valid UTF-8 \(byte 0xe9 "
                                                       r"at offset 3\)"),
        (["t2i", "--prompt", "x", "--prompt-file", "{tmp}/notes.txt"], "not allowed with argument"),
        (["t2i"], "one of the arguments --prompt --prompt-file is required"),
    ],
)
def test_cli_bad_files_and_paths_fail_before_loading(tiny_checkpoint, tmp_path, no_weights, capsys, argv, match):
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    Image.new("RGB", (40, 30)).save(tmp_path / "ok.png")
    (tmp_path / "cut.png").write_bytes((tmp_path / "ok.png").read_bytes()[:60])
    argv = [a.format(tmp=tmp_path) for a in argv]
    argv = [argv[0], "--checkpoint", str(tiny_checkpoint), *argv[1:], "-q"]
    assert _exit_code(argv) == 2
    assert re.search(match, _one_line_error(capsys))


def test_cli_prompt_too_long_for_the_config_fails_before_loading(tiny_checkpoint_copy, no_weights, capsys):
    _edit_json(tiny_checkpoint_copy / "llm_config.json", max_position_embeddings=300)
    assert cli.main(_t2i(tiny_checkpoint_copy)[:4] + ["the cat " * 200, "--steps", "2"]) == 2
    assert re.search(r"--prompt: `prompt` is too long.*max_position_embeddings = 300", _one_line_error(capsys))


def test_cli_size_limit_is_read_from_the_config(tiny_checkpoint_copy, no_weights, capsys):
    # a VAE with 3 levels downsamples by 4: 8-px latent tokens, at most 8 * 64 = 512 px (weights not needed)
    _edit_json(tiny_checkpoint_copy / "ae_config.json", ch_mult=[1, 1, 1], downsample=4)
    assert cli.main(_t2i(tiny_checkpoint_copy, "--width", "1024")) == 2
    assert "--width: `width` must be a positive multiple of 8 and <= 512, got 1024" in _one_line_error(capsys)


def test_cli_broken_config_fails_before_loading(tiny_checkpoint_copy, no_weights, capsys):
    _edit_json(tiny_checkpoint_copy / "llm_config.json", rope_theta=-1.0)
    assert cli.main(_t2i(tiny_checkpoint_copy)) == 2
    assert "rope_theta" in _one_line_error(capsys)


def test_cli_checkpoint_path_mistakes(tmp_path, no_weights, capsys):
    (tmp_path / "file.bin").write_bytes(b"x")
    for value, match in [("", r"argument --checkpoint: empty path ''"),
                         (str(tmp_path / "file.bin"), r"--checkpoint: .*file.bin is a file, not a folder"),
                         (str(tmp_path / "missing"), r"--checkpoint: folder not found: .*missing")]:
        assert _exit_code(["understand", "--checkpoint", value, "--prompt", "x", "-q"]) == 2
        assert re.search(match, _one_line_error(capsys))


# ------------------------------------------------------------------------------------ CLI: run-time failures


def test_cli_interrupt_during_loading_exits_130(tiny_checkpoint, monkeypatch, capsys, tmp_path):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loader_module, "load_bagel", interrupted)
    assert cli.main(_t2i(tiny_checkpoint, "--out", str(tmp_path / "o.png"))) == 130
    assert _one_line_error(capsys) == "error: interrupted (Ctrl-C)\n"
    assert not any(tmp_path.iterdir())


def test_cli_out_of_memory_is_one_line(tiny_checkpoint, monkeypatch, capsys, tmp_path):
    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore details")

    monkeypatch.setattr(loader_module, "load_bagel", no_memory)
    assert cli.main(_t2i(tiny_checkpoint, "--out", str(tmp_path / "o.png"))) == 2
    assert re.search(r"out of memory \(OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\); use a "
                     r"smaller", _one_line_error(capsys))


def test_cli_nan_weights_exit_2_naming_the_tensor(tiny_checkpoint_copy, capsys, tmp_path):
    name = "time_embedder.mlp.0.weight"
    _rewrite(tiny_checkpoint_copy / "ema.safetensors", _set(name, math.nan))
    assert cli.main(_t2i(tiny_checkpoint_copy, "--out", str(tmp_path / "o.png"))) == 2
    assert f"tensor {name!r} holds 1 NaN" in _one_line_error(capsys)
    assert not (tmp_path / "o.png").exists()


def test_cli_error_after_a_progress_line_starts_a_new_line(tiny_checkpoint, monkeypatch, capsys, tmp_path):
    original = pipeline_module.check_velocities

    def fail_on_second_step(raw, guided, *, step, **kw):
        if step == 1:
            raise NumericalError("denoising step 2 of 2: test")
        original(raw, guided, step=step, **kw)

    monkeypatch.setattr(pipeline_module, "check_velocities", fail_on_second_step)
    argv = [a for a in _t2i(tiny_checkpoint, "--steps", "3", "--out", str(tmp_path / "o.png")) if a != "-q"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "denoising [" in err and "1/2\nerror: denoising step 2 of 2: test\n" in err
    assert not (tmp_path / "o.png").exists()


def test_prompt_file_is_read_as_utf8(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes("\ufeffune tasse de café\n".encode("utf-8"))
    assert read_prompt_file(path) == "une tasse de café"  # BOM and one final newline dropped
    path.write_bytes(b"two lines\n\n")
    assert read_prompt_file(path) == "two lines\n"
    path.write_bytes(b"")
    assert read_prompt_file(path) == ""


def test_cli_prompt_file_gives_the_same_answer_as_prompt(tiny_checkpoint, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("What is this?\n", encoding="utf-8")
    base = ["understand", "--checkpoint", str(tiny_checkpoint), "--dtype", "fp32", "--max-new-tokens", "3", "-q"]
    assert cli.main([*base, "--prompt-file", str(tmp_path / "p.txt")]) == 0
    from_file = capsys.readouterr().out
    assert cli.main([*base, "--prompt", "What is this?"]) == 0
    assert capsys.readouterr().out == from_file


def test_save_image_is_atomic(tmp_path, monkeypatch):
    out = tmp_path / "o.png"
    out.write_bytes(b"previous")
    image = Image.new("RGB", (4, 4))

    def half_written(self, fp, format=None, **params):
        Path(fp).write_bytes(b"\x89PNG partial")
        raise OSError("No space left on device")

    monkeypatch.setattr(Image.Image, "save", half_written)
    with pytest.raises(OSError, match="No space left"):
        save_image(image, out, "PNG")
    assert out.read_bytes() == b"previous" and [p.name for p in tmp_path.iterdir()] == ["o.png"]
    monkeypatch.undo()
    save_image(image, tmp_path / "new" / "x.png", "PNG")  # missing folders are created
    with Image.open(tmp_path / "new" / "x.png") as img:
        assert img.size == (4, 4)


# ------------------------------------------------------------------------------------ CLI subprocesses


def _cli_proc(*args, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "unicache_core.bagel", *args], capture_output=True, cwd=ROOT,
                          env=env, timeout=60, **kwargs)


def _assert_one_line(proc: subprocess.CompletedProcess, *needles: bytes) -> bytes:
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count(b"\n") == 1 and proc.stderr.startswith(b"error: "), proc.stderr
    assert b"Traceback" not in proc.stderr and b"loading" not in proc.stderr and proc.stdout == b""
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)
    return proc.stderr


def test_subprocess_invalid_utf8_prompt_argument(tiny_checkpoint):
    proc = _cli_proc(b"understand", b"--checkpoint", os.fsencode(tiny_checkpoint), b"--prompt", b"caf\xe9 \xff", b"-q")
    _assert_one_line(proc, b"--prompt: the text is not valid UTF-8 (byte 0xe9 at character 3)")


def test_subprocess_invalid_utf8_prompt_file(tiny_checkpoint, tmp_path):
    (tmp_path / "p.txt").write_bytes(b"a red \xff cube")
    proc = _cli_proc("t2i", "--checkpoint", str(tiny_checkpoint), "--prompt-file", str(tmp_path / "p.txt"), "-q")
    _assert_one_line(proc, b"--prompt-file: ", b"p.txt is not valid UTF-8 (byte 0xff at offset 6)")


@pytest.mark.parametrize("case", ["empty checkpoint", "checkpoint is a file", "image is a directory",
                                  "out is a directory"])
def test_subprocess_path_mistakes(tiny_checkpoint, tmp_path, case):
    ckpt = str(tiny_checkpoint)
    args = {
        "empty checkpoint": ("understand", "--checkpoint", "", "--prompt", "x"),
        "checkpoint is a file": ("understand", "--checkpoint", str(tiny_checkpoint / "vocab.json"), "--prompt", "x"),
        "image is a directory": ("edit", "--checkpoint", ckpt, "--prompt", "x", "--image", str(tmp_path),
                                 "--out", str(tmp_path / "o.png")),
        "out is a directory": ("t2i", "--checkpoint", ckpt, "--prompt", "x", "--out", str(tmp_path)),
    }[case]
    needle = {
        "empty checkpoint": b"argument --checkpoint: empty path ''",
        "checkpoint is a file": os.fsencode(tiny_checkpoint / "vocab.json") + b" is a file, not a folder",
        "image is a directory": b"--image: " + os.fsencode(tmp_path) + b" is a directory",
        "out is a directory": b"--out: " + os.fsencode(tmp_path) + b" is a directory",
    }[case]
    _assert_one_line(_cli_proc(*args), needle)


def test_subprocess_ctrl_c_during_denoising_exits_130(tiny_checkpoint, tmp_path):
    out = tmp_path / "o.png"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "unicache_core.bagel", "t2i", "--checkpoint", str(tiny_checkpoint), "--prompt", "x",
         "--width", "32", "--height", "32", "--steps", "1000", "--dtype", "fp32", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env,
        # A job started in the background of a non-interactive shell (as CI may run us) inherits SIGINT as
        # ignored, and Python then keeps it ignored: give the child the default disposition, as a terminal would.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    err = bytearray()

    def read_stderr():
        while chunk := os.read(proc.stderr.fileno(), 4096):
            err.extend(chunk)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while b"denoising [" not in err and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, f"the run ended before it could be interrupted: {bytes(err)[-300:]!r}"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    reader.join(timeout=5)
    lines = bytes(err).replace(b"\r", b"\n").strip().splitlines()
    assert lines[-1] == b"error: interrupted (Ctrl-C)", bytes(err)
    assert b"Traceback" not in err and not out.exists() and not list(tmp_path.iterdir())


def test_subprocess_stdout_closed_early(tiny_checkpoint):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will read the answer
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "unicache_core.bagel", "understand", "--checkpoint", str(tiny_checkpoint),
             "--prompt", "x", "--max-new-tokens", "2", "--dtype", "fp32", "-q"],
            stdout=write_end, stderr=subprocess.PIPE, cwd=ROOT, env=env, timeout=60,
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 2 and proc.stderr == b"error: stdout was closed before the answer was written " \
                                                  b"(broken pipe)\n"
