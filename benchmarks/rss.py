"""Peak resident memory of a BAGEL load or run, measured in a fresh process (Linux ``/proc``).

``python -m benchmarks.rss load CHECKPOINT [--weight-dtype D] [--dtype bf16]`` prints one JSON object:
the resident set before the load (``base_rss_bytes``, after the imports), the peak during it
(``peak_rss_bytes``; the kernel's high-water mark, reset just before the load), the load's own peak
(``load_peak_bytes`` = peak - base), the parameter bytes of the loaded model and VAE (``param_bytes``), the
weight files' size (``file_bytes``) and the seconds taken. The first load in a process imports torch's
symbolic-shape modules for the meta build and the kernels of the conversions (about 150-200 MB resident,
whatever the model's size), so the bundled tiny checkpoint (6 MB) is loaded once the same way before the base
is taken: the figures are the load's own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from unicache_commands.flags import OneLineParser

ROOT = Path(__file__).resolve().parents[1]


def current_rss_bytes() -> int:
    """This process's resident set now (``/proc/self/statm``)."""
    import os

    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    """Reset this process's resident high-water mark (``VmHWM``) to its current resident set."""
    Path("/proc/self/clear_refs").write_text("5")


def start_peak_window() -> int:
    """Reset the resident high-water mark, then return the resident set: the base that :func:`peak_rss_bytes`
    is measured against. In that order: the resident set can drop a page between the two reads, and a base
    read before the reset could stand above the mark (a load that allocates nothing new read as -4096)."""
    reset_peak_rss()
    return current_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's resident high-water mark since the last :func:`start_peak_window` (``VmHWM``). The kernel folds
    per-thread resident counters into it in batches, so it can lag the resident set read as the window's base by a
    page: callers take the peak as at least that base (a window's peak includes its start)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _measure_load(checkpoint: Path, weight_dtype: str, dtype: str) -> dict:
    import gc

    from unicache_core.bagel.checkpoint.loader import load_bagel
    from unicache_core.bagel.settings import BUNDLED_CHECKPOINT_DIR
    from unicache_core.bagel.weights import parameter_bytes

    load_bagel(BUNDLED_CHECKPOINT_DIR, dtype=dtype, weight_dtype=weight_dtype)  # the one-time imports, see above
    gc.collect()
    base = start_peak_window()
    start = time.perf_counter()
    loaded = load_bagel(checkpoint, dtype=dtype, weight_dtype=weight_dtype)
    seconds = time.perf_counter() - start
    peak = max(peak_rss_bytes(), base)  # the window's peak includes its start (peak_rss_bytes: the counters' lag)
    files = [checkpoint] if checkpoint.is_file() else list(checkpoint.glob("*.safetensors"))
    return {
        "weight_dtype": weight_dtype,
        "dtype": dtype,
        "base_rss_bytes": base,
        "peak_rss_bytes": peak,
        "load_peak_bytes": peak - base,
        "param_bytes": parameter_bytes(loaded.model) + (parameter_bytes(loaded.vae) if loaded.vae is not None else 0),
        "file_bytes": sum(p.stat().st_size for p in files),
        "load_seconds": seconds,
    }


def measure_load_in_subprocess(checkpoint: str | Path, weight_dtype: str = "auto", dtype: str = "bf16") -> dict:
    """:func:`_measure_load` in a fresh Python process (so earlier allocations do not hide the peak)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.rss",
            "load",
            str(checkpoint),
            "--weight-dtype",
            weight_dtype,
            "--dtype",
            dtype,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the load measurement failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m benchmarks.rss", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    load = sub.add_parser("load", help="peak RSS of load_bagel")
    load.add_argument("checkpoint", type=Path)
    load.add_argument("--weight-dtype", default="auto")
    load.add_argument("--dtype", default="bf16")
    args = parser.parse_args(argv)
    sys.stdout.write(json.dumps(_measure_load(args.checkpoint, args.weight_dtype, args.dtype)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
