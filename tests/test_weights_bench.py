"""benchmarks.weights writes one row per (weight dtype, KV method) with every documented field."""

import json
import math

from benchmarks.quality import QualityConfig
from benchmarks.weights import FIELDS, changed_answers, format_table, run

TINY = "models/bagel/bagel-tiny"


def test_weights_report_schema_on_the_tiny_checkpoint(tmp_path):
    cfg = QualityConfig(checkpoint=TINY, samples={"und": 1, "t2i": 1, "edit": 1}, num_timesteps=3)
    report = run(cfg, weight_dtypes=("int8",), kv_methods=("unicache",))
    data = json.loads(json.dumps(report))
    rows = data["results"]
    assert [(r["weight_dtype"], r["kv_method"]) for r in rows] == [("int8", "unicache")]
    for row in rows:
        assert set(row) == set(FIELDS)
        # the load's own peak above its base: >= 0 (it read -4096 when the base was taken before the mark was
        # reset); it can be 0 here, where the tiny model fits in what the bundled model's warm-up load freed
        assert row["param_bytes"] > 0 and row["load_seconds"] > 0 and row["load_peak_rss_bytes"] >= 0
        assert row["step_seconds"] > 0
        assert 0.0 <= row["und_accuracy"] <= 1.0 and 0.0 <= row["t2i_attribute_mean"] <= 1.0
        assert math.isfinite(row["edit_psnr"])
        assert row["und_answers_changed"] == 0  # the run's first weight dtype is its own reference
    assert "int8" in format_table(report) and "unicache" in format_table(report)
    assert data["config"]["und_reference_weight_dtype"] == "int8"


def test_changed_answers_counts_every_differing_or_missing_answer():
    reference = {1: "red", 2: "3", 3: "left"}
    assert changed_answers(dict(reference), reference) == 0
    assert changed_answers({1: "red", 2: "4", 3: "Left"}, reference) == 2  # answers compare as given
    assert changed_answers({1: "red"}, reference) == 2
