"""The README's "what fits on your card" tables: BAGEL-7B-MoT's memory plan (``python -m unicache_core.bagel plan
--checkpoint bagel-7b-mot ...``) for each request the pack runs, weight storage and offload, on 8-24 GB cards; and
the most input images a request takes on each card (:func:`~unicache_core.bagel.memory.card_fit.card_table`).

    .venv/bin/python -m tools.card_table            # print the markdown tables
    .venv/bin/python -m tools.card_table --write    # put them into README.md and docs/memory.md between markers

A request is one row group (:data:`REQUESTS`): add one there to add it to the table. ``tests/test_card_table.py``
checks that the README holds the table this script makes, so a change of the plan shows up as a failing test
until the table is written again.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from unicache_commands.flags import OneLineParser
from unicache_core.bagel.memory.plan import MemoryPlan, PlanSettings, official_config, plan_memory

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
START = "<!-- card-table:start (python -m tools.card_table --write) -->"
END = "<!-- card-table:end -->"
IMAGES_START = "<!-- card-images:start (python -m tools.card_table --write) -->"
IMAGES_END = "<!-- card-images:end -->"
COMFY_START = "<!-- comfy-box:start (python -m tools.card_table --write) -->"
COMFY_END = "<!-- comfy-box:end -->"
MEMORY_DOC = ROOT / "docs" / "memory.md"
#: Card sizes, in decimal GB as the plan counts them (an "8 GB" card has 8 GiB = 8.6 GB, some of it taken by
#: the driver and the display: the decimal size is a margin for that).
CARDS_GB = (8, 12, 16, 24)
#: A device with room for anything: the plan's peak with the whole VAE decode (a card too small for it falls back
#: to the tiled decode, whose peak its cell shows).
ROOMY_GB = 1000
#: Weight storage x offload, in the order a user with less memory would go down the list.
SETTINGS = (("bf16", "none"), ("fp8_e4m3fn", "none"), ("bf16", "layers"), ("fp8_e4m3fn", "layers"))
#: The KV method the table plans with (the pack's default); its compressed KV is shown beside the full one.
KV_METHOD = "unicache"
#: The compute dtype (the loader's `auto` on a GPU with bf16).
COMPUTE_DTYPE = "bf16"
GB = 1e9


@dataclasses.dataclass(frozen=True)
class CardRequest:
    """One kind of request in the table: the plan's task (``und``, ``t2i``, ``edit``) at ``width x height``."""

    label: str
    task: str
    width: int
    height: int


#: The requests of the shipped workflows at BAGEL-7B-MoT's official size.
REQUESTS = (
    CardRequest("understand a 1024² image", "und", 1024, 1024),
    CardRequest("text to image, 1024²", "t2i", 1024, 1024),
    CardRequest("edit a 1024² image", "edit", 1024, 1024),
)


def plan(request: CardRequest, weight_dtype: str, offload: str, card_gb: int) -> MemoryPlan:
    """The memory plan of ``request`` on a ``card_gb`` GB GPU."""
    settings = PlanSettings(
        task=request.task,
        width=request.width,
        height=request.height,
        kv_method=KV_METHOD,
        weight_dtype=weight_dtype,
        dtype=COMPUTE_DTYPE,
        offload=offload,
        device="cuda",
    )
    return plan_memory(official_config(), settings, int(card_gb * GB))


def _cell(result: MemoryPlan) -> str:
    if not result.fits:
        return "no"
    tiled = ", VAE tiled" if result.vae_decode == "tiled" else ""
    return f"**yes** ({result.peak_bytes / GB:.1f}{tiled})"


def table_rows() -> list[str]:
    """The markdown table: one row per request x weights x offload, one column per card."""
    cards = " | ".join(f"{gb} GB" for gb in CARDS_GB)
    rows = [
        f"| request | weights | offload | peak (GB) | KV full / UniCache (GB) | {cards} |",
        "|---|---|---|---|---|" + "---|" * len(CARDS_GB),
    ]
    for request in REQUESTS:
        for weight_dtype, offload in SETTINGS:
            plans = [plan(request, weight_dtype, offload, gb) for gb in CARDS_GB]
            roomy = plan(request, weight_dtype, offload, ROOMY_GB)  # the whole VAE decode's peak
            parts = roomy.breakdown
            kv = f"{parts['kv_full'] / GB:.2f} / {parts.get('kv_compressed', parts['kv_full']) / GB:.2f}"
            rows.append(
                f"| {request.label} | {weight_dtype} | {offload} | {roomy.peak_bytes / GB:.1f} | {kv} | "
                + " | ".join(_cell(p) for p in plans)
                + " |"
            )
    return rows


def table() -> str:
    return "\n".join(table_rows()) + "\n"


