"""TaylorSeer benchmark: denoising time and decoder forwards with and without TaylorSeer, for full KV and UniCache.

``python -m benchmarks.taylorseer [--quick] [--json PATH] [--checkpoints medium,bundled] [--timesteps N]``

Per (checkpoint, task), four rows in one process, one after the other on the same loaded model: ``full``,
``full+taylorseer``, ``unicache`` and ``unicache+taylorseer`` (UniCache at its defaults; TaylorSeer at the
official interval 3, first steps 5, order 6). The medium checkpoint (:mod:`benchmarks.medium`, random weights
at Qwen2-0.5B's layer geometry with 4 layers) edits a 512 px picture; the bundled model (``unicache-shapes``)
edits a scene of its world at 128 px and draws one (t2i). Official schedule: ``num_timesteps`` 50 (49 Euler
steps). Each row reports:

- ``denoise_seconds``: the pipeline's ``info["denoise_s"]`` (the Euler loop: every forward, forecast, guidance), and
  ``denoise_cpu_seconds``: the CPU time the process spent in that phase (all its threads; less sensitive than the
  wall clock to other processes on a shared machine, ``speedup_cpu_vs_full``);
- ``decoder_forwards``: the branch forwards that ran the decoder, summed over the branches (``forecasts``: those
  TaylorSeer forecast instead), and the ratios of both against ``full`` in the same run (``forwards_vs_full``,
  ``speedup_vs_full``); a TaylorSeer row also against its own method without it (``speedup_vs_method``);
- ``full_step_seconds`` / ``forecast_step_seconds``: median step time of the steps that computed every branch
  and of those that forecast every branch (from the KV report's per-step clocks);
- ``kv_bytes_steady`` (the report's steady managed bytes), ``taylorseer_peak_bytes`` (the factors at their most);
- ``psnr_to_full`` (dB) and ``latent_cosine_to_full`` against the ``full`` row's output of the same request.

One untimed warm-up request per checkpoint runs first (a process's first forwards pay one-time costs). Time it
with nothing else running on the machine: the forward counts and fidelity do not depend on the machine, the
seconds do.
"""

from __future__ import annotations

import logging
import math
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks.report_file import check_report_paths, json_and_table, write_json_report, write_text_report
from unicache_commands.flags import OneLineParser, path_arg
from unicache_core.bagel import BagelPipeline, RunHooks, load_bagel, preset
from unicache_core.bagel.settings import BUNDLED_CHECKPOINT_DIR
from unicache_core.compression import make_cache_factory
from unicache_core.shapes import edit_sample, t2i_sample
from unicache_core.shapes.world import EVAL_SEEDS

from .bagel_e2e import _source_image
from .medium import write_medium_checkpoint

logger = logging.getLogger("benchmarks.taylorseer")
CHECKPOINTS = ("medium", "bundled")
#: The rows of every (checkpoint, task): (row name, KV method, TaylorSeer on).
ROWS = (
    ("full", "full", False),
    ("full+taylorseer", "full", True),
    ("unicache", "unicache", False),
    ("unicache+taylorseer", "unicache", True),
)
#: The tasks run on each checkpoint (the medium model's random weights draw nothing worth a t2i row).
TASKS = {"medium": ("edit",), "bundled": ("edit", "t2i")}
MEDIUM_PROMPT = (
    "replace the small blue square in the upper left corner by a large red circle and make the "
    "background a soft gradient from yellow to green while keeping every other object unchanged"
)


@dataclass
class TaylorSeerBenchConfig:
    checkpoints: tuple[str, ...] = CHECKPOINTS
    num_timesteps: int = 50
    medium_edit_size: int = 512
    seed: int = 7
    threads: int = 0
    work_dir: str = ""


#: --quick: the schedule's first chunk and two forecast cycles, a smaller medium edit (a few minutes)
QUICK = dict(num_timesteps=12, medium_edit_size=256)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return 100.0 if mse == 0 else min(100.0, 10 * math.log10(255.0**2 / mse))


class PhaseCPUClock:
    """``RunHooks.phase``: the process's CPU seconds from the ``denoise`` phase's start to the next phase's."""

    def __init__(self):
        self.start: float | None = None
        self.denoise_cpu_seconds: float | None = None

    def __call__(self, name: str) -> None:
        now = time.process_time()
        if self.start is not None and self.denoise_cpu_seconds is None:
            self.denoise_cpu_seconds = now - self.start
        if name == "denoise":
            self.start = now


