"""Command line of the calibration (``python -m unicache_core.bagel.calibrate``).

Usage::

    python -m unicache_core.bagel.calibrate --checkpoint DIR --task {und,t2i,edit} --prompts FILE [--images DIR]
        --out policy.json [--sensitivity] [--grid] [--steps N] [--max-new-tokens N] [--dtype fp32|bf16] [--size PX]

Defaults: ``--steps 50`` (``num_timesteps``, as in ``python -m unicache_core.bagel``: 49 denoising steps),
``--max-new-tokens 64``, ``--size 512`` (the paper's resolution), ``--dtype bf16``, ``--seed 0``,
``--device auto``. ``--merge`` keeps the other tasks of an existing ``--out`` table; ``-v`` logs progress.
Progress is silent; one summary line goes to stderr. Errors are one line (``error: ...``), exit status 2;
Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

import torch

from ...cli import OneLineParser, path_arg
from ...errors import UniCacheError
from ...kv.token_types import TokenType
from .job import CalibrationJob, calibrate_job
from .options import DTYPES, TASK_NAMES, CalibrationOptions

logger = logging.getLogger("unicache_core.bagel.calibrate")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m unicache_core.bagel.calibrate``."""
    defaults = CalibrationOptions()
    p = OneLineParser(
        prog="python -m unicache_core.bagel.calibrate",
        description="Calibrate a UniCache policy table (K90 routing, docs/compression.md §8.4) on a checkpoint",
    )
    p.add_argument("--checkpoint", required=True, type=path_arg, help="BAGEL checkpoint folder")
    p.add_argument("--task", required=True, choices=sorted(TASK_NAMES), help="und (understanding) | t2i | edit")
    p.add_argument("--prompts", required=True, type=path_arg, help="UTF-8 text file, one prompt per line")
    p.add_argument(
        "--images",
        type=path_arg,
        default=None,
        help="folder of input images for edit / und (sorted, paired with the prompts round-robin); "
        "default: deterministic synthetic images",
    )
    p.add_argument("--out", required=True, type=path_arg, help="policy-table JSON to write")
    p.add_argument(
        "--merge", action="store_true", help="keep the other tasks' entries of an existing --out table (same model)"
    )
    p.add_argument(
        "--sensitivity",
        action="store_true",
        help="also run each type evicted vs quantized alone and compare with the K90 choice",
    )
    p.add_argument(
        "--grid",
        action="store_true",
        help="also measure each type's (rows kept, bits) grid at matched bytes and make it a joint entry "
        "with the calibrated bits per budget level (docs/compression.md §11.4)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=defaults.num_timesteps,
        help="num_timesteps of t2i / edit (steps-1 denoising steps), as in python -m unicache_core.bagel",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=defaults.max_new_tokens,
        help="most decoded tokens per understanding prompt",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default=CalibrationJob.dtype, help="LLM/ViT dtype (VAE is fp32)")
    p.add_argument(
        "--size",
        type=int,
        default=defaults.size,
        help="t2i output side and synthetic image width in px (multiple of 16)",
    )
    p.add_argument("--device", default=CalibrationJob.device, help="torch device, or 'auto' (cuda when available)")
    p.add_argument("--seed", type=int, default=defaults.seed, help="noise seed of every run")
    p.add_argument("-v", "--verbose", action="store_true", help="progress and library logs on stderr")
    return p


def job_from_args(args: argparse.Namespace) -> CalibrationJob:
    """The :class:`CalibrationJob` parsed command-line arguments ask for."""
    options = CalibrationOptions(
        num_timesteps=args.steps,
        max_new_tokens=args.max_new_tokens,
        size=args.size,
        seed=args.seed,
        sensitivity=args.sensitivity,
        grid=args.grid,
    )
    return CalibrationJob(
        checkpoint=args.checkpoint,
        task=args.task,
        prompts=args.prompts,
        out=args.out,
        images=args.images,
        merge=args.merge,
        options=options,
        dtype=args.dtype,
        device=args.device,
    )


def configure_logging(verbose: bool) -> None:
    """Library logs on stderr: INFO and up with ``verbose``, else warnings only."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        stream=sys.stderr,
        format="%(levelname)s %(name)s: %(message)s",
    )


def _fail(message: str) -> None:
    sys.stderr.write(f"error: {' '.join(message.split())}\n")
    sys.stderr.flush()


def _summary(job: CalibrationJob, table) -> str:
    meas = table.measurements["tasks"][TASK_NAMES[job.task]]
    parts = [f"{t} K90 {v:.3f} -> {meas['choice'][t]}" for t, v in meas["k90"].items()]
    for key, plan in table.plans.items():
        if key[0] == TASK_NAMES[job.task]:
            parts.append(
                f"{TokenType(key[1]).name.lower()} plan "
                + ", ".join(f"{level:g}: {'full' if bits == 16 else f'{bits}-bit'}" for level, bits in plan.levels)
            )
    agree = meas.get("sensitivity_agrees")
    if agree is not None:
        parts.append("sensitivity agrees: " + ", ".join(f"{t}={v}" for t, v in agree.items()))
    return (
        f"calibrated {job.task} on {meas['prompts']} prompt(s) ({table.model_id}): {'; '.join(parts)}; "
        f"wrote {job.out}\n"
    )


def run_job(job: CalibrationJob, progress: Callable[[str], None] | None = None) -> int:
    """Run ``job`` as the command line does: one summary line (or one ``error: ...`` line) on stderr.

    Returns the exit status: 0 ok, 2 expected failure (bad input, out of memory), 130 interrupted.
    """
    try:
        table = calibrate_job(job, progress)
        sys.stderr.write(_summary(job, table))
        sys.stderr.flush()
        return 0
    except KeyboardInterrupt:
        _fail("interrupted (Ctrl-C)")
        return 130
    except (MemoryError, torch.OutOfMemoryError) as exc:
        _fail(
            f"out of memory ({type(exc).__name__}); use fewer --steps, a smaller --size, --dtype bf16 or another "
            "--device"
        )
        return 2
    except (UniCacheError, ValueError, OSError) as exc:
        _fail(str(exc) or type(exc).__name__)
        return 2


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 2 expected failure, 130 interrupted)."""
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    progress = (lambda msg: logger.info("%s", msg)) if args.verbose else None
    return run_job(job_from_args(args), progress)


__all__ = ["build_parser", "configure_logging", "job_from_args", "main", "run_job"]
