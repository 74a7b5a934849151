"""The end-to-end benchmark's report: schema, memory matching and ratios (no timing assertions), one task per
test (the benchmark runs its tasks independently, so the suite can run them side by side)."""

import json

import pytest

from benchmarks import bagel_e2e

KEYS = {
    "task",
    "checkpoint",
    "method",
    "kv_bytes_peak",
    "kv_bytes_steady",
    "full_kv_bytes",
    "protected_bytes",
    "rho_mean",
    "attended_ratio_vs_full",
    "attention_seconds_median",
    "attention_speedup_vs_full",
    "attention_share_full",
    "step_ceiling",
    "step_seconds_median",
    "speedup_vs_full",
    "overhead_fraction",
    "fidelity",
}
METHODS = ("full", "unicache", "h2o", "kivi")
FIDELITY = {"und": {"token_agreement", "first_token_logit_rel_error"}, "edit": {"latent_cosine", "image_psnr_db"}}


@pytest.mark.parametrize("task", bagel_e2e.TASKS)
def test_e2e_report_on_the_tiny_checkpoint(tmp_path, task):
    cfg = bagel_e2e.E2EConfig(
        checkpoints=("tiny",),
        tasks=(task,),
        methods=METHODS,
        steps=2,
        decode_tokens=3,
        edit_size=64,
        t2i_size=32,
        work_dir=str(tmp_path),
    )
    report = bagel_e2e.run(cfg)
    json.dumps(report)
    rows = {(r["task"], r["method"]): r for r in report["results"]}
    assert set(rows) == {(task, m) for m in (*METHODS, bagel_e2e.MEMORY_ROW, bagel_e2e.EVICT_ROW, bagel_e2e.JOINT_ROW)}
    for (_, method), row in rows.items():
        assert KEYS <= set(row), (task, method)
        assert row["full_kv_bytes"] == rows[(task, "full")]["full_kv_bytes"] > 0
        assert 0 < row["step_ceiling"] and row["attention_seconds_median"] > 0
        if method == "full":
            assert row["kv_bytes_steady"] == row["full_kv_bytes"] and row["attended_ratio_vs_full"] == 1.0
        else:
            assert row["kv_bytes_steady"] < row["full_kv_bytes"]
    uni, h2o = rows[(task, "unicache")], rows[(task, "h2o")]
    # the baseline ran at UniCache's achieved memory (steady bytes at or under it)
    assert h2o["kv_bytes_steady"] <= uni["kv_bytes_steady"]
    assert h2o["kv_bytes_steady"] >= 0.9 * uni["kv_bytes_steady"]
    assert rows[(task, "kivi")]["attended_ratio_vs_full"] == 1.0  # every row stays visible
    if task in FIDELITY:
        assert set(h2o["fidelity"]) == FIDELITY[task]
    assert "tiny" in bagel_e2e.format_table(report)
