"""The end-to-end benchmark's report: schema, memory matching and ratios (no timing assertions)."""

import json

from benchmarks import bagel_e2e

KEYS = {"task", "checkpoint", "method", "kv_bytes_peak", "kv_bytes_steady", "full_kv_bytes", "protected_bytes",
        "rho_mean", "attended_ratio_vs_full", "attention_seconds_median", "attention_speedup_vs_full",
        "attention_share_full", "step_ceiling", "step_seconds_median", "speedup_vs_full", "overhead_fraction",
        "fidelity"}


def test_e2e_report_on_the_tiny_checkpoint(tmp_path):
    cfg = bagel_e2e.E2EConfig(checkpoints=("tiny",), methods=("full", "unicache", "h2o", "kivi"), steps=2,
                              decode_tokens=3, edit_size=64, t2i_size=32, work_dir=str(tmp_path))
    report = bagel_e2e.run(cfg)
    json.dumps(report)
    rows = {(r["task"], r["method"]): r for r in report["results"]}
    assert set(rows) == {(t, m) for t in ("und", "t2i", "edit")
                         for m in ("full", "unicache", bagel_e2e.JOINT_ROW, "h2o", "kivi")}
    for (task, method), row in rows.items():
        assert KEYS <= set(row), (task, method)
        assert row["full_kv_bytes"] == rows[(task, "full")]["full_kv_bytes"] > 0
        assert 0 < row["step_ceiling"] and row["attention_seconds_median"] > 0
        if method == "full":
            assert row["kv_bytes_steady"] == row["full_kv_bytes"] and row["attended_ratio_vs_full"] == 1.0
        else:
            assert row["kv_bytes_steady"] < row["full_kv_bytes"]
    for task in ("und", "t2i", "edit"):
        uni, h2o = rows[(task, "unicache")], rows[(task, "h2o")]
        # the baseline ran at UniCache's achieved memory (steady bytes at or under it)
        assert h2o["kv_bytes_steady"] <= uni["kv_bytes_steady"]
        assert h2o["kv_bytes_steady"] >= 0.9 * uni["kv_bytes_steady"]
        assert rows[(task, "kivi")]["attended_ratio_vs_full"] == 1.0  # every row stays visible
    assert set(rows[("und", "h2o")]["fidelity"]) == {"token_agreement", "first_token_logit_rel_error"}
    assert set(rows[("edit", "h2o")]["fidelity"]) == {"latent_cosine", "image_psnr_db"}
    assert "tiny" in bagel_e2e.format_table(report)
