"""benchmarks.gpu_device_check, the one command of issue #64's GPU run: the commands it runs, each parsed by its own
benchmark's command line here (CUDA hidden: each stops at its device check, after its argument checks)."""

from __future__ import annotations

import importlib
import shlex

import pytest
import torch
from cli_runs import exit_status

from benchmarks import gpu_device_check


def _listed(capsys, argv) -> list[list[str]]:
    assert exit_status(gpu_device_check.main, [*argv, "--list"]) == 0
    return [shlex.split(line) for line in capsys.readouterr().out.splitlines()]


def test_it_lists_the_issues_measurements_in_order(tmp_path, capsys):
    commands = _listed(capsys, [str(tmp_path / "out"), "--checkpoint", str(tmp_path / "ckpt")])
    modules = [cmd[2] for cmd in commands]
    assert modules == ["benchmarks.gpu_kernels"] + ["benchmarks.gpu_real_size"] * 3 + ["benchmarks.gpu_taylorseer"]
    reports = [cmd[cmd.index("--json") + 1] for cmd in commands]
    assert reports == [
        str(tmp_path / "out" / name)
        for name in ("gpu_kernels.json", "gpu_real_size_2images.json", "gpu_real_size_4images.json",
                     "gpu_lowvram_2images.json", "gpu_taylorseer.json")
    ]  # fmt: skip
    images2, images4, lowvram = commands[1:4]
    for cmd, images in ((images2, "2"), (images4, "4"), (lowvram, "2")):
        assert cmd[cmd.index("--images") + 1] == images and cmd[cmd.index("--size") + 1] == "1024"
        assert cmd[cmd.index("--methods") + 1] == "full,unicache"
        assert cmd[cmd.index("--out") + 1] == str(tmp_path / "ckpt")
    assert images2[images2.index("--taylorseer") + 1] == "off,on"
    assert lowvram[lowvram.index("--offload") + 1] == "layers" and lowvram[lowvram.index("--memory-cap") + 1] == "16GB"
    assert _listed(capsys, [str(tmp_path), "--steps", "taylorseer,kernels"])[0][2] == "benchmarks.gpu_kernels"


def test_every_listed_command_passes_its_benchmarks_argument_checks(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # each stops at its device check, on any machine
    for cmd in _listed(capsys, [str(tmp_path / "out"), "--checkpoint", str(tmp_path / "ckpt")]):
        main = importlib.import_module(cmd[2]).main
        assert exit_status(main, cmd[3:]) == 2  # stopped at the device check, not at an argument
        assert "no CUDA device is visible" in capsys.readouterr().err


def test_without_cuda_it_stops_at_once(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert exit_status(gpu_device_check.main, [str(tmp_path / "out")]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "kernels,nothing"], "--steps must name some of"),
        (["--steps", "kernels,kernels"], "--steps must name some of"),
        (["--memory-cap", "lots"], "--memory-cap: 'lots' is not a memory size"),
        (["--taylorseer-timesteps", "1"], "--taylorseer-timesteps must be 2 or more"),
    ],
)
def test_argument_mistakes_are_one_line_errors(tmp_path, capsys, argv, message):
    assert exit_status(gpu_device_check.main, [str(tmp_path), *argv, "--list"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
