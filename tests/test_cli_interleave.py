"""The command line's interleaved requests: ``--image`` repeated, ``--items FILE.json``, ``plan --image-sizes`` and the
card table's search (issue #43 items 5, 6 and 8)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_runs import forbid_weight_loading, run_bagel_cli
from PIL import Image

from unicache_core.bagel.memory.card_fit import CARD_SIZES_GB, card_table, fitting_images, most_images
from unicache_core.bagel.memory.plan import PlanSettings, official_config, plan_memory
from unicache_core.shapes.world import Scene, Shape

GB = 10**9
FAST = ("--steps", "3", "-q")


@pytest.fixture
def shapes(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    Scene("white", (Shape("circle", "red", "large", 0),)).render().save(a)
    Scene("gray", (Shape("square", "blue", "large", 8),)).render().resize((96, 64)).save(b)
    return a, b


def _one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


# ------------------------------------------------------------------------------------ runs on the tiny checkpoint


def test_edit_with_two_images_writes_the_last_ones_size_and_a_report(tiny_checkpoint, tmp_path, shapes, capsys):
    out, report = tmp_path / "e.png", tmp_path / "r.json"
    code, _, err = run_bagel_cli(
        capsys,
        "edit",
        "--checkpoint",
        str(tiny_checkpoint),
        "--image",
        str(shapes[0]),
        "--image",
        str(shapes[1]),
        "--prompt",
        "put the red circle into the second image",
        "--kv-method",
        "unicache",
        "--report",
        str(report),
        "--out",
        str(out),
        *FAST,
    )
    assert code == 0, err
    assert Image.open(out).size == (96, 64)  # the tiny rule keeps b's 96x64; the output takes the last image's size
    assert json.loads(report.read_text())["method"] == "unicache"


def test_understand_with_two_images_answers_on_stdout(tiny_checkpoint, shapes, capsys):
    code, out, err = run_bagel_cli(
        capsys,
        "understand",
        "--checkpoint",
        str(tiny_checkpoint),
        "--image",
        str(shapes[0]),
        "--image",
        str(shapes[1]),
        "--prompt",
        "what differs?",
        "--max-new-tokens",
        "3",
        "-q",
    )
    assert code == 0 and out.endswith("\n") and out.count("\n") == 1, err


def test_items_file_runs_an_iterative_edit_and_writes_each_round(tiny_checkpoint, tmp_path, shapes, capsys):
    folder = tmp_path / "request"
    folder.mkdir()
    items = folder / "items.json"
    items.write_text(
        json.dumps(
            {
                "items": [
                    {"image": "../a.png"},
                    {"text": "make the circle blue"},
                    {"generate": True},
                    {"text": "move it to the center"},
                ]
            }
        )
    )
    out = tmp_path / "final.png"
    code, _, err = run_bagel_cli(
        capsys, "edit", "--checkpoint", str(tiny_checkpoint), "--items", str(items), "--out", str(out), *FAST
    )
    assert code == 0, err
    first = tmp_path / "final-1.png"
    assert Image.open(first).size == Image.open(out).size == (128, 128)  # the tiny rule keeps the 128 px source


def test_t2i_takes_reference_images_and_keeps_its_size(tiny_checkpoint, tmp_path, shapes, capsys):
    out = tmp_path / "t.png"
    argv = ["t2i", "--checkpoint", str(tiny_checkpoint), "--image", str(shapes[0]), "--prompt", "the same"]
    code, _, err = run_bagel_cli(capsys, *argv, "--width", "48", "--height", "32", "--out", str(out), *FAST)
    assert code == 0 and Image.open(out).size == (48, 32), err


# ------------------------------------------------------------------------------------ mistakes: one line, no load


def _items(tmp_path: Path, content) -> Path:
    path = tmp_path / "items.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


@pytest.mark.parametrize(
    "content, match",
    [
        ("{not json", r"--items .*items.json: not valid JSON \(Expecting property name"),
        ({"itmes": []}, r"unknown key 'itmes' at the top level"),
        ({"items": []}, r"the list of items is empty"),
        ({"items": [{"image": "a.png"}]}, r"1 item\(s\) but no text"),
        ({"items": [{"text": "x", "image": "a.png"}]}, r"items\[0\] must be one of"),
        ({"items": [{"text": 3}]}, r'items\[0\]: "text" must be a string, got int'),
        ({"items": [{"generate": "yes"}, {"text": "x"}]}, r'items\[0\]: "generate" must be true'),
        ({"items": [{"image": "missing.png"}, {"text": "x"}]}, r"items\[0\]: file not found: .*missing.png"),
        ({"items": [{"image": "a.png"}, {"generate": True}, {"text": "x"}]}, r"`items\[1\]` \(GENERATE\) would be"),
        ({"items": [{"text": "x"}, {"text": "y"}]}, r"an edit needs an image item before its first text"),
        # a path's NUL byte or control characters are shown escaped, never raw (the NUL gave "embedded null byte")
        (
            {"items": [{"image": "a\u0000b.png"}, {"text": "x"}]},
            r'items\[0\]: "image" "a\\u0000b.png" holds a NUL byte \(\\u0000\), which no file path can hold',
        ),
        ({"items": [{"image": "a\u001b[31m.png"}, {"text": "x"}]}, r"file not found: .*a\\u001b\[31m.png$"),
    ],
)
def test_bad_items_files_are_one_line_before_loading(
    tiny_checkpoint, tmp_path, shapes, capsys, monkeypatch, content, match
):
    forbid_weight_loading(monkeypatch)
    (tmp_path / "a.png").write_bytes(shapes[0].read_bytes()) if not (tmp_path / "a.png").exists() else None
    path = _items(tmp_path, content)
    code, _, err = run_bagel_cli(capsys, "edit", "--checkpoint", str(tiny_checkpoint), "--items", str(path), "-q")
    assert code == 2 and re.search(match, _one_line(err).rstrip("\n")), err
    assert err.endswith("\n") and err[:-1].isprintable(), repr(err)  # no control character reaches the terminal


def test_items_conflicts_and_understanding_markers_are_one_line(tiny_checkpoint, tmp_path, shapes, capsys, monkeypatch):
    forbid_weight_loading(monkeypatch)
    path = _items(tmp_path, {"items": [{"image": str(shapes[0])}, {"generate": True}, {"text": "x"}]})
    base = ["--checkpoint", str(tiny_checkpoint), "-q"]
    code, _, err = run_bagel_cli(capsys, "understand", *base, "--items", str(path))
    assert code == 2 and '"generate" belongs to t2i and edit' in _one_line(err)
    code, _, err = run_bagel_cli(capsys, "edit", *base, "--items", str(path), "--prompt", "x")
    assert code == 2 and "argument --items: not allowed with argument --prompt" in _one_line(err)
    code, _, err = run_bagel_cli(capsys, "edit", *base, "--items", str(path), "--image", str(shapes[1]))
    assert code == 2 and "give the images inside the items file" in _one_line(err)
    code, _, err = run_bagel_cli(capsys, "edit", *base, "--prompt", "x")
    assert code == 2 and "--image: an edit needs its source image" in _one_line(err)
    code, _, err = run_bagel_cli(capsys, "edit", *base)
    assert code == 2 and "one of the arguments --prompt --prompt-file is required (or --items" in _one_line(err)
    tiny = tmp_path / "dot.png"
    Image.new("RGB", (1, 1)).save(tiny)
    code, _, err = run_bagel_cli(
        capsys, "understand", *base, "--image", str(tiny), "--image", str(shapes[0]), "--prompt", "x"
    )
    assert code == 2 and "`items[0]` is 1x1 px" in _one_line(err)


def test_too_many_images_for_the_device_names_the_count_and_what_fits(
    tiny_checkpoint, tmp_path, shapes, capsys, monkeypatch
):
    """The run is planned at BAGEL-7B's geometry (whose KV outgrows the VAE's working memory within a few images) on
    a device that holds one image less than given: refused before loading, naming the count and what fits."""
    forbid_weight_loading(monkeypatch)
    monkeypatch.setattr("unicache_core.bagel.memory.plan.plan_config", lambda checkpoint: official_config())
    # the tiny checkpoint's weights stand in for BAGEL-7B's: their header check would (rightly) refuse the swap
    monkeypatch.setattr("unicache_core.bagel.checkpoint.folder.check_folder_weights", lambda root, config, **kw: None)
    config = official_config()

    def peak(count: int) -> int:
        settings = PlanSettings(
            task="edit", width=128, height=128, dtype="fp32", device="cpu", images=((128, 128),) * count
        )
        return plan_memory(config, settings, 1 << 50).peak_bytes

    count = next(n for n in range(2, 40) if peak(n) > peak(n - 1) > peak(1))
    monkeypatch.setattr("unicache_core.bagel.memory.plan.device_memory_bytes", lambda device: peak(count - 1))
    images = [arg for _ in range(count) for arg in ("--image", str(shapes[0]))]
    argv = [
        "edit",
        "--checkpoint",
        str(tiny_checkpoint),
        *images,
        "--prompt",
        "x",
        "--dtype",
        "fp32",
        "--device",
        "cpu",
    ]
    code, _, err = run_bagel_cli(capsys, *argv, "--out", str(tmp_path / "x.png"), "-q")
    assert code == 2 and not (tmp_path / "x.png").exists()
    assert f"{count} input images need more than" in _one_line(err) and f"at most {count - 1} of them fit" in err


# ------------------------------------------------------------------------------------ plan with several images


def test_plan_counts_three_images_and_unicache_lowers_the_peak(tmp_path, capsys):
    plans = {}
    for method in ("full", "unicache"):
        out = tmp_path / f"{method}.json"
        code, text, err = run_bagel_cli(
            capsys,
            "plan",
            "--checkpoint",
            "bagel-7b-mot",
            "--task",
            "edit",
            "--image-sizes",
            "1024x1024,1024x1024,1024x1024",
            "--weight-dtype",
            "fp8_e4m3fn",
            "--device",
            "cuda",
            "--device-memory",
            "24GB",
            "--kv-method",
            method,
            "--json",
            str(out),
        )
        assert code == 0, err
        assert "edit 3 images (3 x 1024x1024)" in text and re.search(r"image(s 0-| )2 1024x1024: KV gen", text), text
        plans[method] = json.loads(out.read_text())
    full, unicache = plans["full"], plans["unicache"]
    images = full["settings"]["kv_images"]
    assert len(images) == 3 and all(i["vae_tokens"] == 4096 and i["vit_tokens"] == 4900 for i in images)
    per_image = images[0]["bytes_per_branch"]["gen"]
    assert per_image == (4096 + 4900 + 4) * 57_344  # BAGEL-7B: 56 KiB per cached token in bf16
    assert full["breakdown"]["kv_full"] == unicache["breakdown"]["kv_full"] > 6 * per_image
    # full KV holds each image's rows once (gen and cfg_text share them) and the prompt in gen and cfg_img
    prompt = (64 + 2) * 57_344
    assert 3 * per_image <= full["breakdown"]["kv_held"] <= 3 * per_image + 2 * prompt
    assert full["breakdown"]["kv_shared"] == full["breakdown"]["kv_full"] - 3 * per_image
    # UniCache stores the images' VAE rows quantized as they are written (the paper table quantizes them)
    assert unicache["breakdown"]["kv_held"] < full["breakdown"]["kv_held"]
    assert all(image["held_bytes"] <= per_image - 0.8 * 4096 * 57_344 for image in unicache["settings"]["kv_images"])
    assert unicache["peak_bytes"] <= full["peak_bytes"]
    llm = [name for name in full["phases"] if not name.startswith("vae:")]
    assert all(unicache["phases"][name] < full["phases"][name] for name in llm[1:])
    assert (  # three images' LLM phases hold more than one image's
        max(size for name, size in full["phases"].items() if not name.startswith("vae:"))
        > max(
            size
            for name, size in plan_memory(
                official_config(),
                PlanSettings(task="edit", width=1024, height=1024, weight_dtype="fp8_e4m3fn", device="cuda"),
                24 * GB,
            ).phases
            if not name.startswith("vae:")
        )
    )


@pytest.mark.parametrize("value", ["1024x", "0x5", "a,b", "1024x1024,,512x512"])
def test_bad_image_sizes_are_one_line(value, capsys):
    code, _, err = run_bagel_cli(
        capsys, "plan", "--checkpoint", "bagel-7b-mot", "--task", "edit", "--image-sizes", value
    )
    assert code == 2 and "--image-sizes: entry" in _one_line(err)


# ------------------------------------------------------------------------------------ what fits on a card


def _settings(**changes) -> PlanSettings:
    base = dict(task="edit", width=1024, height=1024, weight_dtype="fp8_e4m3fn", offload="layers", device="cuda")
    return PlanSettings(**{**base, **changes})


def test_most_images_is_the_plans_boundary():
    config = official_config()
    for method in ("full", "unicache"):
        settings = _settings(kv_method=method)
        count = most_images(config, settings, 12 * GB, (1024, 1024))
        assert count > 1
        fits = [
            plan_memory(config, _settings(kv_method=method, images=((1024, 1024),) * n), 12 * GB).fits
            for n in (count, count + 1)
        ]
        assert fits == [True, False]
    assert most_images(config, _settings(offload="none"), 8 * GB, (1024, 1024)) == 0  # the fp8 weights alone
    many = _settings(images=((1024, 1024),) * 40)
    assert fitting_images(config, many, 12 * GB) == most_images(config, many, 12 * GB, (1024, 1024))


def test_card_table_rows_grow_with_the_card():
    """More memory never fits fewer images; UniCache, which stores an edit's VAE rows compressed as the context fills,
    fits more images of an edit than full KV (each image's rows held once), and at most a few fewer of a question.
    With the rows it evicts also written at the target's bytes (FILL_DESIGN D2), at least 4x at 24 GB fp8 for both tasks
    and 3x with the layer offload on 8-16 GB (test_card_table_with_evicted_rows_written)."""
    rows = card_table()
    assert len(rows) == len(CARD_SIZES_GB) * 2 * 2 * 2
    by = {(r.card_gb, r.offload, r.kv_method, r.task): r.most_images for r in rows}
    for offload in ("none", "layers"):
        for method in ("full", "unicache"):
            for task in ("edit", "und"):
                counts = [by[(card, offload, method, task)] for card in CARD_SIZES_GB]
                assert counts == sorted(counts)
    for key, count in by.items():
        if key[2] == "unicache":  # a question: at most a few fewer (the instruction's scoring transient)
            full = by[(key[0], key[1], "full", key[3])]
            assert count >= full if key[3] == "edit" else count >= 0.9 * full
    assert by[(24, "none", "unicache", "edit")] > by[(24, "none", "full", "edit")] >= 12  # each image once
    assert by[(24, "layers", "full", "und")] > by[(24, "layers", "full", "edit")]


def test_card_table_with_evicted_rows_written():
    """Issue 54's targets, planned for UniCache storing the rows it evicts at the target's bytes as they are written
    (its ``memory`` objective)."""
    from unicache_core.compression.methods.unicache import UniCache

    rows = card_table(kv_methods=("full", UniCache(objective="memory")))
    by = {(r.card_gb, r.offload, r.kv_method, r.task): r.most_images for r in rows}
    for task in ("edit", "und"):
        assert by[(24, "none", "unicache", task)] >= 4 * by[(24, "none", "full", task)] >= 4 * 12
        for card in (8, 12, 16):
            assert by[(card, "layers", "unicache", task)] >= 3 * by[(card, "layers", "full", task)] > 0
