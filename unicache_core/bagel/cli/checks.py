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

import errno
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from unicache_commands.flags import printable
from unicache_commands.input_files import read_text_file
from unicache_commands.output_files import check_output_file, same_file, save_text, write_atomically

from ..seeding import check_seed
from ..settings import (
    T2I_DEFAULTS,
    UNDERSTANDING_DEFAULTS,
    GenerationSettings,
    UnderstandingSettings,
    check_output_size,
    check_prompt,
    preset,
)

if TYPE_CHECKING:
    from ..config import BagelConfig
    from ..request_check import CheckedRequest

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
    "taylorseer_interval": "--taylorseer-interval",
    "taylorseer_first_steps": "--taylorseer-first-steps",
    "taylorseer_order": "--taylorseer-order",
    "width": "--width",
    "height": "--height",
    "max_new_tokens": "--max-new-tokens",
    "think_max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "think_temperature": "--temperature",
    "device": "--device",
    "image": "--image",
}


def with_flag(exc: ValueError, flags: dict[str, str] | None = None) -> ValueError:
    """``ValueError("`num_timesteps` must be ...")`` → ``ValueError("--steps: `num_timesteps` must be ...")``.

    ``flags`` overrides entries of :data:`FLAGS` (``{"prompt": "--prompt-file"}`` when the prompt came from a file).
    """
    message = str(exc)
    match = re.match(r"`([a-z_]+)", message)
    flag = ({**FLAGS, **(flags or {})}).get(match.group(1)) if match else None
    return ValueError(f"{flag}: {message}") if flag else exc


# ------------------------------------------------------------------------------------------- paths


def not_found(flag: str, path: Path, what: str) -> OSError:
    """The error for a ``path`` that does not exist: a symlink loop and a dangling symlink are named as such."""
    if path.is_symlink():
        try:
            os.stat(path)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return OSError(
                    f"{flag}: {printable(path)} is a symlink loop (it never reaches a real {what}); fix the link"
                )
        return FileNotFoundError(
            f"{flag}: {printable(path)} is a broken symlink to {printable(os.readlink(path))}, which does not exist; "
            f"fix the link or pass the {what} itself"
        )
    return FileNotFoundError(f"{flag}: {what} not found: {printable(path)}")


def check_checkpoint_dir(path: Path) -> Path:
    """``--checkpoint`` must be an existing BAGEL checkpoint folder (a file, a missing path or a folder with no
    ``llm_config.json`` is a one-line error; the last names every file of the official layout and its size)."""
    if path.is_file():
        raise ValueError(
            f"--checkpoint: {path} is a file, not a folder; pass the folder that holds llm_config.json, "
            f"ema.safetensors and ae.safetensors"
        )
    if not path.is_dir():
        if path.exists():
            raise FileNotFoundError(f"--checkpoint: is not a folder: {path}")
        raise not_found("--checkpoint", path, "folder")
    from ..checkpoint.official_layout import is_checkpoint_folder, not_a_checkpoint_message

    if not is_checkpoint_folder(path):
        raise FileNotFoundError(f"--checkpoint: {not_a_checkpoint_message(path)}")
    return path


def check_writable_file(flag: str, path: Path, what: str) -> None:
    """``path`` can be written as the ``what`` (``"image file"``):
    :func:`~unicache_commands.output_files.check_output_file` (not a folder, device, FIFO or socket, not under a
    file, not a weights or checkpoint file, its folder writable or creatable; a symlink loop is named as such, a
    dangling symlink is written through)."""
    check_output_file(flag, path, what)


def check_out_path(out: Path) -> str:
    """Validate ``--out`` before anything runs and return the PIL format for its suffix.

    It must be a writable file path (:func:`check_writable_file`) whose suffix names a supported format.
    """
    if out.is_dir():
        raise ValueError(
            f"--out: {out} is a directory; give the path of the image file to write, e.g. {out / 'out.png'}"
        )
    check_writable_file("--out", out, "image file")
    fmt = OUT_FORMATS.get(out.suffix.lower())
    if fmt is None:
        raise ValueError(f"--out: unsupported image suffix {out.suffix!r} in {out}; use one of {sorted(OUT_FORMATS)}")
    return fmt


def check_report_path(report: Path) -> None:
    """Validate ``--report`` before anything runs (:func:`check_writable_file`)."""
    check_writable_file("--report", report, "JSON report")


