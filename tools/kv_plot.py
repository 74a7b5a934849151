"""The README's plot of what UniCache saves: KV bytes held with full KV and with UniCache, per task, read from the
measured results in docs/results/ (nothing is computed here that the benchmarks did not measure).

    .venv/bin/python -m tools.kv_plot [--results docs/results] [--out docs/images/kv_bytes.png]

Left: BAGEL-7B-MoT's geometry (random weights, the real sizes): the KV of every CFG branch of an edit at 256,
512 and 1024 px on an H200 (``gpu_real_size.json``, fp8 weights, no offload) and of an answer about a 256 px
image on the CPU (``real_size.json``). Middle: the KV every branch holds together at its peak (rows shared by
branches counted once), for edits of 1, 2, 4 and 8 images (``bagel_e2e.json``, the medium checkpoint), full KV's
beside UniCache's (its image rows stored compressed as they are written, so its peak is compressed too). Right:
the bundled model, every task at the paper's reductions, with the task's score beside each bar (``quality.json``),
so the bytes saved sit next to what they cost. Needs matplotlib (the ``docs`` extra: ``pip install -e '.[docs]'``).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from tools.figure_command import run_figure
from unicache_commands.flags import OneLineParser
from unicache_commands.output_files import write_atomically

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
OUT = ROOT / "docs" / "images" / "kv_bytes.png"
MB = 1e6
#: The gpu_real_size runs the plot reads (the edits of fp8 weights without offload, one per size).
EDIT_WEIGHTS, EDIT_OFFLOAD = "fp8_e4m3fn", "none"
#: quality.json's target set that the right panel shows (the paper's reductions: und 80%, t2i 60%, edit 80%).
QUALITY_TARGETS = "paper"
TASK_NAMES = {"und": "understand", "t2i": "text to image", "edit": "edit"}
FULL_COLOR, UNICACHE_COLOR = "#9e9e9e", "#1e88e5"


@dataclass(frozen=True)
class Bar:
    """One task's pair of bars: bytes (or, on the right, the share of full KV) held, and a note under it."""

    label: str
    full: float
    unicache: float
    note: str = ""


def real_size_bars(results: Path) -> list[Bar]:
    """BAGEL-7B-MoT's geometry: the KV (MB, every branch) of an answer and of edits at three sizes."""
    real = json.loads((results / "real_size.json").read_text(encoding="utf-8"))
    by_method = {run["kv_method"]: run for run in real["runs"]}
    size = by_method["full"]["edit_size"][0]
    bars = [
        Bar(
            f"understand\n{size}² image",
            by_method["full"]["und_kv_bytes"] / MB,
            by_method["unicache"]["und_kv_bytes"] / MB,
        )
    ]
    gpu = json.loads((results / "gpu_real_size.json").read_text(encoding="utf-8"))
    edits: dict[tuple[int, str], float] = {}
    for run in gpu["results"]:
        if run["weight_dtype"] == EDIT_WEIGHTS and run["offload"] == EDIT_OFFLOAD:
            edits[(run["size"][0], run["kv_method"])] = sum(run["kv_bytes_per_branch"].values()) / MB
    for px in sorted({px for px, _ in edits}):
        bars.append(Bar(f"edit\n{px}² image", edits[(px, "full")], edits[(px, "unicache")]))
    return bars


@dataclass(frozen=True)
class PeakBar:
    """One image count's bars: full KV's peak and UniCache's peak (MB)."""

    label: str
    full_peak: float
    unicache_peak: float


#: bagel_e2e.json's checkpoint and task of the peak panel.
PEAK_CHECKPOINT, PEAK_TASK = "medium", "edit"


def peak_bars(results: Path) -> list[PeakBar]:
    """Edits of several images (``bagel_e2e.json``): the KV all branches hold together at the peak."""
    e2e = json.loads((results / "bagel_e2e.json").read_text(encoding="utf-8"))
    rows = {
        (r.get("images", 1), r["method"]): r
        for r in e2e["results"]
        if r["checkpoint"] == PEAK_CHECKPOINT and r["task"] == PEAK_TASK and r["method"] in ("full", "unicache")
    }
    size = e2e["config"]["edit_size"]
    return [
        PeakBar(
            f"{n} x {size}²",
            rows[(n, "full")]["kv_bytes_peak"] / MB,
            rows[(n, "unicache")]["kv_bytes_peak"] / MB,
        )
        for n in sorted({n for n, _ in rows})
        if (n, "full") in rows and (n, "unicache") in rows
    ]


