"""The KV-attention benchmark's report: schema, method names and memory matching (no timing assertions)."""

import json
import subprocess
import sys

from benchmarks import kv_attention

METHODS = [
    "full",
    "h2o",
    "snapkv",
    "pyramidkv",
    "streamingllm",
    "kivi",
    "vlcache",
    "lookm",
    "unicache",
    "unicache_joint",
]
KEYS = {"method", "kv_bytes", "full_kv_bytes", "step_seconds_median", "speedup_vs_full", "rel_error_vs_full"}


def test_quick_benchmark_report(tmp_path):
    out = tmp_path / "new" / "dir" / "bench.json"  # missing folders are created
    kv_attention.main(["--quick", "--repeats", "1", "--dtype", "float32", "--threads", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert set(report) >= {"config", "results"}
    rows = {r["method"]: r for r in report["results"]}
    assert set(METHODS) <= set(rows)
    for row in report["results"]:
        assert KEYS <= set(row), row["method"]
        assert row["step_seconds_median"] > 0
    assert rows["full"]["rel_error_vs_full"] == 0.0
    full_bytes = rows["full"]["full_kv_bytes"]
    for name in METHODS[1:]:
        row = rows[name]
        assert row["full_kv_bytes"] == full_bytes
        # every compressed method really holds at most 20% of the uncompressed K+V bytes
        assert row["full_kv_bytes"] / row["kv_bytes"] >= 5.0 - 1e-9, (name, row["kv_bytes"])
        assert 0.0 < row["rel_error_vs_full"]
    # at equal memory, UniCache's typed plan is more accurate than every single-policy baseline
    for name in ("h2o", "snapkv", "pyramidkv", "streamingllm", "kivi", "vlcache", "lookm"):
        assert rows["unicache"]["rel_error_vs_full"] < rows[name]["rel_error_vs_full"], name
        assert rows["unicache_joint"]["rel_error_vs_full"] < rows[name]["rel_error_vs_full"], name
    # the joint row's plan was calibrated on the context: bits per budget level for every candidate type
    plans = report["config"]["unicache_joint_calibration"]["plans"]
    assert set(plans) == {"instruction", "source_vit", "source_vae"}
    assert all(entry["bits"] in (16, 8, 4, 2) for plan in plans.values() for entry in plan)
    attended = report["config"]["attended_tokens_per_kv_head"]
    # UniCache's evicted types are held whole at low bits where that loses less (docs/compression.md §11.16); the
    # official throughput preset evicts its fixed share
    assert attended["unicache"] <= attended["full"] and attended["unicache_engine"] < attended["full"]
    assert attended["kivi"] == attended["full"]  # quantization keeps every token visible


def test_benchmark_imports_first_in_a_fresh_interpreter():
    """The benchmark imports as the first module of a process (no import circle through the library)."""
    proc = subprocess.run([sys.executable, "-c", "import benchmarks.kv_attention"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
