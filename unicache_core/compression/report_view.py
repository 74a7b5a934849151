"""Views of a KV report (``result.kv_report``, format ``unicache-kv-report``): compact chart data, a text
summary and a PIL-drawn plot (no matplotlib). Used by the ComfyUI report node and its web chart."""

from __future__ import annotations

from PIL import Image, ImageDraw, ImageFont

from .method import METHODS
from .report import REPORT_FORMAT

#: Most points per series in the compact chart data (long decodes are subsampled evenly).
MAX_POINTS = 64
BRANCH_COLORS = {"gen": (66, 133, 244), "cfg_text": (234, 67, 53), "cfg_img": (52, 168, 83), "think": (251, 188, 4)}
TYPE_COLORS = {
    "instruction": (171, 71, 188),
    "source_vit": (0, 172, 193),
    "source_vae": (255, 112, 67),
    "boundary": (120, 144, 156),
    "candidate": (141, 110, 99),
    "current_latent": (158, 157, 36),
    "decoded_text": (92, 107, 192),
}
_FALLBACK = (150, 150, 150)


def check_report(report) -> dict:
    """``report`` if it is a KV report dict, else a ValueError saying where one comes from."""
    if not isinstance(report, dict) or report.get("format") != REPORT_FORMAT:
        kind = report.get("format") if isinstance(report, dict) else type(report).__name__
        raise ValueError(f"expected a KV report (format {REPORT_FORMAT!r}) from a UniCache task node, got {kind!r}")
    return report


def _subsample(items: list, limit: int = MAX_POINTS) -> list:
    if len(items) <= limit:
        return items
    step = (len(items) - 1) / (limit - 1)
    return [items[round(i * step)] for i in range(limit)]


def chart_data(report: dict) -> dict:
    """Compact, JSON-ready chart data: totals, bytes per type and branch (last step), full and held bytes per input
    image (over the branches, at the end), and per step and branch the retention ``rho`` and the managed bytes held
    (at most :data:`MAX_POINTS` steps)."""
    report = check_report(report)
    summary = report.get("summary") or {}
    steps = _subsample(report.get("steps") or [])
    last = (report.get("steps") or [{}])[-1]
    full = summary.get("full_managed_bytes") or 0
    steady = summary.get("steady_managed_bytes")
    series: dict[str, dict] = {}
    for index, step in enumerate(steps):
        for name, branch in (step.get("branches") or {}).items():
            s = series.setdefault(name, {"x": [], "rho": [], "bytes": [], "full_bytes": []})
            s["x"].append(step.get("step", index))
            s["rho"].append(branch.get("rho"))
            s["bytes"].append(branch.get("managed_bytes", 0))
            s["full_bytes"].append(branch.get("full_managed_bytes", 0))
    # a branch without compressible KV (e.g. T2I's cfg_text: only protected tokens) has no budget to draw
    series = {k: v for k, v in series.items() if any(v["full_bytes"]) or any(r is not None for r in v["rho"])}
    types = {}
    for name, branch in (last.get("branches") or {}).items():
        types[name] = {t: int(v.get("bytes", 0)) for t, v in (branch.get("types") or {}).items()}
    return {
        "method": report.get("method"),
        "task": report.get("task"),
        "full_bytes": full,
        "steady_bytes": steady,
        "peak_bytes": summary.get("peak_bytes"),
        "saved_bytes": None if steady is None else max(0, full - steady),
        "reduction": summary.get("reduction"),
        "compression": summary.get("compression"),
        "rho_mean": summary.get("rho_mean"),
        "series": series,
        "types": types,
        "images": {
            image: {"full_bytes": v.get("full_bytes", 0), "held_bytes": v.get("held_bytes", 0)}
            for image, v in (summary.get("images") or {}).items()
        },
    }