def _request(pipe: BagelPipeline, checkpoint: str, task: str, cfg: TaylorSeerBenchConfig, taylorseer: bool):
    """One benchmark request (the same inputs for every row of a checkpoint and task): ``(result, CPU seconds of
    its denoising)``."""
    clock = PhaseCPUClock()
    hooks = RunHooks(phase=clock)
    if checkpoint == "medium":
        image = _source_image(cfg.medium_edit_size, cfg.seed)
        settings = preset("edit", num_timesteps=cfg.num_timesteps, taylorseer=taylorseer)
        result = pipe.edit(MEDIUM_PROMPT, image, settings, seed=cfg.seed, hooks=hooks)
    elif task == "t2i":
        scene = t2i_sample(EVAL_SEEDS.start + cfg.seed)
        settings = preset("t2i", width=128, height=128, num_timesteps=cfg.num_timesteps, taylorseer=taylorseer)
        result = pipe.text_to_image(scene.caption(), settings, seed=cfg.seed, hooks=hooks)
    else:
        sample = edit_sample(EVAL_SEEDS.start + cfg.seed)
        settings = preset("edit", num_timesteps=cfg.num_timesteps, taylorseer=taylorseer)
        result = pipe.edit(sample.instruction, sample.source.render(), settings, seed=cfg.seed, hooks=hooks)
    return result, clock.denoise_cpu_seconds


def _step_medians(report: dict) -> tuple[float | None, float | None]:
    """Median ``step_s`` of the steps that computed every branch (step 0 left out: it also compresses) and of
    those that forecast every branch."""
    full, forecast = [], []
    for record in report["steps"]:
        if record["phase"] != "denoise" or record["step"] == 0:
            continue
        if not record["forecast"]:
            full.append(record["step_s"])
        elif len(record["forecast"]) == len(record["branches"]):
            forecast.append(record["step_s"])
    return (statistics.median(full) if full else None, statistics.median(forecast) if forecast else None)


def _row(checkpoint: str, task: str, name: str, result, cpu_seconds: float) -> dict:
    full_step, forecast_step = _step_medians(result.kv_report)
    summary = result.kv_report["summary"]
    return {
        "checkpoint": checkpoint,
        "task": task,
        "row": name,
        "size": list(result.image.size),
        "denoise_seconds": result.info["denoise_s"],
        "denoise_cpu_seconds": cpu_seconds,
        "decoder_forwards": sum(result.info["forwards"].values()),
        "forwards_per_branch": result.info["forwards"],
        "forecasts": sum(result.info.get("forecasts", {}).values()),
        "full_step_seconds": full_step,
        "forecast_step_seconds": forecast_step,
        "kv_bytes_steady": summary["steady_managed_bytes"],
        "full_kv_bytes": summary["full_managed_bytes"],
        "taylorseer_peak_bytes": result.info.get("taylorseer_peak_bytes", 0),
    }


def _compare(row: dict, result, baseline: dict, baseline_result, method_row: dict | None) -> None:
    """The row's ratios and fidelity against full KV's row (and a TaylorSeer row against its method's)."""
    row["forwards_vs_full"] = row["decoder_forwards"] / baseline["decoder_forwards"]
    row["speedup_vs_full"] = baseline["denoise_seconds"] / row["denoise_seconds"]
    row["speedup_cpu_vs_full"] = baseline["denoise_cpu_seconds"] / row["denoise_cpu_seconds"]
    if method_row is not None:
        row["speedup_vs_method"] = method_row["denoise_seconds"] / row["denoise_seconds"]
        row["speedup_cpu_vs_method"] = method_row["denoise_cpu_seconds"] / row["denoise_cpu_seconds"]
    a, b = result.latents.flatten().float(), baseline_result.latents.flatten().float()
    row["latent_cosine_to_full"] = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    row["psnr_to_full"] = round(_psnr(np.asarray(result.image), np.asarray(baseline_result.image)), 3)


def _checkpoint_path(name: str, cfg: TaylorSeerBenchConfig) -> Path:
    if name == "bundled":
        return BUNDLED_CHECKPOINT_DIR
    work = Path(cfg.work_dir) if cfg.work_dir else Path(tempfile.gettempdir()) / "unicache_e2e"
    return write_medium_checkpoint(work / "medium")


