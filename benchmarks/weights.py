"""Cost and quality of each weight storage dtype on the bundled model, with full KV and with UniCache.

``python -m benchmarks.weights [--quick] [--json PATH] [--checkpoint DIR] [--samples N] [--timesteps N]``

For ``bf16``, ``fp8_e4m3fn``, ``fp8_e5m2`` and ``int8`` (compute in fp32, as the quality bench):

- ``param_bytes``, ``load_seconds``, ``load_peak_rss_bytes``: a load in a fresh process (:mod:`benchmarks.rss`:
  the load's own peak resident memory above the process's base);
- ``step_seconds``: the median time between two denoising steps of one edit (three CFG branches);
- ``und_accuracy``, ``t2i_attribute_mean`` (the mean of colour, shape, position and count accuracy) and
  ``edit_psnr``: the quality bench's headline metrics (:func:`benchmarks.quality.run_task`, the same held-out
  samples), per KV method (``full``, and ``unicache`` at its default reduction);
- ``und_answers_changed``: how many understanding answers differ from those of the run's first weight dtype
  (``config.und_reference_weight_dtype``, bf16 by default) with the same KV method: accuracy is a net figure,
  and answers on thin margins flip both ways.

JSON: ``{"config": {...}, "results": [{"weight_dtype", "kv_method", "param_bytes", "load_seconds",
"load_peak_rss_bytes", "step_seconds", "und_accuracy", "und_answers_changed", "t2i_attribute_mean",
"edit_psnr"}, ...]}``.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from benchmarks.quality import DEFAULT_CHECKPOINT, QUICK, QualityConfig, run_task
from benchmarks.report_file import check_report_paths, write_json_report
from benchmarks.rss import measure_load_in_subprocess
from unicache_commands.flags import OneLineParser, path_arg
from unicache_core.bagel import BagelPipeline, load_bagel, preset
from unicache_core.bagel.request import RunHooks
from unicache_core.compression import make_cache_factory
from unicache_core.shapes import edit_sample

logger = logging.getLogger("benchmarks.weights")
WEIGHT_DTYPES = ("bf16", "fp8_e4m3fn", "fp8_e5m2", "int8")
KV_METHODS = ("full", "unicache")
FIELDS = (
    "weight_dtype",
    "kv_method",
    "param_bytes",
    "load_seconds",
    "load_peak_rss_bytes",
    "step_seconds",
    "und_accuracy",
    "und_answers_changed",
    "t2i_attribute_mean",
    "edit_psnr",
)
T2I_ATTRIBUTES = ("color", "shape", "position", "count")
COMPUTE_DTYPE = "fp32"


def step_seconds(pipe: BagelPipeline, num_timesteps: int) -> float:
    """Median seconds between two denoising steps of one edit of the first held-out sample."""
    marks: list[float] = []
    edit = edit_sample(0)
    pipe.edit(
        edit.instruction,
        edit.source.render(),
        preset("edit", num_timesteps=num_timesteps),
        hooks=RunHooks(progress=lambda done, total: marks.append(time.perf_counter())),
    )
    gaps = [b - a for a, b in zip(marks, marks[1:])]
    return round(statistics.median(gaps), 4) if gaps else float("nan")


def changed_answers(answers: dict, reference: dict) -> int:
    """How many of ``reference``'s samples (seed -> answer text) got a different (or no) answer in ``answers``."""
    return sum(answers.get(seed) != text for seed, text in reference.items())


def quality_metrics(pipe: BagelPipeline, cfg: QualityConfig, und_reference: dict | None = None) -> tuple[dict, dict]:
    """The headline metrics of :func:`benchmarks.quality.run_task` for the tasks of ``cfg``, and the understanding
    answers by seed; ``und_answers_changed`` counts answers unlike ``und_reference``'s (0 without one)."""
    found: dict[str, float] = {}
    answers: dict = {}
    for task in cfg.tasks:
        metrics, outputs, _, _ = run_task(pipe, task, cfg, None)
        if task == "und":
            answers = outputs
            found["und_accuracy"] = round(metrics["accuracy"], 4)
            found["und_answers_changed"] = changed_answers(outputs, und_reference) if und_reference else 0
        elif task == "t2i":
            found["t2i_attribute_mean"] = round(statistics.fmean(metrics[a] for a in T2I_ATTRIBUTES), 4)
        else:
            found["edit_psnr"] = round(metrics["psnr_target"], 3)
    return found, answers


