"""Step time at BAGEL-7B-MoT's real geometry on a GPU: a 1024 px edit with and without TaylorSeer and UniCache.

``python -m benchmarks.gpu_taylorseer [--out DIR] [--size 1024] [--timesteps 50] [--weight-dtype fp8_e4m3fn]
[--offload none] [--json PATH] [--device cuda]``

The checkpoint is :mod:`benchmarks.real_size`'s (random weights at the official geometry, written in fp8 once,
14.6 GB; its transform rule keeps the ``--size`` source at its size). The model is loaded once; after an untimed
warm-up edit, four edits of the same ``--size`` px source run the official schedule (``--timesteps`` 50: 49 Euler
steps, CFG on the whole schedule, three branches per step): ``full``, ``full+taylorseer``, ``unicache`` and
``unicache+taylorseer`` (TaylorSeer at the official interval 3, first steps 5, order 6). Per row:

- ``step_seconds``: every denoising step's wall time, the device synchronized at each step's end (progress hook);
  ``computed_step_seconds`` / ``forecast_step_seconds``: their medians over the steps that run every branch's
  decoder (step 0 left out: the first compression runs in it) and over those that forecast every branch;
- ``denoise_seconds`` (the pipeline's ``info["denoise_s"]``), ``decoder_forwards`` and ``forecasts`` (summed over the
  branches), and ``speedup_vs_full`` / ``speedup_vs_method`` (the same method without TaylorSeer) of the denoising;
- ``denoise_peak_bytes``: the most allocated during the denoising phase (:class:`~benchmarks.phase_meter.PhaseMeter`),
  ``plan_bytes``: :func:`~unicache_core.bagel.memory.plan.plan_memory`'s peak for the same request (TaylorSeer's
  factors counted), ``taylorseer_peak_bytes``: the factors at their most;
- ``psnr_to_full`` (dB) of the image against the ``full`` row's.

``--device cpu`` with twin dimensions (:func:`run`'s ``llm``/``vit``) is the unit test's dry run.
"""

from __future__ import annotations

import gc
import logging
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from benchmarks.phase_meter import PhaseMeter
from benchmarks.real_size import DEFAULT_OUT, write_real_size_checkpoint
from benchmarks.report_file import check_report_paths, write_json_report
from unicache_commands.flags import OneLineParser, path_arg
from unicache_core.bagel import BagelPipeline, load_bagel, preset
from unicache_core.bagel.memory.plan import PlanSettings, plan_config, plan_memory, tensor_peak_bytes
from unicache_core.bagel.memory.trace import TensorMemoryTracker
from unicache_core.bagel.request import RunHooks
from unicache_core.bagel.weights import parameter_bytes
from unicache_core.compression import make_cache_factory

logger = logging.getLogger("benchmarks.gpu_taylorseer")
PROMPT = "make the background red"
#: The plan's name of each compute dtype.
PLAN_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
#: (row name, KV method, TaylorSeer on), in run order.
ROWS = (
    ("full", "full", False),
    ("full+taylorseer", "full", True),
    ("unicache", "unicache", False),
    ("unicache+taylorseer", "unicache", True),
)


def _source(size: int) -> Image.Image:
    """A ``size`` px source with some structure (a gradient and a disc)."""
    y, x = np.mgrid[0:size, 0:size] / size
    pixels = np.stack([200 * x + 30, 160 * y + 40, 120 + 80 * x * y], -1)
    pixels[(x - 0.4) ** 2 + (y - 0.6) ** 2 < 0.04] = (220, 40, 40)
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_edit(loaded, checkpoint: Path, size: int, timesteps: int, method: str, taylorseer: bool, *, meter=None):
    """One edit: ``(result, step seconds)``, the device synchronized at the end of every step."""
    device = loaded.device
    pipe = BagelPipeline(loaded, make_cache_factory(method, checkpoint_dir=str(checkpoint)))
    marks: list[float] = []

    def progress(done: int, total: int) -> None:
        _synchronize(device)
        marks.append(time.perf_counter())

    def phase(name: str) -> None:
        if name == "denoise":
            _synchronize(device)
            marks.append(time.perf_counter())
        if meter is not None:
            meter(name)

    settings = preset("edit", num_timesteps=timesteps, taylorseer=taylorseer)
    result = pipe.edit(PROMPT, _source(size), settings, seed=0, hooks=RunHooks(progress=progress, phase=phase))
    if meter is not None:
        meter.close()
    return result, [b - a for a, b in zip(marks, marks[1:])]


