"""K90 calibration tool (issue C2): observe-only method, aggregation, table output, sensitivity, CLI errors."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from unicache_core.bagel import BagelPipeline, load_bagel, preset
from unicache_core.bagel.calibration import (
    CalibrationJob,
    CalibrationOptions,
    aggregate,
    calibrate_job,
    check_job,
    synthetic_image,
)
from unicache_core.bagel.calibration.cli import main as calibrate_main
from unicache_core.bagel.checkpoint.model_id import model_id_of
from unicache_core.compression import make_cache_factory
from unicache_core.compression.calibration import CalibrationCacheFactory
from unicache_core.compression.defaults import JOINT_BITS, JOINT_LEVELS, UNICACHE_GROUPS
from unicache_core.compression.family import QuantGeometry
from unicache_core.compression.policy_table import PolicyTable
from unicache_core.kv.token_types import TokenType

PROMPTS = "a red circle on the left\n\n  make the square blue and large  \n"
COMMON = ["--steps", "3", "--size", "32", "--dtype", "fp32", "--max-new-tokens", "3", "--device", "cpu"]


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return load_bagel(tiny_checkpoint, dtype=torch.float32)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text(PROMPTS, encoding="utf-8")
    return path


def _run(capsys, *argv):
    try:
        code = calibrate_main([str(a) for a in argv])
    except SystemExit as exc:  # argparse errors exit from parse_args, as in python -m unicache_core.bagel
        code = exc.code
    return code, capsys.readouterr().err


def test_observe_only_scores_every_read_call_at_full_kv(loaded):
    img = synthetic_image(0, 64)
    settings = preset("edit", num_timesteps=4)
    res = BagelPipeline(loaded, CalibrationCacheFactory()).edit("make it blue", img, settings, seed=1)
    ref = BagelPipeline(loaded).edit("make it blue", img, settings, seed=1)
    assert torch.allclose(res.latents, ref.latents, atol=1e-4)  # nothing compressed
    summary = res.kv_report["summary"]
    assert summary["first_compressed_step"] is None
    records = res.kv_report["calibration"]["records"]
    layers = loaded.model.num_layers
    seen = {(b, layer, s, t) for b, layer, s, t, _, _ in records}
    # 3 denoising steps; gen sees all three types, cfg_text the image, cfg_img the text
    for step in range(3):
        for layer in range(layers):
            assert {("gen", layer, step, t) for t in ("instruction", "source_vit", "source_vae")} <= seen
            assert ("cfg_text", layer, step, "source_vae") in seen and ("cfg_img", layer, step, "instruction") in seen
            assert ("cfg_text", layer, step, "instruction") not in seen
    assert all(0.0 < k <= 1.0 and 0.0 <= m <= 1.0 for *_, k, m in records)
    und = BagelPipeline(loaded, CalibrationCacheFactory()).understand(
        "What is it?", img, preset("understanding", max_new_tokens=3)
    )
    steps = {s for _, _, s, _, _, _ in und.kv_report["calibration"]["records"]}
    assert None in steps and 0 in steps  # the prefill observation and the decoded tokens


def test_aggregate_chunks_and_medians():
    records = [["gen", layer, step, "instruction", 0.1 * (1 + layer), 0.5] for layer in range(6) for step in range(7)]
    agg = aggregate([records, records])
    cells = {(c["layer_chunk"], c["step_chunk"]): c for c in agg["cells"]}
    assert set(cells) == {(c, s) for c in (0, 1, 2) for s in (0, 1, 2)}  # layers 0 | 1-4 | 5; steps 0 | 1-5 | 6
    assert cells[(1, 1)]["k90"] == pytest.approx(0.35) and cells[(1, 1)]["samples"] == 2 * 4 * 5
    assert len(agg["k90s"]["instruction"]) == 2 * 9 and agg["mass"]["instruction"] == pytest.approx(0.5)


def test_t2i_and_edit_tables_with_sensitivity_and_merge(tiny_checkpoint, prompts, tmp_path, capsys):
    out = tmp_path / "sub" / "policy.json"
    model_id = model_id_of(tiny_checkpoint)
    code, err = _run(
        capsys,
        "--checkpoint",
        tiny_checkpoint,
        "--task",
        "t2i",
        "--prompts",
        prompts,
        "--out",
        out,
        "--sensitivity",
        *COMMON,
    )
    assert code == 0, err
    assert len(err.strip().splitlines()) == 1 and "calibrated t2i on 2 prompt(s)" in err
    table = PolicyTable.load(out, model_id=model_id)
    assert table.source == "calibrated" and table.model_id == model_id
    assert 0.0 <= table.k90[("t2i", TokenType.INSTRUCTION)] <= 1.0
    k = table.k90[("t2i", TokenType.INSTRUCTION)]
    assert table.kind("t2i", "instruction") == ("evict" if k <= 0.3 else "quantize")
    meas = table.measurements["tasks"]["t2i"]
    assert meas["prompts"] == 2 and meas["steps"] == 2 and meas["arguments"]["task"] == "t2i"
    assert meas["cells"] and all(0.0 <= c["k90"] <= 1.0 for c in meas["cells"])
    sens = meas["sensitivity"]["types"]["instruction"]
    assert sens["evict"]["change"] > 0 and "latent_rel_l2" in sens["evict"]["per_prompt"]
    assert sens["agrees"] in (True, False, None) and meas["sensitivity_agrees"]["instruction"] == sens["agrees"]
    if not sens["comparable"]:
        assert sens["agrees"] is None
    assert table.measurements["filled"]["edit/instruction"] == "paper"
    # edit, merged into the same file: both tasks calibrated, understanding filled from the paper table
    code, err = _run(
        capsys,
        "--checkpoint",
        tiny_checkpoint,
        "--task",
        "edit",
        "--prompts",
        prompts,
        "--out",
        out,
        "--merge",
        "--sensitivity",
        *COMMON,
    )
    assert code == 0, err
    table = PolicyTable.load(out, model_id=model_id)
    for ttype in ("instruction", "source_vit", "source_vae"):
        assert 0.0 <= table.k90[("edit", TokenType.parse(ttype))] <= 1.0
        assert ttype in table.measurements["tasks"]["edit"]["sensitivity_agrees"]
    assert ("t2i", TokenType.parse("instruction")) in table.k90
    assert set(table.measurements["tasks"]) == {"t2i", "edit"}
    filled = table.measurements["filled"]
    assert "edit/instruction" not in filled and "t2i/instruction" not in filled
    assert filled["understanding/instruction"] == "paper"
    assert "synthetic" in table.measurements["tasks"]["edit"]["images"]


def test_the_grid_writes_joint_entries_with_their_plans_and_geometry(
    tiny_checkpoint, prompts, tmp_path, capsys, loaded
):
    """--grid (docs/compression.md §11.4): every (level, bits) point measured with the type alone at matched bytes,
    the plan takes each level's least change, the table is version 2 with its geometry, and a later --merge of
    another task keeps the plan."""
    out = tmp_path / "grid.json"
    one = tmp_path / "one.txt"
    one.write_text("a red circle on the left\n", encoding="utf-8")  # 16 grid points x prompts runs: keep one
    code, err = _run(
        capsys, "--checkpoint", tiny_checkpoint, "--task", "t2i", "--prompts", one, "--out", out, "--grid", *COMMON
    )
    assert code == 0, err
    assert len(err.strip().splitlines()) == 1 and "instruction plan 0.5:" in err
    data = json.loads(out.read_text())
    assert data["version"] == 2 and data["quantization"] == QuantGeometry(groups=UNICACHE_GROUPS).to_dict()
    table = PolicyTable.load(out, model_id=model_id_of(tiny_checkpoint))
    key = ("t2i", TokenType.INSTRUCTION)
    assert table.kind(*key) == "joint"
    grid = table.measurements["tasks"]["t2i"]["grid"]["types"]["instruction"]
    points = {(p["budget"], p["bits"]): p for p in grid["points"]}
    assert set(points) == {(level, bits) for level in JOINT_LEVELS for bits in JOINT_BITS}
    for (level, _bits), point in points.items():
        assert point["change"] >= 0.0 and point["type_retained"] <= level + 1e-9, point  # matched bytes
    best = {level: min(JOINT_BITS, key=lambda b: (points[(level, b)]["change"], b)) for level in JOINT_LEVELS}
    assert table.plan_for(*key).levels == tuple(sorted(best.items(), reverse=True))
    assert any(p["change"] > 0 for p in points.values())  # compressing the prompt changes the latents
    # the calibrated table runs: its joint entry holds the instruction at or under the budget of every step
    res = BagelPipeline(loaded, make_cache_factory("unicache", policy=table, kv_target=0.25)).text_to_image(
        "a red circle", preset("t2i", width=32, height=32, num_timesteps=3), seed=0
    )
    assert res.kv_report["summary"]["achieved_ratio"] <= 0.25 + 1e-9
    # merging another task (no grid) keeps the joint entry and its plan
    code, err = _run(
        capsys,
        "--checkpoint",
        tiny_checkpoint,
        "--task",
        "edit",
        "--prompts",
        prompts,
        "--out",
        out,
        "--merge",
        *COMMON,
    )
    assert code == 0, err
    merged = PolicyTable.load(out, model_id=model_id_of(tiny_checkpoint))
    assert merged.kind(*key) == "joint" and merged.plan_for(*key) == table.plan_for(*key)
    assert merged.kind("edit", "source_vae") in ("evict", "quantize")


def test_understanding_with_an_image_folder(tiny_checkpoint, prompts, tmp_path, capsys):
    images = tmp_path / "imgs"
    images.mkdir()
    rng = np.random.default_rng(0)
    for name in ("b.png", "a.png"):
        Image.fromarray(rng.integers(0, 255, (40, 56, 3), dtype=np.uint8)).save(images / name)
    (images / "notes.txt").write_text("not an image")
    out = tmp_path / "und.json"
    code, err = _run(
        capsys,
        "--checkpoint",
        tiny_checkpoint,
        "--task",
        "und",
        "--prompts",
        prompts,
        "--images",
        images,
        "--out",
        out,
        *COMMON,
    )
    assert code == 0, err
    table = PolicyTable.load(out, model_id=model_id_of(tiny_checkpoint))
    meas = table.measurements["tasks"]["understanding"]
    assert meas["image_names"] == ["a.png", "b.png"] and "--images" in meas["images"]
    assert {c["step_chunk"] for c in meas["cells"]} >= {"prefill", 0}
    assert {("understanding", TokenType.parse(t)) for t in ("instruction", "source_vit")} <= set(table.k90)
    # the same job as a function call (what training.calibration does) writes the same table
    options = CalibrationOptions(num_timesteps=3, max_new_tokens=3, size=32)
    job = CalibrationJob(
        checkpoint=tiny_checkpoint,
        task="und",
        prompts=prompts,
        out=tmp_path / "und_api.json",
        images=images,
        options=options,
        dtype="fp32",
        device="cpu",
    )
    written = calibrate_job(job)
    api = PolicyTable.load(job.out, model_id=model_id_of(tiny_checkpoint))
    assert written.to_dict() == api.to_dict()
    api_meas = api.measurements["tasks"]["understanding"]
    for measured in (meas, api_meas):
        measured.pop("seconds")
        measured["arguments"].pop("out")
    assert api.to_dict() == table.to_dict()


def test_a_job_with_an_unknown_task_or_dtype_is_refused(tiny_checkpoint, prompts, tmp_path):
    for change, message in (
        ({"task": "understanding"}, "--task: 'understanding' is not a calibration task"),
        ({"dtype": "fp16"}, "--dtype: 'fp16' is not a calibration dtype"),
    ):
        job = CalibrationJob(checkpoint=tiny_checkpoint, task="und", prompts=prompts, out=tmp_path / "x.json")
        with pytest.raises(ValueError, match=message):
            check_job(dataclasses.replace(job, **change))
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize(
    "case, message",
    [
        (["--task", "t2i"], "required: --prompts, --out"),
        (["--task", "nope", "--prompts", "P", "--out", "O"], "invalid choice"),
        (["--task", "t2i", "--prompts", "P", "--out", "DIR"], "--out:"),
        (["--task", "t2i", "--prompts", "BLANK", "--out", "O"], "--prompts:"),
        (["--task", "t2i", "--prompts", "MISSING", "--out", "O"], "--prompts: file not found"),
        (["--task", "t2i", "--prompts", "P", "--out", "O", "--images", "DIR"], "--images: t2i takes no input images"),
        (["--task", "edit", "--prompts", "P", "--out", "O", "--images", "DIR"], "--images:"),
        (["--task", "t2i", "--prompts", "P", "--out", "O", "--size", "40"], "--size:"),
        (["--task", "t2i", "--prompts", "P", "--out", "O", "--steps", "1"], "--steps:"),
        (["--task", "und", "--prompts", "P", "--out", "O", "--max-new-tokens", "0"], "--max-new-tokens:"),
        (["--task", "t2i", "--prompts", "P", "--out", "OTHER", "--merge"], "made for model 'someone-else'"),
    ],
)
def test_bad_arguments_give_one_line_errors(tiny_checkpoint, prompts, tmp_path, capsys, case, message):
    (tmp_path / "dir").mkdir()
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    PolicyTable(model_id="someone-else").save(tmp_path / "other.json")
    subst = {
        "P": prompts,
        "O": tmp_path / "x.json",
        "DIR": tmp_path / "dir",
        "BLANK": tmp_path / "blank.txt",
        "MISSING": tmp_path / "missing.txt",
        "OTHER": tmp_path / "other.json",
    }
    argv = ["--checkpoint", tiny_checkpoint] + [str(subst.get(a, a)) for a in case]
    code, err = _run(capsys, *argv)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    assert not (tmp_path / "x.json").exists()


def test_module_entry_point_and_missing_checkpoint(tmp_path, prompts):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "unicache_core.bagel.calibrate",
            "--checkpoint",
            str(tmp_path / "none"),
            "--task",
            "t2i",
            "--prompts",
            str(prompts),
            "--out",
            str(tmp_path / "o.json"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"error: --checkpoint: folder not found: {tmp_path / 'none'}"]
