"""benchmarks.real_size's code path at tiny dimensions: an fp8 file written tensor by tensor, loaded as int8, run."""

import json
import os
import threading
from pathlib import Path

import pytest
import torch

from benchmarks.real_size import DISK_DTYPE_NAME, run
from unicache_core.bagel.checkpoint.header import read_header

TWIN_LLM = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_window_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=640,
)
TWIN_VIT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def test_small_geometry_twin_writes_fp8_loads_and_runs(tmp_path):
    report = run(tmp_path / "twin", weight_dtype="int8", llm=TWIN_LLM, vit=TWIN_VIT, full_vae=False)
    header = read_header(tmp_path / "twin" / "ema.safetensors")
    assert {entry.dtype for entry in header.tensors.values()} == {DISK_DTYPE_NAME}
    assert json.loads((tmp_path / "twin" / "llm_config.json").read_text())["hidden_size"] == 64
    assert report["weight_dtype"] == "int8" and report["load_seconds"] > 0 and report["peak_rss_bytes"] > 0
    full, unicache = report["runs"]
    assert (full["kv_method"], unicache["kv_method"]) == ("full", "unicache")
    for row in report["runs"]:
        assert row["edit_size"] == [256, 256]  # the source's size, not the official VAE rule's 512
        assert len(row["edit_step_seconds"]) == 2 and row["seconds_per_step"] > 0
        assert set(row["edit_kv_bytes_per_branch"]) == {"gen", "cfg_text", "cfg_img"}
        assert 0 < row["attention_share_of_step"] < 1
    # the compressed caches hold fewer bytes than the full ones, branch by branch
    for branch, held in full["edit_kv_bytes_per_branch"].items():
        assert unicache["edit_kv_bytes_per_branch"][branch] < held
    assert unicache["und_kv_bytes"] < full["und_kv_bytes"]
    assert torch.float8_e4m3fn.itemsize == 1


def test_phase_meter_on_the_twin_sees_the_caches_freed_before_the_decode(tmp_path):
    """benchmarks.gpu_real_size's dry run: every phase is metered, the request's KV is gone when the VAE decode
    begins (it starts lower than the denoising did, by at least the caches' bytes), nothing but the latent
    is left on the decode's live-tensor list, and the plan is within 10% of the metered peak."""
    from benchmarks.gpu_real_size import format_table
    from benchmarks.gpu_real_size import run as run_phases

    report = run_phases(
        tmp_path / "twin",
        size=256,
        weight_dtype="int8",
        offloads=("none",),
        device="cpu",
        llm=TWIN_LLM,
        vit=TWIN_VIT,
        full_vae=False,
    )
    rows = report["results"]
    assert [r["kv_method"] for r in rows] == ["full", "unicache"]
    for row in rows:
        entry, peak = row["phase_entry_bytes"], row["phase_peak_bytes"]
        assert set(entry) == set(peak) == {"contexts", "denoise", "decode"}
        assert all(peak[p] >= entry[p] for p in peak) and row["peak_bytes"] == max(peak.values())
        assert abs(row["plan_error"]) <= 0.10, row["plan_error"]
        assert max(t["bytes"] for t in row["decode_entry_tensors"]) <= 256 * 64 * 4  # the packed latent
    # the caches are freed before the decode: all of full KV's rows, each held once (gen and cfg_text share them)
    freed = rows[0]["phase_entry_bytes"]["denoise"] - rows[0]["phase_entry_bytes"]["decode"]
    assert freed >= 0.9 * rows[0]["plan_kv_held"] > 0
    assert len(format_table(rows).splitlines()) == 3


def test_the_committed_gpu_runs_agree_with_this_plan():
    """docs/results/gpu_real_size.json (H200 runs at BAGEL-7B's geometry): planned again by this code, every row's
    plan is the stored one and within 1% of its measured CUDA peak; a row without its prompt length gets it back
    from its stored plan's full KV."""
    from benchmarks.gpu_real_size import replan

    report = json.loads((Path(__file__).resolve().parent.parent / "docs/results/gpu_real_size.json").read_text())
    again = replan(report)
    assert len(again["results"]) == len(report["results"]) >= 8
    for stored, row in zip(report["results"], again["results"]):
        assert row["plan_bytes"] == stored["plan_bytes"] and abs(row["plan_error"]) < 0.01, row
    first = report["results"][0]
    anonymous = {**report, "results": [{k: v for k, v in first.items() if k != "prompt_tokens"}]}
    assert replan(anonymous)["results"][0]["prompt_tokens"] == first["prompt_tokens"]


