"""The memory plan against what a run really holds on the CPU, per task and checkpoint.

``python -m benchmarks.memory_plan_check [--medium DIR] [--json PATH] [--no-rss]``

For the bundled model (``models/bagel/unicache-shapes``, 128 px) and the medium checkpoint
(:mod:`benchmarks.medium`, written to ``out/medium`` when missing; 512 px), and each task (understanding with a
16-token answer, text-to-image and edit with 3 timesteps), bf16 compute:

- ``plan_bytes``: :func:`~unicache_core.bagel.memory.plan.plan_memory`'s peak for that request on the CPU
  (with the CPU runtime's own memory, ``cpu_kernel_cache`` and ``cpu_freed_heap``), compared with the RSS;
- ``plan_tensor_bytes``: the same plan without those parts
  (:func:`~unicache_core.bagel.memory.plan.tensor_peak_bytes`), compared with the tensors;
- ``tensor_bytes``: tensor accounting: the loaded model's and VAE's parameter bytes plus the peak of the tensors
  alive during the run (:class:`~unicache_core.bagel.memory.trace.TensorMemoryTracker`);
- ``rss_bytes``: the whole process in a fresh subprocess: ``VmHWM`` over the load and the run minus the resident
  set just before the load. Before taking that base the child loads the tiny test checkpoint and runs the same
  task on it once, so torch's lazily imported modules, kernels and thread pools (tens of MB, whatever the
  model) are already resident and the figure is the load's and the run's own.

Each error is ``plan / measured - 1``; the plan should stay within 10%.
"""

from __future__ import annotations

import argparse
import gc
import logging
import subprocess
import sys
from pathlib import Path

import torch
from PIL import Image

from benchmarks.report_file import check_report_paths, write_json_report
from benchmarks.rss import peak_rss_bytes, start_peak_window
from unicache_commands.flags import OneLineParser, path_arg
from unicache_core.bagel import BagelPipeline, load_bagel, preset
from unicache_core.bagel.checkpoint.tensor_file import release_freed_host_memory
from unicache_core.bagel.memory.plan import PlanSettings, plan_config, plan_memory, tensor_peak_bytes
from unicache_core.bagel.memory.trace import TensorMemoryTracker
from unicache_core.bagel.settings import BUNDLED_CHECKPOINT
from unicache_core.bagel.weights import parameter_bytes

REPO = Path(__file__).resolve().parent.parent
BUNDLED = REPO / "models" / "bagel" / BUNDLED_CHECKPOINT
TINY = REPO / "models" / "bagel" / "bagel-tiny"
DEFAULT_MEDIUM = REPO / "out" / "medium"
TASKS = ("und", "t2i", "edit")
PROMPT = "make the square red and the background dark"
ANSWER_TOKENS = 16
TIMESTEPS = 3
TOLERANCE = 0.10
logger = logging.getLogger("benchmarks.memory_plan_check")


def run_request(loaded, task: str, size: int) -> None:
    """One request of ``task`` on a ``size`` x ``size`` image (the input of und/edit, the output of t2i)."""
    pipe = BagelPipeline(loaded)
    image = Image.new("RGB", (size, size), (200, 30, 30))
    if task == "und":
        pipe.understand(PROMPT, image, preset("understanding", max_new_tokens=ANSWER_TOKENS))
    elif task == "t2i":
        pipe.text_to_image(PROMPT, preset("t2i", width=size, height=size, num_timesteps=TIMESTEPS))
    else:
        pipe.edit(PROMPT, image, preset("edit", num_timesteps=TIMESTEPS))


def planned_bytes(checkpoint: Path, task: str, size: int, tokenizer) -> tuple[int, int]:
    """``(peak, tensor peak)`` of the CPU plan of :func:`run_request`'s request (its prompt and answer lengths)."""
    settings = PlanSettings(task=task, width=size, height=size, device="cpu")
    plan = plan_memory(
        plan_config(checkpoint),
        settings,
        1 << 40,
        prompt_tokens=len(tokenizer.encode(PROMPT)),
        answer_tokens=ANSWER_TOKENS,
    )
    return plan.peak_bytes, tensor_peak_bytes(plan)


