"""Command line: ``python -m unicache_core.bagel {understand,t2i,edit} --checkpoint DIR --prompt TEXT ...``.

``t2i``/``edit`` write a PNG (``--out``); ``understand`` prints the answer on stdout. Progress goes to
stderr. Expected failures (bad arguments, missing or broken checkpoint or image, unavailable device,
file-system errors, cancelled run) exit with status 2 and a one-line ``error: ...`` message.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path

import torch

from ..errors import UniCacheError
from .settings import EDIT_DEFAULTS, T2I_DEFAULTS, UNDERSTANDING_DEFAULTS

logger = logging.getLogger("unicache_core.bagel.cli")

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m unicache_core.bagel", description="BAGEL inference (UniCache core)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--checkpoint", required=True, type=Path, help="BAGEL checkpoint folder")
        p.add_argument("--prompt", required=True, help="text prompt")
        p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="LLM/ViT dtype (VAE is fp32)")
        p.add_argument("--device", default="auto", help="torch device, or 'auto' (cuda when available)")
        p.add_argument("--seed", type=int, default=0, help="noise / sampling seed")
        p.add_argument("--think", action="store_true", help="think mode (system prompt + planning text)")
        p.add_argument("--do-sample", action="store_true", help="sample text instead of greedy decoding")
        p.add_argument("--temperature", type=float, default=UNDERSTANDING_DEFAULTS.temperature,
                       help="sampling temperature")
        p.add_argument("--max-new-tokens", type=int, default=None,
                       help=f"max generated tokens (answer: {UNDERSTANDING_DEFAULTS.max_new_tokens}, think plan: "
                            f"{T2I_DEFAULTS.think_max_new_tokens})")
        p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
        kv = p.add_argument_group("KV-cache compression")
        kv.add_argument("--kv-method", default="full",
                        help="full | unicache | h2o | snapkv | pyramidkv | streamingllm | kivi | vlcache")
        kv.add_argument("--kv-target", default=None,
                        help="memory of the compressible KV: a retained ratio (0.2, 20%%) or a size (150MB); "
                             "default: the paper's reduction (80%% understanding/edit, 60%% t2i)")
        kv.add_argument("--policy", type=Path, default=None,
                        help="unicache policy table JSON (default: the checkpoint's unicache_policy.json, "
                             "else the paper's table)")
        kv.add_argument("--rho", type=float, default=None, help="unicache starting retention rho0 in (0, 1]")
        kv.add_argument("--rho-floor", type=float, default=None, help="unicache lowest retention, <= rho")
        kv.add_argument("--report", type=Path, default=None, help="write the per-step KV report (JSON) here")

    def flow(p: argparse.ArgumentParser, d) -> None:
        p.add_argument("--out", type=Path, default=Path("out.png"), help="output image (.png, .jpg, .webp)")
        p.add_argument("--steps", type=int, default=d.num_timesteps, help="num_timesteps (steps-1 model evaluations)")
        p.add_argument("--timestep-shift", type=float, default=d.timestep_shift)
        p.add_argument("--cfg-text-scale", type=float, default=d.cfg_text_scale)
        p.add_argument("--cfg-img-scale", type=float, default=d.cfg_img_scale)
        p.add_argument("--cfg-interval", type=float, nargs=2, default=list(d.cfg_interval), metavar=("LO", "HI"))
        p.add_argument("--cfg-renorm-min", type=float, default=d.cfg_renorm_min)
        p.add_argument("--cfg-renorm-type", default=d.cfg_renorm_type, help="global | channel | text_channel")

    p_und = sub.add_parser("understand", help="answer a question about an image")
    common(p_und)
    p_und.add_argument("--image", type=Path, default=None, help="input image (optional)")

    p_t2i = sub.add_parser("t2i", help="text to image")
    common(p_t2i)
    flow(p_t2i, T2I_DEFAULTS)
    p_t2i.add_argument("--width", type=int, default=T2I_DEFAULTS.width)
    p_t2i.add_argument("--height", type=int, default=T2I_DEFAULTS.height)

    p_edit = sub.add_parser("edit", help="edit an image")
    common(p_edit)
    flow(p_edit, EDIT_DEFAULTS)
    p_edit.add_argument("--image", type=Path, required=True, help="source image")
    return parser


class _Bar:
    """A one-line text progress bar on stderr (``progress(step, total)`` callback)."""

    def __init__(self, label: str):
        self.label = label
        self.open = False

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


def _open_image(path: Path):
    """Decode ``path`` as PIL does (no EXIF transpose, as officially); refuses decompression bombs.

    Images above PIL's ``Image.MAX_IMAGE_PIXELS`` are refused before their pixels are decoded (PIL
    only warns between 1x and 2x that limit; here both are errors).
    """
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise FileNotFoundError(f"--image: file not found: {path}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                img.load()
                return img.copy()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ValueError(
            f"--image: {path} is too large to decode safely ({exc}); downscale it below "
            f"{Image.MAX_IMAGE_PIXELS} pixels first (BAGEL resizes every input to at most 1024 px per side)"
        ) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise ValueError(f"--image: cannot read {path} as an image ({exc})") from None


#: Output formats by file suffix (checked before the model loads, so a typo costs nothing).
_OUT_FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP"}


def _image_format(path: Path) -> str:
    """PIL format name for ``--out`` from its suffix; unknown suffixes are an error, not a silent PNG."""
    fmt = _OUT_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"--out: unsupported image suffix {path.suffix!r} in {path}; use one of "
                         f"{sorted(_OUT_FORMATS)}")
    return fmt


def _run(args: argparse.Namespace) -> int:
    from .loader import load_bagel
    from .pipeline import BagelPipeline

    if not args.checkpoint.is_dir():
        raise FileNotFoundError(f"--checkpoint: folder not found: {args.checkpoint}")
    out = getattr(args, "out", None)
    if out is not None and out.is_dir():
        raise ValueError(f"--out: {out} is a directory; give the path of the PNG file to write, e.g. {out / 'out.png'}")
    out_format = _image_format(out) if out is not None else None
    if args.max_new_tokens is not None and args.max_new_tokens < 1:  # fail before the model loads
        raise ValueError(f"--max-new-tokens: `max_new_tokens` must be an integer >= 1, got {args.max_new_tokens}")
    image = _open_image(args.image) if getattr(args, "image", None) is not None else None
    kv_config = _kv_config(args)  # every KV flag is checked before the model loads
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    logger.info("loading %s (%s on %s)", args.checkpoint, args.dtype, device)
    from ..methods import make_cache_factory

    factory = make_cache_factory(kv_config, checkpoint_dir=str(args.checkpoint))
    pipe = BagelPipeline(load_bagel(args.checkpoint, dtype=_DTYPES[args.dtype], device=device), factory)
    if args.command == "understand":
        bar = _progress("decoding", args.quiet)
        max_new = UNDERSTANDING_DEFAULTS.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens
        result = pipe.understand(
            image, args.prompt, max_new_tokens=max_new, do_sample=args.do_sample,
            temperature=args.temperature, think=args.think, seed=args.seed, progress=bar,
        )
        if bar is not None:
            bar.close()
        _write_report(args, result.kv_report)
        sys.stdout.write(result.text + "\n")
        return 0
    flow_kwargs = dict(
        num_timesteps=args.steps, timestep_shift=args.timestep_shift, cfg_text_scale=args.cfg_text_scale,
        cfg_img_scale=args.cfg_img_scale, cfg_interval=tuple(args.cfg_interval), cfg_renorm_min=args.cfg_renorm_min,
        cfg_renorm_type=args.cfg_renorm_type, seed=args.seed, think=args.think,
        think_max_new_tokens=T2I_DEFAULTS.think_max_new_tokens if args.max_new_tokens is None else args.max_new_tokens,
        think_do_sample=args.do_sample,
        think_temperature=args.temperature, progress=_progress("denoising", args.quiet),
    )
    if args.command == "t2i":
        result = pipe.text_to_image(args.prompt, width=args.width, height=args.height, **flow_kwargs)
    else:
        result = pipe.edit(image, args.prompt, **flow_kwargs)
    if result.think_text is not None:
        logger.info("plan: %s", result.think_text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result.image.save(args.out, format=out_format, **({"quality": 95} if out_format == "JPEG" else {}))
    logger.info("wrote %s (%dx%d)", args.out, *result.image.size)
    _write_report(args, result.kv_report)
    return 0


def _kv_config(args: argparse.Namespace):
    """The KV settings of the flags (a ValueError naming the flag for a bad value)."""
    from ..methods import KVConfig

    report = getattr(args, "report", None)
    if report is not None and report.is_dir():
        raise ValueError(f"--report: {report} is a directory; give the path of the JSON file to write")
    if args.policy is not None and not args.policy.is_file():
        raise ValueError(f"--policy: {args.policy} is not a file; pass a policy-table JSON file")
    try:
        return KVConfig(method=args.kv_method, kv_target=args.kv_target, rho=args.rho, rho_floor=args.rho_floor,
                        policy=args.policy)
    except ValueError as exc:
        raise ValueError(f"KV flags: {exc}") from None


def _write_report(args: argparse.Namespace, report: dict | None) -> None:
    if args.report is None:
        return
    import json

    payload = report if report is not None else {"format": "unicache-kv-report", "version": 1, "method": "full",
                                                 "summary": None, "steps": []}
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    summary = payload.get("summary") or {}
    if summary.get("steady_managed_bytes") is not None:
        logger.info("KV %s: %d of %d managed bytes held (%.1fx less), peak %d bytes; report %s", payload["method"],
                    summary["steady_managed_bytes"], summary["full_managed_bytes"], summary["compression"] or 0.0,
                    summary["peak_bytes"], args.report)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the process exit status."""
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return _run(args)
    except (UniCacheError, ValueError, OSError) as exc:  # OSError: unreadable input, unwritable --out
        message = " ".join(str(exc).split()) or type(exc).__name__
        sys.stderr.write(f"error: {message}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
