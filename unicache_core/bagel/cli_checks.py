"""Checks the command line runs before any weights load, plus the atomic image writer.

:func:`preflight` validates every argument of a ``understand`` / ``t2i`` / ``edit`` request by building
the request's settings (:mod:`.settings`), the object the pipeline takes. It reads only the small
files: the config JSON files, which give the size limit and the position budget, and the tokenizer
files, which give the prompt length. It also opens and decodes the input image, and checks the
output path. A mistake therefore costs well under a
second, instead of a weights load of many gigabytes. Each error is a ``ValueError``, ``OSError`` or
:class:`~unicache_core.errors.CheckpointError` whose message starts with the offending flag (for
example ``--steps: ...``).
"""

from __future__ import annotations

import os
import re
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .seeding import check_seed
from .settings import (
    T2I_DEFAULTS, UNDERSTANDING_DEFAULTS, GenerationSettings, UnderstandingSettings, check_output_size, check_prompt,
    preset,
)

#: Output formats by file suffix (checked before the model loads, so a typo costs nothing).
OUT_FORMATS = {".png": "PNG", ".jpg": "JPEG", ".jpeg": "JPEG", ".webp": "WEBP"}
#: Largest accepted ``--prompt-file`` (a prompt longer than the model's positions is refused anyway).
MAX_PROMPT_FILE_BYTES = 4 << 20

#: Pipeline argument name → command-line flag, for error messages.
FLAGS = {
    "prompt": "--prompt",
    "seed": "--seed",
    "num_timesteps": "--steps",
    "timestep_shift": "--timestep-shift",
    "cfg_text_scale": "--cfg-text-scale",
    "cfg_img_scale": "--cfg-img-scale",
    "cfg_interval": "--cfg-interval",
    "cfg_renorm_min": "--cfg-renorm-min",
    "cfg_renorm_type": "--cfg-renorm-type",
    "width": "--width",
    "height": "--height",
    "max_new_tokens": "--max-new-tokens",
    "think_max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "think_temperature": "--temperature",
    "device": "--device",
    "image": "--image",
}


def with_flag(exc: ValueError) -> ValueError:
    """``ValueError("`num_timesteps` must be ...")`` → ``ValueError("--steps: `num_timesteps` must be ...")``."""
    message = str(exc)
    match = re.match(r"`([a-z_]+)", message)
    flag = FLAGS.get(match.group(1)) if match else None
    return ValueError(f"{flag}: {message}") if flag else exc


# ------------------------------------------------------------------------------------------- paths


def check_checkpoint_dir(path: Path) -> Path:
    """``--checkpoint`` must be an existing folder (a file or a missing path is a one-line error)."""
    if path.is_file():
        raise ValueError(
            f"--checkpoint: {path} is a file, not a folder; pass the folder that holds llm_config.json, "
            f"ema.safetensors and ae.safetensors"
        )
    if not path.is_dir():
        kind = "is not a folder" if path.exists() else "folder not found"
        raise FileNotFoundError(f"--checkpoint: {kind}: {path}")
    return path


def check_out_path(out: Path) -> str:
    """Validate ``--out`` before anything runs and return the PIL format for its suffix.

    It must not be a folder or a special file, its suffix must name a supported format, and its
    folder must exist and be writable (a test file is created and removed), or be creatable (missing
    folders are created when the image is written).
    """
    if out.is_dir():
        raise ValueError(f"--out: {out} is a directory; give the path of the image file to write, e.g. "
                         f"{out / 'out.png'}")
    if out.exists() and not out.is_file():
        raise ValueError(f"--out: {out} exists and is not a regular file; give the path of an image file")
    fmt = OUT_FORMATS.get(out.suffix.lower())
    if fmt is None:
        raise ValueError(f"--out: unsupported image suffix {out.suffix!r} in {out}; use one of {sorted(OUT_FORMATS)}")
    folder = out.parent
    probe = folder
    while not probe.exists() and not probe.is_symlink() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"--out: {probe} is not a directory, so {out} cannot be created")
    if probe == folder:
        try:
            fd, name = tempfile.mkstemp(dir=folder, prefix=".unicache-write-test-")
            os.close(fd)
            os.unlink(name)
        except OSError as exc:
            raise OSError(f"--out: cannot write into the folder {folder} ({exc.strerror or exc})") from None
    elif not os.access(probe, os.W_OK | os.X_OK):
        raise OSError(f"--out: cannot create the folder {folder}: {probe} is not writable")
    return fmt


