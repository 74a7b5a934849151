"""The command line's answers to mistakes: every argument is checked before any weights load, and every
mistake, failure and Ctrl-C is one ``error: ...`` line (exit 2, or 130 for Ctrl-C), never a traceback."""

from __future__ import annotations

import math
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoint_edits import edit_json, rewrite_tensors, set_value
from cli_runs import exit_status, forbid_weight_loading, run_bagel_cli, with_flags
from PIL import Image

from unicache_core.bagel import denoise as denoise_module
from unicache_core.bagel.checkpoint import loader as loader_module
from unicache_core.bagel.cli import main as cli
from unicache_core.bagel.cli.checks import open_image, read_prompt_file, save_image
from unicache_core.errors import NumericalError

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------ CLI: before loading


@pytest.fixture
def no_weights(monkeypatch):
    forbid_weight_loading(monkeypatch)


def _exit_code(argv) -> int:
    """``cli.main(argv)``'s exit status (an argparse mistake's ``SystemExit`` code included)."""
    return exit_status(cli.main, argv)


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def _t2i(checkpoint, *extra):
    return with_flags(
        [
            "t2i",
            "--checkpoint",
            str(checkpoint),
            "--prompt",
            "x",
            "--width",
            "32",
            "--height",
            "32",
            "--steps",
            "2",
            "--dtype",
            "fp32",
            "-q",
        ],
        *extra,
    )


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--seed", "-1"], r"--seed: `seed` must be an integer in \[0, 2\*\*64 - 1\]"),
        (["--seed", str(2**64)], "--seed: `seed`"),
        (["--steps", "1"], "--steps: `num_timesteps` must be an integer >= 2 and <= 1000, got 1"),
        (["--steps", "100000000"], "--steps: `num_timesteps`.*got 100000000"),
        (["--width", "40"], "--width: `width` must be a positive multiple of 16 and <= 1024, got 40"),
        (["--height", "2048"], "--height: `height`.*got 2048"),
        (["--width", "0"], "--width:"),
        (["--cfg-text-scale", "1e30"], "--cfg-text-scale: `cfg_text_scale` must be a finite number >= 0.0 and <= 100"),
        (["--cfg-img-scale", "nan"], "--cfg-img-scale:"),
        (["--timestep-shift", "1e-30"], "--timestep-shift: `timestep_shift` must be a finite number >= 0.01"),
        (["--timestep-shift", "inf"], "--timestep-shift:"),
        (["--cfg-interval", "0.9", "0.1"], "--cfg-interval: `cfg_interval` must satisfy lo <= hi"),
        (["--cfg-renorm-type", "Global"], "--cfg-renorm-type:"),
        (["--cfg-renorm-min", "2"], "--cfg-renorm-min:"),
        (["--think", "--do-sample", "--temperature", "1e-30"], "--temperature: `think_temperature`"),
        (["--think", "--max-new-tokens", "0"], "--max-new-tokens: `think_max_new_tokens`"),
        (["--think", "--max-new-tokens", "1000000000"], "--max-new-tokens: `think_max_new_tokens` is too long"),
        (["--device", "bogus"], "--device: `device` 'bogus' is not a torch device"),
        (["--seed", "abc"], r"argument --seed: invalid int value: 'abc' \(see .* --help\)"),
        (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
        # a KV setting that another cancels, or that the method ignores, is refused (it was dropped without a word)
        (
            ["--kv-method", "unicache", "--rho", "0.5", "--kv-target", "0.3"],
            r"KV flags: `rho` \(0.5\) and `kv_target` \(0.3\) both set UniCache's retention: an explicit kv_target "
            r"is its rho0 .*; give `kv_target` alone, or `rho` and `rho_floor` without it",
        ),
        (["--kv-method", "unicache", "--rho-floor", "0.05", "--kv-target", "30%"], r"`rho_floor` \(0.05\) and `kv_t"),
        (
            ["--kv-method", "full", "--kv-target", "0.3"],
            r"KV flags: `kv_target` \(0.3\) does not apply to the full method, which keeps every row; drop",
        ),
    ],
)
def test_cli_bad_argument_fails_before_loading(tiny_checkpoint, no_weights, capsys, extra, match):
    assert _exit_code(_t2i(tiny_checkpoint, *extra)) == 2
    assert re.search(match, _one_line_error(capsys))


