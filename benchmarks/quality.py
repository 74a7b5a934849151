"""Quality benchmark on the bundled shapes model: every KV method at the paper's reductions, one table.

``python -m benchmarks.quality [--quick] [--targets paper,robust,extreme] [--json PATH] [--checkpoint DIR]
[--methods ...]``

Held-out samples of the shapes world (seeds disjoint from training, ``unicache_core.shapes``) go
through the real pipeline once per (task, method, target reduction), and a deterministic analyser
scores the outputs against the exact answers:

- understanding: greedy answer == the exact answer (accuracy; per question kind in ``metrics``);
- text-to-image: the analysed image shows every prompted object in its cell with its colour and shape,
  nothing extra, and the right background (accuracy; per attribute in ``metrics``);
- edit: PSNR to the exact target image (the score), PSNR of the region the edit must leave unchanged,
  and instruction success (the analysed output equals the target scene).

Targets (reduction for und / t2i / edit): ``paper`` 80/60/80 (the paper's table), ``robust`` 90/75/90 and
``extreme`` 95/85/95. UniCache (and its paper-table row) gets ``kv_target = 1 - reduction`` with every other
setting at its default; every baseline then runs at the bytes UniCache achieved on that task and target
(``kv_target = 1 - UniCache's achieved reduction``), so each row compares methods at equal memory; without
a unicache row the baselines take the target itself. ``full`` runs once per task. ``achieved_reduction`` is
``1 - mean(steady managed bytes / full managed bytes)`` over the samples.
Every row keeps its per-sample scores (``metrics["per_sample"]``, in seed order); UniCache's row at a target
carries ``unicache_minus_full`` and every other row at that target ``unicache_minus_this``: the paired
difference over the same samples with its 95% interval and a verdict (ahead / behind / tie,
:mod:`benchmarks.paired`), so the table says which gaps the samples can tell apart.
The same pairing on fidelity to full KV (``metrics["per_sample_to_full"]``: the answer agrees with full KV's,
0/1, or the image's PSNR to full KV's, dB, capped at 100) gives every non-full row ``unicache_to_full_minus_this``:
how much closer to what full KV outputs UniCache stays than that row, at the same bytes. When a task's score is
already at full KV's level, this is the comparison that can still tell the methods apart. Free-running outputs
drift apart chaotically, though, so every non-full row also runs its requests again forced along full KV's path
(teacher forcing, :mod:`.step_path`): ``metrics["per_sample_step_fidelity"]`` (dB: velocity error of every
step for t2i and edit, the answer tokens' KL for und) and ``unicache_steps_minus_this``, paired the same way.
The report also says whether the checkpoint's calibrated policy table routes the types as the paper
does (instruction and ViT evicted, VAE quantized)."""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from benchmarks.report_file import check_report_paths, committed_path, write_json_report
from unicache_core.bagel import BagelPipeline, RunHooks, load_bagel, preset
from unicache_core.bagel.settings import BUNDLED_CHECKPOINT
from unicache_core.cli import OneLineParser, path_arg
from unicache_core.compression import DEFAULT_REDUCTION, METHODS, make_cache_factory
from unicache_core.shapes import analyse, edit_sample, judge_t2i, psnr, scenes_match, t2i_sample, unchanged_mask
from unicache_core.shapes.world import EVAL_SEEDS, image_array, understanding_sample

from .paired import paired_difference
from .quality_rows import (
    FULL_TAYLORSEER_ROW,
    PAPER_ROW,
    UNICACHE_ROWS,
    UNICACHE_TAYLORSEER_ROW,
    at_bytes_row,
    is_unicache_row,
    unequal_bytes,
)
from .quality_table import format_table
from .report_rows import check_match_from, earlier_unicache, items
from .step_path import StepPath, fidelity_db