def run(cfg: QualityConfig, weight_dtypes=WEIGHT_DTYPES, kv_methods=KV_METHODS) -> dict:
    """Every (weight dtype, KV method) row; see the module docstring."""
    checkpoint = Path(cfg.checkpoint)
    rows = []
    reference: dict[str, dict] = {}  # kv method -> the first weight dtype's understanding answers
    for weight_dtype in weight_dtypes:
        load = measure_load_in_subprocess(checkpoint, weight_dtype, COMPUTE_DTYPE)
        loaded = load_bagel(checkpoint, dtype=COMPUTE_DTYPE, weight_dtype=weight_dtype)
        for kv_method in kv_methods:
            pipe = BagelPipeline(loaded, make_cache_factory(kv_method, checkpoint_dir=str(checkpoint)))
            row = {
                "weight_dtype": weight_dtype,
                "kv_method": kv_method,
                "param_bytes": load["param_bytes"],
                "load_seconds": round(load["load_seconds"], 4),
                "load_peak_rss_bytes": load["load_peak_bytes"],
                "step_seconds": step_seconds(pipe, cfg.num_timesteps),
            }
            metrics, answers = quality_metrics(pipe, cfg, reference.get(kv_method))
            reference.setdefault(kv_method, answers)
            row.update(metrics)
            rows.append(row)
            logger.info("%s", row)
    config = asdict(cfg)
    config.update(
        compute_dtype=COMPUTE_DTYPE,
        threads=torch.get_num_threads(),
        und_reference_weight_dtype=weight_dtypes[0] if weight_dtypes else None,
    )
    return {"config": config, "results": rows}


def format_table(report: dict) -> str:
    lines = [
        f"{'weight_dtype':12s} {'kv':9s} {'params MB':>9s} {'load s':>7s} {'load RSS MB':>11s} {'step s':>7s} "
        f"{'und acc':>7s} {'changed':>7s} {'t2i attr':>8s} {'edit PSNR':>9s}"
    ]
    for r in report["results"]:
        cells = [
            f"{r.get(k, float('nan')):{w}.{p}f}"
            for k, w, p in (
                ("und_accuracy", 7, 3),
                ("und_answers_changed", 7, 0),
                ("t2i_attribute_mean", 8, 3),
                ("edit_psnr", 9, 2),
            )
        ]
        lines.append(
            f"{r['weight_dtype']:12s} {r['kv_method']:9s} {r['param_bytes'] / 1e6:9.2f} "
            f"{r['load_seconds']:7.3f} {r['load_peak_rss_bytes'] / 1e6:11.2f} {r['step_seconds']:7.3f} "
            + " ".join(cells)
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m benchmarks.weights", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the quality bench's quick sample counts and steps")
    parser.add_argument("--json", type=path_arg, default=None, help="write the report here")
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--samples", type=int, default=None, help="held-out samples per task (und gets 3x)")
    parser.add_argument("--timesteps", type=int, default=None, help="num_timesteps of t2i and edit")
    args = parser.parse_args(argv)
    check_report_paths(parser, [("--json", args.json, "JSON report")], checkpoints=[args.checkpoint])
    if not (args.checkpoint / "llm_config.json").is_file():
        parser.error(f"--checkpoint {args.checkpoint} is not a BAGEL checkpoint folder (no llm_config.json)")
    if args.samples is not None and args.samples < 1:
        parser.error(f"--samples must be >= 1, got {args.samples}")
    if args.timesteps is not None and args.timesteps < 2:
        parser.error(f"--timesteps must be >= 2, got {args.timesteps}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("unicache_core.compression.registry").setLevel(logging.ERROR)
    cfg = QualityConfig(checkpoint=str(args.checkpoint))
    if args.quick:
        cfg = replace(cfg, samples=QUICK["samples"], num_timesteps=QUICK["num_timesteps"])
    if args.samples is not None:
        cfg = replace(cfg, samples={"und": 3 * args.samples, "t2i": args.samples, "edit": args.samples})
    if args.timesteps is not None:
        cfg = replace(cfg, num_timesteps=args.timesteps)
    report = run(cfg)
    sys.stdout.write(format_table(report) + "\n")
    if args.json is not None:
        write_json_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