def tensor_accounting(checkpoint: Path, task: str, size: int) -> tuple[int, int, int]:
    """``(measured, planned tensors, planned peak)``: parameter bytes + the run's peak of live tensors, and the
    CPU plan's tensor peak and whole peak (:func:`planned_bytes`)."""
    loaded = load_bagel(checkpoint)
    params = parameter_bytes(loaded.model) + parameter_bytes(loaded.vae)
    with torch.inference_mode(), TensorMemoryTracker() as tracker:
        run_request(loaded, task, size)
    peak, tensors = planned_bytes(checkpoint, task, size, loaded.tokenizer)
    return params + tracker.peak_bytes, tensors, peak


def _rss_of_run(checkpoint: Path, task: str, size: int) -> int:
    """In this (fresh) process: peak resident bytes of loading ``checkpoint`` and running the request."""
    with torch.inference_mode():
        run_request(load_bagel(TINY), task, 64)  # imports, kernels, thread pools: see the module docstring
    gc.collect()
    release_freed_host_memory()
    base = start_peak_window()
    with torch.inference_mode():
        run_request(load_bagel(checkpoint), task, size)
    return peak_rss_bytes() - base


def rss_in_subprocess(checkpoint: Path, task: str, size: int) -> int:
    """:func:`_rss_of_run` in a fresh Python process."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory_plan_check", "--rss-child", str(checkpoint), task, str(size)],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the RSS measurement of {checkpoint} {task} failed: {proc.stderr.strip()[-2000:]}")
    return int(proc.stdout.strip().splitlines()[-1])


def check(checkpoints: dict[str, tuple[Path, int]], *, rss: bool = True, tasks=TASKS) -> list[dict]:
    """One row per (checkpoint, task): plan, tensor accounting, RSS (``None`` without ``rss``) and the errors."""
    rows = []
    for name, (checkpoint, size) in checkpoints.items():
        for task in tasks:
            measured, planned_tensors, planned = tensor_accounting(checkpoint, task, size)
            row = {
                "checkpoint": name,
                "task": task,
                "size": size,
                "plan_bytes": planned,
                "plan_tensor_bytes": planned_tensors,
                "tensor_bytes": measured,
                "tensor_error": round(planned_tensors / measured - 1, 4),
                "rss_bytes": None,
                "rss_error": None,
            }
            if rss:
                row["rss_bytes"] = rss_in_subprocess(checkpoint, task, size)
                row["rss_error"] = round(planned / row["rss_bytes"] - 1, 4)
            logger.info("%s", format_table([row]).splitlines()[-1])
            rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    mb = 1e6
    lines = [
        f"{'checkpoint':10s} {'task':5s} {'px':>4s} {'plan MB':>9s} {'tensors':>9s} {'measured':>9s} "
        f"{'err':>7s} {'RSS MB':>9s} {'err':>7s}"
    ]
    for r in rows:
        rss = "-" if r["rss_bytes"] is None else f"{r['rss_bytes'] / mb:9.2f}"
        rss_err = "-" if r["rss_error"] is None else f"{r['rss_error']:+7.1%}"
        lines.append(
            f"{r['checkpoint']:10s} {r['task']:5s} {r['size']:4d} {r['plan_bytes'] / mb:9.2f} "
            f"{r['plan_tensor_bytes'] / mb:9.2f} {r['tensor_bytes'] / mb:9.2f} {r['tensor_error']:+7.1%} "
            f"{rss:>9s} {rss_err:>7s}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m benchmarks.memory_plan_check", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--medium", type=Path, default=DEFAULT_MEDIUM, help="the medium checkpoint (written if missing)"
    )
    parser.add_argument("--json", type=path_arg, default=None, help="write the rows here")
    parser.add_argument("--no-rss", action="store_true", help="tensor accounting only")
    parser.add_argument("--rss-child", nargs=3, metavar=("CHECKPOINT", "TASK", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_report_paths(parser, [("--json", args.json, "JSON report")], checkpoints=[args.medium])
    if args.rss_child:
        checkpoint, task, size = args.rss_child
        sys.stdout.write(f"{_rss_of_run(Path(checkpoint), task, int(size))}\n")
        return 0
    from benchmarks.medium import write_medium_checkpoint

    logging.basicConfig(format="%(name)s: %(message)s")
    logger.setLevel(logging.INFO)

    medium = write_medium_checkpoint(args.medium)
    rows = check({"bundled": (BUNDLED, 128), "medium": (medium, 512)}, rss=not args.no_rss)
    sys.stdout.write(format_table(rows) + "\n")
    if args.json is not None:
        write_json_report(args.json, {"tolerance": TOLERANCE, "results": rows})
    worst = max(max(abs(r["tensor_error"]), abs(r["rss_error"] or 0.0)) for r in rows)
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    raise SystemExit(main())
