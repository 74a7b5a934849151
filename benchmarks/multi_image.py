"""Fidelity to full KV of requests with several images, every method, on the bundled model.

``python -m benchmarks.multi_image [--quick] [--json PATH] [--methods unicache,lookm,...]``

The bundled model (``models/bagel/unicache-shapes``) was trained on one image per request and never saw two, so it has
no multi-image task quality to score: what is measured is how close each method's outputs stay to full KV's on the
same multi-image requests (issue #43 item 7). Each request holds ``N`` shapes-world images (2 and 3), then the prompt:

- edit: the images of ``N`` edit samples, then the last sample's instruction (the output takes the last image's size);
- understanding: the scenes of ``N`` question samples, then the last sample's question.

Per method and image count, over the same samples:

- step fidelity (teacher forcing, :mod:`.step_path`): every step's guided velocity (edit) or next-token distribution
  (understanding) on full KV's path, in dB (higher is closer to full KV);
- free-running fidelity: the output image's PSNR to full KV's (edit), the answer tokens that match full KV's (und);
- the KV held (steady managed bytes) against full KV's;
- UniCache minus the method, paired over the samples (:func:`.paired.paired_difference`).

UniCache runs at its default (the checkpoint's calibrated table and schedule); every baseline at UniCache's steady
bytes of the same sample (``kv_target`` in bytes), so every row compares at equal memory.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from PIL import Image

from benchmarks.report_file import check_report_paths, json_and_table, write_json_report, write_text_report
from unicache_commands.flags import OneLineParser, path_arg
from unicache_core.bagel import BagelPipeline, RunHooks, load_bagel, preset
from unicache_core.bagel.settings import BUNDLED_CHECKPOINT_DIR
from unicache_core.compression import METHODS, make_cache_factory
from unicache_core.shapes import edit_sample
from unicache_core.shapes.world import understanding_sample

from .paired import paired_difference
from .step_path import StepPath, fidelity_db

logger = logging.getLogger("benchmarks.multi_image")


@dataclass
class MultiImageConfig:
    samples: int = 12
    images: tuple[int, ...] = (2, 3)
    tasks: tuple[str, ...] = ("edit", "und")
    methods: tuple[str, ...] = tuple(m for m in METHODS if m != "full")
    num_timesteps: int = 25  # the shipped workflows' steps
    max_new_tokens: int = 8
    first_seed: int = 5000  # held-out seeds (the training and quality benches use lower ones)


QUICK = dict(samples=3, images=(2,), num_timesteps=8)


def _items(task: str, seed: int, count: int) -> list:
    """``count`` images, then the prompt: the last sample's instruction or question."""
    if task == "edit":
        samples = [edit_sample(seed * 7 + i) for i in range(count)]
        return [s.source.render() for s in samples] + [samples[-1].instruction]
    samples = [understanding_sample(seed * 7 + i) for i in range(count)]
    return [scene.render() for scene, _ in samples] + [samples[-1][1].question]


def _run(pipe: BagelPipeline, task: str, items: list, cfg: MultiImageConfig, hooks: RunHooks | None = None):
    if task == "edit":
        return pipe.generate("edit", items, preset("edit", num_timesteps=cfg.num_timesteps), seed=1, hooks=hooks)
    return pipe.understand_items(items, preset("understanding", max_new_tokens=cfg.max_new_tokens), hooks=hooks)


def _psnr(a: Image.Image, b: Image.Image) -> float:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    mse = float(((x - y) ** 2).mean())
    return 100.0 if mse == 0 else min(100.0, 10 * np.log10(255.0**2 / mse))


def _free_fidelity(task: str, result, full) -> float:
    if task == "edit":
        return _psnr(result.image, full.image)
    a, b = result.token_ids, full.token_ids
    return sum(x == y for x, y in zip(a, b)) / max(len(a), len(b), 1)