logger = logging.getLogger("benchmarks.quality")
REPO = Path(__file__).resolve().parent.parent
DEFAULT_CHECKPOINT = REPO / "models" / "bagel" / BUNDLED_CHECKPOINT
TASKS = ("und", "t2i", "edit")
_PIPE_TASK = {"und": "understanding", "t2i": "t2i", "edit": "edit"}
#: (name, {task: target reduction}): the paper's operating point, then two harder ones (10x und / edit, 4x
#: t2i; 20x und / edit, 6.7x t2i).
TARGETS: tuple[tuple[str, dict[str, float]], ...] = (
    ("paper", {task: DEFAULT_REDUCTION[_PIPE_TASK[task]] for task in TASKS}),
    ("robust", {"und": 0.9, "t2i": 0.75, "edit": 0.9}),
    ("extreme", {"und": 0.95, "t2i": 0.85, "edit": 0.95}),
)
TARGET_NAMES = tuple(name for name, _ in TARGETS)
#: Disjoint held-out seed blocks per task (all inside EVAL_SEEDS).
_SEED_OFFSET = {"und": 0, "t2i": 1 << 20, "edit": 2 << 20}


def paper_table_for(checkpoint: Path):
    """The paper's assignment (instruction and ViT evicted, VAE quantized) as a table for this checkpoint."""
    from unicache_core.bagel.checkpoint.model_id import model_id_of
    from unicache_core.compression.policy_table import paper_policy_table

    return replace(paper_policy_table(), model_id=model_id_of(checkpoint))


@dataclass
class QualityConfig:
    checkpoint: str = str(DEFAULT_CHECKPOINT)
    methods: tuple[str, ...] = tuple(METHODS)
    tasks: tuple[str, ...] = TASKS
    samples: dict = field(default_factory=lambda: {"und": 120, "t2i": 32, "edit": 32})
    num_timesteps: int = 25
    targets: tuple[str, ...] = ("paper", "robust")
    threads: int = 0
    paper_table_row: bool = True  # also run unicache with the paper's policy table (next to the calibrated one)
    #: baselines run at the bytes UniCache achieved (False: at the named target, like UniCache)
    match_unicache_bytes: bool = True
    #: every non-full row runs its requests again forced along full KV's path (:mod:`.step_path`)
    step_fidelity: bool = True
    #: t2i and edit: full+taylorseer once per task, unicache+taylorseer per target (psnr_to_full_taylorseer)
    taylorseer: bool = True
    match_from: str | None = None  #: an earlier report's unicache rows instead of running unicache (.report_rows)


#: --quick: fewer samples and steps, two targets, no teacher-forced pass (it doubles the run; --step-fidelity adds it)
QUICK = dict(
    samples={"und": 36, "t2i": 8, "edit": 8}, num_timesteps=12, targets=("paper", "robust"), step_fidelity=False
)


def _seeds(task: str, n: int) -> list[int]:
    start = EVAL_SEEDS.start + _SEED_OFFSET[task]
    return list(range(start, start + n))


def _reduction(reports: list[dict]) -> float:
    ratios = [r["summary"]["achieved_ratio"] for r in reports if r["summary"].get("achieved_ratio") is not None]
    return 0.0 if not ratios else round(1.0 - statistics.fmean(ratios), 4)


def _request(pipe: BagelPipeline, task: str, seed: int, cfg: QualityConfig, hooks: RunHooks, taylorseer=False):
    """One bench request: ``(pipeline result, the world sample it was drawn from)`` (t2i, edit: ``taylorseer``)."""
    if task == "und":
        scene, q = understanding_sample(seed)
        return pipe.understand(q.question, scene.render(), preset("understanding", max_new_tokens=4), hooks=hooks), (
            scene,
            q,
        )
    if task == "t2i":
        scene = t2i_sample(seed)
        return pipe.text_to_image(
            scene.caption(),
            preset("t2i", width=128, height=128, num_timesteps=cfg.num_timesteps, taylorseer=taylorseer),
            seed=seed % (1 << 32),
            hooks=hooks,
        ), scene
    edit = edit_sample(seed)
    return pipe.edit(
        edit.instruction,
        edit.source.render(),
        preset("edit", num_timesteps=cfg.num_timesteps, taylorseer=taylorseer),
        seed=seed % (1 << 32),
        hooks=hooks,
    ), edit


