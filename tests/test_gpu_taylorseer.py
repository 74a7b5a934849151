"""benchmarks.gpu_taylorseer's dry run: the GPU script's code path on the CPU at a small twin of BAGEL-7B's geometry."""

from test_real_size import TWIN_LLM, TWIN_VIT

from benchmarks.gpu_taylorseer import ROWS, format_table, run


def test_dry_run_on_the_cpu_twin(tmp_path):
    """Four rows on one model; the TaylorSeer rows run the decoder on 6 of 8 steps per branch (steps 0-4 and 7),
    hold their factors in the denoising phase (the plan counts them, within 10% of the metered peak) and stay
    close to full KV's image; every step is timed."""
    report = run(
        tmp_path / "twin",
        size=256,
        timesteps=9,
        weight_dtype="int8",
        device="cpu",
        llm=TWIN_LLM,
        vit=TWIN_VIT,
        full_vae=False,
    )
    rows = {r["row"]: r for r in report["results"]}
    assert list(rows) == [name for name, _, _ in ROWS]
    for name, row in rows.items():
        assert row["size"] == [256, 256] and len(row["step_seconds"]) == 8 and min(row["step_seconds"]) > 0
        assert abs(row["plan_bytes"] / row["peak_bytes"] - 1) <= 0.10, (name, row["plan_bytes"], row["peak_bytes"])
        if row["taylorseer"]:
            assert (row["decoder_forwards"], row["forecasts"]) == (3 * 6, 3 * 2)
            assert row["forecast_step_seconds"] is not None and row["speedup_vs_method"] > 0
            # the factors: order + 1 = 7 latent blocks [16 * 16 + 2, hidden] per branch at most, counted by the plan
            per_branch = 7 * (16 * 16 + 2) * TWIN_LLM["hidden_size"] * 2
            assert 0 < row["taylorseer_peak_bytes"] <= row["plan_taylorseer_bytes"] == 3 * per_branch
        else:
            assert (row["decoder_forwards"], row["forecasts"]) == (3 * 8, 0) and row["forecast_step_seconds"] is None
    assert rows["full"]["psnr_to_full"] == 100.0 and rows["full+taylorseer"]["psnr_to_full"] > 20
    assert rows["unicache"]["kv_bytes_per_branch"]["gen"] < rows["full"]["kv_bytes_per_branch"]["gen"]
    assert len(format_table(report["results"]).splitlines()) == 5
