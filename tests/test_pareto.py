"""The Pareto figure draws the measured fidelities and bytes of docs/results (tools/pareto.py), and a method's rows
measured later are added to a committed quality report only when they pair with it (benchmarks/report_rows.py)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from PIL import Image

from benchmarks import report_rows
from tools import pareto

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def test_the_points_are_the_measured_rows():
    quality = json.loads((RESULTS / "quality.json").read_text(encoding="utf-8"))
    points = pareto.single_image_points(RESULTS, "edit")
    rows = [r for r in quality["results"] if r["task"] == "edit" and r["method"] != "full"]
    assert len(points) == len(rows) and {p.method for p in points} >= {"unicache", "kivi", "h2o"}
    unicache = next(r for r in rows if r["method"] == "unicache" and r["target_reduction"] == 0.9)
    point = next(p for p in points if p.method == "unicache" and p.held == pytest.approx(10.0, abs=0.5))
    assert point.held == pytest.approx(100 * (1 - unicache["achieved_reduction"]))
    assert point.fidelity == pytest.approx(statistics.fmean(unicache["metrics"]["per_sample_step_fidelity"]))
    multi = json.loads((RESULTS / "multi_image.json").read_text(encoding="utf-8"))
    two = {r["method"]: r for r in multi["results"] if r["task"] == "und" and r["images"] == 2}
    drawn = {p.method: p for p in pareto.multi_image_points(RESULTS, "und", 2)}
    assert set(drawn) == set(two)
    assert drawn["kivi"].fidelity == two["kivi"]["step_fidelity_db"]
    assert drawn["kivi"].held == pytest.approx(100 * two["kivi"]["held_ratio"])


def test_the_frontier_keeps_only_the_points_nothing_beats():
    p = pareto.Point
    points = [p("a", 5, 10, 0), p("b", 5, 12, 0), p("c", 10, 11, 0), p("d", 10, 20, 0), p("e", 20, 15, 0)]
    assert [x.method for x in pareto.frontier(points)] == ["b", "d"]
    assert pareto.frontier([]) == []


def test_the_figure_renders_the_committed_size(tmp_path):
    out = tmp_path / "pareto.png"
    pareto.render(pareto.panels(RESULTS), out)
    with Image.open(out) as image, Image.open(pareto.OUT) as committed:
        assert image.size == committed.size == (1200, 840)


def _report(methods, rows):
    return {"config": {"methods": methods}, "results": rows}


def _row(task, method, target, per_sample):
    return {"task": task, "method": method, "target_reduction": target, "metrics": {"per_sample": per_sample}}


def test_added_rows_go_after_their_target_and_must_pair_with_the_report():
    report = _report(
        ["full", "unicache", "kivi"],
        [
            _row("edit", "full", 0.0, [1, 2]),
            _row("edit", "unicache", 0.8, [1, 1]),
            _row("edit", "kivi", 0.8, [0, 1]),
            _row("edit", "unicache", 0.9, [1, 0]),
        ],
    )
    new = _report(["full", "lookm"], [_row("edit", "full", 0.0, [1, 2]), _row("edit", "lookm", 0.8, [2, 2])])
    merged = report_rows.merge_reports(report, new)
    assert [(r["method"], r["target_reduction"]) for r in merged["results"]] == [
        ("full", 0.0),
        ("unicache", 0.8),
        ("kivi", 0.8),
        ("lookm", 0.8),
        ("unicache", 0.9),
    ]
    assert merged["config"]["methods"] == ["full", "unicache", "kivi", "lookm"]
    other_samples = _report(["full", "lookm"], [_row("edit", "full", 0.0, [2, 2]), _row("edit", "lookm", 0.8, [1, 1])])
    with pytest.raises(ValueError, match="not the same samples"):
        report_rows.merge_reports(report, other_samples)
    with pytest.raises(ValueError, match="already has kivi"):
        report_rows.merge_reports(report, _report(["kivi"], [_row("edit", "kivi", 0.8, [0, 0])]))


def test_split_runs_combine_and_replace_only_with_replace():
    und = _report(["full", "unicache"], [_row("und", "full", 0.0, [1, 0]), _row("und", "unicache", 0.95, [1, 1])])
    und["config"]["targets"] = {"extreme": {"und": 0.95}}
    edit = _report(["full", "kivi"], [_row("edit", "full", 0.0, [3, 4]), _row("edit", "kivi", 0.95, [2, 2])])
    edit["config"]["targets"] = {"extreme": {"edit": 0.95}}
    merged = report_rows.merge_reports(und, edit)
    assert [(r["task"], r["method"]) for r in merged["results"]] == [
        ("und", "full"),
        ("und", "unicache"),
        ("edit", "full"),
        ("edit", "kivi"),
    ]
    assert merged["config"]["targets"] == {"extreme": {"und": 0.95, "edit": 0.95}}
    again = _report(["full", "unicache"], [_row("und", "full", 0.0, [1, 0]), _row("und", "unicache", 0.95, [0, 0])])
    with pytest.raises(ValueError, match="already has unicache"):
        report_rows.merge_reports(merged, again)
    replaced = report_rows.merge_reports(merged, again, replace=True)
    assert [r["metrics"]["per_sample"] for r in replaced["results"] if r["method"] == "unicache"] == [[0, 0]]
    assert len(replaced["results"]) == 4 and replaced["config"]["added_runs"][-1]["replaced"] is True
    other = _report(["full"], [_row("und", "full", 0.0, [0, 0])])
    with pytest.raises(ValueError, match="not the same samples"):
        report_rows.merge_reports(merged, other, replace=True)


def test_multi_image_rows_keep_the_unicache_row_they_were_paired_with():
    def row(method, images, steps):
        return {
            "task": "edit",
            "images": images,
            "method": method,
            "per_sample_step_fidelity": steps,
            "held_ratio": 0.2,
            "step_fidelity_db": sum(steps) / len(steps),
            "free_fidelity": 30.0,
        }

    report = {
        "config": {"methods": ["unicache", "kivi"], "images": [2, 3]},
        "results": [row("unicache", 2, [1.0, 2.0]), row("kivi", 2, [3.0, 1.0]), row("unicache", 3, [2.0, 2.0])],
    }
    same = {
        "config": {"methods": ["unicache", "lookm"]},
        "results": [row("unicache", 2, [1.0, 2.0]), row("lookm", 2, [0.5, 0.5])],
    }
    merged = report_rows.merge_multi_image(report, same)
    assert [(r["method"], r["images"]) for r in merged["results"]] == [
        ("unicache", 2),
        ("kivi", 2),
        ("lookm", 2),
        ("unicache", 3),
    ]
    assert "paired_unicache" not in merged["results"][2]
    drifted = {"config": same["config"], "results": [row("unicache", 2, [1.0, 2.5]), row("lookm", 2, [0.5, 0.5])]}
    added = report_rows.merge_multi_image(report, drifted)["results"][2]
    assert added["paired_unicache"]["per_sample_step_fidelity"] == [1.0, 2.5]
    with pytest.raises(ValueError, match="already has kivi"):
        report_rows.merge_multi_image(
            report, {"config": same["config"], "results": [row("unicache", 2, [1.0, 2.0]), row("kivi", 2, [1.0, 1.0])]}
        )
