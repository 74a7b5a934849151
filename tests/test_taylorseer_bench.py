"""benchmarks.taylorseer: the four rows of every (checkpoint, task), their forward counts and ratios (no timing
assertions), on the bundled model with a short schedule."""

import json

from benchmarks import taylorseer as bench


def test_rows_forwards_and_ratios_on_the_bundled_model(tmp_path):
    cfg = bench.TaylorSeerBenchConfig(checkpoints=("bundled",), num_timesteps=8, work_dir=str(tmp_path))
    report = bench.run(cfg)
    json.dumps(report)
    rows = {(r["task"], r["row"]): r for r in report["results"]}
    assert set(rows) == {(task, name) for task in ("edit", "t2i") for name, _, _ in bench.ROWS}
    for (task, name), row in rows.items():
        seer = name.endswith("+taylorseer")
        # 7 steps: 0-4 computed, 5 and 6 forecast; the edit runs its three branches on every step, the
        # t2i its CFG branches while t > 0.4
        per_branch = row["forwards_per_branch"]
        assert per_branch["gen"] == (5 if seer else 7)
        plain = rows[(task, "full")]["decoder_forwards"]
        assert row["forecasts"] == (plain - row["decoder_forwards"] if seer else 0)
        assert row["forwards_vs_full"] == row["decoder_forwards"] / rows[(task, "full")]["decoder_forwards"]
        assert (row["taylorseer_peak_bytes"] > 0) == seer and ("speedup_vs_method" in row) == seer
        assert (row["forecast_step_seconds"] is not None) == seer and row["denoise_seconds"] > 0
        assert row["denoise_cpu_seconds"] > 0 and ("speedup_cpu_vs_method" in row) == seer
        assert 0 < row["psnr_to_full"] <= 100 and -1 <= row["latent_cosine_to_full"] <= 1 + 1e-6
        if name.startswith("unicache"):
            assert row["kv_bytes_steady"] < row["full_kv_bytes"]
    assert rows[("edit", "full")]["psnr_to_full"] == 100
    assert (
        rows[("edit", "full+taylorseer")]["decoder_forwards"] == 15 and rows[("edit", "full")]["decoder_forwards"] == 21
    )
    assert len(bench.format_table(report).splitlines()) == 1 + len(rows)