def run_task(
    pipe: BagelPipeline, task: str, cfg: QualityConfig, full_outputs: dict | None, taylorseer: bool = False
) -> tuple[dict, dict, list, dict]:
    """Score one method on one task; returns ``(metrics, outputs by seed, kv reports, step paths by seed)``."""
    n = cfg.samples[task]
    outputs, reports, per_sample, paths = {}, [], [], {}
    judged, by_kind = defaultdict(list), defaultdict(list)
    for seed in _seeds(task, n):
        paths[seed] = StepPath()
        res, sample = _request(pipe, task, seed, cfg, RunHooks(steer=paths[seed]), taylorseer)
        reports.append(res.kv_report)
        if task == "und":
            scene, q = sample
            ok = res.text.strip().lower() == q.answer
            by_kind[q.kind].append(ok)
            per_sample.append(float(ok))
            outputs[seed] = res.text.strip()
        elif task == "t2i":
            j = judge_t2i(res.image, sample)
            for name in ("correct", "color", "shape", "position", "background", "count"):
                judged[name].append(float(getattr(j, name)))
            outputs[seed] = image_array(res.image)
        else:
            src, tgt = image_array(sample.source.render()), image_array(sample.target.render())
            out = image_array(res.image)
            judged["psnr_target"].append(psnr(out, tgt))
            judged["psnr_source_as_output"].append(psnr(src, tgt))  # the do-nothing reference
            judged["psnr_unchanged"].append(psnr(out, tgt, unchanged_mask(src, tgt)))
            success = float(scenes_match(analyse(out), sample.target))
            judged["success"].append(success)
            judged[f"success_{sample.kind}"].append(success)
            outputs[seed] = out
    if task == "und":
        flat = [v for vs in by_kind.values() for v in vs]
        metrics = {
            "accuracy": sum(flat) / len(flat),
            "by_kind": {k: round(sum(v) / len(v), 4) for k, v in sorted(by_kind.items())},
            "per_sample": per_sample,
        }
        if full_outputs is not None:
            metrics["per_sample_to_full"] = [float(outputs[s] == full_outputs[s]) for s in outputs]
            metrics["agreement_with_full"] = statistics.fmean(metrics["per_sample_to_full"])
        return metrics, outputs, reports, paths
    metrics = {k: round(statistics.fmean(v), 4) for k, v in sorted(judged.items())}
    metrics["per_sample"] = [round(v, 4) for v in judged["correct" if task == "t2i" else "psnr_target"]]
    if task == "t2i":
        metrics["accuracy"] = metrics.pop("correct")
    if full_outputs is not None:
        metrics["per_sample_to_full"] = [round(psnr(outputs[s], full_outputs[s]), 4) for s in outputs]
        metrics["psnr_to_full"] = round(statistics.fmean(metrics["per_sample_to_full"]), 3)
    return metrics, outputs, reports, paths


def step_fidelity(pipe: BagelPipeline, task: str, cfg: QualityConfig, full_paths: dict, seer=False) -> list[float]:
    """Per-sample step fidelity to full KV in dB (:mod:`.step_path`): every request again, forced along full KV's
    path, in seed order."""
    per_sample = []
    for seed in _seeds(task, cfg.samples[task]):
        path = StepPath(forced=full_paths[seed])
        _request(pipe, task, seed, cfg, RunHooks(steer=path), seer)
        per_sample.append(round(fidelity_db(task, path, full_paths[seed]), 4))
    return per_sample


def _score(task: str, metrics: dict) -> float:
    return metrics["psnr_target"] if task == "edit" else metrics["accuracy"]