def test_several_images_with_and_without_taylorseer_on_the_twin(tmp_path):
    """The issue-64 rows' code path: a 2-image edit without and with TaylorSeer (its factors planned and metered, the
    plan within 10% of the peak either way), and a row that runs out of CUDA memory reported as such."""
    from benchmarks.gpu_real_size import format_table, replan
    from benchmarks.gpu_real_size import run as run_phases

    report = run_phases(
        tmp_path / "twin",
        size=256,
        weight_dtype="int8",
        offloads=("none",),
        methods=("full",),
        device="cpu",
        llm=TWIN_LLM,
        vit=TWIN_VIT,
        full_vae=False,
        images=2,
        timesteps=9,
        taylorseers=(False, True),
    )
    plain, seer = report["results"]
    assert (plain["taylorseer"], seer["taylorseer"]) == (False, True)
    assert plain["images"] == seer["images"] == 2 and plain["timesteps"] == seer["timesteps"] == 9
    assert plain["plan_breakdown"].get("taylorseer", 0) == 0 < seer["plan_breakdown"]["taylorseer"]
    for row in (plain, seer):
        assert abs(row["plan_error"]) <= 0.10, (row["taylorseer"], row["plan_error"])
        assert row["memory_cap_bytes"] is None and row["denoise_seconds"] > 0
    oom = {"kv_method": "full", "weight_dtype": "int8", "offload": "layers", "size": [256, 256], "images": 2}
    oom["out_of_memory"] = "CUDA out of memory. Tried to allocate 2.00 GiB"
    lines = format_table([plain, seer, oom]).splitlines()
    assert len(lines) == 4 and lines[2].rstrip().endswith("on") and "out of memory: CUDA out of memory" in lines[3]
    assert replan({"results": [oom]})["results"] == [oom]


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda p: os.mkfifo(p), "is a FIFO (named pipe), not a regular file"),
        (lambda p: p.symlink_to("/dev/zero"), "is a character device, not a regular file"),
        (lambda p: p.mkdir(), "is a directory"),
        (lambda p: p.write_text('"just a string"'), "not a report of this program"),
        (lambda p: p.write_text('{"results": [{"kv_method": "full", "kv_method": "h2o"}]}'), "given twice"),
        (lambda p: p.write_text('{"results": [{"kv_method": "full"}]}'), "results[0] has neither 'prompt_tokens'"),
        (
            lambda p: p.write_text(
                '{"results": [{"kv_method": "full", "weight_dtype": "bf16", "offload": "none", "size": [1024, 1024],'
                ' "peak_bytes": 1, "prompt_tokens": 6, "images": 1000000000}]}'
            ),
            "results[0].images must be 1 to 1000",
        ),
    ],
    ids=["fifo", "dev-zero", "folder", "json-string", "duplicate-key", "no-tokens", "a-billion-images"],
)
def test_replan_reads_a_bounded_regular_report_only(tmp_path, capsys, make, said):
    """``--replan F`` reads F as every input is read: a regular JSON file of bounded size, each row's fields
    checked; a FIFO (which would hang), /dev/zero (read until MemoryError), a folder or a JSON string is one line,
    exit 2, nothing written."""
    from benchmarks.gpu_real_size import main

    report = tmp_path / "r.json"
    make(report)
    out = tmp_path / "o.json"
    box: dict = {}

    def replan_it():  # in a thread: a read that blocks (the FIFO) fails the test instead of hanging the suite
        try:
            main(["--replan", str(report), "--json", str(out)])
        except SystemExit as exc:
            box["code"] = exc.code

    thread = threading.Thread(target=replan_it, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "--replan blocked on its input"
    err = capsys.readouterr().err
    assert box.get("code") == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--replan {report}" in err and said in err and "Traceback" not in err, err
    assert not out.exists()
