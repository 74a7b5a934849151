"""The README's generated figures: the "what fits on your card" table is the memory plan's (tools/card_table.py),
and the plot of KV bytes draws the numbers of docs/results (tools/kv_plot.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from tools import card_table, kv_plot

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


def test_the_readme_holds_the_plans_card_table():
    made = card_table.table()
    assert card_table.readme_table(card_table.README.read_text(encoding="utf-8")) == made, (
        "the memory plan changed: run `python -m tools.card_table --write`"
    )
    rows = made.splitlines()[2:]
    assert len(rows) == len(card_table.REQUESTS) * len(card_table.SETTINGS)
    # what the plan says, row by row: fp8 with layer offload edits at 1024 px on an 8 GB card (tiled VAE decode),
    # bf16 without offload fits none of the cards
    edit_fp8_layers = next(r for r in rows if r.startswith("| edit") and "| fp8_e4m3fn | layers |" in r)
    assert "**yes** (6.7, VAE tiled)" in edit_fp8_layers.split("|")[6]
    assert all(cell.strip() == "no" for r in rows if "| bf16 | none |" in r for cell in r.split("|")[6:-1])


def test_the_readme_holds_the_plans_image_counts():
    made = card_table.images_table()
    readme = card_table.README.read_text(encoding="utf-8")
    assert card_table.readme_table(readme, card_table.IMAGES_START, card_table.IMAGES_END) == made, (
        "the memory plan changed: run `python -m tools.card_table --write`"
    )
    rows = {tuple(c.strip() for c in r.split("|")[1:3]): r.split("|")[3:-1] for r in made.splitlines()[2:]}
    assert set(rows) == {(f"{gb} GB", offload) for gb in card_table.CARDS_GB for offload in ("none", "layers")}
    # fp8 weights without offload (15.2 GB) leave room for images only on a 24 GB card
    assert all(
        c.strip() == "-"
        for (card, offload), cells in rows.items()
        if offload == "none" and card != "24 GB"
        for c in cells
    )
    # edit full / UniCache / UniCache memory, the same for a question: UniCache never fewer, more for an edit, and
    # its memory objective (every image row in a few bits as written) at least as many as its speed objective
    for cells in rows.values():
        full, speed, memory, und_full, und_speed, und_memory = (
            int(c.split()[0].strip("+").replace("-", "0")) for c in cells
        )
        assert memory >= speed >= full and und_memory >= 0.9 * und_full and und_speed >= 0.9 * und_full
    cells = [int(c.split()[0]) for c in rows[("24 GB", "none")]]
    assert cells[2] >= 3 * cells[0] and cells[1] > cells[0] > 0 and cells[4] >= cells[3] > 0


def test_the_readme_holds_the_comfyui_box():
    made = card_table.comfy_box()
    readme = card_table.README.read_text(encoding="utf-8")
    assert card_table.readme_table(readme, card_table.COMFY_START, card_table.COMFY_END) == made, (
        "the memory plan changed: run `python -m tools.card_table --write`"
    )
    assert "offload" not in made.splitlines()[0]
    assert "| 24 GB | `fp8_e4m3fn` | whole model on the card | whole model on the card | whole model" in made
    assert "GB/step" in made and "a plan" in made.lower()
    # ComfyUI's placement of a 2- and a 4-image edit on 12 and 16 GB cards, full KV and UniCache
    streamed = [r.split("|")[1:3] for r in made.splitlines() if r.endswith(" |") and " images |" in r]
    assert streamed == [
        [" 12 GB ", " 2 images "],
        [" 12 GB ", " 4 images "],
        [" 16 GB ", " 2 images "],
        [" 16 GB ", " 4 images "],
    ]


def test_the_table_goes_between_the_markers_and_nowhere_else():
    text = f"intro\n{card_table.START}\nold\n{card_table.END}\nrest\n"
    assert card_table.write_into(text, "| new |\n") == f"intro\n{card_table.START}\n| new |\n{card_table.END}\nrest\n"
    with pytest.raises(ValueError, match="no card-table markers"):
        card_table.write_into("no markers here\n", "| new |\n")


def test_the_plot_shows_the_measured_bytes(tmp_path):
    left = kv_plot.real_size_bars(RESULTS)
    gpu = json.loads((RESULTS / "gpu_real_size.json").read_text(encoding="utf-8"))
    full_1024 = next(
        r
        for r in gpu["results"]
        if r["size"] == [1024, 1024]
        and r["kv_method"] == "full"
        and r["weight_dtype"] == "fp8_e4m3fn"
        and r["offload"] == "none"
    )
    edit_1024 = next(b for b in left if b.label == "edit\n1024² image")
    assert edit_1024.full == pytest.approx(sum(full_1024["kv_bytes_per_branch"].values()) / 1e6)
    assert [b.label.split("\n")[0] for b in left] == ["understand", "edit", "edit", "edit"]
    assert all(4.0 < b.full / b.unicache < 6.0 for b in left)
    right = kv_plot.bundled_bars(RESULTS)
    assert [b.label for b in right] == ["understand", "text to image", "edit"]
    quality = json.loads((RESULTS / "quality.json").read_text(encoding="utf-8"))
    und = next(r for r in quality["results"] if r["task"] == "und" and r["method"] == "unicache")
    assert right[0].unicache == pytest.approx(100 * (1 - und["achieved_reduction"]))
    out = tmp_path / "kv_bytes.png"
    peaks = kv_plot.peak_bars(RESULTS)
    e2e = json.loads((RESULTS / "bagel_e2e.json").read_text(encoding="utf-8"))
    four = {
        r["method"]: r
        for r in e2e["results"]
        if r["checkpoint"] == "medium" and r["task"] == "edit" and r.get("images", 1) == 4
    }
    assert [p.label for p in peaks] == [f"{n} x 512²" for n in (1, 2, 4, 8)]
    assert peaks[2].full_peak == pytest.approx(four["full"]["kv_bytes_peak"] / 1e6)
    assert peaks[2].unicache_peak == pytest.approx(four["unicache"]["kv_bytes_peak"] / 1e6)
    # issue 54: UniCache's image rows are stored compressed as written, so its peak is several times below full KV's
    assert all(p.full_peak / p.unicache_peak > 4.0 for p in peaks)
    kv_plot.render(left, right, out, peaks)
    with Image.open(out) as image, Image.open(kv_plot.OUT) as committed:
        assert image.size == committed.size == (1500, 440)