def calibration_check(checkpoint: Path) -> dict:
    """Does the checkpoint's calibrated table route the types as the paper does?"""
    from unicache_core.compression.policy_table import CHECKPOINT_POLICY_FILE

    path = checkpoint / CHECKPOINT_POLICY_FILE
    paper = {"instruction": "evict", "source_vit": "evict", "source_vae": "quantize"}
    if not path.is_file():
        return {"table": None, "agrees_with_paper": None, "note": f"no {CHECKPOINT_POLICY_FILE} next to the checkpoint"}
    data = json.loads(path.read_text(encoding="utf-8"))
    routes: dict[str, dict[str, str]] = {}
    occurring = {
        "understanding": ("instruction", "source_vit"),
        "t2i": ("instruction",),
        "edit": ("instruction", "source_vit", "source_vae"),
    }
    for entry in data.get("entries", []):
        if entry["type"] in occurring.get(entry["task"], ()):
            routes.setdefault(entry["task"], {})[entry["type"]] = entry["kind"]
    mismatches = [
        f"{task}/{t}: {p} (paper: {paper[t]})"
        for task, types in routes.items()
        for t, p in types.items()
        if t in paper and p != paper[t]
    ]
    shown = path.resolve()
    shown = shown.relative_to(REPO) if shown.is_relative_to(REPO) else shown  # the repository's own: no machine path
    return {"table": str(shown), "routing": routes, "agrees_with_paper": not mismatches, "mismatches": mismatches}