def save_image(image, out: Path, fmt: str) -> None:
    """Write ``image`` to ``out`` (``--out``) atomically: a temporary file in the same folder, then a rename."""
    write_atomically(
        "--out", out, lambda tmp: image.save(tmp, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    )


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
    """``--prompt-file``: a regular file of at most :data:`MAX_PROMPT_FILE_BYTES`, strict UTF-8 (an initial BOM and
    one final newline are dropped; :func:`~unicache_commands.input_files.read_text_file`)."""
    if not path.exists() and not path.is_dir():
        raise not_found("--prompt-file", path, "file")
    text = read_text_file(path, label=f"--prompt-file: {path}", max_bytes=MAX_PROMPT_FILE_BYTES)
    if text.endswith("\r\n"):
        text = text[:-2]
    elif text.endswith("\n"):
        text = text[:-1]
    return text


# ------------------------------------------------------------------------------------------- images


def open_image(path: Path, flag: str = "--image"):
    """Decode ``--image`` (``flag`` names it in errors) as PIL does (no EXIF transpose, as officially); refuses
    decompression bombs.

    Images above PIL's ``Image.MAX_IMAGE_PIXELS`` are refused before their pixels are decoded (PIL
    only warns between 1x and 2x that limit; here both are errors). The RGB conversion
    is tried too, so an unconvertible mode fails here and not after loading.
    """
    from PIL import Image, UnidentifiedImageError

    from ..transforms import pil_img2rgb

    if path.is_dir():
        raise ValueError(f"{flag}: {printable(path)} is a directory; pass an image file")
    if not path.exists():
        raise not_found(flag, path, "file")
    if not path.is_file():
        raise ValueError(f"{flag}: {printable(path)} is not a regular file; pass an image file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                img.load()
                image = img.copy()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ValueError(
            f"{flag}: {printable(path)} is too large to decode safely ({exc}); downscale it below "
            f"{Image.MAX_IMAGE_PIXELS} pixels first (BAGEL resizes every input to at most 1024 px per side)"
        ) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as exc:
        raise ValueError(f"{flag}: cannot read {printable(path)} as an image ({exc})") from None
    try:
        pil_img2rgb(image, "image")
    except ValueError as exc:
        raise ValueError(f"{flag}: {printable(path)}: {exc}") from None
    return image


# ------------------------------------------------------------------------------------------- request


def check_kv_target_size(kv_target: str | None, config, dtype: str) -> None:
    """``--kv-target``: parsed (a ValueError names the flag), and a size must hold at least one cached token of the
    checkpoint (keys and values of every layer in ``dtype``), else nothing could be kept."""
    from ...compression import parse_kv_target
    from ..checkpoint.loader import parse_dtype
    from ..memory.accounting import kv_bytes_per_token

    try:
        target = parse_kv_target(kv_target)
    except ValueError as exc:
        raise ValueError(f"--kv-target: {exc}") from None
    if isinstance(target, int):
        row = kv_bytes_per_token(config, parse_dtype(dtype))
        if target < row:
            raise ValueError(
                f"--kv-target: {kv_target!r} is {target} bytes, less than one cached token of this "
                f"checkpoint ({row} bytes in {dtype}); give at least {row} bytes or a ratio (0.2, 20%)"
            )


def check_policy_table(args, root: Path, config: BagelConfig) -> None:
    """``--kv-method unicache``: the policy table it will use (``--policy``, else the checkpoint's own
    ``unicache_policy.json``) is read, must cover the task and fit the model's segments, so a broken table costs no
    weights load."""
    from ...compression.policy_table import CHECKPOINT_POLICY_FILE, resolve_policy_table
    from ..checkpoint.model_id import model_id_of
    from ..tokens import segment_rows

    policy = getattr(args, "policy", None)
    if getattr(args, "kv_method", None) != "unicache" or (
        policy is None and not os.path.lexists(root / CHECKPOINT_POLICY_FILE)  # a FIFO there is refused, not skipped
    ):
        return  # the shipped paper table (its warning is logged once, by the run)
    table, _ = resolve_policy_table(policy, str(root), model_id_of(root), segment_rows(config))
    table.require_task("understanding" if args.command == "understand" else args.command)


@dataclass
class Checked:
    """What :func:`preflight` validated: the prompt text, the decoded image, the output format, the device, the
    request's settings and seed; ``items``: the request's item list when it is not a single-image request (several
    ``--image``, ``--items``: :mod:`.items`; ``image`` is then its last image), ``request``: that list checked and
    counted once (:class:`~..request_check.CheckedRequest`, run as it is), ``rounds_out``: where an iterative
    request writes its earlier images."""

    prompt: str | None
    image: Any
    out_format: str | None
    device: str
    settings: GenerationSettings | UnderstandingSettings
    seed: int
    items: tuple | None = None
    request: CheckedRequest | None = None
    rounds_out: tuple[Path, ...] = ()

    def understanding_settings(self) -> UnderstandingSettings:
        """``settings`` of an ``understand`` request (a TypeError when they are a generation's)."""
        return narrow_settings(self.settings, UnderstandingSettings)

    def generation_settings(self) -> GenerationSettings:
        """``settings`` of a ``t2i`` / ``edit`` request (a TypeError when they are an understanding's)."""
        return narrow_settings(self.settings, GenerationSettings)


def require_prompt(prompt: str | None) -> str:
    """The prompt of a request without ``--items`` (a ValueError naming the flags when it is missing)."""
    if prompt is None:
        raise ValueError("--prompt: the request has no text; give --prompt TEXT, --prompt-file FILE or --items FILE")
    return prompt


_S = TypeVar("_S", GenerationSettings, UnderstandingSettings)


def narrow_settings(settings: GenerationSettings | UnderstandingSettings, kind: type[_S]) -> _S:
    """``settings`` as ``kind``, the settings class of the command (a TypeError, a bug, when they are not)."""
    if not isinstance(settings, kind):
        raise TypeError(f"the request's settings are {type(settings).__name__}, expected {kind.__name__}")
    return settings


def resolve_device(device: str) -> str:
    """``--device``: ``auto`` is cuda when available, else cpu; anything else must be a usable torch device."""
    import torch

    from ..checkpoint.loader import parse_device

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parse_device(device)
    except ValueError as exc:
        raise with_flag(exc) from None
    return device


def request_settings(args) -> GenerationSettings | UnderstandingSettings:
    """The settings of a parsed ``understand`` / ``t2i`` / ``edit`` command line (a ValueError names the field).

    ``--max-new-tokens`` and ``--temperature`` set the answer's decoding, or the think text's in generation.
    """
    if args.command == "understand":
        return preset(
            "understanding",
            max_new_tokens=UNDERSTANDING_DEFAULTS.max_new_tokens
            if args.max_new_tokens is None
            else args.max_new_tokens,
            do_sample=args.do_sample,
            temperature=args.temperature,
            think=args.think,
            prompt_special_tokens=args.allow_special_tokens,
        )
    size = dict(width=args.width, height=args.height) if args.command == "t2i" else {}
    return preset(
        args.command,
        num_timesteps=args.steps,
        timestep_shift=args.timestep_shift,
        cfg_text_scale=args.cfg_text_scale,
        cfg_img_scale=args.cfg_img_scale,
        cfg_interval=tuple(args.cfg_interval),
        cfg_renorm_min=args.cfg_renorm_min,
        cfg_renorm_type=args.cfg_renorm_type,
        think=args.think,
        think_max_new_tokens=T2I_DEFAULTS.think_max_new_tokens if args.max_new_tokens is None else args.max_new_tokens,
        think_do_sample=args.do_sample,
        think_temperature=args.temperature,
        prompt_special_tokens=args.allow_special_tokens,
        **taylorseer_changes(args),
        **size,
    )


#: The TaylorSeer settings that have a flag of their own, which applies only with ``--taylorseer``.
TAYLORSEER_FLAGS = {
    "taylorseer_interval": "--taylorseer-interval",
    "taylorseer_first_steps": "--taylorseer-first-steps",
    "taylorseer_order": "--taylorseer-order",
}


def taylorseer_changes(args) -> dict[str, Any]:
    """The TaylorSeer settings of a command line (a run's or ``plan``'s), for :func:`~.settings.preset`: a
    ``--taylorseer-*`` flag without ``--taylorseer`` is refused (it would be silently ignored), and so is
    ``--taylorseer`` on an understanding request (it has no denoising steps; ``understand`` has no such flag)."""
    enabled = bool(getattr(args, "taylorseer", False))
    given = {name: getattr(args, name) for name in TAYLORSEER_FLAGS if getattr(args, name, None) is not None}
    if given and not enabled:
        flag = TAYLORSEER_FLAGS[next(iter(given))]
        raise ValueError(f"{flag}: applies only with --taylorseer; add --taylorseer or drop {flag}")
    if enabled and (getattr(args, "task", None) or args.command) in ("und", "understand"):
        raise ValueError(
            "--taylorseer: an understanding request has no denoising steps to forecast (understand takes no "
            "--taylorseer); drop it, or plan --task t2i or edit"
        )
    return {"taylorseer": enabled, **given} if enabled else {}


def check_prompt_positions(
    config, tokenizer, task: str, prompt: str, has_image: bool, settings: GenerationSettings | UnderstandingSettings
) -> None:
    """The prompt's RoPE positions, then with the answer's (``understand``) or the think text's, against the
    checkpoint's budget (a ValueError naming the field)."""
    from ..memory.accounting import check_positions, generation_positions, understanding_positions

    if task == "understand":
        understanding = narrow_settings(settings, UnderstandingSettings)
        think, special = understanding.think, understanding.prompt_special_tokens
        used = understanding_positions(tokenizer, prompt, has_image=has_image, think=think, special_tokens=special)
        check_positions(config, used, 0, "prompt")
        check_positions(config, used, understanding.max_new_tokens, "max_new_tokens")
        return
    generation = narrow_settings(settings, GenerationSettings)
    think, special = generation.think, generation.prompt_special_tokens
    used = generation_positions(tokenizer, prompt, has_image=has_image, think=think, special_tokens=special)
    check_positions(config, used, 0, "prompt")
    if think:
        check_positions(config, used, generation.think_max_new_tokens + 2, "think_max_new_tokens")


def preflight(args, *, items: bool = False) -> Checked:
    """Validate a parsed command line (``args.command``: ``understand``, ``t2i`` or ``edit``): the prompt, the
    request's settings and seed, the device, the output size and the prompt's positions against the
    checkpoint's config, the input image and ``--out``. Nothing here loads weights. ``items``: the request is an
    item list (:func:`~.items.preflight_request` checks its images, texts and positions), so the image and the
    prompt's positions are left to it.
    """
    from ..checkpoint.folder import check_folder_weights
    from ..config import load_bagel_config
    from ..tokenizer import BagelTokenizer, check_bagel_tokens

    root = check_checkpoint_dir(args.checkpoint)
    prompt_flag = None
    if getattr(args, "items", None) is not None:
        prompt = None  # the texts are in the items file
    elif getattr(args, "prompt_file", None) is not None:
        prompt = read_prompt_file(args.prompt_file)
        prompt_flag = {"prompt": f"--prompt-file {args.prompt_file}"}
    else:
        prompt = check_text_argument("--prompt", args.prompt)
        prompt_flag = None
    out = getattr(args, "out", None)
    out_format = check_out_path(out) if out is not None else None
    if getattr(args, "report", None) is not None:
        check_report_path(args.report)
    task = args.command
    try:
        if prompt is not None:
            check_prompt(prompt)
        settings = request_settings(args)
        seed = check_seed(args.seed)
    except ValueError as exc:
        raise with_flag(exc, prompt_flag) from None
    device = resolve_device(args.device)
    config = load_bagel_config(root)  # JSON only: gives the size limit and the position budget
    check_kv_target_size(getattr(args, "kv_target", None), config, args.dtype)
    check_policy_table(args, root, config)
    if task == "t2i":
        t2i = narrow_settings(settings, GenerationSettings)
        try:
            check_output_size(config, t2i.width, t2i.height)
        except ValueError as exc:
            raise with_flag(exc) from None
    if items:
        return Checked(prompt, None, out_format, device, settings, seed)
    paths = args.image if isinstance(args.image, list) else [p for p in (getattr(args, "image", None),) if p]
    if task == "edit" and not paths:
        raise ValueError("--image: an edit needs its source image: give --image FILE (or --items FILE.json)")
    image = open_image(paths[0]) if paths else None
    tokenizer = BagelTokenizer.from_dir(root)
    check_bagel_tokens(tokenizer, root)
    text = require_prompt(prompt)
    try:
        check_prompt_positions(config, tokenizer, task, text, image is not None, settings)
    except ValueError as exc:
        raise with_flag(exc, prompt_flag) from None
    check_folder_weights(root, config)  # the weights' headers, so the plan and the load never build a claimed geometry
    return Checked(prompt, image, out_format, device, settings, seed)


__all__ = [
    "Checked",
    "FLAGS",
    "OUT_FORMATS",
    "check_checkpoint_dir",
    "check_kv_target_size",
    "check_out_path",
    "check_policy_table",
    "check_prompt_positions",
    "check_report_path",
    "check_writable_file",
    "taylorseer_changes",
    "not_found",
    "check_text_argument",
    "open_image",
    "preflight",
    "narrow_settings",
    "read_prompt_file",
    "require_prompt",
    "request_settings",
    "resolve_device",
    "same_file",
    "save_image",
    "save_text",
    "with_flag",
]
