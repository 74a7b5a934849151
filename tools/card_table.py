"""The README's "what fits on your card" tables: BAGEL-7B-MoT's memory plan (``python -m unicache_core.bagel plan
--checkpoint bagel-7b-mot ...``) for each request the pack runs, weight storage and offload, on 8-24 GB cards; and
the most input images a request takes on each card (:func:`~unicache_core.bagel.card_fit.card_table`).

    .venv/bin/python -m tools.card_table            # print the markdown tables
    .venv/bin/python -m tools.card_table --write    # put them into README.md between their markers

A request is one row group (:data:`REQUESTS`): add one there to add it to the table. ``tests/test_card_table.py``
checks that the README holds the table this script makes, so a change of the plan shows up as a failing test
until the table is written again.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from unicache_commands.flags import OneLineParser
from unicache_core.bagel.memory_plan import MemoryPlan, PlanSettings, official_config, plan_memory

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
START = "<!-- card-table:start (python -m tools.card_table --write) -->"
END = "<!-- card-table:end -->"
IMAGES_START = "<!-- card-images:start (python -m tools.card_table --write) -->"
IMAGES_END = "<!-- card-images:end -->"
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
    edited one included) and 980 px images of an understanding question, with full KV and with UniCache."""
    from unicache_core.bagel.card_fit import card_table

    cells = {(r.card_gb, r.offload, r.task, r.kv_method): r.most_images for r in card_table()}
    rows = [
        "| card | offload | edit, 1024² images: full KV | UniCache | understand, 980 px images: full KV | UniCache |",
        "|---|---|---|---|---|---|",
    ]
    for card in CARDS_GB:
        for offload in ("none", "layers"):
            counts = [cells[(card, offload, task, kv)] for task in ("edit", "und") for kv in ("full", "unicache")]
            rows.append(f"| {card} GB | {offload} | " + " | ".join(str(c) if c else "-" for c in counts) + " |")
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


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m tools.card_table", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the table into README.md (between its markers)")
    args = parser.parse_args(argv)
    new_table, new_images = table(), images_table()
    if args.write:
        try:
            text = write_into(README.read_text(encoding="utf-8"), new_table)
            README.write_text(write_into(text, new_images, IMAGES_START, IMAGES_END), encoding="utf-8")
        except ValueError as error:
            sys.stderr.write(f"error: {error}\n")
            return 2
    else:
        sys.stdout.write(new_table + "\n" + new_images)
    return 0


if __name__ == "__main__":
    sys.exit(main())
