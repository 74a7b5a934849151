"""Every GPU measurement issue #64 asks for, in one command (about 10 minutes on one H100 or H200).

``python -m benchmarks.gpu_device_check OUT [--checkpoint DIR] [--memory-cap 16GB] [--taylorseer-timesteps 50]
[--steps kernels,images2,images4,lowvram,taylorseer] [--budget-minutes 12] [--list]``

Runs, each in a process of its own, in this order (a step's failure does not stop the next), writing into ``OUT``:

- ``kernels``: ``benchmarks.gpu_kernels`` (the packed-KV kernel against dequantize-then-attend and full-width rows,
  5K-40K rows, 1 and 4096 queries, BAGEL-7B's heads) → ``gpu_kernels.json``;
- ``images2``, ``images4``: the several-image rows of ``benchmarks.gpu_real_size``: a 1024² edit of 2 and 4 images,
  full KV and UniCache, without and with TaylorSeer (21 timesteps, so its factors reach the official order 6),
  weights resident → ``gpu_real_size_2images.json``, ``gpu_real_size_4images.json``;
- ``lowvram``: one denoising step (2 timesteps) of the 2-image 1024² edit with the decoder layers streamed from host
  memory (``--offload layers``, the engine's counterpart of ComfyUI's lowvram loading), full KV and UniCache, the
  process capped at ``--memory-cap`` (``torch.cuda.set_per_process_memory_fraction``) → ``gpu_lowvram_2images.json``;
- ``taylorseer``: ``benchmarks.gpu_taylorseer`` (1024² edit, ``--taylorseer-timesteps``) → ``gpu_taylorseer.json``.

The real-size checkpoint (random weights at BAGEL-7B-MoT's geometry, 14.6 GB) is written once into ``--checkpoint``
by the first step that needs it. Each step's output goes to ``OUT/<step>.log``; ``OUT/device_check.json`` names the
device and each step's command, exit status and seconds. A step is not started once ``--budget-minutes`` have passed.
``--list`` prints the commands and runs nothing (no GPU needed).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.real_size import DEFAULT_OUT
from benchmarks.report_file import write_json_report
from unicache_commands.flags import OneLineParser, path_arg
from unicache_core.sizes import parse_size

REPO = Path(__file__).resolve().parent.parent
STEPS = ("kernels", "images2", "images4", "lowvram", "taylorseer")
#: Timesteps of the several-image rows: TaylorSeer's factors fill to order 6 by forward 19.
IMAGE_TIMESTEPS = 21
#: The longest one step may run (seconds).
STEP_TIMEOUT = 600


def _real_size(out: Path, checkpoint: Path, name: str, flags: list[str]) -> list[str]:
    common = ["--out", str(checkpoint), "--size", "1024", "--methods", "full,unicache"]
    return ["benchmarks.gpu_real_size", *common, *flags, "--json", str(out / name)]


def commands(out: Path, checkpoint: Path, memory_cap: str, taylorseer_timesteps: int) -> dict[str, list[str]]:
    """Each step's ``python -m`` arguments (module docstring)."""
    images = ["--offload", "none", "--taylorseer", "off,on", "--timesteps", str(IMAGE_TIMESTEPS)]
    lowvram = ["--images", "2", "--offload", "layers", "--timesteps", "2", "--memory-cap", memory_cap]
    taylorseer = ["--out", str(checkpoint), "--size", "1024", "--timesteps", str(taylorseer_timesteps)]
    return {
        "kernels": ["benchmarks.gpu_kernels", "--json", str(out / "gpu_kernels.json")],
        "images2": _real_size(out, checkpoint, "gpu_real_size_2images.json", ["--images", "2", *images]),
        "images4": _real_size(out, checkpoint, "gpu_real_size_4images.json", ["--images", "4", *images]),
        "lowvram": _real_size(out, checkpoint, "gpu_lowvram_2images.json", lowvram),
        "taylorseer": ["benchmarks.gpu_taylorseer", *taylorseer, "--json", str(out / "gpu_taylorseer.json")],
    }


def _device() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    return {"gpu": torch.cuda.get_device_name() if cuda else None, "torch": torch.__version__, "cuda": cuda}


def run_steps(out: Path, steps: dict[str, list[str]], budget_s: float) -> list[dict]:
    """Run ``steps`` in order, each ``python -m ...`` from the repository with its output in ``out/<step>.log``."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TRITON_INTERPRET", None)
    start = time.perf_counter()
    records = []
    for name, args in steps.items():
        record = {"step": name, "command": ["python", "-m", *args]}
        if time.perf_counter() - start > budget_s:
            records.append({**record, "skipped": "past --budget-minutes"})
            continue
        began = time.perf_counter()
        with open(out / f"{name}.log", "w", encoding="utf-8") as log:
            try:
                status = subprocess.run(
                    [sys.executable, "-m", *args], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                    timeout=STEP_TIMEOUT,
                ).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                status = None
        records.append({**record, "returncode": status, "seconds": round(time.perf_counter() - began, 1)})
        sys.stderr.write(f"{name}: exit {status} after {records[-1]['seconds']} s (log: {out / (name + '.log')})\n")
    return records


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m benchmarks.gpu_device_check", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=path_arg, help="folder for the JSON reports and logs")
    parser.add_argument("--checkpoint", type=path_arg, default=DEFAULT_OUT, help="real-size checkpoint folder (15 GB)")
    parser.add_argument("--memory-cap", default="16GB", help="the lowvram step's cap on the card's memory")
    parser.add_argument("--taylorseer-timesteps", type=int, default=50, help="the TaylorSeer step's num_timesteps")
    parser.add_argument("--steps", default=",".join(STEPS), help="comma-separated, of " + ", ".join(STEPS))
    parser.add_argument("--budget-minutes", type=float, default=12.0, help="start no step after this long")
    parser.add_argument("--list", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    chosen = args.steps.split(",")
    if not chosen or not set(chosen) <= set(STEPS) or len(set(chosen)) != len(chosen):
        parser.error(f"--steps must name some of {', '.join(STEPS)} once each, got {args.steps!r}")
    if args.taylorseer_timesteps < 2 or args.budget_minutes <= 0:
        parser.error("--taylorseer-timesteps must be 2 or more and --budget-minutes positive")
    try:
        parse_size(args.memory_cap, "--memory-cap", example="16GB")
    except ValueError as exc:
        parser.error(str(exc))
    every = commands(args.out, args.checkpoint, args.memory_cap, args.taylorseer_timesteps)
    steps = {name: every[name] for name in STEPS if name in chosen}
    if args.list:
        sys.stdout.write("".join(" ".join(["python", "-m", *cmd]) + "\n" for cmd in steps.values()))
        return 0
    device = _device()
    if not device["cuda"]:
        sys.stderr.write("error: no CUDA device is visible; run it on the GPU machine (--list shows the commands)\n")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    records = run_steps(args.out, steps, 60 * args.budget_minutes)
    report = {**device, "seconds": round(time.perf_counter() - began, 1), "steps": records}
    write_json_report(args.out / "device_check.json", report, "OUT")
    return 0 if all(r.get("returncode") == 0 for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