@pytest.mark.parametrize(
    "argv, match",
    [
        (["understand", "--prompt", "x", "--do-sample", "--temperature", "0"], "--temperature: `temperature`"),
        (
            ["understand", "--prompt", "x", "--max-new-tokens", "40000"],
            "--max-new-tokens: `max_new_tokens` is too long",
        ),
        (["understand", "--prompt", "x", "--seed", "-5"], "--seed:"),
        (["understand", "--prompt", "x", "--image", "{tmp}"], "--image: .* is a directory; pass an image file"),
        (["understand", "--prompt", "x", "--image", "{tmp}/nope.png"], "--image: file not found"),
        (["edit", "--prompt", "x", "--image", "{tmp}/notes.txt", "--out", "{tmp}/e.png"], "--image: cannot read"),
        (["edit", "--prompt", "x", "--image", "{tmp}/cut.png", "--out", "{tmp}/e.png"], "--image: cannot read"),
        (["edit", "--prompt", "x", "--image", "{tmp}/ok.png", "--out", "{tmp}/e.png", "--steps", "1"], "--steps:"),
        (["t2i", "--prompt", "x", "--out", "{tmp}"], "--out: .* is a directory"),
        (["t2i", "--prompt", "x", "--out", "{tmp}/notes.txt/o.png"], "--out: .*notes.txt is not a directory"),
        (["t2i", "--prompt", "x", "--out", "{tmp}/o.gif"], "--out: unsupported image suffix '.gif'"),
        (["t2i", "--prompt", "x", "--out", "/dev/null"], "--out: /dev/null exists and is not a regular file"),
        (["t2i", "--prompt-file", "{tmp}/nope.txt"], "--prompt-file: file not found"),
        (["t2i", "--prompt-file", "{tmp}"], "--prompt-file: .* is a directory"),
        (
            ["t2i", "--prompt-file", "{tmp}/latin1.txt"],
            r"--prompt-file: .*latin1.txt is not valid UTF-8 \(byte 0xe9 "
            r"at offset 3\)",
        ),
        (["t2i", "--prompt", "x", "--prompt-file", "{tmp}/notes.txt"], "not allowed with argument"),
        (["t2i"], "one of the arguments --prompt --prompt-file is required"),
    ],
)
def test_cli_bad_files_and_paths_fail_before_loading(tiny_checkpoint, tmp_path, no_weights, capsys, argv, match):
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    Image.new("RGB", (40, 30)).save(tmp_path / "ok.png")
    (tmp_path / "cut.png").write_bytes((tmp_path / "ok.png").read_bytes()[:60])
    argv = [a.format(tmp=tmp_path) for a in argv]
    argv = [argv[0], "--checkpoint", str(tiny_checkpoint), *argv[1:], "-q"]
    assert _exit_code(argv) == 2
    assert re.search(match, _one_line_error(capsys))


def test_cli_prompt_too_long_for_the_config_fails_before_loading(tiny_checkpoint_copy, no_weights, capsys):
    edit_json(tiny_checkpoint_copy / "llm_config.json", max_position_embeddings=300)
    assert cli.main(_t2i(tiny_checkpoint_copy)[:4] + ["the cat " * 200, "--steps", "2"]) == 2
    assert re.search(r"--prompt: `prompt` is too long.*max_position_embeddings = 300", _one_line_error(capsys))


def test_cli_size_limit_is_read_from_the_config(tiny_checkpoint_copy, no_weights, capsys):
    # a VAE with 3 levels downsamples by 4: 8-px latent tokens, at most 8 * 64 = 512 px (weights not needed)
    edit_json(tiny_checkpoint_copy / "ae_config.json", ch_mult=[1, 1, 1], downsample=4)
    assert cli.main(_t2i(tiny_checkpoint_copy, "--width", "1024")) == 2
    assert "--width: `width` must be a positive multiple of 8 and <= 512, got 1024" in _one_line_error(capsys)


