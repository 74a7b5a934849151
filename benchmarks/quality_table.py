"""The quality report as a readable table (:mod:`benchmarks.quality`): one block per target, a row per method, then
UniCache minus every other row paired over the same samples (scores, fidelity to full KV, step fidelity)."""

from __future__ import annotations

import math

from .quality_rows import FULL_TAYLORSEER_ROW

TASKS = ("und", "t2i", "edit")


def format_table(report: dict) -> str:
    """Paper-style table per target: one row per method, the headline score per task and edit details."""
    rows = report["results"]
    lines = []
    full = {r["task"]: r for r in rows if r["method"] == "full"}
    targets = report["config"]["targets"]
    for name, reductions in targets.items():
        head = (
            f"[{name}: und {reductions['und']:.0%}, t2i {reductions['t2i']:.0%}, edit {reductions['edit']:.0%} "
            "reduction; achieved in brackets; baselines at unicache's achieved bytes]"
        )
        lines.append(head)
        lines.append(
            f"{'method':21s} {'und acc':>15s} {'t2i acc':>15s} {'edit PSNR':>16s} {'unchanged':>9s} "
            f"{'success':>7s} {'to full':>7s}"
        )
        methods = list(dict.fromkeys(r["method"] for r in rows))  # run order: full, unicache, its paper row, ...
        for method in methods:
            cells = []
            detail = ("", "", "", "")
            for task in ("und", "t2i", "edit"):
                if method in ("full", FULL_TAYLORSEER_ROW):
                    r = next((x for x in rows if x["task"] == task and x["method"] == method), None)
                else:
                    r = next(
                        (
                            x
                            for x in rows
                            if x["task"] == task
                            and x["method"] == method
                            and math.isclose(x["target_reduction"], reductions[task])
                        ),
                        None,
                    )
                if r is None:
                    cells.append(f"{'-':>15s}" if task != "edit" else f"{'-':>16s}")
                    continue
                ach = f"[{r['achieved_reduction']:.0%}]"
                if task == "edit":
                    cells.append(f"{r['score']:8.2f} dB {ach:>6s}")
                    m = r["metrics"]
                    detail = (
                        f"{m['psnr_unchanged']:9.2f}",
                        f"{m['success']:7.2f}",
                        f"{m.get('psnr_to_full', float('nan')):7.2f}" if method != "full" else f"{'':7s}",
                        f" (to full+taylorseer {ts:.2f})" if (ts := m.get("psnr_to_full_taylorseer")) else "",
                    )
                else:
                    cells.append(f"{r['score']:8.3f} {ach:>6s}")
            lines.append(f"{method:21s} " + " ".join(cells) + " " + " ".join(detail[:3]) + detail[3])
        lines.extend(_paired_lines(rows, methods, reductions))
        lines.append("")
    if "edit" in full:
        lines.append(
            f"edit reference: the unedited source scores {full['edit']['metrics']['psnr_source_as_output']:.2f} dB "
            "against the target (success 0)"
        )
    cal = report["config"].get("calibration", {})
    if cal.get("agrees_with_paper") is not None:
        verdict = (
            "agrees with the paper"
            if cal["agrees_with_paper"]
            else "differs from the paper: " + "; ".join(cal["mismatches"])
        )
        lines.append(f"calibrated policy table ({cal['table']}): {verdict}")
    else:
        lines.append(f"calibration: {cal.get('note', 'not checked')}")
    return "\n".join(lines)


def _paired_lines(rows: list[dict], methods: list[str], reductions: dict) -> list[str]:
    """UniCache minus every other row of one target, paired over the same samples (:mod:`.paired`): on the task
    scores, then on fidelity to full KV's outputs."""

    def at_target(task: str, method: str) -> dict | None:
        return next(
            (
                x
                for x in rows
                if x["task"] == task
                and x["method"] == method
                and math.isclose(x.get("target_reduction", 0.0), reductions[task])
            ),
            None,
        )

    def block(title: str, key_for) -> list[str]:
        lines = []
        for method in methods:
            cells = []
            for task in ("und", "t2i", "edit"):
                r, key = at_target(task, method), key_for(method)
                d = None if r is None or key is None else r.get(key)
                mark = "*" if r is not None and r.get("paired_with") else " "
                cell = "-" if d is None else f"{d['mean']:+8.3f} +-{d['ci95']:6.3f} {d['verdict']:6s}{mark}"
                cells.append(f"{cell:>24s}")
            if any(c.strip() != "-" for c in cells):
                vs = "full" if method == "unicache" else method
                lines.append(f"  unicache - {vs:20s}" + " ".join(cells))
        return [title] + lines if lines else []

    scores = block(
        "  paired over the same samples: unicache minus each row, mean +- 95% interval (und, t2i, edit dB)",
        lambda m: "unicache_minus_full" if m == "unicache" else "unicache_minus_this",
    )
    fidelity = block(
        "  fidelity to full KV's outputs, paired: unicache minus each row (und agreement, t2i dB, edit dB)",
        lambda m: None if m == "unicache" else "unicache_to_full_minus_this",
    )
    steps = block(
        "  step fidelity on full KV's path (teacher-forced, dB), paired: unicache minus each row",
        lambda m: None if m == "unicache" else "unicache_steps_minus_this",
    )
    marked = any((r := at_target(task, m)) is not None and r.get("paired_with") for task in TASKS for m in methods)
    note = ["  * at equal bytes: the baseline held over 5% more or fewer bytes than UniCache: vs unicache@<it>"]
    return scores + fidelity + steps + (note if marked else [])