def run(cfg: MultiImageConfig) -> dict:
    loaded = load_bagel(BUNDLED_CHECKPOINT_DIR, dtype=torch.float32)
    checkpoint = str(BUNDLED_CHECKPOINT_DIR)
    rows = []
    for task in cfg.tasks:
        for count in cfg.images:
            per_method: dict[str, dict[str, list]] = {m: {"step": [], "free": [], "held": []} for m in cfg.methods}
            full_held = []
            t0 = time.perf_counter()
            for seed in range(cfg.first_seed, cfg.first_seed + cfg.samples):
                items = _items(task, seed, count)
                full_path = StepPath()
                full_pipe = BagelPipeline(loaded, make_cache_factory("full"))
                full = _run(full_pipe, task, items, cfg, RunHooks(steer=full_path))
                full_held.append(full.kv_report["summary"]["full_managed_bytes"])
                unicache_bytes = None
                for method in cfg.methods:
                    kw = {} if method == "unicache" or unicache_bytes is None else {"kv_target": int(unicache_bytes)}
                    pipe = BagelPipeline(loaded, make_cache_factory(method, checkpoint_dir=checkpoint, **kw))
                    result = _run(pipe, task, items, cfg)
                    held = result.kv_report["summary"]["steady_managed_bytes"]
                    if method == "unicache":
                        unicache_bytes = held
                    path = StepPath(forced=full_path)
                    _run(pipe, task, items, cfg, RunHooks(steer=path))
                    per_method[method]["step"].append(round(fidelity_db(task, path, full_path), 4))
                    per_method[method]["free"].append(round(_free_fidelity(task, result, full), 4))
                    per_method[method]["held"].append(held)
            for method, values in per_method.items():
                row = {
                    "task": task,
                    "images": count,
                    "method": method,
                    "samples": cfg.samples,
                    "step_fidelity_db": round(statistics.fmean(values["step"]), 3),
                    "free_fidelity": round(statistics.fmean(values["free"]), 4),
                    "free_fidelity_metric": "image PSNR to full KV (dB)" if task == "edit" else "token agreement",
                    "held_ratio": round(statistics.fmean(h / f for h, f in zip(values["held"], full_held)), 4),
                    "per_sample_step_fidelity": values["step"],
                    "per_sample_free_fidelity": values["free"],
                }
                if method != "unicache" and "unicache" in per_method:
                    row["unicache_minus_this_step_db"] = paired_difference(
                        per_method["unicache"]["step"], values["step"]
                    )
                rows.append(row)
            logger.info("%s with %d images: %d samples in %.0f s", task, count, cfg.samples, time.perf_counter() - t0)
    config = asdict(cfg)
    config.update(
        checkpoint="models/bagel/unicache-shapes",
        note="the bundled model never saw two images in one request: these are fidelities to full KV, not scores",
        baselines="kv_target = UniCache's steady managed bytes of the same sample",
    )
    return {"config": config, "results": rows}


def format_table(report: dict) -> str:
    lines = [
        f"{'task':5s} {'img':>3s} {'method':13s} {'held':>6s} {'step dB':>8s} {'free':>7s}  UniCache - this (step dB)"
    ]
    for r in report["results"]:
        diff = r.get("unicache_minus_this_step_db")
        paired = "" if diff is None else f"{diff['mean']:+.2f} +- {diff['ci95']:.2f} {diff['verdict']}"
        lines.append(
            f"{r['task']:5s} {r['images']:3d} {r['method']:13s} {r['held_ratio']:6.3f} {r['step_fidelity_db']:8.2f} "
            f"{r['free_fidelity']:7.3f}  {paired}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog="python -m benchmarks.multi_image", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 samples, 2 images, 8 timesteps")
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--json", type=path_arg, default=None, help="write the JSON report here (and a .txt table)")
    parser.add_argument(
        "--methods",
        default=None,
        help="comma list of methods (unicache always runs first: the baselines take its bytes)",
    )
    args = parser.parse_args(argv)
    check_report_paths(parser, json_and_table(args.json))
    methods = None
    if args.methods is not None:
        allowed = [m for m in METHODS if m != "full"]
        items = [m.strip() for m in args.methods.split(",") if m.strip()]
        bad = [m for m in items if m not in allowed]
        if bad or not items:
            parser.error(f"--methods: unknown {bad or args.methods!r}; choose from {', '.join(allowed)}")
        methods = ("unicache", *dict.fromkeys(m for m in items if m != "unicache"))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    kw: dict = dict(QUICK) if args.quick else {}
    if args.samples is not None:
        if args.samples < 2:
            parser.error("--samples must be >= 2 (paired intervals need two)")
        kw["samples"] = args.samples
    if methods is not None:
        kw["methods"] = methods
    report = run(MultiImageConfig(**kw))
    table = format_table(report)
    logger.info("results\n%s", table)
    if args.json is not None:
        write_json_report(args.json, report)
        write_text_report(args.json.with_suffix(".txt"), table)


if __name__ == "__main__":
    main()
