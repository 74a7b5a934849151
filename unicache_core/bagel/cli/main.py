"""Command line: ``python -m unicache_core.bagel {understand,t2i,edit} --checkpoint DIR --prompt TEXT ...``.

``t2i``/``edit`` write a PNG (``--out``); ``understand`` prints the answer on stdout. ``--image`` may be given
several times (the images in that order, then the prompt), and ``--items FILE.json`` gives any interleaved list of
texts and images instead (:mod:`.items_file`, :mod:`.items`); an iterative request's earlier images are written
beside ``--out`` as ``<stem>-1.png``, ``<stem>-2.png``... Progress goes to
stderr. Every argument is checked before the weights load (:mod:`.checks`). Expected failures (bad
arguments, missing or broken checkpoint or image, unavailable device, file-system errors, non-finite
values, out of memory, cancelled run) exit with status 2 and a one-line ``error: ...`` message; Ctrl-C
exits with status 130 and ``error: interrupted (Ctrl-C)``. A traceback means a bug.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...cli import OneLineParser as _Parser
from ...cli import path_arg as _path
from ...errors import UniCacheError
from ..request import RunHooks
from ..settings import BUNDLED_CHECKPOINT, BUNDLED_CHECKPOINT_DIR, EDIT_DEFAULTS, T2I_DEFAULTS, UNDERSTANDING_DEFAULTS
from .checks import require_prompt, save_image, save_text
from .items import preflight_request
from .memory import (
    add_kv_arguments,
    add_memory_arguments,
    add_plan_parser,
    kv_method_of,
    refuse_unfitting_run,
    run_plan,
)

if TYPE_CHECKING:  # the run imports the model code only after the checks, so a refusal never loads it
    from PIL import Image

    from ..generation import GenerationResult
    from ..pipeline import BagelPipeline
    from .checks import Checked

logger = logging.getLogger("unicache_core.bagel.cli")

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: The error of a second --image (a repeated single-value flag is refused, never dropped: unicache_core.cli).


def _request_arguments(p: argparse.ArgumentParser) -> None:
    """What every subcommand takes: the checkpoint, the request, the device and memory, the seed."""
    p.add_argument(
        "--checkpoint",
        type=_path,
        default=None,
        help=f"BAGEL checkpoint folder (default: the bundled {BUNDLED_CHECKPOINT})",
    )
    text = p.add_mutually_exclusive_group()  # one of them, or --items (checked by _check_request_text)
    text.add_argument("--prompt", help="text prompt")
    text.add_argument("--prompt-file", type=_path, help="read the prompt from a UTF-8 text file")
    p.add_argument(
        "--items",
        type=_path,
        help='the request as a JSON list of texts and images in order: {"items": [{"image": "a.png"}, '
        '{"image": "b.png"}, {"text": "..."}]} (paths relative to the file; t2i/edit: {"generate": true} '
        "generates an image there and goes on with it)",
    )
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="LLM/ViT dtype (VAE is fp32)")
    p.add_argument("--device", default="auto", help="torch device, or 'auto' (cuda when available)")
    add_memory_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="noise / sampling seed")
    p.add_argument("--think", action="store_true", help="think mode (system prompt + planning text)")
    p.add_argument(
        "--allow-special-tokens",
        action="store_true",
        help="parse control tokens typed in the prompt (<|im_end|> ...) as the official code does; "
        "default: the prompt is plain text",
    )


def _decoding_arguments(p: argparse.ArgumentParser) -> None:
    """Text decoding, progress and the KV method (every subcommand)."""
    p.add_argument("--do-sample", action="store_true", help="sample text instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=UNDERSTANDING_DEFAULTS.temperature, help="sampling temperature")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"max generated tokens (answer: {UNDERSTANDING_DEFAULTS.max_new_tokens}, think text: "
        f"{T2I_DEFAULTS.think_max_new_tokens})",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    kv = add_kv_arguments(p)
    kv.add_argument("--report", type=_path, default=None, help="write the per-step KV report (JSON) here")


def _flow_arguments(p: argparse.ArgumentParser, d) -> None:
    """The image generation's output, sampling and TaylorSeer (t2i and edit; defaults from ``d``)."""
    p.add_argument("--out", type=_path, default=Path("out.png"), help="output image (.png, .jpg, .webp)")
    p.add_argument("--steps", type=int, default=d.num_timesteps, help="num_timesteps (steps-1 model evaluations)")
    p.add_argument("--timestep-shift", type=float, default=d.timestep_shift)
    p.add_argument("--cfg-text-scale", type=float, default=d.cfg_text_scale)
    p.add_argument("--cfg-img-scale", type=float, default=d.cfg_img_scale)
    p.add_argument("--cfg-interval", type=float, nargs=2, default=list(d.cfg_interval), metavar=("LO", "HI"))
    p.add_argument("--cfg-renorm-min", type=float, default=d.cfg_renorm_min)
    p.add_argument("--cfg-renorm-type", default=d.cfg_renorm_type, help="global | channel | text_channel")
    ts = p.add_argument_group("TaylorSeer (the official enable_taylorseer feature cache)")
    ts.add_argument(
        "--taylorseer",
        action="store_true",
        help="forecast the decoder output on most steps: after the first steps, each CFG branch runs its "
        "decoder on one step in --taylorseer-interval (a third of the forwards by default)",
    )
    ts.add_argument(  # None: not given (refused without --taylorseer: checks.taylorseer_changes)
        "--taylorseer-interval",
        type=int,
        default=None,
        help=f"with --taylorseer: one full step in this many after the first (default {d.taylorseer_interval})",
    )
    ts.add_argument(
        "--taylorseer-first-steps",
        type=int,
        default=None,
        help=f"with --taylorseer: the first steps of each branch, all full (default {d.taylorseer_first_steps})",
    )
    ts.add_argument(
        "--taylorseer-order",
        type=int,
        default=None,
        help=f"with --taylorseer: highest Taylor order of the forecast (default {d.taylorseer_order})",
    )


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m unicache_core.bagel", description="BAGEL inference (UniCache core)")
    sub = parser.add_subparsers(dest="command", required=True)

    p_und = sub.add_parser("understand", help="answer a question about images")
    _request_arguments(p_und)
    _decoding_arguments(p_und)
    p_und.add_argument(
        "--image",
        type=_path,
        action="append",
        default=None,
        help="input image (optional; repeat it for several: the images in the given order, then the prompt)",
    )

    p_t2i = sub.add_parser("t2i", help="text to image")
    _request_arguments(p_t2i)
    _decoding_arguments(p_t2i)
    _flow_arguments(p_t2i, T2I_DEFAULTS)
    p_t2i.add_argument("--width", type=int, default=T2I_DEFAULTS.width)
    p_t2i.add_argument("--height", type=int, default=T2I_DEFAULTS.height)
    p_t2i.add_argument(
        "--image",
        type=_path,
        action="append",
        default=None,
        help="reference image (repeatable), before the prompt in the given order; the output keeps --width/--height",
    )

    p_edit = sub.add_parser("edit", help="edit an image")
    _request_arguments(p_edit)
    _decoding_arguments(p_edit)
    _flow_arguments(p_edit, EDIT_DEFAULTS)
    p_edit.add_argument(
        "--image",
        type=_path,
        action="append",
        default=None,
        help="source image (required unless --items; repeat it for several: the images in the given order, then the "
        "prompt; the output takes the last one's size)",
    )
    add_plan_parser(sub)
    return parser


