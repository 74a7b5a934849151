"""The memory plan against a real run at BAGEL-7B-MoT's geometry on a GPU, phase by phase.

``python -m benchmarks.gpu_real_size [--out DIR] [--size 1024] [--images N] [--weight-dtype fp8_e4m3fn]
[--offload none,layers] [--methods full,unicache] [--timesteps 3] [--taylorseer off,on] [--memory-cap 16GB]
[--json PATH] [--device cuda]``

``--images N`` edits with ``N`` sources of ``--size`` px in one request (the item list ``[image 1 .. image N, prompt]``:
``N - 1`` references and the edited image, issue #43), planned with the same ``N`` images. ``--layers L`` keeps
``L`` decoder and ViT layers at the real widths (hidden 3584, MLP 18944, 28/4 heads, vocab 152,064, SigLIP 1152):
with ``--device cpu`` that checks every per-layer figure of the plan against tensor accounting at BAGEL-7B-MoT's
geometry in a few GB (depth only scales the KV and the weights; docs/results/real_width_images.json).
``--taylorseer off,on`` measures each method without and with TaylorSeer (its factors fill to the official order 6
from about 21 timesteps: ``--timesteps``, 3 by default). ``--memory-cap`` caps what the process may allocate on the
card (``torch.cuda.set_per_process_memory_fraction``: a smaller card, e.g. a lowvram run with ``--offload layers``);
an edit that runs out of it is a row saying so (``out_of_memory``).

The checkpoint is :mod:`benchmarks.real_size`'s (random weights at the official geometry, written in fp8, 14.6 GB;
its transform rule keeps the ``--size`` source at its size). For each offload mode the model is loaded on the
device with ``--weight-dtype``, and each KV method edits a ``--size`` px source (3 timesteps, CFG on). A
:class:`PhaseMeter` on :attr:`RunHooks.phase <unicache_core.bagel.request.RunHooks.phase>` reads, for each
phase of the request (``contexts``: VAE encode and prefill; ``denoise``; ``decode``: the VAE decode), the bytes
allocated when it begins and the most reached inside it (CUDA: ``torch.cuda.memory_allocated`` and
``max_memory_allocated``). Each row puts the run's peak beside :func:`~unicache_core.bagel.memory.plan.plan_memory`'s
peak and breakdown for the same request, and (``decode_entry_tensors``) the largest tensors Python still
references when the decode begins, so a gap can be traced to what holds it. ``--replan REPORT`` plans a stored
report's rows again with the current plan (the measured bytes stay; no GPU needed).

``--device cpu`` with twin dimensions (:func:`run`'s ``llm``/``vit``) is the unit test's dry run: there the meter
counts the loaded parameters plus the tensors a :class:`~unicache_core.bagel.memory.trace.TensorMemoryTracker`
sees alive.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import sys
import time
from pathlib import Path

import torch
from PIL import Image

from benchmarks.phase_meter import PhaseMeter
from benchmarks.real_size import DEFAULT_OUT, edit_transform_rules, write_real_size_checkpoint
from benchmarks.report_file import check_report_paths, write_json_report
from unicache_commands.flags import OneLineParser, path_arg
from unicache_commands.input_files import parse_json, read_text_file
from unicache_core.bagel import BagelPipeline, load_bagel, preset
from unicache_core.bagel.config import BagelConfig
from unicache_core.bagel.memory.plan import (
    PlanSettings,
    official_config,
    plan_config,
    plan_memory,
    tensor_peak_bytes,
    tensor_phase_bytes,
)
from unicache_core.bagel.memory.trace import TensorMemoryTracker
from unicache_core.bagel.request import RunHooks
from unicache_core.bagel.transform_config import TRANSFORM_CONFIG_FILE, parse_transform_config
from unicache_core.bagel.weights import parameter_bytes
from unicache_core.compression import make_cache_factory
from unicache_core.sizes import parse_size

logger = logging.getLogger("benchmarks.gpu_real_size")
PROMPT = "make the background red"
TIMESTEPS = 3


def _plan(
    config: BagelConfig,
    size: int,
    method: str,
    weight_dtype: str,
    offload: str,
    device: torch.device,
    prompt_tokens: int,
    images: int = 1,
    taylorseer: bool = False,
):
    settings = PlanSettings(
        images=((size, size),) * images if images > 1 else (),
        task="edit",
        width=size,
        height=size,
        kv_method=method,
        weight_dtype=weight_dtype,
        dtype="bf16",
        offload=offload,
        device=device.type,
        taylorseer=taylorseer,
    )
    return plan_memory(config, settings, 1 << 50, prompt_tokens=prompt_tokens)


def meter_phases(planned: dict[str, int]) -> dict[str, int]:
    """The plan's phases (:attr:`~unicache_core.bagel.memory.plan.MemoryPlan.phases`) as the request's
    :attr:`RunHooks.phase` names them: ``contexts`` (the VAE encode and every item's prefill), ``denoise``,
    ``decode`` (the VAE's; an answer's decoding steps count as ``decode`` too)."""
    grouped: dict[str, int] = {}
    for name, size in planned.items():
        phase = "contexts" if name.startswith(("vae:encode", "prefill:")) else name.split(":")[0]
        phase = "decode" if phase == "vae" else phase
        grouped[phase] = max(grouped.get(phase, 0), size)
    return grouped


def real_size_config(size: int) -> BagelConfig:
    """BAGEL-7B-MoT's configuration with the transform rule :mod:`benchmarks.real_size` writes for ``size``."""
    rules = parse_transform_config(edit_transform_rules(size), Path(TRANSFORM_CONFIG_FILE))
    return dataclasses.replace(official_config(), transforms=rules)


def measure_edit(
    loaded,
    checkpoint: Path,
    size: int,
    method: str,
    *,
    weight_dtype: str,
    offload: str,
    images: int = 1,
    timesteps: int = TIMESTEPS,
    taylorseer: bool = False,
) -> dict:
    """One edit of ``images`` sources of ``size`` px with ``method`` (``timesteps``, with or without TaylorSeer): phase
    bytes, the run's peak and the plan's."""
    device = loaded.device
    pipe = BagelPipeline(loaded, make_cache_factory(method, checkpoint_dir=str(checkpoint)))
    sources = [Image.new("RGB", (size, size), (40 + (50 * i) % 200, 120, 200)) for i in range(images)]
    settings = preset("edit", num_timesteps=timesteps, taylorseer=taylorseer)

    def edit(hooks: RunHooks):
        if images == 1:  # the single-image call, as the rows before --images were measured
            return pipe.edit(PROMPT, sources[0], settings, hooks=hooks)
        return pipe.generate("edit", [*sources, PROMPT], settings, hooks=hooks)

    gc.collect()
    weights = [*loaded.model.parameters(), *loaded.model.buffers()]
    if loaded.vae is not None:
        weights += [*loaded.vae.parameters(), *loaded.vae.buffers()]
    tracker = None if device.type == "cuda" else TensorMemoryTracker(weights)  # views of a weight allocate nothing
    meter = PhaseMeter(device, tracker, parameter_bytes(loaded.model) + parameter_bytes(loaded.vae))
    start = time.perf_counter()
    if tracker is None:
        result = edit(RunHooks(phase=meter))
        meter.close()
    else:
        with torch.inference_mode(), tracker:
            result = edit(RunHooks(phase=meter))
            meter.close()
    seconds = time.perf_counter() - start
    plan = _plan(
        plan_config(checkpoint),
        size,
        method,
        weight_dtype,
        offload,
        device,
        len(loaded.tokenizer.encode(PROMPT)),
        images,
        taylorseer,
    )
    planned = tensor_peak_bytes(plan)  # on the CPU without the runtime's own memory, which the meter cannot see
    return {
        "kv_method": method,
        "weight_dtype": weight_dtype,
        "offload": offload,
        "size": list(result.image.size),
        "images": images,
        "timesteps": timesteps,
        "taylorseer": taylorseer,
        "denoise_seconds": round(result.info["denoise_s"], 3),
        "prompt_tokens": len(loaded.tokenizer.encode(PROMPT)),
        "peak_bytes": meter.overall_peak,
        "plan_bytes": planned,
        "plan_error": round(planned / meter.overall_peak - 1, 4),
        "phase_entry_bytes": meter.entry,
        "phase_peak_bytes": meter.peak,
        "kv_bytes_per_branch": result.info["cache_bytes"],
        "plan_breakdown": plan.breakdown,
        "plan_phase_bytes": meter_phases(tensor_phase_bytes(plan)),
        "plan_kv_held": plan.breakdown["kv_held"],
        "decode_entry_tensors": meter.decode_entry_tensors,
        "seconds": round(seconds, 2),
    }


def run(
    out: Path,
    *,
    size: int = 1024,
    weight_dtype: str = "fp8_e4m3fn",
    offloads=("none", "layers"),
    methods=("full", "unicache"),
    device: str = "cuda",
    llm: dict | None = None,
    vit: dict | None = None,
    full_vae: bool = True,
    images: int = 1,
    timesteps: int = TIMESTEPS,
    taylorseers=(False,),
    memory_cap: int | None = None,
) -> dict:
    """Write (if needed) the checkpoint, then one row per (offload, method, TaylorSeer) of an edit with ``images``
    sources; see the module docstring. ``memory_cap``: the bytes this process may allocate on the card
    (``torch.cuda.set_per_process_memory_fraction``, a smaller card's); a row that runs out of them says so."""
    checkpoint = write_real_size_checkpoint(out, llm=llm, vit=vit, full_vae=full_vae, source_size=size)
    if memory_cap is not None and torch.device(device).type == "cuda":
        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, memory_cap / total), torch.device(device))
    rows = []
    for offload in offloads:
        start = time.perf_counter()
        loaded = load_bagel(checkpoint, device=device, weight_dtype=weight_dtype, offload=offload)
        load_seconds = round(time.perf_counter() - start, 2)
        for method in methods:
            for taylorseer in taylorseers:
                row = _capped_row(
                    loaded, checkpoint, size, method, weight_dtype, offload, images, timesteps, taylorseer
                )
                row.update(load_seconds=load_seconds, memory_cap_bytes=memory_cap)
                logger.info("%s", format_table([row]).splitlines()[-1])
                rows.append(row)
        del loaded
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    info = {
        "device": device,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.device(device).type == "cuda" else None,
    }
    return {"config": info, "results": rows}