def images_table() -> str:
    """The most input images per card (fp8 weights, without and with layer offload): 1024² images of an edit (the
    edited one included) and 980 px images of an understanding question, with full KV (each image's rows held
    once) and with UniCache at its default (``speed``: a generation's ViT rows wait whole for the first step, as in
    the official release) and with its ``memory`` objective (every image row stored in a few bits as it is written)."""
    from unicache_core.bagel.memory.card_fit import MOST_IMAGES_SEARCHED, card_table
    from unicache_core.compression.methods.unicache import UniCache

    cells = {(r.card_gb, r.offload, r.task, r.kv_method): r.most_images for r in card_table()}
    memory = card_table(kv_methods=(UniCache(objective="memory"),))
    cells.update({(r.card_gb, r.offload, r.task, "unicache:memory"): r.most_images for r in memory})

    def count(value: int) -> str:
        return "-" if not value else f"{value}+" if value >= MOST_IMAGES_SEARCHED else str(value)

    def ratio(ours: int, full: int) -> str:
        return (f"{ours / full:.1f}" + ("+" if ours >= MOST_IMAGES_SEARCHED else "")) if full else "-"

    rows = [
        "| card | offload | edit, 1024² images: full KV | UniCache (x) | UniCache memory (x) | understand, 980 px "
        "images: full KV | UniCache (x) | UniCache memory (x) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for card in CARDS_GB:
        for offload in ("none", "layers"):
            counts = []
            for task in ("edit", "und"):
                full = cells[(card, offload, task, "full")]
                counts.append(count(full))
                for method in ("unicache", "unicache:memory"):
                    ours = cells[(card, offload, task, method)]
                    counts.append(count(ours) + (f" ({ratio(ours, full)})" if full else ""))
            rows.append(f"| {card} GB | {offload} | " + " | ".join(counts) + " |")
    return "\n".join(rows) + "\n"


def _comfy_cell(full: dict, ours: dict) -> str:
    def streamed(row: dict) -> str:
        unit = "answer token" if row["task"] == "understanding" else "step"
        return f"{row['streamed_per_step'] / GB:.1f} GB/{unit}"

    if ours["whole"] and full["whole"]:
        return "whole model on the card"
    text = f"streams {streamed(ours)}, {ours['offloaded'] / GB:.1f} GB off the card"
    return text if streamed(full) == streamed(ours) else f"{text} (full KV: {streamed(full)})"


def comfy_box() -> str:
    """The README's ComfyUI box: per card and loader ``weight_dtype``, what ComfyUI's own placement does with
    BAGEL-7B-MoT for each task at 1024² with UniCache (and full KV where it differs), from the memory plan of
    ComfyUI's rules (:mod:`unicache_core.bagel.memory.comfy_placement`); then the bytes streamed per denoising step
    for a 2- and a 4-image 1024² edit on 12 and 16 GB cards."""
    from unicache_core.bagel.memory.card_fit import COMFY_BOX_REQUESTS, comfy_box_rows, comfy_stream_rows

    cells = {(r["card_gb"], r["weight_dtype"], r["task"], r["kv_method"]): r for r in comfy_box_rows()}
    labels = {"understanding": "understand a 1024² image", "t2i": "text to image, 1024²", "edit": "edit a 1024² image"}
    rows = [
        "| your card | loader `weight_dtype` | " + " | ".join(labels[t] for t, _ in COMFY_BOX_REQUESTS) + " |",
        "|---|---|" + "---|" * len(COMFY_BOX_REQUESTS),
    ]
    for card in CARDS_GB:
        for weight_dtype in ("fp8_e4m3fn", "default"):
            cols = [
                _comfy_cell(cells[(card, weight_dtype, t, "full")], cells[(card, weight_dtype, t, "unicache")])
                for t, _ in COMFY_BOX_REQUESTS
            ]
            rows.append(f"| {card} GB | `{weight_dtype}` | " + " | ".join(cols) + " |")
    rows += [
        "",
        "A plan, not a measurement: ComfyUI 0.3.75's placement rules (`load_models_gpu`, lowvram partial loading) "
        "applied to the memory the pack asks for, a card of N GB taken as N x 10^9 bytes free. With several images "
        "(fp8; GB):",
        "",
        "| card | 1024² edit of | full KV: memory_required / off the card / streamed per step | UniCache |",
        "|---|---|---|---|",
    ]
    stream = {(r["card_gb"], r["images"], r["kv_method"]): r for r in comfy_stream_rows()}
    for card, images in sorted({(c, n) for c, n, _ in stream}):
        cols = [
            f"{r['memory_required'] / GB:.2f} / {r['offloaded'] / GB:.2f} / {r['streamed_per_step'] / GB:.1f}"
            for r in (stream[(card, images, "full")], stream[(card, images, "unicache")])
        ]
        rows.append(f"| {card} GB | {images} images | " + " | ".join(cols) + " |")
    return "\n".join(rows) + "\n"


def readme_table(text: str, start: str = START, end: str = END) -> str:
    """The table between the README's markers."""
    if start not in text or end not in text:
        raise ValueError(f"README.md has no card-table markers ({start} ... {end})")
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n") + "\n"


def write_into(text: str, new_table: str, start: str = START, end: str = END) -> str:
    """``text`` with the table between its markers replaced by ``new_table``."""
    readme_table(text, start, end)  # the markers are there
    head, rest = text.split(start, 1)
    tail = rest.split(end, 1)[1]
    return f"{head}{start}\n{new_table}{end}{tail}"


def blocks() -> list[tuple[str, str, str]]:
    """``(start marker, end marker, text)`` of every generated block."""
    return [(START, END, table()), (IMAGES_START, IMAGES_END, images_table()), (COMFY_START, COMFY_END, comfy_box())]


def write_blocks(path: Path, made: list[tuple[str, str, str]]) -> list[str]:
    """Write each block of ``made`` whose markers ``path`` holds; the start markers written."""
    text = path.read_text(encoding="utf-8")
    written = []
    for start, end, block in made:
        if start in text and end in text:
            text = write_into(text, block, start, end)
            written.append(start)
    path.write_text(text, encoding="utf-8")
    return written


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m tools.card_table", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--write", action="store_true", help="write the tables into README.md and docs/memory.md (between markers)"
    )
    args = parser.parse_args(argv)
    made = blocks()
    if not args.write:
        sys.stdout.write("\n".join(block for _, _, block in made))
        return 0
    written = write_blocks(README, made) + write_blocks(MEMORY_DOC, made)
    missing = [start for start, _, _ in made if start not in written]
    if missing:
        sys.stderr.write(f"error: no file holds the markers {', '.join(missing)}: add them where the table goes\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
