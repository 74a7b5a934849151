"""The README's workflow thumbnails and the template browser's pictures, made from what ``make demo`` wrote: one
strip per shipped workflow with its input image, its outputs and its KV report's plot, each captioned, and one
square card of its pictures per workflow for ComfyUI's template browser.

    make thumbnails                                   # make demo, then this
    .venv/bin/python -m tools.thumbnails [--demo out/demo] [--out docs/images] [--templates workflows]

For ``workflows/api/<name>.json`` it reads ``<demo>/<name>/summary.json`` (the batch runner's, one run) and writes
``<out>/demo_<name>.png`` and ``<templates>/<name>.jpg``. ComfyUI's frontend (1.32) shows a custom node pack's
example workflow ``<folder>/<name>.json`` with the picture ``/api/workflow_templates/<pack>/<name>.jpg``, a JPEG of
the same name beside it (the host serves the pack's ``workflows`` folder there, as it does ``example_workflows``).
What each image is comes from the workflow itself: a ``LoadImage`` is the input (``workflows/assets/``), a
``SaveImage`` an output (captioned with the KV method of the task node it saves), a ``PreviewImage`` of a
``UniCacheKVReport`` the report's plot; an understanding node's answer captions the input.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from unicache_commands.flags import OneLineParser, path_arg
from unicache_commands.output_files import check_outputs, write_atomically

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / "workflows" / "api"
ASSETS = ROOT / "workflows" / "assets"
#: Height of every panel's picture, in pixels (the bundled model's 128 px images are drawn at 1.25x, unsmoothed).
PANEL = 160
CAPTION = 34
GAP = 8
BACKGROUND = (255, 255, 255)
INK = (40, 40, 40)
#: An output file of the batch runner: ``node<id>_<index>_<name>`` (tools/batch/outputs.py).
OUTPUT_NAME = re.compile(r"node(?P<node>[^_]+)_(?P<index>\d+)(?:_(?P<name>.*))?$")
TASK_LABELS = {"UniCacheTextToImage": "text to image", "UniCacheImageEdit": "edit", "UniCacheUnderstand": "answer"}


@dataclass(frozen=True)
class Panel:
    """One picture of a strip and its caption."""

    image: Image.Image
    caption: str


def _source(graph: dict, node_id: str, input_name: str) -> str | None:
    """The id of the node feeding ``input_name`` of ``node_id`` (an API workflow link is ``[id, output]``)."""
    link = graph[node_id]["inputs"].get(input_name)
    return str(link[0]) if isinstance(link, list) else None


def _kv_method(graph: dict, task_id: str) -> str:
    config = _source(graph, task_id, "kv")
    return graph[config]["inputs"]["method"] if config else "full"


def _outputs(run: dict) -> dict[str, list[Path]]:
    """The run's output files by the node id that wrote them."""
    by_node: dict[str, list[Path]] = {}
    for name in run["outputs"]:
        match = OUTPUT_NAME.match(Path(name).stem)
        if match:
            by_node.setdefault(match["node"], []).append(ROOT / name if not Path(name).is_absolute() else Path(name))
    return by_node


def _fit(image: Image.Image) -> Image.Image:
    """``image`` at :data:`PANEL` pixels high: small images scaled without smoothing, large ones smoothly."""
    image = image.convert("RGB")
    width = max(1, round(image.width * PANEL / image.height))
    smooth = Image.Resampling.LANCZOS if image.height > PANEL else Image.Resampling.NEAREST
    return image.resize((width, PANEL), smooth)


def panels(name: str, demo: Path) -> list[Panel]:
    """The panels of workflow ``name``: input, outputs, report plots, in the workflow's node order."""
    graph = json.loads((WORKFLOWS / f"{name}.json").read_text(encoding="utf-8"))
    summary = json.loads((demo / name / "summary.json").read_text(encoding="utf-8"))
    run = summary["runs"][0]
    if run["status"] != "success":
        raise ValueError(f"{demo / name / 'summary.json'}: the demo run of {name} did not succeed ({run['status']})")
    files = _outputs(run)
    answers = {
        _source(graph, node_id, "image"): files[node_id][0].read_text(encoding="utf-8").strip()
        for node_id, node in graph.items()
        if node["class_type"] == "UniCacheUnderstand" and node_id in files
    }
    result = []
    for node_id in sorted(graph, key=int):
        node = graph[node_id]
        kind = node["class_type"]
        if kind == "LoadImage":
            answer = answers.get(node_id)
            caption = f'input · answer: "{answer}"' if answer else "input"
            result.append(Panel(Image.open(ASSETS / node["inputs"]["image"]), caption))
        elif kind == "SaveImage":
            task = _source(graph, node_id, "images")
            label = TASK_LABELS.get(graph[task]["class_type"], "output")
            method = _kv_method(graph, task)
            caption = f"{label}, {'full KV' if method == 'full' else method}"
            result += [Panel(Image.open(p), caption) for p in files.get(node_id, []) if p.suffix == ".png"]
        elif kind == "PreviewImage":
            report = _source(graph, node_id, "images")
            if graph[report]["class_type"] == "UniCacheKVReport":
                result += [Panel(Image.open(p), "KV report") for p in files.get(node_id, []) if p.suffix == ".png"]
    if not result:
        raise ValueError(f"{demo / name}: no images found for workflow {name}")
    return result