def _capped_row(loaded, checkpoint, size, method, weight_dtype, offload, images, timesteps, taylorseer) -> dict:
    """:func:`measure_edit`, or the row of an edit that ran out of CUDA memory (under a ``memory_cap``)."""
    try:
        return measure_edit(
            loaded, checkpoint, size, method, weight_dtype=weight_dtype, offload=offload, images=images,
            timesteps=timesteps, taylorseer=taylorseer,
        )  # fmt: skip
    except torch.cuda.OutOfMemoryError as exc:
        gc.collect()
        torch.cuda.empty_cache()
        return {
            "kv_method": method, "weight_dtype": weight_dtype, "offload": offload, "size": [size, size],
            "images": images, "timesteps": timesteps, "taylorseer": taylorseer,
            "out_of_memory": str(exc).splitlines()[0],
        }  # fmt: skip


def _prompt_tokens(row: dict) -> int:
    """The row's prompt length; rows written before it was recorded: the length whose plan holds the stored
    plan's full KV (the KV grows by one row per token, so exactly one length matches)."""
    if "prompt_tokens" in row:
        return int(row["prompt_tokens"])
    for tokens in range(1, 257):
        plan = _plan(
            real_size_config(row["size"][0]),
            row["size"][0],
            row["kv_method"],
            row["weight_dtype"],
            row["offload"],
            torch.device("cuda"),
            tokens,
        )
        if plan.breakdown["kv_full"] == row["plan_breakdown"]["kv_full"]:
            return tokens
    raise ValueError(f"no prompt length gives the stored plan's full KV ({row['plan_breakdown']['kv_full']} B)")


