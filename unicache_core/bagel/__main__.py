"""Command line: ``python -m unicache_core.bagel {understand,t2i,edit} --checkpoint DIR --prompt TEXT ...``.

``t2i``/``edit`` write a PNG (``--out``); ``understand`` prints the answer on stdout. Progress goes to
stderr. Every argument is checked before the weights load (:mod:`.cli_checks`). Expected failures (bad
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

import torch

from ..errors import UniCacheError
from .cli_checks import open_image as _open_image  # noqa: F401  (the tests' entry point for image decoding)
from .cli_checks import preflight, save_image

logger = logging.getLogger("unicache_core.bagel.cli")

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's one-line error format (``error: ...``, exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"error: {' '.join(message.split())} (see {self.prog} --help)\n")


def _path(value: str) -> Path:
    """A path argument; the empty string is refused (``Path('')`` would silently mean the current folder)."""
    if not value:
        raise argparse.ArgumentTypeError("empty path ''")
    return Path(value)


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m unicache_core.bagel", description="BAGEL inference (UniCache core)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--checkpoint", required=True, type=_path, help="BAGEL checkpoint folder")
        text = p.add_mutually_exclusive_group(required=True)
        text.add_argument("--prompt", help="text prompt")
        text.add_argument("--prompt-file", type=_path, help="read the prompt from a UTF-8 text file")
        p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="LLM/ViT dtype (VAE is fp32)")
        p.add_argument("--device", default="auto", help="torch device, or 'auto' (cuda when available)")
        p.add_argument("--seed", type=int, default=0, help="noise / sampling seed")
        p.add_argument("--think", action="store_true", help="think mode (system prompt + planning text)")
        p.add_argument("--do-sample", action="store_true", help="sample text instead of greedy decoding")
        p.add_argument("--temperature", type=float, default=0.3, help="sampling temperature")
        p.add_argument("--max-new-tokens", type=int, default=None,
                       help="max generated tokens (answer: 512, think plan: 1024)")
        p.add_argument("-q", "--quiet", action="store_true", help="no progress output")

    def flow(p: argparse.ArgumentParser, text_scale, img_scale, interval, renorm) -> None:
        p.add_argument("--out", type=_path, default=Path("out.png"), help="output image (.png, .jpg, .webp)")
        p.add_argument("--steps", type=int, default=50, help="num_timesteps (steps-1 model evaluations)")
        p.add_argument("--timestep-shift", type=float, default=3.0)
        p.add_argument("--cfg-text-scale", type=float, default=text_scale)
        p.add_argument("--cfg-img-scale", type=float, default=img_scale)
        p.add_argument("--cfg-interval", type=float, nargs=2, default=interval, metavar=("LO", "HI"))
        p.add_argument("--cfg-renorm-min", type=float, default=0.0)
        p.add_argument("--cfg-renorm-type", default=renorm, help="global | channel | text_channel")

    p_und = sub.add_parser("understand", help="answer a question about an image")
    common(p_und)
    p_und.add_argument("--image", type=_path, default=None, help="input image (optional)")

    p_t2i = sub.add_parser("t2i", help="text to image")
    common(p_t2i)
    flow(p_t2i, 4.0, 1.5, [0.4, 1.0], "global")
    p_t2i.add_argument("--width", type=int, default=1024)
    p_t2i.add_argument("--height", type=int, default=1024)

    p_edit = sub.add_parser("edit", help="edit an image")
    common(p_edit)
    flow(p_edit, 4.0, 2.0, [0.0, 1.0], "text_channel")
    p_edit.add_argument("--image", type=_path, required=True, help="source image")
    return parser


class _Bar:
    """A one-line text progress bar on stderr (``progress(step, total)`` callback)."""

    #: Every bar made (so an error message never lands on the end of an unfinished bar line).
    made: list["_Bar"] = []

    def __init__(self, label: str):
        self.label = label
        self.open = False
        _Bar.made.append(self)

    def __call__(self, step: int, total: int) -> None:
        width = 30
        filled = int(width * step / max(total, 1))
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


def _request_kwargs(args: argparse.Namespace) -> dict:
    """The pipeline keyword arguments of the command (without callbacks); :func:`preflight` checks them."""
    if args.command == "understand":
        return dict(max_new_tokens=512 if args.max_new_tokens is None else args.max_new_tokens,
                    do_sample=args.do_sample, temperature=args.temperature, think=args.think, seed=args.seed)
    kwargs = dict(
        num_timesteps=args.steps, timestep_shift=args.timestep_shift, cfg_text_scale=args.cfg_text_scale,
        cfg_img_scale=args.cfg_img_scale, cfg_interval=tuple(args.cfg_interval), cfg_renorm_min=args.cfg_renorm_min,
        cfg_renorm_type=args.cfg_renorm_type, seed=args.seed, think=args.think,
        think_max_new_tokens=1024 if args.max_new_tokens is None else args.max_new_tokens,
        think_do_sample=args.do_sample, think_temperature=args.temperature,
    )
    if args.command == "t2i":
        kwargs.update(width=args.width, height=args.height)
    return kwargs


def _run(args: argparse.Namespace) -> int:
    from .loader import load_bagel
    from .pipeline import BagelPipeline

    kwargs = _request_kwargs(args)
    checked = preflight(args, kwargs)  # every argument, the image and --out: before any weights load
    logger.info("loading %s (%s on %s)", args.checkpoint, args.dtype, checked.device)
    pipe = BagelPipeline(load_bagel(args.checkpoint, dtype=_DTYPES[args.dtype], device=checked.device))
    if args.command == "understand":
        bar = _progress("decoding", args.quiet)
        result = pipe.understand(checked.image, checked.prompt, progress=bar, **kwargs)
        if bar is not None:
            bar.close()
        sys.stdout.write(result.text + "\n")
        sys.stdout.flush()
        return 0
    progress = _progress("denoising", args.quiet)
    if args.command == "t2i":
        result = pipe.text_to_image(checked.prompt, progress=progress, **kwargs)
    else:
        result = pipe.edit(checked.image, checked.prompt, progress=progress, **kwargs)
    if result.think_text is not None:
        logger.info("plan: %s", result.think_text)
    save_image(result.image, args.out, checked.out_format)
    logger.info("wrote %s (%dx%d)", args.out, *result.image.size)
    return 0


def _fail(message: str) -> None:
    """Finish any open progress-bar line, then write the one-line error."""
    for bar in _Bar.made:
        bar.close()
    sys.stderr.write(f"error: {' '.join(message.split())}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the process exit status (0 ok, 2 expected failure, 130 interrupted)."""
    _Bar.made.clear()
    try:
        args = _build_parser().parse_args(argv)
        logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, stream=sys.stderr,
                            format="%(levelname)s %(name)s: %(message)s")
        return _run(args)
    except KeyboardInterrupt:
        _fail("interrupted (Ctrl-C)")
        return 130
    except BrokenPipeError:  # stdout closed early (e.g. `| head`); keep Python's exit-time flush quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        _fail("stdout was closed before the answer was written (broken pipe)")
        return 2
    except (MemoryError, torch.OutOfMemoryError) as exc:
        _fail(f"out of memory ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}); "
              f"use a smaller --width/--height or --max-new-tokens, --dtype bf16, or another --device")
        return 2
    except (UniCacheError, ValueError, OSError) as exc:  # OSError: unreadable input, unwritable --out
        _fail(str(exc) or type(exc).__name__)
        return 2


if __name__ == "__main__":
    sys.exit(main())