def test_cli_broken_config_fails_before_loading(tiny_checkpoint_copy, no_weights, capsys):
    edit_json(tiny_checkpoint_copy / "llm_config.json", rope_theta=-1.0)
    assert cli.main(_t2i(tiny_checkpoint_copy)) == 2
    assert "rope_theta" in _one_line_error(capsys)


def test_cli_checkpoint_path_mistakes(tmp_path, no_weights, capsys):
    (tmp_path / "file.bin").write_bytes(b"x")
    for value, match in [
        ("", r"argument --checkpoint: empty path ''"),
        (str(tmp_path / "file.bin"), r"--checkpoint: .*file.bin is a file, not a folder"),
        (str(tmp_path / "missing"), r"--checkpoint: folder not found: .*missing"),
    ]:
        assert _exit_code(["understand", "--checkpoint", value, "--prompt", "x", "-q"]) == 2
        assert re.search(match, _one_line_error(capsys))


def _assert_one_line_in_process(capsys, argv, *needles: str) -> None:
    """``main(argv)`` exits 2 with exactly one ``error: ...`` line holding every needle, and nothing on stdout
    (the ``no_weights`` fixture fails the test if any weights load first)."""
    code, out, err = run_bagel_cli(capsys, *argv)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err and out == "", err
    for needle in needles:
        assert needle in err, (needle, err)


def test_invalid_utf8_prompt_file(tiny_checkpoint, tmp_path, no_weights, capsys):
    (tmp_path / "p.txt").write_bytes(b"a red \xff cube")
    _assert_one_line_in_process(
        capsys,
        ["t2i", "--checkpoint", str(tiny_checkpoint), "--prompt-file", str(tmp_path / "p.txt"), "-q"],
        "--prompt-file: ",
        "p.txt is not valid UTF-8 (byte 0xff at offset 6)",
    )


@pytest.mark.parametrize(
    "case", ["empty checkpoint", "checkpoint is a file", "image is a directory", "out is a directory"]
)
def test_path_mistakes(tiny_checkpoint, tmp_path, no_weights, capsys, case):
    ckpt = str(tiny_checkpoint)
    args = {
        "empty checkpoint": ("understand", "--checkpoint", "", "--prompt", "x"),
        "checkpoint is a file": ("understand", "--checkpoint", str(tiny_checkpoint / "vocab.json"), "--prompt", "x"),
        "image is a directory": (
            "edit",
            "--checkpoint",
            ckpt,
            "--prompt",
            "x",
            "--image",
            str(tmp_path),
            "--out",
            str(tmp_path / "o.png"),
        ),
        "out is a directory": ("t2i", "--checkpoint", ckpt, "--prompt", "x", "--out", str(tmp_path)),
    }[case]
    needle = {
        "empty checkpoint": "argument --checkpoint: empty path ''",
        "checkpoint is a file": f"{tiny_checkpoint / 'vocab.json'} is a file, not a folder",
        "image is a directory": f"--image: {tmp_path} is a directory",
        "out is a directory": f"--out: {tmp_path} is a directory",
    }[case]
    _assert_one_line_in_process(capsys, args, needle)


# ------------------------------------------------------------------------------------ CLI: run-time failures


def test_cli_interrupt_during_loading_exits_130(tiny_checkpoint, monkeypatch, capsys, tmp_path):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loader_module, "load_bagel", interrupted)
    assert cli.main(_t2i(tiny_checkpoint, "--out", str(tmp_path / "o.png"))) == 130
    assert _one_line_error(capsys) == "error: interrupted (Ctrl-C)\n"
    assert not any(tmp_path.iterdir())