#: Largest ``--replan`` report read (the committed one is about 30 kB).
MAX_REPORT_BYTES = 16 << 20
#: Most rows and source images per row a ``--replan`` report may ask for (the committed one: 12 rows, 1 to 4 images).
MAX_REPLAN_ROWS = MAX_REPLAN_IMAGES = 1000
#: Each row's fields ``replan`` reads: a test of the value and what it must be.
_ROW_FIELDS = {
    "kv_method": (lambda v: v in ("full", "unicache"), "'full' or 'unicache'"),
    "weight_dtype": (lambda v: v in ("bf16", "fp8_e4m3fn", "fp8_e5m2", "int8"), "a --weight-dtype choice"),
    "offload": (lambda v: v in ("none", "layers"), "'none' or 'layers'"),
    "size": (lambda v: isinstance(v, list) and len(v) == 2 and all(_count(x, 1024) for x in v), "[px, px]"),
    "peak_bytes": (lambda v: _count(v, 1 << 50), "a byte count"),
}


def _count(value, most: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= most


def read_report(path: Path) -> dict:
    """The report ``--replan`` plans again: a regular JSON file of bounded size holding ``results``, the rows
    :func:`run` writes (each field :func:`replan` reads checked); a ValueError or OSError naming ``--replan`` and
    what is wrong, else."""
    label = f"--replan {path}"
    advice = "give a report python -m benchmarks.gpu_real_size --json wrote"
    report = parse_json(read_text_file(path, label=label, max_bytes=MAX_REPORT_BYTES, advice=advice), label=label)
    rows = report.get("results") if isinstance(report, dict) else None
    if not isinstance(rows, list) or not rows or len(rows) > MAX_REPLAN_ROWS:
        raise ValueError(
            f"{label}: not a report of this program (no list of 1 to {MAX_REPLAN_ROWS} 'results'); {advice}"
        )
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{label}: results[{i}] is {type(row).__name__}, not a row object; {advice}")
        checks = dict(_ROW_FIELDS)
        checks["images"] = (lambda v: _count(v, MAX_REPLAN_IMAGES), f"1 to {MAX_REPLAN_IMAGES}")
        if "prompt_tokens" in row:
            checks["prompt_tokens"] = (lambda v: _count(v, 1 << 20), "a token count")
        else:
            breakdown = row.get("plan_breakdown")
            kv_full = breakdown.get("kv_full") if isinstance(breakdown, dict) else None
            if not _count(kv_full, 1 << 50):
                raise ValueError(
                    f"{label}: results[{i}] has neither 'prompt_tokens' nor a plan_breakdown.kv_full; {advice}"
                )
        for name, (test, what) in checks.items():
            value = row.get(name, 1) if name == "images" else row.get(name)
            if not test(value):
                raise ValueError(f"{label}: results[{i}].{name} must be {what}, got {str(value)[:80]!r}; {advice}")
    return report


def replan(report: dict) -> dict:
    """``report`` (a CUDA run at BAGEL-7B-MoT's geometry) with every row's plan made again by the current
    :func:`~unicache_core.bagel.memory.plan.plan_memory`; the measured bytes are kept as they were."""
    rows = []
    for row in report["results"]:
        if "out_of_memory" in row:  # nothing measured to plan against
            rows.append(row)
            continue
        tokens = _prompt_tokens(row)
        plan = _plan(
            real_size_config(row["size"][0]),
            row["size"][0],
            row["kv_method"],
            row["weight_dtype"],
            row["offload"],
            torch.device("cuda"),
            tokens,
            row.get("images", 1),
            row.get("taylorseer", False),
        )
        rows.append(
            {
                **row,
                "prompt_tokens": tokens,
                "plan_bytes": plan.peak_bytes,
                "plan_breakdown": plan.breakdown,
                "plan_error": round(plan.peak_bytes / row["peak_bytes"] - 1, 4),
            }
        )
    return {**report, "results": rows, "replanned": True}


def format_table(rows: list[dict]) -> str:
    gb = 1e9
    lines = [
        f"{'weights':11s} {'offload':7s} {'method':9s} {'px':>5s} {'n':>3s} {'peak GB':>8s} {'plan GB':>8s} "
        f"{'err':>7s} {'ctx GB':>7s} {'denoise':>8s} {'decode':>7s} {'dec in':>7s} {'TS':>2s}"
    ]
    for r in rows:
        head = (
            f"{r['weight_dtype']:11s} {r['offload']:7s} {r['kv_method']:9s} {r['size'][0]:5d} {r.get('images', 1):3d} "
        )
        if "out_of_memory" in r:
            lines.append(head + f"out of memory: {r['out_of_memory'][:60]}")
            continue
        p, e = r["phase_peak_bytes"], r["phase_entry_bytes"]
        lines.append(
            head + f"{r['peak_bytes'] / gb:8.2f} {r['plan_bytes'] / gb:8.2f} {r['plan_error']:+7.1%} "
            f"{p.get('contexts', 0) / gb:7.2f} {p.get('denoise', 0) / gb:8.2f} {p.get('decode', 0) / gb:7.2f} "
            f"{e.get('decode', 0) / gb:7.2f} {'on' if r.get('taylorseer') else '':>2s}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m benchmarks.gpu_real_size", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="checkpoint folder (about 15 GB)")
    parser.add_argument("--size", type=int, default=1024, help="edit size in pixels (the source's)")
    parser.add_argument("--images", type=int, default=1, help="source images of --size px in the edit request")
    parser.add_argument(
        "--layers", type=int, default=None, help="keep this many decoder and ViT layers (real widths; default: all)"
    )
    parser.add_argument("--weight-dtype", default="fp8_e4m3fn", choices=("bf16", "fp8_e4m3fn", "fp8_e5m2", "int8"))
    parser.add_argument("--offload", default="none,layers", help="comma-separated offload modes")
    parser.add_argument("--methods", default="full,unicache", help="comma-separated KV methods")
    parser.add_argument("--timesteps", type=int, default=TIMESTEPS, help="num_timesteps of each edit")
    parser.add_argument("--taylorseer", default="off", help="comma-separated: off, on (TaylorSeer's official rule)")
    parser.add_argument(
        "--memory-cap", default=None, help="the most this process may allocate on the card, e.g. 16GB (a smaller card)"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=path_arg, default=None)
    parser.add_argument(
        "--replan",
        type=Path,
        default=None,
        metavar="REPORT",
        help="plan a stored report's rows again with the current plan (no GPU needed) and print them",
    )
    args = parser.parse_args(argv)
    check_report_paths(
        parser, [("--json", args.json, "JSON report")], inputs=[("--replan", args.replan)], checkpoints=[args.out]
    )
    taylorseers = tuple(dict.fromkeys(args.taylorseer.split(",")))
    if not set(taylorseers) <= {"off", "on"} or args.timesteps < 2:
        parser.error(f"--taylorseer takes off and on, --timesteps 2 or more; got {args.taylorseer}, {args.timesteps}")
    try:
        cap = None if args.memory_cap is None else parse_size(args.memory_cap, "--memory-cap", example="16GB")
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.replan is not None:
        try:
            report = replan(read_report(args.replan))
        except (OSError, ValueError) as exc:
            parser.error(str(exc))
        sys.stdout.write(format_table(report["results"]) + "\n")
        if args.json is not None:
            write_json_report(args.json, report)
        return 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.stderr.write("error: --device cuda but no CUDA device is visible; run it on the GPU machine\n")
        return 2
    report = run(
        args.out,
        size=args.size,
        weight_dtype=args.weight_dtype,
        offloads=tuple(args.offload.split(",")),
        methods=tuple(args.methods.split(",")),
        device=args.device,
        images=args.images,
        timesteps=args.timesteps,
        taylorseers=tuple(name == "on" for name in taylorseers),
        memory_cap=cap,
        llm=None if args.layers is None else {"num_hidden_layers": args.layers, "max_window_layers": args.layers},
        vit=None if args.layers is None else {"num_hidden_layers": args.layers + 1},  # the last one is dropped
    )
    sys.stdout.write(format_table(report["results"]) + "\n")
    if args.json is not None:
        write_json_report(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