def save_image(image, out: Path, fmt: str) -> None:
    """Write ``image`` to ``out`` atomically: a temporary file in the same folder, then a rename.

    An interrupted or failed write leaves no truncated image behind (and an existing file unchanged).
    Missing folders are created. A symlink is written through, as before.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    target = Path(os.path.realpath(out)) if out.is_symlink() else out
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        image.save(tmp, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


# ------------------------------------------------------------------------------------------- text


def check_text_argument(flag: str, text: str) -> str:
    """A command-line text must be valid UTF-8 (undecodable bytes arrive as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = ord(text[exc.start])
        byte = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"character U+{char:04X}"
        raise ValueError(
            f"{flag}: the text is not valid UTF-8 ({byte} at character {exc.start}); pass UTF-8 text, e.g. "
            f"with a UTF-8 --prompt-file"
        ) from None
    return text


def read_prompt_file(path: Path) -> str:
    """``--prompt-file``: strict UTF-8 (an initial BOM and one final newline are dropped)."""
    if path.is_dir():
        raise ValueError(f"--prompt-file: {path} is a directory; pass a UTF-8 text file")
    if not path.exists():
        raise FileNotFoundError(f"--prompt-file: file not found: {path}")
    if not path.is_file():
        raise ValueError(f"--prompt-file: {path} is not a regular file; pass a UTF-8 text file")
    size = path.stat().st_size
    if size > MAX_PROMPT_FILE_BYTES:
        raise ValueError(f"--prompt-file: {path} is {size} bytes; a prompt file may hold at most "
                         f"{MAX_PROMPT_FILE_BYTES} bytes")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"--prompt-file: {path} is not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
            f"save it as UTF-8"
        ) from None
    text = text.removeprefix("\ufeff")
    if text.endswith("\r\n"):
        text = text[:-2]
    elif text.endswith("\n"):
        text = text[:-1]
    return text


# ------------------------------------------------------------------------------------------- images


