"""The pack's icon for the Comfy Registry and ComfyUI-Manager (``[tool.comfy] Icon`` in pyproject.toml): a
square PNG, at most 400 px, as the registry asks. A bagel whose ring is a KV cache: full rows in grey, the rows
UniCache keeps in blue.

    .venv/bin/python -m tools.icon [--out docs/images/icon.png]
"""

from __future__ import annotations

import sys
from pathlib import Path

from PIL import Image, ImageDraw

from unicache_commands.flags import OneLineParser, path_arg
from unicache_commands.output_files import check_outputs, write_atomically

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "images" / "icon.png"
SIZE = 256
#: Segments of the ring, and which of them are drawn as kept (one in five: UniCache's default 80% reduction).
SEGMENTS = 30
KEPT_EVERY = 5
DOUGH, KEPT, HOLE = (196, 150, 92), (30, 136, 229), (255, 255, 255, 0)


def icon(size: int = SIZE) -> Image.Image:
    """The icon as an RGBA image of ``size`` x ``size`` pixels."""
    scale = 4  # drawn large, then scaled down smoothly
    big = size * scale
    image = Image.new("RGBA", (big, big), (0, 0, 0, 0))
    draw = ImageDraw.Draw(image)
    centre, outer, inner = big / 2, big * 0.47, big * 0.2
    step = 360 / SEGMENTS
    for i in range(SEGMENTS):
        colour = KEPT if i % KEPT_EVERY == 0 else DOUGH
        start = i * step - 90
        draw.pieslice(
            (centre - outer, centre - outer, centre + outer, centre + outer), start, start + step * 0.86, colour
        )
    draw.ellipse((centre - inner, centre - inner, centre + inner, centre + inner), fill=HOLE)
    return image.resize((size, size), Image.Resampling.LANCZOS)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m tools.icon", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=path_arg, default=OUT, help="the PNG to write")
    args = parser.parse_args(argv)
    try:  # the one output guard: never a device, a folder, a checkpoint's file; written whole
        check_outputs([("--out", args.out, "icon PNG")])
    except (OSError, ValueError) as error:
        parser.error(str(error))
    image = icon()
    write_atomically("--out", args.out, lambda tmp: image.save(tmp, format="PNG", optimize=True))
    sys.stdout.write(f"{args.out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
