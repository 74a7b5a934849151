"""GPU check (<= 5 min on one GPU): every KV method on the medium checkpoint in bf16 on CUDA.

``python -m benchmarks.gpu_check [--json PATH] [--device cuda] [--steps 8]``

Per task and method: agreement of the CUDA bf16 result with CPU fp32 full KV (latent cosine / token
agreement), the peak CUDA memory of the run (``torch.cuda.max_memory_allocated``) next to the memory plan's
peak for the same request (``planned_peak_bytes``), the KV report's steady
and peak bytes, and the median step and attention time (clocks synchronised). On CUDA, attention over
compressed caches uses the fused kernels that return the LSE (flash for bf16), so KIVI-style segments
are dequantized chunk-wise and attended there. ``--device cpu --checkpoint tiny`` is a dry run of the
script itself.
"""

from __future__ import annotations

import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.report_file import check_report_paths, write_json_report
from training.tiny import write_tiny_checkpoint
from unicache_commands.flags import OneLineParser, path_arg
from unicache_core.bagel import BagelPipeline, load_bagel, preset
from unicache_core.bagel.memory.plan import PlanSettings, plan_config, plan_memory
from unicache_core.compression import METHODS, make_cache_factory

from .bagel_e2e import _source_image
from .medium import write_medium_checkpoint

logger = logging.getLogger("benchmarks.gpu_check")


PROMPTS = {
    "und": "Describe the objects in this picture.",
    "t2i": "a red circle above a blue square",
    "edit": "make the red circle green",
}
ANSWER_TOKENS = 16
T2I_SIZE = 256


def _task(pipe, task, image, steps):
    if task == "und":
        return pipe.understand(PROMPTS[task], image, preset("understanding", max_new_tokens=ANSWER_TOKENS))
    if task == "t2i":
        return pipe.text_to_image(
            PROMPTS[task], preset("t2i", width=T2I_SIZE, height=T2I_SIZE, num_timesteps=steps + 1), seed=42
        )
    return pipe.edit(PROMPTS[task], image, preset("edit", num_timesteps=steps + 1), seed=42)


def _planned_peak(path, loaded, task: str, method: str, image) -> int:
    """The memory plan's peak (``python -m unicache_core.bagel plan``) for this request on CUDA in bf16."""
    width, height = (T2I_SIZE, T2I_SIZE) if task == "t2i" else image.size
    settings = PlanSettings(task=task, width=width, height=height, kv_method=method, dtype="bf16", device="cuda")
    plan = plan_memory(
        plan_config(path),
        settings,
        1 << 40,
        prompt_tokens=len(loaded.tokenizer.encode(PROMPTS[task])),
        answer_tokens=ANSWER_TOKENS if task == "und" else None,
    )
    return plan.peak_bytes


def _agreement(task, result, ref) -> float:
    if task == "und":
        a, b = result.token_ids, ref.token_ids
        return sum(x == y for x, y in zip(a, b)) / max(len(a), len(b), 1)
    x, y = result.latents.flatten().float().cpu(), ref.latents.flatten().float().cpu()
    return float(torch.nn.functional.cosine_similarity(x, y, dim=0))


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--checkpoint", choices=("medium", "tiny"), default="medium")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", type=path_arg, default=None)
    args = parser.parse_args(argv)
    check_report_paths(parser, [("--json", args.json, "JSON report")])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("unicache_core.compression.registry").setLevel(logging.ERROR)
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.stderr.write(
            "error: --device cuda but no CUDA device is visible; run it on the GPU machine or pass "
            "--device cpu for a dry run\n"
        )
        return 2
    work = Path(tempfile.gettempdir()) / "unicache_gpu_check"
    path = (
        write_medium_checkpoint(work / "medium")
        if args.checkpoint == "medium"
        else write_tiny_checkpoint(work / "tiny", force=True)
    )
    image = _source_image(384, 0)
    cpu = load_bagel(path, dtype=torch.float32)
    dtype = torch.bfloat16 if cuda else torch.float32
    dev = load_bagel(path, dtype=dtype, device=args.device)
    rows = []
    t_start = time.perf_counter()
    for task in ("und", "t2i", "edit"):
        ref = _task(BagelPipeline(cpu), task, image, args.steps)
        for method in METHODS:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            factory = make_cache_factory(method, sync_timing=cuda)
            result = _task(BagelPipeline(dev, factory), task, image, args.steps)
            report = result.kv_report
            steps = report["steps"][1:] or report["steps"]
            rows.append(
                {
                    "task": task,
                    "method": method,
                    "device": args.device,
                    "dtype": str(dtype).replace("torch.", ""),
                    "agreement_vs_cpu_fp32_full": _agreement(task, result, ref),
                    "cuda_peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                    "planned_peak_bytes": _planned_peak(path, dev, task, method, image),
                    "kv_bytes_steady": report["summary"]["steady_managed_bytes"],
                    "kv_bytes_peak": report["summary"]["peak_bytes"],
                    "full_kv_bytes": report["summary"]["full_managed_bytes"],
                    "step_seconds_median": statistics.median(s["step_s"] for s in steps),
                    "attention_seconds_median": statistics.median(s["attention_s"] for s in steps),
                }
            )
            logger.info(
                "%s %-12s agreement %.4f, steady %s / %s B, step %.3fs",
                task,
                method,
                rows[-1]["agreement_vs_cpu_fp32_full"],
                rows[-1]["kv_bytes_steady"],
                rows[-1]["full_kv_bytes"],
                rows[-1]["step_seconds_median"],
            )
    out = {
        "config": {
            "checkpoint": args.checkpoint,
            "steps": args.steps,
            "device": args.device,
            "gpu": torch.cuda.get_device_name() if cuda else None,
            "torch": torch.__version__,
            "seconds": time.perf_counter() - t_start,
        },
        "results": rows,
    }
    if args.json is not None:
        write_json_report(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