def strip(items: list[Panel]) -> Image.Image:
    """The panels side by side, each captioned under it."""
    pictures = [_fit(p.image) for p in items]
    font = ImageFont.load_default(size=13)
    width = sum(p.width for p in pictures) + GAP * (len(pictures) + 1)
    canvas = Image.new("RGB", (width, PANEL + CAPTION + GAP), BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    x = GAP
    for picture, item in zip(pictures, items):
        canvas.paste(picture, (x, GAP))
        draw.rectangle((x, GAP, x + picture.width - 1, GAP + PANEL - 1), outline=(200, 200, 200))
        draw.text((x + picture.width / 2, GAP + PANEL + 6), item.caption, fill=INK, font=font, anchor="ma")
        x += picture.width + GAP
    return canvas


#: Side of a template card, in pixels.
CARD = 320


def card(items: list[Panel]) -> Image.Image:
    """The pictures of the panels but the KV report's, on a white square of :data:`CARD` pixels: one picture
    fills it, more are laid out on a grid (input first, outputs after)."""
    pictures = [p.image.convert("RGB") for p in items if p.caption != "KV report"] or [items[0].image.convert("RGB")]
    cols = 1 if len(pictures) == 1 else 2
    rows = -(-len(pictures) // cols)
    cell = (CARD - GAP * (cols + 1)) // cols
    canvas = Image.new("RGB", (CARD, CARD), BACKGROUND)
    top = (CARD - rows * cell - (rows - 1) * GAP) // 2
    for index, picture in enumerate(pictures):
        scale = min(cell / picture.width, cell / picture.height)
        size = (max(1, round(picture.width * scale)), max(1, round(picture.height * scale)))
        smooth = Image.Resampling.LANCZOS if scale < 1 else Image.Resampling.NEAREST
        row, col = divmod(index, cols)
        x = GAP + col * (cell + GAP) + (cell - size[0]) // 2
        y = top + row * (cell + GAP) + (cell - size[1]) // 2
        canvas.paste(picture.resize(size, smooth), (x, y))
    return canvas


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m tools.thumbnails", description=__doc__.splitlines()[0])
    parser.add_argument("--demo", type=Path, default=ROOT / "out" / "demo", help="make demo's output folder")
    parser.add_argument("--out", type=path_arg, default=ROOT / "docs" / "images", help="where the PNGs go")
    parser.add_argument(
        "--templates", type=path_arg, default=ROOT / "workflows", help="where the template cards (<name>.jpg) go"
    )
    args = parser.parse_args(argv)
    names = sorted(p.stem for p in WORKFLOWS.glob("*.json"))
    missing = [n for n in names if not (args.demo / n / "summary.json").is_file()]
    if missing:
        sys.stderr.write(f"error: {args.demo} has no demo run of {', '.join(missing)}; run `make demo` first\n")
        return 2
    try:  # the one output guard: never a file of --demo, a device or a checkpoint's file
        check_outputs(
            [("--out", args.out / f"demo_{name}.png", "thumbnail PNG") for name in names]
            + [("--templates", args.templates / f"{name}.jpg", "template card") for name in names],
            input_folders=[("--demo", args.demo)],
        )
    except (OSError, ValueError) as error:
        parser.error(str(error))
    args.out.mkdir(parents=True, exist_ok=True)
    args.templates.mkdir(parents=True, exist_ok=True)
    for name in names:
        try:
            made = panels(name, args.demo)
        except (OSError, ValueError, KeyError) as error:
            sys.stderr.write(f"error: {name}: {error}\n")
            return 2
        target, template = args.out / f"demo_{name}.png", args.templates / f"{name}.jpg"
        strip_image, card_image = strip(made), card(made)
        write_atomically("--out", target, lambda tmp, im=strip_image: im.save(tmp, format="PNG", optimize=True))
        write_atomically(
            "--templates", template, lambda tmp, im=card_image: im.save(tmp, format="JPEG", quality=90, optimize=True)
        )
        for path in (target, template):
            sys.stdout.write(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