def _medians(report: dict, seconds: list[float]) -> tuple[float | None, float | None]:
    computed, forecast = [], []
    for record, elapsed in zip(report["steps"], seconds):
        if record["step"] == 0:
            continue
        if not record["forecast"]:
            computed.append(elapsed)
        elif len(record["forecast"]) == len(record["branches"]):
            forecast.append(elapsed)
    return (statistics.median(computed) if computed else None, statistics.median(forecast) if forecast else None)


def _psnr(a: Image.Image, b: Image.Image) -> float:
    mse = float(((np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)) ** 2).mean())
    return 100.0 if mse == 0 else min(100.0, 10 * math.log10(255.0**2 / mse))


def measure(loaded, checkpoint: Path, size: int, timesteps: int, *, weight_dtype: str, offload: str) -> list[dict]:
    """The four rows of the module docstring on one loaded model."""
    device = loaded.device
    timed_edit(loaded, checkpoint, size, 3, "full", False)  # warm-up: kernels, allocator, upcast buffers
    rows: list[dict] = []
    outputs = {}
    for name, method, taylorseer in ROWS:
        gc.collect()
        tracker = None if device.type == "cuda" else TensorMemoryTracker()
        meter = PhaseMeter(device, tracker, parameter_bytes(loaded.model) + parameter_bytes(loaded.vae))
        if tracker is None:
            result, seconds = timed_edit(loaded, checkpoint, size, timesteps, method, taylorseer, meter=meter)
        else:
            with torch.inference_mode(), tracker:
                result, seconds = timed_edit(loaded, checkpoint, size, timesteps, method, taylorseer, meter=meter)
        computed, forecast = _medians(result.kv_report, seconds)
        plan = plan_memory(
            plan_config(checkpoint),
            PlanSettings(
                task="edit",
                width=size,
                height=size,
                kv_method=method,
                weight_dtype=weight_dtype,
                dtype=PLAN_DTYPES[loaded.dtype],
                offload=offload,
                device=device.type,
                taylorseer=taylorseer,
            ),
            1 << 50,
            prompt_tokens=len(loaded.tokenizer.encode(PROMPT)),
        )
        row = {
            "row": name,
            "kv_method": method,
            "taylorseer": taylorseer,
            "size": list(result.image.size),
            "timesteps": timesteps,
            "step_seconds": [round(s, 4) for s in seconds],
            "computed_step_seconds": computed,
            "forecast_step_seconds": forecast,
            "denoise_seconds": round(result.info["denoise_s"], 3),
            "decoder_forwards": sum(result.info["forwards"].values()),
            "forecasts": sum(result.info.get("forecasts", {}).values()),
            "denoise_peak_bytes": meter.peak.get("denoise"),
            "peak_bytes": meter.overall_peak,
            "plan_bytes": tensor_peak_bytes(plan) if device.type != "cuda" else plan.peak_bytes,
            "plan_taylorseer_bytes": plan.breakdown.get("taylorseer", 0),
            "taylorseer_peak_bytes": result.info.get("taylorseer_peak_bytes", 0),
            "kv_bytes_per_branch": result.info["cache_bytes"],
        }
        outputs[name] = result.image
        full = rows[0] if rows else row
        row["speedup_vs_full"] = round(full["denoise_seconds"] / row["denoise_seconds"], 3)
        if taylorseer:
            plain = next(r for r in rows if r["row"] == method)
            row["speedup_vs_method"] = round(plain["denoise_seconds"] / row["denoise_seconds"], 3)
        row["psnr_to_full"] = round(_psnr(result.image, outputs["full"]), 3)
        rows.append(row)
        logger.info("%s", format_table([row]).splitlines()[-1])
        del result
    return rows


