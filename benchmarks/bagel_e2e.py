"""End-to-end benchmark: every task x every KV method through the real BAGEL pipeline, in one run.

``python -m benchmarks.bagel_e2e [--quick] [--json PATH] [--checkpoints medium,tiny] [--images 1,2,4,8]``

``--images``: the image counts of the und and edit requests (one row group each; the images are distinct
pictures, all given before the prompt, as the official ``interleave_inference`` takes them): at the medium
checkpoint's 512 px an image is about 2.3K KV tokens per branch, so 8 images reach the UniCache paper's regime of
~20K KV tokens per attention branch.

Per (checkpoint, task): ``full`` first, then ``unicache`` (its own schedule), ``unicache_memory`` (its ``memory``
objective), ``unicache_evict`` (every candidate type evicted: :func:`evict_table`), ``unicache_joint`` (the same
method with every candidate type ``joint``: rows kept by score at the bits of :data:`JOINT_PLAN` for its
budget level, docs/compression.md §11.3; the plan is not calibrated, since these weights are random: the
row measures the mode's bytes, attended rows and overhead), then every baseline at UniCache's achieved
steady managed bytes of the same run (``kv_target`` in bytes). Weights are random
(no trained BAGEL runs here), so fidelity shows each method's distortion, not task quality; bytes and
time do not depend on the values. Clocks come from the caches' own reports:

- ``attention_seconds_median``: the median over the compressed steps of the time inside the caches'
  attention calls (all layers and branches of the step; statistics and allocation excluded);
- ``step_seconds_median``: the median whole step (denoising step, or decoded token for und);
- ``attended_ratio_vs_full``: rows full KV attends / rows this method attends, the CPU ceiling of the
  attention speedup (exact attention costs the same per attended row, dequantized or not);
- ``step_ceiling = 1 / ((1 - share) + share / attended_ratio)`` with ``share`` = full KV's attention
  share of its step (Amdahl: only attention shrinks);
- ``overhead_fraction``: sum(statistics + allocation) / sum(step) over the compressed steps;
- ``kv_bytes_peak`` beside ``kv_bytes_steady``: the KV every branch holds together at its peak (when the first step
  begins, the context filled; rows shared by branches counted once) and after compression, and
  ``kv_peak_ratio_vs_full``: full KV's peak over this method's (the table's ``full/peak``).

Time it with nothing else running on the machine.
"""

from __future__ import annotations

import logging
import math
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from benchmarks.report_file import check_report_paths, json_and_table, write_json_report, write_text_report
from training.tiny import write_tiny_checkpoint
from unicache_commands.flags import OneLineParser, path_arg
from unicache_core.bagel import BagelPipeline, load_bagel, preset
from unicache_core.compression import METHODS, PolicyTable, make_cache_factory, paper_policy_table
from unicache_core.compression.family import JointPlan
from unicache_core.kv.token_types import THINK

from .medium import write_medium_checkpoint

logger = logging.getLogger("benchmarks.bagel_e2e")
TASKS = ("und", "t2i", "edit")
_PIPE_TASK = {"und": "understanding", "t2i": "t2i", "edit": "edit"}
#: The joint row's bits per budget level (every candidate type): 8-bit rows while a type keeps at least a
#: quarter of its bytes, 4-bit down to 12%, 2-bit below.
JOINT_PLAN = JointPlan(((0.25, 8), (0.12, 4), (0.06, 2)))
JOINT_ROW = "unicache_joint"
#: UniCache with its ``memory`` objective (docs/compression.md §11.19) beside its default ``speed``.
MEMORY_ROW = "unicache_memory"
#: UniCache with every candidate type evicted (its budgets, protected rows and merging; nothing held at low bits):
#: the setting for speed where many images fill the context (docs/compression.md §11.19).
EVICT_ROW = "unicache_evict"


def joint_table() -> PolicyTable:
    """The paper table's (task, type) pairs, every one ``joint`` with :data:`JOINT_PLAN`, for any model."""
    paper = paper_policy_table()
    return PolicyTable(
        entries={key: "joint" for key in paper.entries},
        plans={key: JOINT_PLAN for key in paper.entries},
        source="calibrated",
        measurements={"purpose": "benchmarks.bagel_e2e: the joint mode with a fixed plan"},
    )


def evict_table() -> PolicyTable:
    """The paper table's (task, type) pairs, every one ``evict`` (the paper's strengths), for any model."""
    paper = paper_policy_table()
    return PolicyTable(
        entries={key: "evict" for key in paper.entries},
        strengths=dict(paper.strengths),
        source="calibrated",
        measurements={"purpose": "benchmarks.bagel_e2e: every candidate type evicted"},
    )