def _fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _budget_line(method, s: dict) -> str:
    """The share of the full compressible KV held against what the method aimed at (UniCache: its mean retention
    rho; a baseline: ``kv_target``), as numbers: a few percent off the aim is how the method rounds, not a failure;
    ``flags`` say when fixed parts make the aim unreachable."""
    held, aim = s.get("achieved_ratio"), s.get("budget_ratio")
    registered = METHODS.get(method) if isinstance(method, str) else None
    what = "the mean retention rho" if registered is not None and registered.budget == "rho" else "kv_target"
    line = f"held {held:.3f} of the full compressible KV; aimed at {aim:.3f} ({what})"
    if s["within_budget"]:
        return line + ": within it"
    off = f"{(held / aim - 1) * 100:+.1f}% off it" if aim else "above it"
    return line + (f": {off}, fixed parts exceed it (see the flags)" if s.get("budget_unreachable") else f": {off}")


def saving_words(summary: dict) -> str:
    """What a compression saved, in words: ``80.0% saved, 5.00x less``; a target that kept no byte of the
    compressible KV says so (``100% saved: none of it held``), never a ratio over zero bytes (``0.00x less``)."""
    if not summary.get("steady_managed_bytes"):
        return "100% saved: none of it held, every compressible row dropped"
    return f"{(summary.get('reduction') or 0) * 100:.1f}% saved, {summary.get('compression') or 0:.2f}x less"


def summary_text(report: dict) -> str:
    """A few lines for humans: method, task, full / held / peak bytes, reduction, rho and flags."""
    report = check_report(report)
    s = report.get("summary") or {}
    lines = [f"KV method {report.get('method')} on {report.get('task')} ({report.get('model_id') or 'model'})"]
    if s.get("full_managed_bytes") == 0:  # e.g. an empty t2i prompt: "0 B -> 0 B (0.00x less)" would say nothing
        lines.append(
            "compressible KV: none (the context holds no compressible tokens, e.g. an empty prompt): nothing was "
            "compressed"
        )
    elif s.get("steady_managed_bytes") is not None:
        lines.append(
            f"compressible KV: {_fmt_bytes(s.get('full_managed_bytes'))} full -> "
            f"{_fmt_bytes(s.get('steady_managed_bytes'))} held "
            f"({saving_words(s)})"
        )
    else:
        lines.append(f"compressible KV: {_fmt_bytes(s.get('full_managed_bytes'))} (not compressed)")
    lines.append(
        f"peak KV (all branches, protected included): {_fmt_bytes(s.get('peak_bytes'))}; protected: "
        f"{_fmt_bytes(s.get('protected_bytes'))}"
    )
    if s.get("rho_mean") is not None:
        lines.append(f"mean retention rho: {s['rho_mean']:.3f}")
    if s.get("within_budget") is not None:
        lines.append(_budget_line(report.get("method"), s))
    lines.append(
        f"time: attention {s.get('attention_seconds') or 0:.2f}s, statistics {s.get('stats_seconds') or 0:.2f}s"
        f", allocation {s.get('alloc_seconds') or 0:.2f}s"
    )
    for key, reason in (s.get("flags") or {}).items():
        lines.append(f"flag {key}: {reason}")
    warning = (report.get("policy") or {}).get("warning")
    if warning:
        lines.append(f"policy: {warning}")
    if report.get("batch"):
        lines.append(f"batch of {len(report['batch'])}: the chart shows the first item")
    return "\n".join(lines)


