"""benchmarks.gpu_real_size with several source images (issue #43 item 6): the CPU dry run on the small-geometry
twin meters an edit of three sources in one request phase by phase, and the plan, made for the same three images,
is within 10% of the metered peak; UniCache holds less at the denoising's start than full KV (the images' rows that
cfg_text shares with gen), as the plan says."""

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
    kv = sum(full["kv_bytes_per_branch"].values())
    held = kv - full["kv_bytes_per_branch"]["cfg_text"]  # every row of full KV's cfg_text is gen's (shared, held once)
    assert full["phase_entry_bytes"]["denoise"] - full["phase_entry_bytes"]["decode"] >= held
    # Full KV now holds the rows cfg_text shares with gen once too, and UniCache stores the images' VAE rows (the twin
    # has the paper's table) quantized as they are written (docs/compression.md §13). The memory plan still counts
    # full KV's rows per branch until it models sharing (issue #54 items 5-8): its full-vs-UniCache gap is now an upper
    # bound of the measured one, which is UniCache's prefill quantization alone.
    assert full["plan_breakdown"]["kv_held"] == full["plan_breakdown"]["kv_full"] == kv
    planned_gap = full["plan_breakdown"]["kv_held"] - unicache["plan_breakdown"]["kv_held"]
    measured = full["phase_entry_bytes"]["denoise"] - unicache["phase_entry_bytes"]["denoise"]
    assert 0 < measured < planned_gap, (measured, planned_gap)
    assert format_table(report["results"]).splitlines()[1].split()[4] == "3"  # the images column
