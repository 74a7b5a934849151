"""Fidelity to full KV against the KV held, for every method, read from the measured results in docs/results/.

    .venv/bin/python -m tools.pareto [--results docs/results] [--out docs/images/pareto.png]

Four panels of the bundled model: understanding and editing with one image (``quality.json``: each method at the
paper's, the robust and the extreme targets, the baselines at UniCache's bytes) and with two images
(``multi_image.json``: UniCache at its default, every baseline at UniCache's bytes of the same sample). A point is
one method at one target: across, the compressible KV it held (% of full KV's, log scale); up, its step fidelity
(teacher-forced on full KV's path, dB, higher is nearer full KV; docs/compression.md §11.11), with the 95% interval
of the mean over the samples. The dashed line is the frontier: the points no other point beats on both axes.
Nothing is computed here that the benchmarks did not measure. Needs matplotlib (the ``docs`` extra).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from tools.figure_command import run_figure
from unicache_commands.flags import OneLineParser
from unicache_commands.output_files import write_atomically

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
OUT = ROOT / "docs" / "images" / "pareto.png"
#: quality.json's task names and the multi-image benchmark's.
PANELS = (("und", 1), ("edit", 1), ("und", 2), ("edit", 2))
TASK_NAMES = {"und": "understanding", "edit": "edit"}
#: The KV-held axis (%, log) spans at least this range in every panel, with these ticks.
HELD_RANGE, HELD_TICKS = (3.0, 40.0), (2, 3, 5, 10, 20, 40, 60, 100)
#: A colour per method (others: grey); UniCache drawn last and largest.
COLORS = {
    "unicache": "#1e88e5",
    "kivi": "#e53935",
    "lookm": "#8e24aa",
    "h2o": "#fb8c00",
    "snapkv": "#43a047",
    "pyramidkv": "#00897b",
    "streamingllm": "#6d4c41",
    "vlcache": "#fdd835",
    "unicache_paper_table": "#90caf9",
}


@dataclass(frozen=True)
class Point:
    """One method at one target: KV held (% of full), step fidelity (dB) and the half-width of its 95% interval."""

    method: str
    held: float
    fidelity: float
    ci95: float


def _ci95(values: list[float]) -> float:
    return 1.96 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


def single_image_points(results: Path, task: str) -> list[Point]:
    """``quality.json``: every compressed row of ``task`` with a step fidelity, at every target."""
    quality = json.loads((results / "quality.json").read_text(encoding="utf-8"))
    points = []
    for row in quality["results"]:
        steps = row.get("metrics", {}).get("per_sample_step_fidelity")
        if row["task"] != task or row["method"] == "full" or not steps:
            continue
        held = 100.0 * (1.0 - row["achieved_reduction"])
        points.append(Point(row["method"], held, statistics.fmean(steps), _ci95(steps)))
    return points


def multi_image_points(results: Path, task: str, images: int) -> list[Point]:
    """``multi_image.json``: every method's row of ``task`` with ``images`` images."""
    multi = json.loads((results / "multi_image.json").read_text(encoding="utf-8"))
    return [
        Point(r["method"], 100.0 * r["held_ratio"], r["step_fidelity_db"], _ci95(r["per_sample_step_fidelity"]))
        for r in multi["results"]
        if r["task"] == task and r["images"] == images
    ]


def frontier(points: list[Point]) -> list[Point]:
    """The points no other point beats on both axes (held no more, fidelity no less, one of them strictly), in
    order of bytes held."""
    best = []
    for p in sorted(points, key=lambda p: (p.held, -p.fidelity)):
        if not best or p.fidelity > best[-1].fidelity:
            best.append(p)
    return best


def panels(results: Path) -> list[tuple[str, list[Point]]]:
    """``(title, points)`` of the four panels."""
    out = []
    for task, images in PANELS:
        if images == 1:
            out.append((f"{TASK_NAMES[task]}, one image", single_image_points(results, task)))
        else:
            out.append((f"{TASK_NAMES[task]}, {images} images", multi_image_points(results, task, images)))
    return out


def render(drawn: list[tuple[str, list[Point]]], out: Path) -> None:
    """Draw the panels into ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator, StrMethodFormatter

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.4))
    held = [p.held for _, points in drawn for p in points]
    low, high = min([HELD_RANGE[0], *[h / 1.25 for h in held]]), max([HELD_RANGE[1], *[h * 1.25 for h in held]])
    handles: dict[str, object] = {}
    for ax, (title, points) in zip(axes.flat, drawn):
        methods = sorted({p.method for p in points}, key=lambda m: (m == "unicache", m))
        for method in methods:
            mine = sorted((p for p in points if p.method == method), key=lambda p: p.held)
            handles[method] = ax.errorbar(
                [p.held for p in mine],
                [p.fidelity for p in mine],
                yerr=[p.ci95 for p in mine],
                marker="o",
                markersize=7 if method == "unicache" else 5,
                linewidth=1.6 if method == "unicache" else 0.9,
                capsize=2,
                color=COLORS.get(method, "#9e9e9e"),
                label=method,
            )
        edge = frontier(points)
        (handles["frontier"],) = ax.plot(
            [p.held for p in edge], [p.fidelity for p in edge], "k--", linewidth=0.8, label="frontier"
        )
        ax.set_xscale("log")
        ax.set_xlim(low, high)
        ax.xaxis.set_major_locator(FixedLocator([t for t in HELD_TICKS if low <= t <= high]))
        ax.xaxis.set_major_formatter(StrMethodFormatter("{x:g}%"))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("compressible KV held (% of full KV, log scale)")
        ax.set_ylabel("step fidelity to full KV (dB)")
        ax.set_title(title, fontsize=10)
        ax.spines[["top", "right"]].set_visible(False)
    order = sorted(handles, key=lambda m: (m != "unicache", m == "frontier", m))
    fig.legend([handles[m] for m in order], order, loc="lower center", ncol=len(order), frameon=False, fontsize=8)
    fig.suptitle("Bundled model: fidelity to full KV against the KV held (higher and further left is better)")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    write_atomically("--out", out, lambda tmp: fig.savefig(tmp, format="png", dpi=100, metadata={"Software": None}))
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m tools.pareto", description=__doc__.splitlines()[0])
    return run_figure(parser, argv, results=RESULTS, out=OUT, read=panels, render=render)


if __name__ == "__main__":
    sys.exit(main())
