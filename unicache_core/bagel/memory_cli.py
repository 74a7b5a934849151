"""The command line's memory options: how the weights are stored (``--weight-dtype``) and placed (``--offload``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .checkpoint.loader import OFFLOAD_MODES
from .weights import WEIGHT_DTYPES


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--weight-dtype`` and ``--offload`` to ``parser``."""
    parser.add_argument(
        "--weight-dtype",
        choices=list(WEIGHT_DTYPES),
        default="auto",
        help="storage of the LLM/ViT Linear and Embedding weights, upcast to --dtype at each call: "
        "auto (= --dtype), bf16, fp16, fp32, fp8_e4m3fn, fp8_e5m2 (one scale per row) or "
        "int8 (weight-only, one scale per row); fp8/int8 halve the weights' memory",
    )
    parser.add_argument(
        "--offload",
        choices=list(OFFLOAD_MODES),
        default="none",
        help="layers: keep the decoder layers in host memory and bring each to --device as it runs",
    )


def add_plan_parser(sub) -> None:
    """The ``plan`` subcommand: the predicted peak device memory of a run, before anything is downloaded or loaded."""
    from .memory_plan import OFFICIAL_CHECKPOINT, PLAN_TASKS
    from .settings import T2I_DEFAULTS

    p = sub.add_parser("plan", help="predict the peak device memory of a run and whether it fits")
    p.add_argument(
        "--checkpoint",
        default=None,
        help=f"checkpoint folder, or {OFFICIAL_CHECKPOINT} for BAGEL-7B-MoT's geometry (no files needed)",
    )
    p.add_argument("--task", choices=sorted(PLAN_TASKS), required=True)
    p.add_argument("--width", type=int, default=1024, help="image width (und/edit: the input, t2i: the output)")
    p.add_argument("--height", type=int, default=1024)
    p.add_argument("--kv-method", default="full")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument(
        "--device",
        default="auto",
        help="the device whose memory is planned for ('auto': cuda if any, and with --device-memory a GPU; "
        "cpu adds the CPU runtime's own memory)",
    )
    p.add_argument("--device-memory", default=None, help="plan for a device of this size instead (e.g. 24GB)")
    p.add_argument("--json", type=Path, default=None, help="also write the plan as JSON here")
    p.add_argument("-q", "--quiet", action="store_true", help="no log output")
    p.add_argument("--taylorseer", action="store_true", help="t2i/edit with TaylorSeer: count its factors")
    p.add_argument("--taylorseer-order", type=int, default=T2I_DEFAULTS.taylorseer_order)
    add_memory_arguments(p)


def run_plan(args: argparse.Namespace) -> int:
    """``plan``: print the plan (and write ``--json``); exit status 0 whether or not it fits."""
    import json
    import sys

    plan = _plan_of(args, args.checkpoint, args.task, args.width, args.height, args.device_memory)
    sys.stdout.write(describe(plan) + "\n")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(plan.to_json(), indent=1) + "\n", encoding="utf-8")
    return 0


def refuse_unfitting_run(args: argparse.Namespace, checked) -> None:
    """Before a run loads anything: raise a one-line ValueError when its plan does not fit the device."""
    if args.command == "t2i":
        width, height = checked.settings.width, checked.settings.height
    elif checked.image is not None:
        width, height = checked.image.size
    else:
        width = height = 0
    task = {"understand": "und"}.get(args.command, args.command)
    plan = _plan_of(args, args.checkpoint, task, width, height, None, device=checked.device)
    if not plan.fits:
        raise ValueError(
            f"this run needs about {plan.peak_bytes / 1e9:.1f} GB on {checked.device} (planned), which has "
            f"{plan.device_bytes / 1e9:.1f} GB; {plan.suggestion} (details: python -m unicache_core.bagel plan)"
        )


def _plan_of(args, checkpoint, task: str, width: int, height: int, device_memory: str | None, *, device=None):
    import torch

    from .cli_checks import resolve_device
    from .memory_plan import PlanSettings, device_memory_bytes, parse_memory_size, plan_config, plan_memory
    from .settings import BUNDLED_CHECKPOINT_DIR

    if width < 0 or height < 0:
        raise ValueError(f"--width/--height must be positive, got {width}x{height}")
    config = plan_config(checkpoint if checkpoint is not None else BUNDLED_CHECKPOINT_DIR)
    if device_memory is not None:  # a device that need not be here: a GPU unless --device names the CPU
        total = parse_memory_size(device_memory)
        planned = torch.device(device if device is not None else "cuda" if args.device == "auto" else args.device)
    else:
        planned = torch.device(device if device is not None else resolve_device(args.device))
        total = device_memory_bytes(planned)
    settings = PlanSettings(
        task=task,
        width=width,
        height=height,
        kv_method=args.kv_method,
        weight_dtype=args.weight_dtype,
        dtype=args.dtype,
        offload=args.offload,
        device=planned.type,
        taylorseer=bool(getattr(args, "taylorseer", False)),
        taylorseer_order=getattr(args, "taylorseer_order", PlanSettings.taylorseer_order),
    )
    return plan_memory(config, settings, total)


def describe(plan) -> str:
    from .memory_plan import describe as describe_plan

    return describe_plan(plan)


__all__ = ["add_memory_arguments", "add_plan_parser", "refuse_unfitting_run", "run_plan"]
