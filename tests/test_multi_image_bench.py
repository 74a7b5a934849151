"""benchmarks/multi_image.py on a small run: the rows, their pairing with UniCache and what they can show."""

from __future__ import annotations

import json

from benchmarks import multi_image


def test_multi_image_bench_pairs_every_method_with_unicache(tmp_path):
    cfg = multi_image.MultiImageConfig(
        samples=2, images=(2,), methods=("unicache", "h2o", "kivi"), num_timesteps=3, max_new_tokens=3
    )
    report = multi_image.run(cfg)
    rows = {(r["task"], r["method"]): r for r in report["results"]}
    assert set(rows) == {(task, m) for task in ("edit", "und") for m in cfg.methods}
    for (_task, method), row in rows.items():
        assert row["images"] == 2 and len(row["per_sample_step_fidelity"]) == 2
        assert 0 < row["held_ratio"] < 1  # every method holds less than full KV on these requests
        assert 0 < row["step_fidelity_db"] <= 100
        assert ("unicache_minus_this_step_db" in row) == (method != "unicache")
    # the baselines are matched to UniCache's bytes of the same sample
    for task in ("edit", "und"):
        assert abs(rows[(task, "h2o")]["held_ratio"] - rows[(task, "unicache")]["held_ratio"]) < 0.05
    assert "never saw two images" in report["config"]["note"]
    table = multi_image.format_table(report)
    assert table.count("\n") == len(report["results"])
    json.dumps(report)