def render_plot(report: dict, width: int = 768, height: int = 512) -> Image.Image:
    """An RGB plot: top, the bytes held per token type for each branch (last step; the grey outline is the
    full cache); bottom, rho per step for each branch."""
    data = chart_data(report)
    img = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default()
    pad = 12
    title = (
        f"{data['method']} / {data['task']}: {_fmt_bytes(data['steady_bytes'] or data['full_bytes'])} of "
        f"{_fmt_bytes(data['full_bytes'])} compressible KV held"
    )
    draw.text((pad, pad), title, fill=(0, 0, 0), font=font)
    if data["images"]:
        per_image = "  ".join(
            f"image {int(i) + 1}: {_fmt_bytes(v['held_bytes'])} of {_fmt_bytes(v['full_bytes'])}"
            for i, v in data["images"].items()
        )
        draw.text((pad + 420, pad), per_image, fill=(60, 60, 60), font=font)
    # --- top panel: bytes per type and branch
    top, mid = pad + 20, height // 2
    branches = list(data["types"])
    label_w = 70
    bar_x0, bar_x1 = pad + label_w, width - pad - 150
    full_by_branch = {b: (data["series"].get(b, {}).get("full_bytes") or [0])[-1] for b in branches}
    scale_max = max([sum(v.values()) for v in data["types"].values()] + list(full_by_branch.values()) + [1])
    row_h = max(12, min(36, (mid - top - 10) // max(1, len(branches)) - 6))
    for i, name in enumerate(branches):
        y = top + i * (row_h + 6)
        draw.text((pad, y + row_h // 2 - 5), name, fill=(0, 0, 0), font=font)
        x = bar_x0
        for t, nbytes in sorted(data["types"][name].items()):
            w = (bar_x1 - bar_x0) * nbytes / scale_max
            draw.rectangle([x, y, x + w, y + row_h], fill=TYPE_COLORS.get(t, _FALLBACK))
            x += w
        full_w = (bar_x1 - bar_x0) * (full_by_branch[name] + data["types"][name].get("boundary", 0)) / scale_max
        draw.rectangle([bar_x0, y, bar_x0 + min(full_w, bar_x1 - bar_x0), y + row_h], outline=(90, 90, 90))
    legend = sorted({t for v in data["types"].values() for t in v})
    for i, t in enumerate(legend):
        y = top + i * 14
        draw.rectangle([width - pad - 140, y, width - pad - 130, y + 10], fill=TYPE_COLORS.get(t, _FALLBACK))
        draw.text((width - pad - 124, y - 1), t, fill=(0, 0, 0), font=font)
    # --- bottom panel: rho per step
    x0, x1, y0, y1 = pad + 40, width - pad - 150, mid + 24, height - pad - 16
    draw.text((pad, mid + 4), "rho per step (retained share of the compressible KV)", fill=(0, 0, 0), font=font)
    draw.line([x0, y1, x1, y1], fill=(0, 0, 0))
    draw.line([x0, y0, x0, y1], fill=(0, 0, 0))
    for v in (0.0, 0.5, 1.0):
        yy = y1 - (y1 - y0) * v
        draw.text((pad, yy - 5), f"{v:.1f}", fill=(0, 0, 0), font=font)
        draw.line([x0, yy, x1, yy], fill=(225, 225, 225))
    xs = [x for s in data["series"].values() for x in s["x"]]
    lo, hi = (min(xs), max(xs)) if xs else (0, 1)
    span = max(1, hi - lo)
    for i, (name, s) in enumerate(data["series"].items()):
        color = BRANCH_COLORS.get(name, _FALLBACK)
        pts = []
        for x, rho, b, f in zip(s["x"], s["rho"], s["bytes"], s["full_bytes"]):
            value = rho if rho is not None else (b / f if f else 1.0)
            pts.append((x0 + (x1 - x0) * (x - lo) / span, y1 - (y1 - y0) * max(0.0, min(1.0, value))))
        if len(pts) == 1:
            draw.ellipse([pts[0][0] - 3, pts[0][1] - 3, pts[0][0] + 3, pts[0][1] + 3], fill=color)
        elif pts:
            draw.line(pts, fill=color, width=2)
        ly = mid + 24 + i * 14
        draw.line([width - pad - 140, ly + 5, width - pad - 128, ly + 5], fill=color, width=3)
        draw.text((width - pad - 124, ly), name, fill=(0, 0, 0), font=font)
    draw.text((x0, y1 + 3), f"step {lo}", fill=(0, 0, 0), font=font)
    draw.text((x1 - 40, y1 + 3), f"step {hi}", fill=(0, 0, 0), font=font)
    return img


__all__ = ["chart_data", "check_report", "render_plot", "saving_words", "summary_text"]