def test_cli_out_of_memory_is_one_line(tiny_checkpoint, monkeypatch, capsys, tmp_path):
    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore details")

    monkeypatch.setattr(loader_module, "load_bagel", no_memory)
    assert cli.main(_t2i(tiny_checkpoint, "--out", str(tmp_path / "o.png"))) == 2
    assert re.search(
        r"out of memory \(OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\); use a "
        r"smaller",
        _one_line_error(capsys),
    )


def test_cli_nan_weights_exit_2_naming_the_tensor(tiny_checkpoint_copy, capsys, tmp_path):
    name = "time_embedder.mlp.0.weight"
    rewrite_tensors(tiny_checkpoint_copy / "ema.safetensors", set_value(name, math.nan))
    assert cli.main(_t2i(tiny_checkpoint_copy, "--out", str(tmp_path / "o.png"))) == 2
    assert f"tensor {name!r} holds 1 NaN" in _one_line_error(capsys)
    assert not (tmp_path / "o.png").exists()


def test_cli_error_after_a_progress_line_starts_a_new_line(tiny_checkpoint, monkeypatch, capsys, tmp_path):
    original = denoise_module.check_velocities

    def fail_on_second_step(raw, guided, *, step, **kw):
        if step == 1:
            raise NumericalError("denoising step 2 of 2: test")
        original(raw, guided, step=step, **kw)

    monkeypatch.setattr(denoise_module, "check_velocities", fail_on_second_step)
    argv = [a for a in _t2i(tiny_checkpoint, "--steps", "3", "--out", str(tmp_path / "o.png")) if a != "-q"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "denoising [" in err and "1/2\nerror: denoising step 2 of 2: test\n" in err
    assert not (tmp_path / "o.png").exists()


def test_prompt_file_is_read_as_utf8(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes("\ufeffune tasse de café\n".encode("utf-8"))
    assert read_prompt_file(path) == "une tasse de café"  # BOM and one final newline dropped
    path.write_bytes(b"two lines\n\n")
    assert read_prompt_file(path) == "two lines\n"
    path.write_bytes(b"")
    assert read_prompt_file(path) == ""


def test_cli_prompt_file_gives_the_same_answer_as_prompt(tiny_checkpoint, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("What is this?\n", encoding="utf-8")
    base = ["understand", "--checkpoint", str(tiny_checkpoint), "--dtype", "fp32", "--max-new-tokens", "3", "-q"]
    assert cli.main([*base, "--prompt-file", str(tmp_path / "p.txt")]) == 0
    from_file = capsys.readouterr().out
    assert cli.main([*base, "--prompt", "What is this?"]) == 0
    assert capsys.readouterr().out == from_file


def test_save_image_is_atomic(tmp_path, monkeypatch):
    out = tmp_path / "o.png"
    out.write_bytes(b"previous")
    image = Image.new("RGB", (4, 4))

    def half_written(self, fp, format=None, **params):
        Path(fp).write_bytes(b"\x89PNG partial")
        raise OSError("No space left on device")

    monkeypatch.setattr(Image.Image, "save", half_written)
    with pytest.raises(OSError, match="No space left"):
        save_image(image, out, "PNG")
    assert out.read_bytes() == b"previous" and [p.name for p in tmp_path.iterdir()] == ["o.png"]
    monkeypatch.undo()
    save_image(image, tmp_path / "new" / "x.png", "PNG")  # missing folders are created
    with Image.open(tmp_path / "new" / "x.png") as img:
        assert img.size == (4, 4)


# ------------------------------------------------------------------------------------ CLI subprocesses


def _cli_proc(*args, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "unicache_core.bagel", *args],
        capture_output=True,
        cwd=ROOT,
        env=env,
        timeout=60,
        **kwargs,
    )


def _assert_one_line(proc: subprocess.CompletedProcess, *needles: bytes) -> bytes:
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count(b"\n") == 1 and proc.stderr.startswith(b"error: "), proc.stderr
    assert b"Traceback" not in proc.stderr and b"loading" not in proc.stderr and proc.stdout == b""
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)
    return proc.stderr


def test_subprocess_invalid_utf8_prompt_argument(tiny_checkpoint):
    proc = _cli_proc(b"understand", b"--checkpoint", os.fsencode(tiny_checkpoint), b"--prompt", b"caf\xe9 \xff", b"-q")
    _assert_one_line(proc, b"--prompt: the text is not valid UTF-8 (byte 0xe9 at character 3)")


def test_subprocess_ctrl_c_during_denoising_exits_130(tiny_checkpoint, tmp_path):
    out = tmp_path / "o.png"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "unicache_core.bagel",
            "t2i",
            "--checkpoint",
            str(tiny_checkpoint),
            "--prompt",
            "x",
            "--width",
            "32",
            "--height",
            "32",
            "--steps",
            "1000",
            "--dtype",
            "fp32",
            "--out",
            str(out),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        env=env,
        # A job started in the background of a non-interactive shell (as CI may run us) inherits SIGINT as
        # ignored, and Python then keeps it ignored: give the child the default disposition, as a terminal would.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    err = bytearray()

    def read_stderr():
        while chunk := os.read(proc.stderr.fileno(), 4096):
            err.extend(chunk)

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while b"denoising [" not in err and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, f"the run ended before it could be interrupted: {bytes(err)[-300:]!r}"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    reader.join(timeout=5)
    lines = bytes(err).replace(b"\r", b"\n").strip().splitlines()
    assert lines[-1] == b"error: interrupted (Ctrl-C)", bytes(err)
    assert b"Traceback" not in err and not out.exists() and not list(tmp_path.iterdir())


def test_subprocess_stdout_closed_early(tiny_checkpoint):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will read the answer
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "unicache_core.bagel",
                "understand",
                "--checkpoint",
                str(tiny_checkpoint),
                "--prompt",
                "x",
                "--max-new-tokens",
                "2",
                "--dtype",
                "fp32",
                "-q",
            ],
            stdout=write_end,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env=env,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert (
        proc.returncode == 2
        and proc.stderr == b"error: stdout was closed before the answer was written (broken pipe)\n"
    )