def run(cfg: TaylorSeerBenchConfig) -> dict:
    saved = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rows = []
    start = time.perf_counter()
    try:
        for checkpoint in cfg.checkpoints:
            path = _checkpoint_path(checkpoint, cfg)
            loaded = load_bagel(path, dtype=torch.float32)
            warm = dict(asdict(cfg), num_timesteps=3)
            _request(BagelPipeline(loaded), checkpoint, TASKS[checkpoint][0], TaylorSeerBenchConfig(**warm), False)
            for task in TASKS[checkpoint]:
                by_name: dict[str, tuple[dict, object]] = {}
                for name, method, taylorseer in ROWS:
                    pipe = BagelPipeline(loaded, make_cache_factory(method, checkpoint_dir=str(path)))
                    result, cpu_seconds = _request(pipe, checkpoint, task, cfg, taylorseer)
                    row = _row(checkpoint, task, name, result, cpu_seconds)
                    full_row, full_result = by_name.get("full", (row, result))
                    method_row = by_name[method][0] if taylorseer else None
                    _compare(row, result, full_row, full_result, method_row)
                    by_name[name] = (row, result)
                    rows.append(row)
                    logger.info("%s", format_table({"results": [row]}).splitlines()[-1])
    finally:
        torch.set_num_threads(saved)
    config = asdict(cfg)
    config.update(
        threads=cfg.threads or torch.get_num_threads(),
        dtype="float32",
        device="cpu",
        taylorseer={"interval": 3, "first_steps": 5, "order": 6},
        seconds=round(time.perf_counter() - start, 1),
    )
    return {"config": config, "results": rows}


def format_table(report: dict) -> str:
    head = (
        f"{'ckpt':8s} {'task':5s} {'row':20s} {'px':>4s} {'fwd':>4s} {'fwd/full':>8s} {'denoise s':>9s} "
        f"{'x full':>6s} {'x meth':>6s} {'cpu x full':>10s} {'cpu x meth':>10s} {'full st':>8s} {'fcst st':>8s} "
        f"{'KV MB':>7s} {'TS MB':>6s} {'PSNR':>6s} {'cos':>6s}"
    )
    lines = [head]

    def num(value, spec: str, width: int) -> str:
        return f"{'-':>{width}s}" if value is None else f"{value:{width}{spec}}"

    for r in report["results"]:
        lines.append(
            f"{r['checkpoint']:8s} {r['task']:5s} {r['row']:20s} {r['size'][0]:4d} {r['decoder_forwards']:4d} "
            f"{num(r.get('forwards_vs_full'), '.3f', 8)} {r['denoise_seconds']:9.2f} "
            f"{num(r.get('speedup_vs_full'), '.2f', 6)} {num(r.get('speedup_vs_method'), '.2f', 6)} "
            f"{num(r.get('speedup_cpu_vs_full'), '.2f', 10)} {num(r.get('speedup_cpu_vs_method'), '.2f', 10)} "
            f"{num(r['full_step_seconds'], '.3f', 8)} {num(r['forecast_step_seconds'], '.4f', 8)} "
            f"{(r['kv_bytes_steady'] or 0) / 1e6:7.2f} {r['taylorseer_peak_bytes'] / 1e6:6.2f} "
            f"{num(r.get('psnr_to_full'), '.2f', 6)} {num(r.get('latent_cosine_to_full'), '.4f', 6)}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m benchmarks.taylorseer", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="12 timesteps, a 256 px medium edit")
    parser.add_argument(
        "--json", type=path_arg, default=None, help="write the JSON report here (and the table as .txt)"
    )
    parser.add_argument("--checkpoints", default=",".join(CHECKPOINTS), help="comma list: medium,bundled")
    parser.add_argument("--timesteps", type=int, default=None, help="num_timesteps (default 50, --quick 12)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--work-dir", default="", help="where the medium checkpoint is written (reused)")
    args = parser.parse_args(argv)
    check_report_paths(parser, json_and_table(args.json))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("unicache_core.compression.registry").setLevel(logging.ERROR)
    checkpoints = tuple(c.strip() for c in args.checkpoints.split(",") if c.strip())
    if not checkpoints or any(c not in CHECKPOINTS for c in checkpoints):
        parser.error(f"--checkpoints: choose from {', '.join(CHECKPOINTS)}, got {args.checkpoints!r}")
    kw: dict = dict(QUICK) if args.quick else {}
    if args.timesteps is not None:
        if args.timesteps < 2:
            parser.error(f"--timesteps must be >= 2, got {args.timesteps}")
        kw["num_timesteps"] = args.timesteps
    report = run(TaylorSeerBenchConfig(checkpoints=checkpoints, threads=args.threads, work_dir=args.work_dir, **kw))
    table = format_table(report)
    sys.stdout.write(table + "\n")
    if args.json is not None:
        write_json_report(args.json, report)
        write_text_report(args.json.with_suffix(".txt"), table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