def _method_row(
    loaded, task: str, cfg: QualityConfig, method: str, reduction: float, run_at: float, full_out: dict,
    full_paths: dict, seer_outputs: dict | None,
) -> dict:  # fmt: skip
    """One row: ``method`` (a UniCache row's name runs UniCache) on ``task`` at ``run_at`` reduction, scored, with its
    fidelity to full KV's outputs and, when configured, its step fidelity on full KV's paths."""
    t0 = time.perf_counter()
    checkpoint = Path(cfg.checkpoint)
    kw = {"policy": paper_table_for(checkpoint)} if method == PAPER_ROW else {}
    seer = method == UNICACHE_TAYLORSEER_ROW
    factory = make_cache_factory(
        "unicache" if is_unicache_row(method) else method,
        checkpoint_dir=str(checkpoint),
        kv_target=round(1.0 - run_at, 6),
        **kw,
    )
    pipe = BagelPipeline(loaded, factory)
    metrics, outputs, reports, _ = run_task(pipe, task, cfg, full_out, seer)
    if seer and seer_outputs is not None:  # what UniCache changes on top of TaylorSeer
        to_seer = [psnr(outputs[s], seer_outputs[s]) for s in outputs]
        metrics["psnr_to_full_taylorseer"] = round(statistics.fmean(to_seer), 3)
    if cfg.step_fidelity:
        metrics["per_sample_step_fidelity"] = step_fidelity(pipe, task, cfg, full_paths, seer)
        metrics["step_fidelity_db"] = round(statistics.fmean(metrics["per_sample_step_fidelity"]), 3)
    row = {
        "task": task,
        "method": method,
        "target_reduction": reduction,
        "run_at_reduction": run_at,
        "achieved_reduction": _reduction(reports),
        "score": _score(task, metrics),
        "metrics": metrics,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    logger.info(
        "%s %s @%.0f%%: score %.4f, achieved %.1f%% (%.0fs)",
        task, method, 100 * reduction, row["score"], 100 * row["achieved_reduction"], row["seconds"],
    )  # fmt: skip
    return row


def _pair(row: dict, unicache: dict) -> None:
    """``row``'s paired differences with UniCache's ``metrics`` (scores, fidelity to full KV, step fidelity)."""
    metrics = row["metrics"]
    row["unicache_minus_this"] = paired_difference(unicache["per_sample"], metrics["per_sample"])
    to_full = unicache["per_sample_to_full"]
    row["unicache_to_full_minus_this"] = paired_difference(to_full, metrics["per_sample_to_full"])
    if unicache.get("per_sample_step_fidelity") is not None and "per_sample_step_fidelity" in metrics:
        row["unicache_steps_minus_this"] = paired_difference(
            unicache["per_sample_step_fidelity"], metrics["per_sample_step_fidelity"]
        )


def run(cfg: QualityConfig) -> dict:
    saved = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    checkpoint = Path(cfg.checkpoint)
    loaded = load_bagel(checkpoint, dtype=torch.float32)
    results = []
    t_start = time.perf_counter()
    try:
        for task in cfg.tasks:
            full_rows = [("full", False)] + ([(FULL_TAYLORSEER_ROW, True)] if cfg.taylorseer and task != "und" else [])
            seer_outputs = full_out = full_paths = full_metrics = None
            for method, seer in full_rows:  # full KV, then with TaylorSeer (against full KV's outputs and path)
                t0 = time.perf_counter()
                pipe = BagelPipeline(loaded, make_cache_factory("full"))
                metrics, outputs, reports, paths = run_task(pipe, task, cfg, full_out if seer else None, seer)
                row = dict(task=task, method=method, target_reduction=0.0, achieved_reduction=_reduction(reports))
                if seer:
                    seer_outputs = outputs
                    if cfg.step_fidelity:
                        metrics["per_sample_step_fidelity"] = step_fidelity(pipe, task, cfg, full_paths, True)
                        metrics["step_fidelity_db"] = round(statistics.fmean(metrics["per_sample_step_fidelity"]), 3)
                    row["full_minus_this"] = paired_difference(full_metrics["per_sample"], metrics["per_sample"])
                    row["forecasts"] = sum(sum(r["summary"]["forecast_forwards"].values()) for r in reports)
                else:
                    full_metrics, full_out, full_paths = metrics, outputs, paths
                row.update(score=_score(task, metrics), metrics=metrics, seconds=round(time.perf_counter() - t0, 1))
                results.append(row)
                logger.info("%s %s: score %.4f (%.0fs)", task, method, row["score"], row["seconds"])
            for target_name in cfg.targets:
                reduction = dict(TARGETS)[target_name][task]
                runs = [m for m in cfg.methods if m != "full"]
                if "unicache" in runs:
                    runs.remove("unicache")
                    runs[:0] = ["unicache", PAPER_ROW] if cfg.paper_table_row else ["unicache"]
                    if seer_outputs is not None:
                        runs.insert(1, UNICACHE_TAYLORSEER_ROW)
                matched = reduction
                # UniCache's per-sample scores and fidelity at this target: the other rows pair with them
                unicache = None
                at_rows: list[dict] = []  # UniCache run again at the bytes of a baseline that missed its own
                if cfg.match_from is not None:
                    matched, unicache = earlier_unicache(cfg.match_from, task, reduction)
                for method in runs:
                    run_at = reduction if method in UNICACHE_ROWS + (UNICACHE_TAYLORSEER_ROW,) else matched
                    row = _method_row(loaded, task, cfg, method, reduction, run_at, full_out, full_paths, seer_outputs)
                    if method == "unicache" and cfg.match_unicache_bytes:
                        matched = row["achieved_reduction"]
                    if method == "unicache":
                        unicache = row["metrics"]
                        full_samples = full_metrics["per_sample"]
                        row["unicache_minus_full"] = paired_difference(unicache["per_sample"], full_samples)
                    elif unicache is not None:
                        reference = unicache
                        if not is_unicache_row(method) and cfg.match_unicache_bytes:
                            if unequal_bytes(matched, row["achieved_reduction"]):  # UniCache again, at its bytes
                                held = row["achieved_reduction"]
                                at = next((a for a in at_rows if not unequal_bytes(a["run_at_reduction"], held)), None)
                                if at is None:  # no UniCache row at these bytes yet
                                    at = _method_row(
                                        loaded, task, cfg, at_bytes_row(method), reduction, held, full_out, full_paths,
                                        None,
                                    )  # fmt: skip
                                    at_rows.append(at)
                                    results.append(at)
                                reference, row["paired_with"] = at["metrics"], at["method"]
                        _pair(row, reference)
                    results.append(row)
    finally:
        torch.set_num_threads(saved)
    config = asdict(cfg)
    config.update(
        checkpoint=committed_path(checkpoint),
        threads=torch.get_num_threads() if not cfg.threads else cfg.threads,
        dtype="float32",
        device="cpu",
        targets={name: dict(TARGETS)[name] for name in cfg.targets},
        seeds={task: [_seeds(task, 1)[0], cfg.samples[task]] for task in cfg.tasks},
        calibration=calibration_check(checkpoint),
        seconds=round(time.perf_counter() - t_start, 1),
    )
    model_card = checkpoint / "training.json"
    if model_card.is_file():
        config["model"] = json.loads(model_card.read_text(encoding="utf-8")).get("variant")
    return {"config": config, "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m benchmarks.quality", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="fewer samples and steps, paper and robust targets, no teacher-forced pass (under 5 "
        "min on an idle machine)",
    )
    parser.add_argument(
        "--targets", default=None, help=f"comma list of {', '.join(TARGET_NAMES)} (default paper,robust)"
    )
    parser.add_argument("--json", type=path_arg, default=None, help="write the JSON report here")
    parser.add_argument(
        "--checkpoint",
        type=path_arg,
        default=DEFAULT_CHECKPOINT,
        help=f"checkpoint folder (default {DEFAULT_CHECKPOINT.relative_to(REPO)})",
    )
    parser.add_argument("--tasks", default=None, help="comma list: und,t2i,edit")
    parser.add_argument("--methods", default=None, help="comma list of methods (full always runs)")
    parser.add_argument("--match-from", type=path_arg, default=None, help="run at this report's unicache bytes")
    parser.add_argument("--samples", type=int, default=None, help="held-out samples per task (und gets 3x)")
    parser.add_argument("--timesteps", type=int, default=None, help="num_timesteps of t2i and edit")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--taylorseer", action=argparse.BooleanOptionalAction, default=True, help="TaylorSeer rows")
    parser.add_argument(
        "--step-fidelity",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run every row again forced along full KV's path (default: on, off with --quick)",
    )
    args = parser.parse_args(argv)
    check_report_paths(parser, [("--json", args.json, "JSON report")], checkpoints=[args.checkpoint])
    if not (Path(args.checkpoint) / "llm_config.json").is_file():
        parser.error(f"--checkpoint {args.checkpoint} is not a BAGEL checkpoint folder (no llm_config.json)")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("unicache_core.compression.registry").setLevel(logging.ERROR)
    kw: dict = dict(QUICK) if args.quick else {}
    if args.tasks:
        kw["tasks"] = items(parser, "tasks", args.tasks, TASKS)
    if args.targets:
        kw["targets"] = items(parser, "targets", args.targets, TARGET_NAMES)
    if args.methods:
        kw["methods"] = items(parser, "methods", args.methods, tuple(METHODS))
    kw["match_from"] = check_match_from(parser, args.match_from, kw.get("methods", METHODS))
    if args.samples is not None:
        if args.samples < 1:
            parser.error(f"--samples must be >= 1, got {args.samples}")
        kw["samples"] = {"und": 3 * args.samples, "t2i": args.samples, "edit": args.samples}
    if args.step_fidelity is not None:
        kw["step_fidelity"] = args.step_fidelity
    if args.timesteps is not None:
        if args.timesteps < 2:
            parser.error(f"--timesteps must be >= 2, got {args.timesteps}")
        kw["num_timesteps"] = args.timesteps
    cfg = QualityConfig(checkpoint=str(args.checkpoint), threads=args.threads, taylorseer=args.taylorseer, **kw)
    report = run(cfg)
    table = format_table(report)
    sys.stdout.write(table + "\n")
    if args.json is not None:
        write_json_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