def open_image(path: Path):
    """Decode ``--image`` as PIL does (no EXIF transpose, as officially); refuses decompression bombs.

    Images above PIL's ``Image.MAX_IMAGE_PIXELS`` are refused before their pixels are decoded (PIL
    only warns between 1x and 2x that limit; here both are errors). The RGB conversion
    is tried too, so an unconvertible mode fails here and not after loading.
    """
    from PIL import Image, UnidentifiedImageError

    from .transforms import pil_img2rgb

    if path.is_dir():
        raise ValueError(f"--image: {path} is a directory; pass an image file")
    if not path.exists():
        raise FileNotFoundError(f"--image: file not found: {path}")
    if not path.is_file():
        raise ValueError(f"--image: {path} is not a regular file; pass an image file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                img.load()
                image = img.copy()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ValueError(
            f"--image: {path} is too large to decode safely ({exc}); downscale it below "
            f"{Image.MAX_IMAGE_PIXELS} pixels first (BAGEL resizes every input to at most 1024 px per side)"
        ) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as exc:
        raise ValueError(f"--image: cannot read {path} as an image ({exc})") from None
    try:
        pil_img2rgb(image, "image")
    except ValueError as exc:
        raise ValueError(f"--image: {path}: {exc}") from None
    return image


# ------------------------------------------------------------------------------------------- request


@dataclass
class Checked:
    """What :func:`preflight` validated: the prompt text, the decoded image, the output format, the device, the
    request's settings and seed."""

    prompt: str
    image: Any
    out_format: str | None
    device: str
    settings: GenerationSettings | UnderstandingSettings
    seed: int


def resolve_device(device: str) -> str:
    """``--device``: ``auto`` is cuda when available, else cpu; anything else must be a usable torch device."""
    import torch

    from .checkpoint.loader import parse_device

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parse_device(device)
    except ValueError as exc:
        raise with_flag(exc) from None
    return device


def request_settings(args) -> GenerationSettings | UnderstandingSettings:
    """The settings of a parsed ``understand`` / ``t2i`` / ``edit`` command line (a ValueError names the field).

    ``--max-new-tokens`` and ``--temperature`` set the answer's decoding, or the think plan's in generation.
    """
    if args.command == "understand":
        return preset("understanding", max_new_tokens=UNDERSTANDING_DEFAULTS.max_new_tokens
                      if args.max_new_tokens is None else args.max_new_tokens,
                      do_sample=args.do_sample, temperature=args.temperature, think=args.think)
    size = dict(width=args.width, height=args.height) if args.command == "t2i" else {}
    return preset(
        args.command, num_timesteps=args.steps, timestep_shift=args.timestep_shift,
        cfg_text_scale=args.cfg_text_scale, cfg_img_scale=args.cfg_img_scale, cfg_interval=tuple(args.cfg_interval),
        cfg_renorm_min=args.cfg_renorm_min, cfg_renorm_type=args.cfg_renorm_type, think=args.think,
        think_max_new_tokens=T2I_DEFAULTS.think_max_new_tokens if args.max_new_tokens is None
        else args.max_new_tokens, think_do_sample=args.do_sample, think_temperature=args.temperature, **size,
    )


def preflight(args) -> Checked:
    """Validate a parsed command line (``args.command``: ``understand``, ``t2i`` or ``edit``): the prompt, the
    request's settings and seed, the device, the output size and the prompt's positions against the
    checkpoint's config, the input image and ``--out``. Nothing here loads weights.
    """
    from .accounting import check_positions, generation_positions, understanding_positions
    from .config import load_bagel_config
    from .tokenizer import BagelTokenizer

    root = check_checkpoint_dir(args.checkpoint)
    if getattr(args, "prompt_file", None) is not None:
        prompt = read_prompt_file(args.prompt_file)
    else:
        prompt = check_text_argument("--prompt", args.prompt)
    out = getattr(args, "out", None)
    out_format = check_out_path(out) if out is not None else None
    task = args.command
    try:
        check_prompt(prompt)
        settings = request_settings(args)
        seed = check_seed(args.seed)
    except ValueError as exc:
        raise with_flag(exc) from None
    device = resolve_device(args.device)
    config = load_bagel_config(root)  # JSON only: gives the size limit and the position budget
    if task == "t2i":
        try:
            check_output_size(config, settings.width, settings.height)
        except ValueError as exc:
            raise with_flag(exc) from None
    image_path = getattr(args, "image", None)
    image = open_image(image_path) if image_path is not None else None
    tokenizer = BagelTokenizer.from_dir(root)
    has_image = image is not None
    try:
        if task == "understand":
            used = understanding_positions(tokenizer, prompt, has_image=has_image, think=settings.think)
            check_positions(config, used, 0, "prompt")
            check_positions(config, used, settings.max_new_tokens, "max_new_tokens")
        else:
            used = generation_positions(tokenizer, prompt, has_image=has_image, think=settings.think)
            check_positions(config, used, 0, "prompt")
            if settings.think:
                check_positions(config, used, settings.think_max_new_tokens + 2, "think_max_new_tokens")
    except ValueError as exc:
        raise with_flag(exc) from None
    return Checked(prompt=prompt, image=image, out_format=out_format, device=device, settings=settings, seed=seed)


__all__ = [
    "Checked",
    "FLAGS",
    "OUT_FORMATS",
    "check_checkpoint_dir",
    "check_out_path",
    "check_text_argument",
    "open_image",
    "preflight",
    "read_prompt_file",
    "request_settings",
    "resolve_device",
    "save_image",
    "with_flag",
]
