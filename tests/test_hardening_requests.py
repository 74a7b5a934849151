"""Round four of the hardening (issue 49), requests: the plan refuses what the run refuses (one check of the request
for both), a flag that would be silently ignored is refused, and an items file with a key given twice or nested past
the JSON parser's depth is one clear line."""

from __future__ import annotations

import json

import pytest
from cli_runs import run_bagel_cli
from test_cli_errors import no_weights  # noqa: F401  (a fixture)

from unicache_core.bagel.cli.checks import taylorseer_changes
from unicache_core.bagel.settings import BUNDLED_CHECKPOINT_DIR


def _one_line(capsys, *argv: str) -> str:
    code, out, err = run_bagel_cli(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: "), (code, out, err)
    assert "Traceback" not in err
    return err


def _plan(*argv: str) -> list[str]:
    return ["plan", "--checkpoint", str(BUNDLED_CHECKPOINT_DIR), *argv]


def test_plan_refuses_more_images_than_the_positions_hold(capsys):
    """The bundled model has 4,096 positions: 10,000 images are refused by the run's own count, naming how many
    fit (each image one position in an understanding, and a 64-token prompt)."""
    sizes = ",".join(["1024x1024"] * 10_000)
    err = _one_line(capsys, *_plan("--task", "und", "--image-sizes", sizes))
    assert err.startswith("error: --image-sizes: `request` holds 10000 images") and "at most 3518 images fit" in err
    err = _one_line(capsys, *_plan("--task", "edit", "--image-sizes", ",".join(["64x64"] * 2100)))
    assert "holds 2100 images" in err and ", 2 per image)" in err
    code, out, _ = run_bagel_cli(capsys, *_plan("--task", "und", "--image-sizes", ",".join(["64x64"] * 3000)))
    assert code == 0 and "fits" in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (
            ["--task", "und", "--image-sizes", "100000x100000"],
            "--image-sizes: entry 1: an input image of 100000x100000 px cannot be read by the run",
        ),
        (
            ["--task", "edit", "--image-sizes", "512x512", "--width", "1024", "--height", "1024"],
            "--width: not with --image-sizes for --task edit",
        ),
        (["--task", "und", "--image-sizes", "512x512", "--height", "64"], "--height: not with --image-sizes"),
        (
            ["--task", "t2i", "--taylorseer", "--taylorseer-order", "99"],
            "--taylorseer-order: `taylorseer_order` must be an integer >= 0 and <= 6, got 99",
        ),
        (["--task", "t2i", "--taylorseer-order", "3"], "--taylorseer-order: applies only with --taylorseer"),
        (["--task", "und", "--taylorseer"], "--taylorseer: an understanding request has no denoising steps"),
        (["--task", "und", "--image-sizes", "-5x-5"], "--image-sizes: entry 1 ('-5x-5') is not WIDTHxHEIGHT"),
        (["--task", "t2i", "--width", "-5"], "--width: `width` must be a positive multiple of 16"),
    ],
)
def test_plan_refuses_what_the_run_refuses(capsys, argv, needle):
    assert needle in _one_line(capsys, *_plan(*argv))


def test_plan_of_t2i_keeps_its_output_size_beside_reference_images(capsys):
    code, out, _ = run_bagel_cli(capsys, *_plan("--task", "t2i", "--image-sizes", "64x64", "--width", "128"))
    assert code == 0 and "fits" in out


def test_plan_blames_the_weights_when_they_are_what_does_not_fit(capsys):
    argv = ["plan", "--checkpoint", "bagel-7b-mot", "--task", "t2i", "--image-sizes", "1024x1024,512x512"]
    code, out, _ = run_bagel_cli(capsys, *argv, "--device-memory", "8GB")
    assert code == 0
    assert "does not fit: the bf16 weights on the device do not fit 8.0 GB even with one input image: use " in out
    assert "input images need more" not in out


@pytest.mark.parametrize("flag", ["--taylorseer-interval", "--taylorseer-first-steps", "--taylorseer-order"])
def test_a_taylorseer_flag_without_taylorseer_is_refused(tiny_checkpoint, tmp_path, no_weights, capsys, flag):
    argv = ["t2i", "--checkpoint", str(tiny_checkpoint), "--prompt", "x", "--out", str(tmp_path / "o.png"), flag, "2"]
    err = _one_line(capsys, *argv)
    assert f"error: {flag}: applies only with --taylorseer; add --taylorseer or drop {flag}" in err
    assert not (tmp_path / "o.png").exists()


def test_taylorseer_flags_are_kept_with_taylorseer():
    class Args:
        command, taylorseer, taylorseer_interval, taylorseer_first_steps, taylorseer_order = "edit", True, 2, None, 4

    assert taylorseer_changes(Args()) == {"taylorseer": True, "taylorseer_interval": 2, "taylorseer_order": 4}


# ------------------------------------------------------------------------------------------- items files


@pytest.mark.parametrize(
    "text, needle",
    [
        ('{"items": [{"text": "a"}], "items": [{"text": "b"}]}', "the key 'items' is given twice in one object"),
        ('{"items": [{"text": "a", "text": "b"}]}', "the key 'text' is given twice in one object"),
        ("[" * 100_000 + "]" * 100_000, "the JSON is nested too deeply to read"),
    ],
)
def test_items_file_with_a_repeated_key_or_deep_nesting_is_one_line(
    tiny_checkpoint, tmp_path, no_weights, capsys, text, needle
):
    items = tmp_path / "items.json"
    items.write_text(text)
    err = _one_line(capsys, "understand", "--checkpoint", str(tiny_checkpoint), "--items", str(items), "-q")
    assert err.startswith(f"error: --items {items}: {needle}"), err


def test_items_file_without_repeats_still_runs_its_checks(tiny_checkpoint, tmp_path, no_weights, capsys):
    items = tmp_path / "items.json"
    items.write_text(json.dumps({"items": [{"text": "a"}], "extra": 1}))
    err = _one_line(capsys, "understand", "--checkpoint", str(tiny_checkpoint), "--items", str(items), "-q")
    assert "unknown key 'extra' at the top level" in err