@dataclass
class E2EConfig:
    checkpoints: tuple[str, ...] = ("medium", "tiny")
    tasks: tuple[str, ...] = TASKS
    methods: tuple[str, ...] = tuple(METHODS)
    steps: int = 12  # denoising steps (num_timesteps = steps + 1), same schedule shape as the official 50
    decode_tokens: int = 24  # understanding: fixed number of decoded tokens
    edit_size: int = 512  # source image side (medium transforms keep 512)
    images: tuple[int, ...] = (1,)  # input images of the und and edit requests (one row group per count)
    t2i_size: int = 256
    seed: int = 42
    threads: int = 0
    work_dir: str = ""
    prompt: str = (
        "replace the small blue square in the upper left corner by a large red circle and make the "
        "background a soft gradient from yellow to green while keeping every other object unchanged"
    )
    question: str = "Describe the objects in this picture, their colours and where they are."
    extra: dict = field(default_factory=dict)


QUICK = dict(checkpoints=("medium", "tiny"), steps=6, decode_tokens=8, edit_size=384, t2i_size=192)


def _source_image(size: int, seed: int) -> Image.Image:
    """A deterministic picture: coloured rectangles and discs on a gradient (structure for the ViT/VAE)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    img = np.stack([200 * x + 30, 160 * y + 40, 120 + 80 * x * y], -1)
    for _ in range(6):
        cx, cy, r = rng.uniform(0.15, 0.85), rng.uniform(0.15, 0.85), rng.uniform(0.05, 0.18)
        colour = rng.integers(0, 255, 3)
        mask = (
            (np.abs(x - cx) < r) & (np.abs(y - cy) < r) if rng.random() < 0.5 else (x - cx) ** 2 + (y - cy) ** 2 < r * r
        )
        img[mask] = colour
    return Image.fromarray(img.clip(0, 255).astype(np.uint8))


def _psnr(a: Image.Image, b: Image.Image) -> float:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    mse = float(((x - y) ** 2).mean())
    return float("inf") if mse == 0 else 10 * math.log10(255.0**2 / mse)


def _run(
    pipe: BagelPipeline, task: str, cfg: E2EConfig, image: Image.Image | list[Image.Image]
) -> tuple[object, torch.Tensor | None]:
    """One request of ``task``: ``image`` one source, or a list (several images, then the prompt)."""
    first_logits = []
    model = pipe.loaded.model
    original = model.lm_logits

    def capture(hidden):
        out = original(hidden)
        if not first_logits:
            first_logits.append(out.detach().float().clone())
        return out

    if task == "und":
        model.lm_logits = capture
        und = preset("understanding", max_new_tokens=cfg.decode_tokens)
        try:
            if isinstance(image, list):
                result = pipe.understand_items([*image, cfg.question], und)
            else:
                result = pipe.understand(cfg.question, image, und)
        finally:
            del model.lm_logits
        return result, first_logits[0][0] if first_logits else None
    if task == "t2i":
        settings = preset("t2i", width=cfg.t2i_size, height=cfg.t2i_size, num_timesteps=cfg.steps + 1)
        return pipe.text_to_image(cfg.prompt, settings, seed=cfg.seed), None
    edit = preset("edit", num_timesteps=cfg.steps + 1)
    if isinstance(image, list):
        return pipe.generate("edit", [*image, cfg.prompt], edit, seed=cfg.seed), None
    return pipe.edit(cfg.prompt, image, edit, seed=cfg.seed), None


def _compressed_steps(report: dict) -> list[dict]:
    steps = [s for s in report["steps"] if THINK not in s["branches"]]
    first = report["summary"].get("first_compressed_step")
    if report["method"] == "full" or first is None:
        return steps[1:] if len(steps) > 1 else steps  # the same steps the compressed methods are timed on
    return [s for s in steps if s["step"] > first] or steps[-1:]


def _row(checkpoint: str, task: str, method: str, result, report: dict, full: dict | None, images: int = 1) -> dict:
    summ = report["summary"]
    steps = _compressed_steps(report)
    attn = [s["attention_s"] for s in steps]
    step_t = [s["step_s"] for s in steps]
    rows = sum(b["attended_rows"] for s in steps for b in s["branches"].values())
    row = {
        "task": task,
        "checkpoint": checkpoint,
        "method": method,
        "images": images,
        "kv_bytes_peak": summ["peak_bytes"],
        "kv_bytes_steady": summ["steady_managed_bytes"],
        "full_kv_bytes": summ["full_managed_bytes"],
        "protected_bytes": summ["protected_bytes"],
        "rho_mean": summ["rho_mean"],
        "attended_rows": rows,
        "attention_seconds_median": statistics.median(attn),
        "step_seconds_median": statistics.median(step_t),
        "overhead_fraction": (sum(s["stats_s"] + s["alloc_s"] for s in steps) / max(1e-12, sum(step_t))),
        "budget_ratio": summ.get("budget_ratio"),
        "target_ratio": summ.get("target_ratio"),
        "achieved_ratio": summ["achieved_ratio"],
        "flags": summ["flags"],
        "budget_met": None,
        "fidelity": {},
    }
    if method in ("unicache", MEMORY_ROW, EVICT_ROW, JOINT_ROW) and summ["rho_mean"]:
        row["budget_met"] = summ["full_managed_bytes"] / max(1, summ["steady_managed_bytes"]) >= 0.98 / summ["rho_mean"]
    elif method != "full" and summ.get("target_ratio"):
        row["budget_met"] = summ["achieved_ratio"] <= summ["target_ratio"] + 1e-9
    return row


def _finish(row: dict, full_row: dict, result, full_result, logits, full_logits, task: str) -> None:
    row["attended_ratio_vs_full"] = full_row["attended_rows"] / max(1, row["attended_rows"])
    # the KV held at its peak (what decides the device memory) against full KV's peak, beside the steady ratio
    row["kv_peak_ratio_vs_full"] = full_row["kv_bytes_peak"] / max(1, row["kv_bytes_peak"])
    row["attention_speedup_vs_full"] = full_row["attention_seconds_median"] / row["attention_seconds_median"]
    row["speedup_vs_full"] = full_row["step_seconds_median"] / row["step_seconds_median"]
    share = full_row["attention_seconds_median"] / full_row["step_seconds_median"]
    row["attention_share_full"] = share
    row["step_ceiling"] = 1.0 / ((1.0 - share) + share / row["attended_ratio_vs_full"])
    if task == "und":
        a, b = result.token_ids, full_result.token_ids
        n = max(len(a), len(b), 1)
        row["fidelity"] = {
            "token_agreement": sum(x == y for x, y in zip(a, b)) / n,
            "first_token_logit_rel_error": (
                float((logits - full_logits).norm() / full_logits.norm())
                if logits is not None and full_logits is not None
                else None
            ),
        }
    else:
        x, y = result.latents.flatten().float(), full_result.latents.flatten().float()
        row["fidelity"] = {
            "latent_cosine": float(torch.nn.functional.cosine_similarity(x, y, dim=0)),
            "image_psnr_db": _psnr(result.image, full_result.image),
        }


def run(cfg: E2EConfig) -> dict:
    saved = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    work = Path(cfg.work_dir) if cfg.work_dir else Path(tempfile.gettempdir()) / "unicache_e2e"
    results = []
    ckpt_info = {}
    try:
        for name in cfg.checkpoints:
            path = (
                write_medium_checkpoint(work / "medium")
                if name == "medium"
                else write_tiny_checkpoint(work / "tiny", force=True)
            )
            loaded = load_bagel(path, dtype=torch.float32)
            llm = loaded.config.llm
            ckpt_info[name] = {
                "hidden": llm.hidden_size,
                "layers": llm.num_hidden_layers,
                "heads": llm.num_attention_heads,
                "kv_heads": llm.num_key_value_heads,
                "head_dim": llm.head_dim,
            }
            image = _source_image(cfg.edit_size, cfg.seed)
            requests = [(task, 1) for task in cfg.tasks if task == "t2i" or 1 in cfg.images] + [
                (task, n) for n in cfg.images if n > 1 for task in cfg.tasks if task != "t2i"
            ]
            for task, count in requests:
                sources = image if count == 1 else [_source_image(cfg.edit_size, cfg.seed + i) for i in range(count)]
                full_result, full_logits = None, None
                full_row = None
                unicache_steady = None
                ours = ("unicache", MEMORY_ROW, EVICT_ROW, JOINT_ROW)
                order = ["full", *ours] + [m for m in cfg.methods if m not in ("full", "unicache")]
                runs = [
                    m for m in order if m in cfg.methods or m == "full" or (m in ours and "unicache" in cfg.methods)
                ]
                for method in runs:
                    kw = {}
                    if method not in ("full", *ours) and unicache_steady:
                        kw["kv_target"] = int(unicache_steady)  # memory matched to UniCache in this run
                    if method == JOINT_ROW:
                        kw["policy"] = joint_table()
                    if method == EVICT_ROW:
                        kw["policy"] = evict_table()
                    if method == MEMORY_ROW:
                        kw["objective"] = "memory"
                    factory = make_cache_factory(
                        "unicache" if method in ours else method, checkpoint_dir=str(path), **kw
                    )
                    pipe = BagelPipeline(loaded, factory)
                    t0 = time.perf_counter()
                    result, logits = _run(pipe, task, cfg, sources)
                    report = result.kv_report
                    row = _row(name, task, method, result, report, full_row, count)
                    row["kv_tokens_per_branch"] = result.info["context_tokens"]
                    row["wall_seconds"] = time.perf_counter() - t0
                    if method == "full":
                        full_result, full_logits, full_row = result, logits, row
                    if method == "unicache":
                        unicache_steady = report["summary"]["steady_managed_bytes"]
                    _finish(row, full_row, result, full_result, logits, full_logits, task)
                    results.append(row)
                    logger.info(
                        "%s %s x%d %-12s steady %s / %s B, attn x%.2f (ceiling %.2f), step x%.2f (ceiling %.2f)",
                        name,
                        task,
                        count,
                        method,
                        row["kv_bytes_steady"],
                        row["full_kv_bytes"],
                        row["attention_speedup_vs_full"],
                        row["attended_ratio_vs_full"],
                        row["speedup_vs_full"],
                        row["step_ceiling"],
                    )
    finally:
        torch.set_num_threads(saved)
    config = asdict(cfg)
    config.update(
        threads=torch.get_num_threads() if not cfg.threads else cfg.threads,
        checkpoint_geometry=ckpt_info,
        dtype="float32",
        device="cpu",
        weights="random (generated)",
        memory_matching="baselines: kv_target = UniCache's steady managed bytes of the same run",
    )
    return {"config": config, "results": results}


def format_table(report: dict) -> str:
    head = (
        f"{'ckpt':7s} {'task':5s} {'img':>3s} {'method':14s} {'full/steady':>11s} {'steady MB':>9s} {'peak MB':>8s} "
        f"{'full/peak':>9s} {'rho':>5s} "
        f"{'attn x':>7s} {'rows x':>7s} {'step x':>7s} {'ceil':>6s} {'ovh':>6s}  fidelity"
    )
    lines = [head]
    for r in report["results"]:
        ratio = r["full_kv_bytes"] / max(1, r["kv_bytes_steady"] or 1)
        fid = (
            ", ".join(f"{k}={v:.4g}" for k, v in r["fidelity"].items() if isinstance(v, (int, float)))
            if r["fidelity"]
            else ""
        )
        rho = "" if r["rho_mean"] is None else f"{r['rho_mean']:.2f}"
        flag = " [flagged]" if r["flags"] else ""
        lines.append(
            f"{r['checkpoint']:7s} {r['task']:5s} {r.get('images', 1):3d} {r['method']:14s} {ratio:11.2f} "
            f"{(r['kv_bytes_steady'] or 0) / 1e6:9.2f} {r['kv_bytes_peak'] / 1e6:8.2f} "
            f"{r.get('kv_peak_ratio_vs_full', 1.0):9.2f} {rho:>5s} "
            f"{r['attention_speedup_vs_full']:7.2f} {r['attended_ratio_vs_full']:7.2f} "
            f"{r['speedup_vs_full']:7.2f} {r['step_ceiling']:6.2f} {r['overhead_fraction']:6.3f}  {fid}{flag}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog="python -m benchmarks.bagel_e2e", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and smaller images (<= 3 min)")
    parser.add_argument("--json", type=path_arg, default=None, help="write the JSON report here")
    parser.add_argument("--checkpoints", default=None, help="comma list: medium,tiny")
    parser.add_argument("--tasks", default=None, help="comma list: und,t2i,edit")
    parser.add_argument("--methods", default=None, help="comma list of methods (full is always run)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--images", default=None, help="comma list of image counts of und and edit (default 1)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--work-dir", default="", help="where the generated checkpoints are written (reused)")
    args = parser.parse_args(argv)
    check_report_paths(parser, json_and_table(args.json))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("unicache_core.compression.registry").setLevel(logging.ERROR)
    kw: dict = dict(QUICK) if args.quick else {}
    for name in ("checkpoints", "tasks", "methods"):
        value = getattr(args, name)
        if value:
            items = tuple(v.strip() for v in value.split(",") if v.strip())
            allowed = {"checkpoints": ("medium", "tiny"), "tasks": TASKS, "methods": tuple(METHODS)}[name]
            bad = [v for v in items if v not in allowed]
            if bad:
                parser.error(f"--{name}: unknown {bad}; choose from {', '.join(allowed)}")
            kw[name] = items
    if args.images:
        try:
            counts = tuple(int(v) for v in args.images.split(",") if v.strip())
        except ValueError:
            parser.error(f"--images: {args.images!r} is not a comma list of counts like 1,2,4")
        if not counts or min(counts) < 1 or max(counts) > 16:
            parser.error(f"--images: counts must be 1..16, got {args.images!r}")
        kw["images"] = counts
    if args.steps is not None:
        if args.steps < 2:
            parser.error("--steps must be >= 2")
        kw["steps"] = args.steps
    cfg = E2EConfig(threads=args.threads, work_dir=args.work_dir, **kw)
    report = run(cfg)
    table = format_table(report)
    logger.info("results\n%s", table)
    if args.json is not None:
        write_json_report(args.json, report)
        write_text_report(args.json.with_suffix(".txt"), table)


if __name__ == "__main__":
    main()