# ------------------------------------------------------------------------------------ input images


def _png_header_only(path: Path, width: int, height: int) -> Path:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    )
    return path


@pytest.mark.parametrize("side", [20000, 10000])
def test_cli_decompression_bomb_is_a_clear_error(tmp_path, side):
    path = _png_header_only(tmp_path / "bomb.png", side, side)
    with pytest.raises(ValueError, match=rf"--image: .*bomb.png is too large.*{side * side} pixels.*downscale"):
        open_image(path)


def test_cli_non_image_and_directory(tmp_path):
    (tmp_path / "notes.png").write_text("not an image")
    with pytest.raises(ValueError, match="--image: cannot read .*notes.png as an image"):
        open_image(tmp_path / "notes.png")
    with pytest.raises(ValueError, match="--image: .* is a directory"):
        open_image(tmp_path)


def test_cli_truncated_image(tmp_path):
    path = tmp_path / "cut.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path)
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(ValueError, match="--image: cannot read .*cut.png"):
        open_image(path)


def test_cli_bad_image_exits_2_one_line(tiny_checkpoint, tmp_path, capsys):
    path = _png_header_only(tmp_path / "bomb.png", 20000, 20000)
    code = cli.main(["edit", "--checkpoint", str(tiny_checkpoint), "--prompt", "x", "--image", str(path), "-q"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: --image:")


def test_cli_cuda_without_cuda_exits_2(tiny_checkpoint, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = cli.main(["understand", "--checkpoint", str(tiny_checkpoint), "--prompt", "x", "--device", "cuda", "-q"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "CUDA is not available" in err


def test_cli_out_is_a_directory_exits_2(tiny_checkpoint, tmp_path, capsys):
    code = cli.main(
        [
            "t2i",
            "--checkpoint",
            str(tiny_checkpoint),
            "--prompt",
            "x",
            "--width",
            "32",
            "--height",
            "32",
            "--steps",
            "2",
            "--dtype",
            "fp32",
            "--out",
            str(tmp_path),
            "-q",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and str(tmp_path) in err