def bundled_bars(results: Path) -> list[Bar]:
    """The bundled model: per task, the share of full KV's compressible bytes held (%) and both scores."""
    quality = json.loads((results / "quality.json").read_text(encoding="utf-8"))
    targets = quality["config"]["targets"][QUALITY_TARGETS]
    bars = []
    for task in ("und", "t2i", "edit"):
        rows = {
            r["method"]: r
            for r in quality["results"]
            if r["task"] == task
            and r["method"] in ("full", "unicache")
            and r["target_reduction"] in (0.0, targets[task])
        }
        full, unicache = rows["full"], rows["unicache"]
        unit = " dB" if task == "edit" else ""
        score = "PSNR" if task == "edit" else "accuracy"
        note = f"{score}\n{full['score']:.3g}{unit} → {unicache['score']:.3g}{unit}"
        bars.append(Bar(TASK_NAMES[task], 100.0, 100.0 * (1 - unicache["achieved_reduction"]), note))
    return bars


def render(left: list[Bar], right: list[Bar], out: Path, peaks: list[PeakBar] | None = None) -> None:
    """Draw the panels into ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_l, ax_p, ax_r) = plt.subplots(1, 3, figsize=(15, 4.4), gridspec_kw={"width_ratios": [4, 4, 3]})
    _peak_panel(ax_p, peaks or [])
    width = 0.38
    for ax, bars, unit in ((ax_l, left, "MB"), (ax_r, right, "%")):
        xs = range(len(bars))
        ax.bar([x - width / 2 for x in xs], [b.full for b in bars], width, color=FULL_COLOR, label="full KV")
        ax.bar([x + width / 2 for x in xs], [b.unicache for b in bars], width, color=UNICACHE_COLOR, label="UniCache")
        for x, bar in zip(xs, bars):
            if unit == "MB":  # the measured sizes, on the log scale's bars
                for offset, value in ((-width / 2, bar.full), (width / 2, bar.unicache)):
                    ax.annotate(
                        f"{value:,.0f}",
                        (x + offset, value),
                        xytext=(0, -10),
                        textcoords="offset points",
                        ha="center",
                        fontsize=7,
                        color="white",
                    )
            ax.annotate(
                f"{bar.full / bar.unicache:.1f}x less",
                (x + width / 2, bar.unicache),
                xytext=(0, 3 if unit == "%" else 4),
                textcoords="offset points",
                ha="center",
                fontsize=8,
                color=UNICACHE_COLOR,
            )
        ax.set_xticks(list(xs), [b.label + (f"\n{b.note}" if b.note else "") for b in bars], fontsize=8)
        ax.spines[["top", "right"]].set_visible(False)
        ax.legend(frameon=False, fontsize=8, loc="upper left")
    ax_l.set_yscale("log")
    ax_l.set_ylabel("KV held, all CFG branches (MB, log scale)")
    ax_l.set_title("BAGEL-7B-MoT geometry, measured after compression", fontsize=10)
    ax_r.set_ylabel("compressible KV held (% of full)")
    ax_r.set_ylim(0, 115)
    ax_r.set_title("bundled model, paper reductions: bytes and score", fontsize=10)
    fig.tight_layout()
    write_atomically("--out", out, lambda tmp: fig.savefig(tmp, format="png", dpi=100, metadata={"Software": None}))
    plt.close(fig)


def _peak_panel(ax, peaks: list[PeakBar]) -> None:
    """Full KV's peak beside UniCache's per image count. (The steady bytes of bagel_e2e count a store that branches
    share once per branch, so they are not drawn beside a peak that counts it once.)"""
    width = 0.38
    xs = range(len(peaks))
    series = (
        ("full KV, peak", [p.full_peak for p in peaks], FULL_COLOR, -width / 2),
        ("UniCache, peak", [p.unicache_peak for p in peaks], UNICACHE_COLOR, width / 2),
    )
    for label, values, color, offset in series:
        ax.bar([x + offset for x in xs], values, width, color=color, label=label)
    for x, bar in zip(xs, peaks):
        ax.annotate(
            f"{bar.full_peak / bar.unicache_peak:.1f}x",
            (x + width / 2, bar.unicache_peak),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            fontsize=8,
            color="#1565c0",
        )
    ax.set_xticks(list(xs), [p.label for p in peaks], fontsize=8)
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(frameon=False, fontsize=8, loc="upper left")
    ax.set_ylabel("KV held, all CFG branches (MB)")
    ax.set_title("edits of several images (medium checkpoint): KV at the peak", fontsize=10)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m tools.kv_plot", description=__doc__.splitlines()[0])
    return run_figure(
        parser,
        argv,
        results=RESULTS,
        out=OUT,
        read=lambda folder: (real_size_bars(folder), bundled_bars(folder), peak_bars(folder)),
        render=lambda bars, out: render(bars[0], bars[1], out, bars[2]),
    )


if __name__ == "__main__":
    sys.exit(main())
