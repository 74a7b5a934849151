"""benchmarks.gpu_real_size with several source images (issue #43 item 6): the CPU dry run on the small-geometry
twin meters an edit of three sources in one request phase by phase, and the plan, made for the same three images,
is within 10% of the metered peak; full KV holds the images' rows once (cfg_text shares them with gen), as the plan
says, and UniCache no more."""

from __future__ import annotations

from test_real_size import TWIN_LLM, TWIN_VIT


def test_phase_meter_on_the_twin_with_three_sources(tmp_path):
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
        images=3,
    )
    full, unicache = report["results"]
    for row in (full, unicache):
        assert row["images"] == 3 and row["size"] == [256, 256]
        assert abs(row["plan_error"]) <= 0.10, row["plan_error"]
        assert max(t["bytes"] for t in row["decode_entry_tensors"]) <= 256 * 64 * 4  # only the packed latent
    kv = sum(full["kv_bytes_per_branch"].values())  # each branch's bytes, the shared rows in both
    assert full["phase_entry_bytes"]["denoise"] - full["phase_entry_bytes"]["decode"] >= full["plan_kv_held"] / 2
    # full KV holds the three images' rows once (gen and cfg_text share them), as the plan says: what the denoising
    # starts with above the decode's start is within 25% of the plan's KV at its first step (the full cache also
    # keeps each row's type and RoPE position, 18 B per row beside 256 B of keys and values on the twin)
    held = full["phase_entry_bytes"]["denoise"] - full["phase_entry_bytes"]["decode"]
    assert full["plan_kv_held"] < kv and 0.9 * full["plan_kv_held"] <= held <= 1.25 * full["plan_kv_held"], held
    # UniCache holds no more than full KV when the denoising starts. Its plan is a bound: on the twin (head_dim 16)
    # 256 rows of an image are too few for 2 bits to shrink, so every image waits whole for the first compression
    # (as in the run) and the plan's peak is full KV's plus the boundary rows a compressing cache copies per layer
    assert unicache["phase_entry_bytes"]["denoise"] <= full["phase_entry_bytes"]["denoise"]
    assert full["plan_kv_held"] <= unicache["plan_kv_held"] <= 1.02 * full["plan_kv_held"]
    assert format_table(report["results"]).splitlines()[1].split()[4] == "3"  # the images column


def test_the_committed_real_width_cpu_rows_agree_with_the_plan():
    """docs/results/real_width_images.json (issue #54's check at BAGEL-7B's widths, N = 1, 2, 4, full and UniCache):
    the plan within 2% of every measured tensor peak; the KV held when the denoising starts within 25% of the planned
    (6% with two images or more: one image's 2-bit rows sit beside the caches' per-row entries); UniCache's
    measured peak never further above full KV's than planned, and its KV at least 4x below full KV's."""
    import json
    from pathlib import Path

    report = json.loads((Path(__file__).resolve().parent.parent / "docs/results/real_width_images.json").read_text())
    rows = {(r["kv_method"], r["images"]): r for r in report["results"]}
    assert set(rows) == {(m, n) for m in ("full", "unicache") for n in (1, 2, 4)}
    held = {}
    for key, row in rows.items():
        assert abs(row["peak_bytes"] / row["plan_bytes"] - 1) <= 0.02, key
        entry = row["phase_entry_bytes"]
        held[key] = entry["denoise"] - entry["decode"]
        slack = 0.25 if key[1] == 1 else 0.06
        assert abs(held[key] / row["plan_kv_held"] - 1) <= slack, (key, held[key], row["plan_kv_held"])
    for n in (1, 2, 4):
        full, ours = rows[("full", n)], rows[("unicache", n)]
        assert full["peak_bytes"] - ours["peak_bytes"] >= full["plan_bytes"] - ours["plan_bytes"]
        assert held[("unicache", n)] * 4 < held[("full", n)]
