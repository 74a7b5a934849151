"""The Triton kernel of attention over packed KV rows (unicache_core/kv/packed_attention_triton.py) and its selection.

The kernel runs on the CPU under Triton's interpreter. Triton decorates its own standard library when it is first
imported, and interprets it only when ``TRITON_INTERPRET=1`` was set before that import, so the kernel cases run in
one fresh process (tests/packed_kernel_cases.py, about 5 s) and the tests here assert on its report: the output and
the LSE within 1e-3 relative of the torch path in fp32, for every bit width, group size, residual length and head
layout. The selection (CUDA queries with Triton only, each fallback logged once) is tested in this process.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from packed_kernel_cases import LAYOUTS, make_store, queries, reference, relative  # isort: skip  (tests/ on the path)
from unicache_core.kv import packed_attention_triton as pat

pytest.importorskip("triton")
# the report's tests share one interpreter process: keep them on one xdist worker (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("packed_kernel")

ROOT = Path(__file__).resolve().parents[1]
#: The exactness the issue asks of the kernel in fp32: output and LSE within 1e-3 relative of the torch reference.
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """The report of tests/packed_kernel_cases.py, run by Triton's interpreter in a fresh process."""
    path = tmp_path_factory.mktemp("packed_kernel") / "report.json"
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "packed_kernel_cases.py"), str(path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(path.read_text(encoding="utf-8"))


def test_the_cases_ran_under_the_interpreter(report):
    assert report["interpret"] and report["kernels_interpret"]
    assert set(report["layouts"]) == set(LAYOUTS)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_kernel_matches_the_torch_path(report, name):
    case = report["layouts"][name]
    rows, bits, vbits, per_token, _, residual, layout, hq, tq, mag, d = LAYOUTS[name]
    # the store is the layout named: value bits, key grouping, per-head rows, fp32 scales past fp16's range
    assert case["value_bits"] == (bits if vbits is None else vbits) and case["key_per_token"] == per_token
    assert case["per_head_rows"] == (layout != "shared") and case["quantized"] == rows - min(rows, residual)
    assert case["scale_dtype"] == ("torch.float32" if mag > 1e4 else "torch.float16")
    for splits, got in case["splits"].items():
        assert got["dtype"] == "torch.float32" and got["lse_dtype"] == "torch.float32", splits
        assert got["shape"] == [tq, hq, d], splits
        errors = [got["out"], got["lse"], got["out_vs_torch"], got["lse_vs_torch"]]
        assert max(errors) < TOLERANCE, (splits, errors)


def test_the_kernel_attends_exactly_the_stores_rows(report):
    rows = report["rows"]
    for layout in ("shared", "bitmap"):
        # scale 0: the LSE is log(77): each of the 77 rows (72 packed, 5 residual) counted once; the output their mean
        assert rows[layout]["lse_minus_log_rows"] < 1e-5 and rows[layout]["out_minus_mean"] < 1e-5
    assert max(rows["needle"]) < 1e-4  # rows 0, 16, 47 and 76 (four splits of 16-row tiles), each found


@pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float16"])
def test_half_precision_queries(report, dtype):
    case = report["half"][dtype]
    assert case["dtype"] == dtype
    # the tiles are rounded to the queries' dtype as the torch path rounds them: an error of that dtype's size
    bound = 2 * case["torch_out"] + 4 * case["eps"]
    assert case["out"] < bound and case["out_vs_torch"] < bound
    assert case["lse"] < 10 * case["eps"] and case["torch_lse"] < 10 * case["eps"]


def test_store_attend_runs_the_kernel_for_cuda_queries(report):
    dispatch = report["dispatch"]
    assert dispatch["kernel_calls"] == 1  # the kernel_disabled() call took the torch path
    assert dispatch["out_vs_torch"] < TOLERANCE and dispatch["lse_vs_torch"] < TOLERANCE


def test_the_fused_path_attends_quantized_stores_by_the_kernel(report):
    # SegmentedLayer.attend(fused=True), the calls that measure nothing: the two quantized stores by the kernel, the
    # full and evicted ones through the workspace, the new block visible, causal or absent
    assert len(report["fused"]) == 6
    for case, got in report["fused"].items():
        assert got["calls"] == 2, case
        assert got["out"] < TOLERANCE and got["lse"] < TOLERANCE, (case, got)


@pytest.fixture
def fresh_logs(monkeypatch):
    """Fresh once-only logs and failure records."""
    monkeypatch.setattr(pat, "_LOGGED", set())
    monkeypatch.setattr(pat, "_FAILED", set())


def _pretend_cuda(monkeypatch):
    """The selection's one device test answers yes for these CPU queries."""
    monkeypatch.setattr(pat, "_on_cuda", lambda q: True)


def test_cpu_queries_never_take_the_kernel(fresh_logs, caplog):
    store = make_store(40, residual=4)
    with caplog.at_level(logging.INFO, logger=pat.__name__):
        assert pat.packed_attention_kernel(store, queries(1, 2)) is None
    assert caplog.records == []


def test_cuda_queries_take_the_kernel_when_triton_is_importable(fresh_logs, monkeypatch):
    _pretend_cuda(monkeypatch)
    store = make_store(40, residual=4, layout="list")
    assert pat.packed_attention_kernel(store, queries(1, 2)) is pat._attend_or_fall_back
    with pat.kernel_disabled():
        assert pat.packed_attention_kernel(store, queries(1, 2)) is None
    assert pat.packed_attention_kernel(store, queries(1, 2)) is pat._attend_or_fall_back


def test_unsupported_layouts_take_the_torch_path_logged_once(fresh_logs, monkeypatch, caplog):
    _pretend_cuda(monkeypatch)
    monkeypatch.setattr(pat, "packed_attention", lambda *a, **k: pytest.fail("the kernel ran"))
    cases = [
        (make_store(30, d=8, residual=2), queries(1, 2, d=8), "head dim 8"),  # tl.dot needs 16 channels at least
        (make_store(30, residual=2), queries(1, 2, dtype=torch.float64), "torch.float64"),
    ]
    with caplog.at_level(logging.INFO, logger=pat.__name__):
        for store, q, reason in cases:
            for _ in range(2):
                assert pat.packed_attention_kernel(store, q) is None
                out, lse = store.attend(q)
                want_out, want_lse = reference(store, q)
                assert relative(out, want_out) < TOLERANCE and relative(lse, want_lse) < TOLERANCE
            assert sum(reason in r.getMessage() for r in caplog.records) == 1
    assert len(caplog.records) == 2


def test_without_triton_the_torch_path_runs_logged_once(fresh_logs, monkeypatch, caplog):
    _pretend_cuda(monkeypatch)
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` raises ImportError
    pat._triton_importable.cache_clear()
    try:
        store = make_store(30, residual=2)
        q = queries(1, 2)
        with caplog.at_level(logging.INFO, logger=pat.__name__):
            for _ in range(3):
                assert pat.packed_attention_kernel(store, q) is None
                out, _ = store.attend(q)
        assert [r.getMessage() for r in caplog.records if "Triton is not importable" in r.getMessage()] != []
        assert len(caplog.records) == 1
        assert relative(out, reference(store, q)[0]) < TOLERANCE
    finally:
        pat._triton_importable.cache_clear()


def test_a_layout_the_kernel_fails_on_falls_back_once(fresh_logs, monkeypatch, caplog):
    from triton.runtime.errors import OutOfResources

    _pretend_cuda(monkeypatch)
    tries = []

    def out_of_resources(*args, **kwargs):
        tries.append(1)
        raise OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(pat, "packed_attention", out_of_resources)
    store = make_store(40, residual=4)
    q = queries(2, 2)
    want_out, want_lse = reference(store, q)
    with caplog.at_level(logging.INFO, logger=pat.__name__):
        for _ in range(2):
            out, lse = store.attend(q)
            assert relative(out, want_out) < TOLERANCE and relative(lse, want_lse) < TOLERANCE
    assert tries == [1]  # the second call goes straight to the torch path
    assert len(caplog.records) == 1 and "OutOfResources" in caplog.records[0].getMessage()


def test_the_row_split_never_leaves_a_split_empty():
    for rows in (1, 15, 16, 17, 77, 5000, 40960):
        for programs in (1, 4, 28, 1792):
            splits, per_split = pat._split(rows, programs, torch.device("cpu"), 64, None)
            assert per_split % 64 == 0 and (splits - 1) * per_split < rows <= splits * per_split
            assert splits <= max(1, math.ceil(8 / programs)) and splits <= math.ceil(rows / 64)
