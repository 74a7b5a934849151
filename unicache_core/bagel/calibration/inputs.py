"""Calibration inputs: the prompts file, the image folder, deterministic synthetic images, and the pairing
of prompts with images."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from unicache_commands.input_files import read_text_file

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
MAX_PROMPTS_FILE_BYTES = 16 << 20


def read_prompts(path: Path) -> list[str]:
    """One prompt per line (a regular file of strict UTF-8, BOM dropped, surrounding whitespace stripped, blank lines
    skipped; :func:`~unicache_commands.input_files.read_text_file`)."""
    return [p for _, p in _numbered(path, _read(path))]


def _read(path: Path) -> str:
    advice = "pass a UTF-8 text file with one prompt per line"
    if not path.exists() and not path.is_symlink():
        raise FileNotFoundError(f"--prompts: file not found: {path}")
    return read_text_file(path, label=f"--prompts: {path}", max_bytes=MAX_PROMPTS_FILE_BYTES, advice=advice)


def _numbered(path: Path, text: str) -> list[tuple[int, str]]:
    lines = [(i + 1, line.strip()) for i, line in enumerate(text.splitlines())]
    lines = [(n, p) for n, p in lines if p]
    if not lines:
        raise ValueError(f"--prompts: {path} holds no prompt (every line is blank); write one prompt per line")
    return lines


def prompt_line_numbers(path: Path) -> list[int]:
    """File line number of each prompt :func:`read_prompts` returns (for error messages)."""
    return [n for n, _ in _numbered(path, _read(path))]


def read_images(folder: Path) -> list[tuple[str, object]]:
    """``[(file name, PIL image)]`` of the image files of ``folder`` (not recursive), sorted by name."""
    from ..cli.checks import open_image

    if not folder.exists():
        raise FileNotFoundError(f"--images: folder not found: {folder}")
    if not folder.is_dir():
        raise ValueError(f"--images: {folder} is not a folder; pass a folder of images")
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ValueError(f"--images: {folder} holds no image file ({', '.join(IMAGE_SUFFIXES)})")
    out = []
    for path in files:
        try:
            out.append((path.name, open_image(path)))
        except ValueError as exc:
            raise ValueError(str(exc).replace("--image:", "--images:", 1)) from None
    return out


#: Colours of the synthetic images (background, rectangle) — fixed, so calibration runs are reproducible.
_PALETTE = (
    (200, 40, 40),
    (40, 160, 60),
    (40, 70, 200),
    (230, 200, 40),
    (150, 60, 170),
    (30, 170, 180),
    (240, 130, 30),
    (120, 120, 120),
)


def synthetic_image(index: int, size: int):
    """A deterministic ``size x (3/4 size)`` RGB image: a coloured background with a rectangle of another colour."""
    from PIL import Image, ImageDraw

    width, height = size, max(16, (size * 3 // 4) // 16 * 16)
    bg = _PALETTE[index % len(_PALETTE)]
    fg = _PALETTE[(index * 3 + 1) % len(_PALETTE)]
    if fg == bg:
        red, green, blue = bg
        fg = (255 - red, 255 - green, 255 - blue)
    image = Image.new("RGB", (width, height), bg)
    draw = ImageDraw.Draw(image)
    fx, fy = ((index * 37) % 50) / 100.0, ((index * 61) % 50) / 100.0  # top-left corner in [0, 0.5)
    x0, y0 = int(fx * width), int(fy * height)
    draw.rectangle([x0, y0, x0 + width // 2 - 1, y0 + height // 2 - 1], fill=fg)
    return image


def pair_inputs(
    task: str, prompts: Sequence[str], images: Sequence[tuple[str, object]] | None, size: int
) -> tuple[list[tuple[str, object]], list[str | None]]:
    """``([(prompt, image or None)], [image name or None])``: one request input per prompt.

    t2i takes no image; edit / understanding prompts get ``images`` round-robin, or without ``images`` the
    synthetic image of their index (``size`` px wide, named ``synthetic-<index>``).
    """
    inputs: list[tuple[str, object]] = []
    image_names: list[str | None] = []
    for i, prompt in enumerate(prompts):
        if task == "t2i":
            inputs.append((prompt, None))
            image_names.append(None)
        elif images:
            name, image = images[i % len(images)]
            inputs.append((prompt, image))
            image_names.append(name)
        else:
            inputs.append((prompt, synthetic_image(i, size)))
            image_names.append(f"synthetic-{i}")
    return inputs, image_names


__all__ = [
    "IMAGE_SUFFIXES",
    "MAX_PROMPTS_FILE_BYTES",
    "pair_inputs",
    "prompt_line_numbers",
    "read_images",
    "read_prompts",
    "synthetic_image",
]