class _Bar:
    """A one-line text progress bar on stderr (``progress(step, total)`` callback)."""

    #: Every bar made (so an error message never lands on the end of an unfinished bar line).
    made: list[_Bar] = []

    def __init__(self, label: str):
        self.label = label
        self.open = False
        _Bar.made.append(self)

    def __call__(self, step: int, total: int) -> None:
        width = 30
        filled = int(width * step / max(total, 1))
        self.open = True  # before the write: a Ctrl-C landing in it still ends the line before the error
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {step}/{total}")
        self.open = step < total
        if not self.open:
            sys.stderr.write("\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.open:
            sys.stderr.write("\n")
            self.open = False


def _progress(label: str, quiet: bool) -> _Bar | None:
    return None if quiet else _Bar(label)


def _run(args: argparse.Namespace) -> int:
    if args.command == "plan":
        return run_plan(args)
    from ..checkpoint.loader import load_bagel
    from ..pipeline import BagelPipeline

    if args.checkpoint is None:
        args.checkpoint = BUNDLED_CHECKPOINT_DIR
    checked = preflight_request(args)  # every argument, the images and --out: before any weights load
    refuse_unfitting_run(args, checked)  # the planned peak against the device's memory
    kv_config = _kv_config(args)  # every KV flag is checked before the model loads
    logger.info("loading %s (%s on %s)", args.checkpoint, args.dtype, checked.device)
    from ...compression import make_cache_factory

    factory = make_cache_factory(kv_config, checkpoint_dir=str(args.checkpoint))
    loaded = load_bagel(
        args.checkpoint,
        dtype=_DTYPES[args.dtype],
        device=checked.device,
        weight_dtype=args.weight_dtype,
        offload=args.offload,
    )
    pipe = BagelPipeline(loaded, factory)
    if args.command == "understand":
        return _understand(pipe, args, checked)
    return _generate(pipe, args, checked)


def _understand(pipe: BagelPipeline, args: argparse.Namespace, checked: Checked) -> int:
    """Run a checked ``understand`` request: the answer to stdout, the KV report to ``--report``."""
    settings = checked.understanding_settings()
    bar = _progress("decoding", args.quiet)
    hooks = RunHooks(progress=bar)
    if checked.request is not None:  # an item list, checked and counted before the weights loaded
        result = pipe.understand_request(checked.request, seed=checked.seed, hooks=hooks)
    else:
        result = pipe.understand(
            require_prompt(checked.prompt), checked.image, settings, seed=checked.seed, hooks=hooks
        )
    if bar is not None:
        bar.close()
    _write_report(args, result.kv_report)
    sys.stdout.write(result.text + "\n")
    sys.stdout.flush()
    return 0


def _generate(pipe: BagelPipeline, args: argparse.Namespace, checked: Checked) -> int:
    """Run a checked ``t2i`` / ``edit`` request: its images to ``--out`` (and the earlier rounds'), the KV report
    to ``--report``."""
    settings = checked.generation_settings()
    out_format = checked.out_format
    if out_format is None:  # --out has a default: set unless a caller built the namespace by hand
        raise ValueError("--out: this command writes an image; give --out FILE.png (or .jpg, .webp)")
    hooks = RunHooks(progress=_progress("denoising", args.quiet))
    if checked.request is not None:  # an item list, checked and counted before the weights loaded
        result = pipe.generate_request(checked.request, seed=checked.seed, hooks=hooks)
    elif args.command == "t2i":
        result = pipe.text_to_image(require_prompt(checked.prompt), settings, seed=checked.seed, hooks=hooks)
    else:
        result = pipe.edit(require_prompt(checked.prompt), checked.image, settings, seed=checked.seed, hooks=hooks)
    if result.think_text is not None:
        logger.info("think: %s", result.think_text)
    for earlier, path in zip(result.rounds, checked.rounds_out):
        save_image(earlier.image, path, out_format)
        logger.info("wrote %s (an earlier round)", path)
    image = _decoded(result)
    save_image(image, args.out, out_format)
    logger.info("wrote %s (%dx%d)", args.out, *image.size)
    _write_report(args, _with_rounds(result))
    return 0


def _decoded(result: GenerationResult) -> Image.Image:
    """The image of a generation run with ``decode=True`` (the command line's; a RuntimeError, a bug, without)."""
    if result.image is None:
        raise RuntimeError("the generation returned no image (it ran with decode=False)")
    return result.image


def _with_rounds(result) -> dict | None:
    """The KV report of the last generation, with the earlier rounds' reports (an iterative request) under
    ``rounds``."""
    if not result.rounds or result.kv_report is None:
        return result.kv_report
    return {**result.kv_report, "rounds": [earlier.kv_report for earlier in result.rounds]}


def _fail(message: str) -> None:
    """Finish any open progress-bar line, then write the one-line error."""
    for bar in _Bar.made:
        bar.close()
    sys.stderr.write(f"error: {' '.join(message.split())}\n")
    sys.stderr.flush()


def _kv_config(args: argparse.Namespace):
    """The KV method of the flags (:func:`.memory.kv_method_of`)."""
    return kv_method_of(args)


def _write_report(args: argparse.Namespace, report: dict | None) -> None:
    if args.report is None:
        return
    import json

    from ...compression.report import REPORT_FORMAT
    from ...compression.report_view import saving_words

    payload: dict[str, Any] = (
        report
        if report is not None
        else {"format": REPORT_FORMAT, "version": 1, "method": "full", "summary": None, "steps": []}
    )
    save_text(json.dumps(payload, indent=1) + "\n", args.report, "--report")
    summary = payload.get("summary") or {}
    if summary.get("steady_managed_bytes") is not None and summary.get("full_managed_bytes"):
        logger.info(
            "KV %s: %d of %d managed bytes held (%s), peak %d bytes; report %s",
            payload["method"],
            summary["steady_managed_bytes"],
            summary["full_managed_bytes"],
            saving_words(summary),
            summary["peak_bytes"],
            args.report,
        )


def _check_request_text(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A request's text comes from exactly one of ``--prompt``, ``--prompt-file`` and ``--items``."""
    if args.command == "plan":
        return
    given = [
        flag for flag, value in (("--prompt", args.prompt), ("--prompt-file", args.prompt_file)) if value is not None
    ]
    if args.items is not None and given:
        parser.error(f"argument --items: not allowed with argument {given[0]} (the items file holds the texts)")
    if args.items is None and not given:
        parser.error("one of the arguments --prompt --prompt-file is required (or --items FILE.json)")


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the process exit status (0 ok, 2 expected failure, 130 interrupted)."""
    _Bar.made.clear()
    try:
        parser = _build_parser()
        args = parser.parse_args(argv)
        _check_request_text(parser, args)
        logging.basicConfig(
            level=logging.WARNING if args.quiet else logging.INFO,
            stream=sys.stderr,
            format="%(levelname)s %(name)s: %(message)s",
        )
        return _run(args)
    except KeyboardInterrupt:
        _fail("interrupted (Ctrl-C)")
        return 130
    except BrokenPipeError:  # stdout closed early (e.g. `| head`); keep Python's exit-time flush quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        _fail("stdout was closed before the answer was written (broken pipe)")
        return 2
    except (MemoryError, torch.OutOfMemoryError) as exc:
        _fail(
            f"out of memory ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}); "
            f"use a smaller --width/--height or --max-new-tokens, --dtype bf16, or another --device"
        )
        return 2
    except (UniCacheError, ValueError, OSError) as exc:  # OSError: unreadable input, unwritable --out
        _fail(str(exc) or type(exc).__name__)
        return 2


if __name__ == "__main__":
    sys.exit(main())
