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
    ],
)
def test_plan_refuses_sizes_the_run_refuses(capsys, task, width, height, message):
    code, out, err = run_bagel_cli(
        capsys, "plan", "--checkpoint", "bagel-7b-mot", "--task", task, f"--width={width}", f"--height={height}"
    )
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and re.search(message, err), err


@pytest.mark.parametrize("task, width, height", [("edit", 17, 17), ("und", 0, 0), ("und", 1, 1), ("t2i", 16, 1024)])
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