def run(
    out: Path,
    *,
    size: int = 1024,
    timesteps: int = 50,
    weight_dtype: str = "fp8_e4m3fn",
    offload: str = "none",
    device: str = "cuda",
    llm: dict | None = None,
    vit: dict | None = None,
    full_vae: bool = True,
) -> dict:
    """Write (if needed) and load the checkpoint, then the rows of :func:`measure`."""
    start = time.perf_counter()
    checkpoint = write_real_size_checkpoint(out, llm=llm, vit=vit, full_vae=full_vae, source_size=size)
    written = time.perf_counter()
    loaded = load_bagel(checkpoint, device=device, weight_dtype=weight_dtype, offload=offload)
    loaded_at = time.perf_counter()
    rows = measure(loaded, checkpoint, size, timesteps, weight_dtype=weight_dtype, offload=offload)
    info = {
        "device": device,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.device(device).type == "cuda" else None,
        "weight_dtype": weight_dtype,
        "offload": offload,
        "write_seconds": round(written - start, 1),
        "load_seconds": round(loaded_at - written, 1),
        "seconds": round(time.perf_counter() - start, 1),
    }
    return {"config": info, "results": rows}


def format_table(rows: list[dict]) -> str:
    def num(value, spec: str) -> str:
        return f"{'-':>8s}" if value is None else f"{value:8{spec}}"

    lines = [
        f"{'row':20s} {'px':>5s} {'fwd':>4s} {'fcst':>4s} {'denoise s':>9s} {'x full':>6s} {'x meth':>6s} "
        f"{'step s':>8s} {'fcst s':>8s} {'peak GB':>8s} {'plan GB':>8s} {'TS GB':>6s} {'PSNR':>6s}"
    ]
    for r in rows:
        lines.append(
            f"{r['row']:20s} {r['size'][0]:5d} {r['decoder_forwards']:4d} {r['forecasts']:4d} "
            f"{r['denoise_seconds']:9.2f} {r['speedup_vs_full']:6.2f} {r.get('speedup_vs_method', 1.0):6.2f} "
            f"{num(r['computed_step_seconds'], '.3f')} {num(r['forecast_step_seconds'], '.4f')} "
            f"{r['peak_bytes'] / 1e9:8.2f} {r['plan_bytes'] / 1e9:8.2f} {r['taylorseer_peak_bytes'] / 1e9:6.3f} "
            f"{r['psnr_to_full']:6.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m benchmarks.gpu_taylorseer", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="checkpoint folder (about 15 GB)")
    parser.add_argument("--size", type=int, default=1024, help="edit size in pixels (the source's)")
    parser.add_argument("--timesteps", type=int, default=50, help="num_timesteps (official 50)")
    parser.add_argument("--weight-dtype", default="fp8_e4m3fn", choices=("bf16", "fp8_e4m3fn", "fp8_e5m2", "int8"))
    parser.add_argument("--offload", default="none", choices=("none", "layers"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=path_arg, default=None)
    args = parser.parse_args(argv)
    check_report_paths(parser, [("--json", args.json, "JSON report")], checkpoints=[args.out])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("unicache_core.compression.registry").setLevel(logging.ERROR)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.stderr.write("error: --device cuda but no CUDA device is visible; run it on the GPU machine\n")
        return 2
    if args.timesteps < 2:
        parser.error(f"--timesteps must be >= 2, got {args.timesteps}")
    report = run(
        args.out,
        size=args.size,
        timesteps=args.timesteps,
        weight_dtype=args.weight_dtype,
        offload=args.offload,
        device=args.device,
    )
    sys.stdout.write(format_table(report["results"]) + "\n")
    if args.json is not None:
        write_json_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
