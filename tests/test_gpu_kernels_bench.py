"""benchmarks.gpu_kernels: its command line here, and its dry run on the CPU (Triton's interpreter, in a fresh process:
the interpreter needs ``TRITON_INTERPRET=1`` before Triton is first imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runs import exit_status

from benchmarks import gpu_kernels

ROOT = Path(__file__).resolve().parents[1]


def test_help_names_the_comparison(capsys):
    assert exit_status(gpu_kernels.main, ["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--rows", "--queries", "--bits", "--group", "--residual", "--heads", "--repeats", "--json"):
        assert flag in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--heads", "28,5"], "--heads must be query heads,KV heads"),
        (["--bits", "3"], "--bits must be among 1, 2, 4, 8"),
        (["--rows", "0"], "invalid _ints value"),
        (["--json", ""], "empty path"),
    ],
)
def test_argument_mistakes_are_one_line_errors(capsys, argv, message):
    assert exit_status(gpu_kernels.main, ["--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_dry_run_on_the_cpu(tmp_path):
    report_path = tmp_path / "gpu_kernels.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)  # the script sets it for --device cpu
    argv = ["--device", "cpu", "--rows", "96", "--queries", "1,20", "--bits", "2,4", "--heads", "4,2"]
    argv += ["--head-dim", "32", "--group", "16", "--residual", "8", "--repeats", "1", "--json", str(report_path)]
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_kernels", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(report_path.read_text(encoding="utf-8"))
    assert report["config"]["gpu"] is None and report["config"]["device"] == "cpu"
    rows = report["results"]
    assert [(r["queries"], r["bits"]) for r in rows] == [(1, 2), (1, 4), (20, 2), (20, 4)]
    for row in rows:
        assert not row["selected"]  # CPU queries: QuantizedStore.attend keeps the torch path
        assert row["splits"] >= 1 and min(row["kernel_ms"], row["dequant_ms"], row["full_ms"]) > 0
        assert row["store_bytes"] < row["full_bytes"]
        # bf16 outputs of two roundings of the same attention (the kernel's and the torch path's)
        assert row["out_error"] < 5e-2 and row["lse_error"] < 1e-2
    assert len(run.stdout.strip().splitlines()) == 1 + len(rows)
