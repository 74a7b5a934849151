"""One size parser for every size (issue 45.2: ``--device-memory 1e400GB`` was an OverflowError traceback), and no
single-value flag silently dropped when given twice (issue 45.3), in every command of the project."""

from __future__ import annotations

import pytest
from cli_runs import exit_status, run_bagel_cli

from unicache_core.bagel.calibration import cli as calibrate_cli
from unicache_core.bagel.checkpoint import single_file
from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.cli import main as bagel_cli
from unicache_core.bagel.memory.plan import parse_memory_size
from unicache_core.compression import parse_kv_target
from unicache_core.sizes import MAX_BYTES, parse_size

# ------------------------------------------------------------------------------------------------ sizes


@pytest.mark.parametrize(
    "text, expected",
    [
        ("24GB", 24 * 10**9),
        ("24 GiB", 24 * 2**30),
        (" 1.5e10 ", 15 * 10**9),
        ("512mib", 512 * 2**20),
        ("2TB", 2 * 10**12),
        (".5GB", 5 * 10**8),
        ("1e3MB", 10**9),
        ("123456", 123456),
    ],
)
def test_sizes_parse(text, expected):
    assert parse_size(text, "--x") == expected


@pytest.mark.parametrize(
    "text, match",
    [
        ("1e400GB", r"--x: '1e400GB' is more than the largest size accepted, 1125899906842624 bytes \(1 PiB\)"),
        ("1e99999999999TiB", "is more than the largest size accepted"),
        ("2PB", "is not a memory size"),
        ("inf", "'inf' is not a memory size"),
        ("nan", "'nan' is not a memory size"),
        ("-1GB", "'-1GB' is not a memory size"),
        ("0", "'0' is less than the smallest size accepted, 1 bytes"),
        ("1e-99999GB", "is less than the smallest size accepted"),
        ("12XB", "'12XB' is not a memory size"),
        ("", "'' is not a memory size"),
        ("9" * 1000, "is not a memory size"),
    ],
)
def test_hostile_sizes_are_one_clear_error(text, match):
    with pytest.raises(ValueError, match=match) as info:
        parse_size(text, "--x")
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


def test_limits_are_each_callers():
    assert parse_size(str(MAX_BYTES), "--x") == MAX_BYTES
    with pytest.raises(ValueError, match="more than"):
        parse_size(str(MAX_BYTES + 1), "--x")
    with pytest.raises(ValueError, match=r"less than the smallest size accepted, 67108864 bytes \(64 MiB\)"):
        parse_memory_size("1MB")
    assert parse_memory_size("24GB") == 24 * 10**9


@pytest.mark.parametrize("value", ["1e400GB", "inf", "nan", "-1GB", "0", "1B", "1e99999999GB", "24 XB"])
def test_plan_device_memory_refused_in_one_line(capsys, value):
    code, out, err = run_bagel_cli(
        capsys, "plan", "--checkpoint", "bagel-7b-mot", "--task", "edit", f"--device-memory={value}"
    )
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: --device-memory: ") and "Traceback" not in err, err


@pytest.mark.parametrize("value", ["1e400GB", "99999999999999999999999", "1e400", "inf", "nan%"])
def test_kv_target_sizes_share_the_parser(value):
    with pytest.raises(ValueError, match="kv_target") as info:
        parse_kv_target(value)
    assert "\n" not in str(info.value)


def test_kv_target_keeps_its_forms():
    assert parse_kv_target("150MB") == 150 * 10**6 and parse_kv_target("64MiB") == 64 * 2**20
    assert parse_kv_target("0.2") == 0.2 and parse_kv_target("1e-1") == 0.1 and parse_kv_target("123456") == 123456
    assert parse_kv_target("1") == 1.0 and parse_kv_target(10**6) == 10**6


def test_max_memory_sizes_read_by_the_same_parser(tiny_checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r"`max_memory`\['cpu'\]: '1e400GB' is more than"):
        load_bagel(tiny_checkpoint, device_map="auto", max_memory={"cpu": "1e400GB"}, offload_folder=tmp_path)


# ------------------------------------------------------------------------------------------------ flags


def _tools_batch_main():
    from tools.batch import cli as batch_cli

    return batch_cli.main


def _training_main():
    from training.__main__ import main

    return main


@pytest.mark.parametrize(
    "main, argv, flag",
    [
        (lambda: bagel_cli.main, ["t2i", "--prompt", "a", "--prompt", "b"], "--prompt"),
        (lambda: bagel_cli.main, ["t2i", "--prompt", "a", "--steps", "2", "--steps", "3"], "--steps"),
        (
            lambda: bagel_cli.main,
            ["t2i", "--prompt", "a", "--cfg-interval", "0", "1", "--cfg-interval", "0", "1"],
            "--cfg-interval",
        ),
        (
            lambda: bagel_cli.main,
            ["understand", "--prompt", "a", "--kv-target", "0.2", "--kv-target", "0.5"],
            "--kv-target",
        ),
        (lambda: bagel_cli.main, ["plan", "--task", "t2i", "--width", "64", "--width", "128"], "--width"),
        (
            lambda: calibrate_cli.main,
            ["--checkpoint", "a", "--task", "t2i", "--prompts", "p", "--out", "o", "--out", "p"],
            "--out",
        ),
        (
            _tools_batch_main,
            ["w.json", "--host", "http://h:1", "--count", "1", "--count", "2", "--out", "o"],
            "--count",
        ),
        (_training_main, ["out", "--seed", "1", "--seed", "2"], "--seed"),
        (lambda: single_file.main, ["a", "b", "--variant", "x", "--variant", "y"], "--variant"),
    ],
    ids=[
        "bagel-prompt",
        "bagel-steps",
        "bagel-nargs",
        "bagel-kv-target",
        "plan",
        "calibrate",
        "batch",
        "training",
        "convert",
    ],
)
def test_single_value_flag_given_twice_is_refused(capsys, main, argv, flag):
    capsys.readouterr()
    assert exit_status(main(), argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {flag} given twice ("), err
    assert f"pass {flag} once" in err


@pytest.mark.parametrize("command", ["edit", "understand"])
def test_image_repeats_and_a_single_value_flag_does_not(capsys, command):
    """``--image`` is declared to repeat (several images, in order: tests/test_cli_interleave.py); ``--prompt`` is not,
    and giving it twice is refused in one line."""
    from unicache_core.bagel.cli.main import _build_parser

    args = _build_parser().parse_args([command, "--prompt", "a", "--image", "a.png", "--image", "b.png"])
    assert [str(p) for p in args.image] == ["a.png", "b.png"]
    code, out, err = run_bagel_cli(capsys, command, "--prompt", "a", "--prompt", "b", "--image", "a.png")
    assert code == 2 and err.count("\n") == 1 and "--prompt given twice (--prompt a, then --prompt b)" in err


def test_flags_meant_to_repeat_keep_every_value(tmp_path):
    from tools.batch import cli as batch_cli

    args = batch_cli.parse_args(
        ["w.json", "--host", "http://a:1", "--host", "http://b:2", "--count", "1", "--out", str(tmp_path)]
    )
    assert args.host == ["http://a:1", "http://b:2"]
    parsed = bagel_cli._build_parser().parse_args(["t2i", "--prompt", "a", "-q", "-q"])  # a switch says one thing
    assert parsed.quiet and not hasattr(parsed, "_one_line_parser_seen")
