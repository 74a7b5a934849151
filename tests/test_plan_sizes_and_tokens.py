"""Issue 46.4: ``plan`` refuses the sizes a run refuses, an added token made of punctuation is refused like one of
ordinary words, and a UTF-8 byte-order mark in a text input never becomes prompt tokens."""

from __future__ import annotations

import json
import re

import pytest
from checkpoint_edits import edit_json
from cli_runs import run_bagel_cli

from unicache_core.bagel.cli import main as bagel_cli
from unicache_core.bagel.cli.checks import preflight
from unicache_core.bagel.tokenizer import BagelTokenizer
from unicache_core.errors import CheckpointError


@pytest.mark.parametrize(
    "task, width, height, message",
    [
        ("t2i", 0, 128, r"--width: `width` must be a positive multiple of 16 and <= 1024, got 0"),
        ("t2i", 17, 17, r"--width: `width` must be a positive multiple of 16 and <= 1024, got 17"),
        ("t2i", 128, 2048, r"--height: `height` must be a positive multiple of 16 and <= 1024, got 2048"),
        ("t2i", -16, 128, r"--width: .*got -16"),
        ("edit", 0, 0, r"an input image of 0x0 px cannot be read by the run"),
        ("edit", 10, 0, r"an input image of 10x0 px"),
        ("und", 100_000, 100_000, r"an input image of 100000x100000 px cannot be read by the run"),
        # the run refuses a one-pixel side (items.check_image_item); the plan planned it
        ("und", 1, 1, r"an input image of 1x1 px cannot be read by the run \(a one-pixel side holds no picture\)"),
        ("edit", 1, 64, r"an input image of 1x64 px .*at least 2x2"),
    ],
)
def test_plan_refuses_sizes_the_run_refuses(capsys, task, width, height, message):
    code, out, err = run_bagel_cli(
        capsys, "plan", "--checkpoint", "bagel-7b-mot", "--task", task, f"--width={width}", f"--height={height}"
    )
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and re.search(message, err), err


@pytest.mark.parametrize("task, width, height", [("edit", 17, 17), ("und", 0, 0), ("und", 2, 2), ("t2i", 16, 1024)])
def test_plan_accepts_sizes_the_run_accepts(capsys, tmp_path, task, width, height):
    code, _, err = run_bagel_cli(
        capsys,
        "plan",
        "--checkpoint",
        "bagel-7b-mot",
        "--task",
        task,
        "--width",
        str(width),
        "--height",
        str(height),
        "--device-memory",
        "80GB",
        "--json",
        str(tmp_path / "p.json"),
    )
    assert code == 0 and err == ""
    assert json.loads((tmp_path / "p.json").read_text())["settings"]["width"] == width


@pytest.mark.parametrize("content", [". ", "--", "...", "_", "!?", " \t"])
def test_added_token_of_punctuation_is_refused(tiny_checkpoint_copy, content):
    path = tiny_checkpoint_copy / "tokenizer_config.json"
    decoder = json.loads(path.read_text())["added_tokens_decoder"]
    decoder["570"] = {"content": content, "special": True}
    edit_json(path, added_tokens_decoder=decoder)
    with pytest.raises(CheckpointError, match=rf"added token 570 has the content {re.escape(repr(content))}, which is"):
        BagelTokenizer.from_dir(tiny_checkpoint_copy)


def test_control_tokens_are_still_read(tiny_checkpoint):
    tokenizer = BagelTokenizer.from_dir(tiny_checkpoint)
    assert tokenizer.eos_token_id == tokenizer.token_to_id("<|im_end|>")


def test_a_bom_in_the_prompt_file_is_no_prompt_token(tiny_checkpoint, tmp_path):
    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_bytes(b"a red cube\n")
    marked.write_bytes(b"\xef\xbb\xbfa red cube\r\n")
    checked = []
    for path in (plain, marked):
        argv = [
            "t2i",
            "--checkpoint",
            str(tiny_checkpoint),
            "--prompt-file",
            str(path),
            "--out",
            str(tmp_path / "o.png"),
        ]
        checked.append(preflight(bagel_cli._build_parser().parse_args(argv)).prompt)
    assert checked == ["a red cube", "a red cube"]


@pytest.mark.parametrize(
    "task, sizes", [("edit", "64x64,1x1"), ("und", "1x1"), ("t2i", "1x1")], ids=["edit", "und", "t2i-reference"]
)
def test_plan_refuses_a_one_pixel_image_size_as_the_run_does(capsys, task, sizes):
    code, out, err = run_bagel_cli(
        capsys,
        "plan",
        "--checkpoint",
        "bagel-7b-mot",
        "--task",
        task,
        "--image-sizes",
        sizes,
        "--device-memory",
        "80GB",
    )
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert re.search(r"--image-sizes: entry \d: an input image of 1x1 px .*a one-pixel side holds no picture", err), err


def test_plan_keeps_a_taylorseer_order_of_zero(capsys, tmp_path):
    """``--taylorseer-order 0`` (a valid order, which the run honours) was planned as the default order."""
    argv = ["plan", "--checkpoint", "bagel-7b-mot", "--task", "edit", "--taylorseer", "--taylorseer-order", "0"]
    code, out, _ = run_bagel_cli(capsys, *argv, "--device-memory", "80GB", "--json", str(tmp_path / "p.json"))
    assert code == 0 and "TaylorSeer order 0" in out and "TaylorSeer: 1 factors" in out, out
    assert json.loads((tmp_path / "p.json").read_text())["settings"]["taylorseer_order"] == 0


def test_plan_of_ten_thousand_images_prints_a_summary(capsys):
    """10,000 images of one size: one header naming ``10000 x 1024x1024`` and the per-item phases as one range,
    not a header of 10,000 sizes and a phase per item (hundreds of kB)."""
    sizes = ",".join(["1024x1024"] * 10_000)
    argv = [
        "plan",
        "--checkpoint",
        "bagel-7b-mot",
        "--task",
        "und",
        "--image-sizes",
        sizes,
        "--device-memory",
        "1000TB",
    ]
    code, out, _ = run_bagel_cli(capsys, *argv)
    assert code == 0 and len(out) < 4000, len(out)
    assert out.startswith("und 10000 images (10000 x 1024x1024), "), out[:200]
    assert re.search(r"phases \(GB\): prefill:item0-\d+ [\d.]+\.\.[\d.]+ \(most at item\d+\) \| decode", out), out
    assert "images 0-9999 1024x1024: KV gen" in out
