"""Every check the configs and the safetensors headers allow runs before any module is built (issue 45.1): a
checkpoint whose ``llm_config.json`` claims ``num_hidden_layers: 10000000`` is refused in one line by the command
line's run, by ``plan`` and by the loader, and a plan at a claimed geometry counts it without building it.

Each test makes constructing :class:`Bagel` or :class:`AutoEncoder` fail, so "before any module is built" is what
is checked, not a time."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from cli_runs import run_bagel_cli

from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.config import load_bagel_config
from unicache_core.bagel.memory.plan import PlanSettings, official_config, plan_memory
from unicache_core.bagel.modeling import autoencoder as autoencoder_module
from unicache_core.bagel.modeling import bagel as bagel_module
from unicache_core.errors import CheckpointError

CONFIG_FILES = ("llm_config.json", "vit_config.json", "ae_config.json")


def _refuse(self, *args, **kwargs):
    raise AssertionError("a model was built before the configs were checked against the weights")


@pytest.fixture
def no_bagel_built(monkeypatch):
    """Any BAGEL model constructed anywhere fails the test (a plan still traces the VAE on the meta device for its
    working memory: a bounded network, at most 8 levels of 32 blocks)."""
    monkeypatch.setattr(bagel_module.Bagel, "__init__", _refuse)


@pytest.fixture
def no_module_built(monkeypatch, no_bagel_built):
    """Any BAGEL or VAE module constructed anywhere fails the test."""
    monkeypatch.setattr(autoencoder_module.AutoEncoder, "__init__", _refuse)


def variant(tiny_checkpoint: Path, folder: Path, file: str, key: str, value, *, weights: bool = True) -> Path:
    """A checkpoint folder of links to the tiny checkpoint's files, with ``file``'s ``key`` set to ``value``
    (``weights=False``: without the two safetensors files, as before a download)."""
    folder.mkdir()
    for entry in tiny_checkpoint.iterdir():
        if entry.name != file and (weights or entry.suffix != ".safetensors"):
            os.symlink(entry, folder / entry.name)
    data = json.loads((tiny_checkpoint / file).read_text())
    data[key] = value
    (folder / file).write_text(json.dumps(data))
    return folder


def _t2i(checkpoint: Path, tmp_path: Path) -> list[str]:
    return ["t2i", "--checkpoint", str(checkpoint), "--prompt", "x", "--width", "32", "--height", "32"] + [
        "--steps",
        "2",
        "-q",
        "--out",
        str(tmp_path / "o.png"),
    ]


def _one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "file, key, message",
    [
        ("llm_config.json", "num_hidden_layers", r"num_hidden_layers = 10000000 layers, but ema.safetensors holds 2"),
        ("vit_config.json", "num_hidden_layers", r"num_hidden_layers = 10000000 means 9999999 built layers"),
        ("ae_config.json", "num_res_blocks", r"field 'num_res_blocks' = 10000000 must be <= 32"),
    ],
)
@pytest.mark.parametrize("command", ["t2i", "plan"])
def test_ten_million_layers_refused_in_one_line_before_any_build(
    tiny_checkpoint, tmp_path, capsys, no_module_built, file, key, message, command
):
    import re

    checkpoint = variant(tiny_checkpoint, tmp_path / "ck", file, key, 10_000_000)
    argv = (
        _t2i(checkpoint, tmp_path)
        if command == "t2i"
        else ["plan", "--checkpoint", str(checkpoint), "--task", "t2i", "--width", "32", "--height", "32"]
    )
    code, out, err = run_bagel_cli(capsys, *argv)
    assert code == 2 and out == ""
    line = _one_line(err)
    assert re.search(message, line) and str(checkpoint / file) in line, line
    assert not (tmp_path / "o.png").exists()


def test_loader_refuses_ten_million_layers_before_any_build(tiny_checkpoint, tmp_path, no_module_built):
    checkpoint = variant(tiny_checkpoint, tmp_path / "ck", "llm_config.json", "num_hidden_layers", 10_000_000)
    with pytest.raises(CheckpointError, match=r"llm_config.json does not match the weights: num_hidden_layers"):
        load_bagel(checkpoint, dtype="fp32")


def test_plan_before_download_counts_a_claimed_geometry_without_building(
    tiny_checkpoint, tmp_path, capsys, no_bagel_built
):
    """Configs without weight files: nothing to check against, so the plan counts the claim from the formulas."""
    checkpoint = variant(
        tiny_checkpoint, tmp_path / "ck", "llm_config.json", "num_hidden_layers", 10_000_000, weights=False
    )
    code, out, err = run_bagel_cli(
        capsys,
        "plan",
        "--checkpoint",
        str(checkpoint),
        "--task",
        "t2i",
        "--width",
        "32",
        "--height",
        "32",
        "--device-memory",
        "24GB",
        "--json",
        str(tmp_path / "plan.json"),
    )
    assert code == 0 and err == "", err
    plan = json.loads((tmp_path / "plan.json").read_text())
    one_layer = load_bagel_config(tiny_checkpoint)
    assert plan["fits"] is False and plan["peak_bytes"] > 10_000_000 * one_layer.llm.hidden_size**2
    assert "does not fit" in out


def test_plan_api_counts_bagel_7b_at_a_million_layers_without_building(no_bagel_built):
    config = official_config()
    huge = dataclasses.replace(config, llm=dataclasses.replace(config.llm, num_hidden_layers=1_000_000))
    plan = plan_memory(huge, PlanSettings(task="t2i", width=512, height=512), 80 * 10**9)
    real = plan_memory(config, PlanSettings(task="t2i", width=512, height=512), 80 * 10**9)
    per_layer = (
        real.breakdown["weights_device_bfloat16"]
        - plan_memory(
            dataclasses.replace(config, llm=dataclasses.replace(config.llm, num_hidden_layers=27)),
            PlanSettings(task="t2i", width=512, height=512),
            80 * 10**9,
        ).breakdown["weights_device_bfloat16"]
    )
    assert per_layer > 0
    assert plan.breakdown["weights_device_bfloat16"] == real.breakdown["weights_device_bfloat16"] + per_layer * (
        1_000_000 - 28
    )
    assert not plan.fits and real.fits


# ------------------------------------------------------------------------------------ every key, hostile values

#: Keys of each config that give the model's geometry, the numbers of its norms and tables, and the VAE's.
KEYS = {
    "llm_config.json": [
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
    ],
    "vit_config.json": [
        "hidden_size",
        "image_size",
        "intermediate_size",
        "num_attention_heads",
        "num_hidden_layers",
        "patch_size",
    ],
    "ae_config.json": ["in_channels", "ch", "out_ch", "num_res_blocks", "z_channels", "downsample", "ch_mult"],
}
#: Keys that are no geometry: 10**7 and 1.5 are legal there (rope_theta, max_position_embeddings) or refused by
#: range (the epsilons); 0, -1 and a string never are.
OTHER_KEYS = {
    "llm_config.json": ["rope_theta", "rms_norm_eps", "max_position_embeddings"],
    "vit_config.json": ["layer_norm_eps", "num_channels"],
    "ae_config.json": ["resolution", "scale_factor"],
}
GEOMETRY_CASES = [(f, k, v) for f, keys in KEYS.items() for k in keys for v in (10**7, 0, -1, "x", 1.5)]
OTHER_CASES = [(f, k, v) for f, keys in OTHER_KEYS.items() for k in keys for v in (0, -1, "x")]
EPSILON_CASES = [
    (f, k, v)
    for f, k in (("llm_config.json", "rms_norm_eps"), ("vit_config.json", "layer_norm_eps"))
    for v in (1, 10**7)
]


@pytest.mark.parametrize("file, key, value", GEOMETRY_CASES + OTHER_CASES + EPSILON_CASES)
def test_hostile_config_value_refused_in_one_line_naming_file_and_key(
    tiny_checkpoint, tmp_path, capsys, no_module_built, file, key, value
):
    checkpoint = variant(tiny_checkpoint, tmp_path / "ck", file, key, value)
    code, out, err = run_bagel_cli(capsys, *_t2i(checkpoint, tmp_path))
    line = _one_line(err)
    assert code == 2 and out == ""
    assert file in line and key in line, line
    assert not (tmp_path / "o.png").exists()
