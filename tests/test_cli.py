"""``python -m unicache_core.bagel`` on the tiny checkpoint: one run as a real process, the others through
``main(argv)`` in the test's process (:mod:`cli_runs`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_runs import forbid_weight_loading, run_bagel_cli
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def _cli_process(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "unicache_core.bagel", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


@pytest.fixture(scope="module")
def source_png(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "src.png"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, size=(30, 40, 3), dtype=np.uint8)).save(path)
    return path


def test_t2i_writes_png(tiny_checkpoint, tmp_path):
    """The real process: exit status 0, the image written, progress (and the log) on stderr, nothing on stdout."""
    out = tmp_path / "sub" / "t2i.png"
    proc = _cli_process(
        "t2i",
        "--checkpoint",
        str(tiny_checkpoint),
        "--prompt",
        "a red cube",
        "--width",
        "48",
        "--height",
        "32",
        "--steps",
        "3",
        "--seed",
        "1",
        "--dtype",
        "fp32",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    with Image.open(out) as img:
        assert img.format == "PNG" and img.size == (48, 32)
    assert "denoising" in proc.stderr and "2/2" in proc.stderr and "loading" in proc.stderr
    assert proc.stdout == ""


def test_edit_writes_png(tiny_checkpoint, tmp_path, source_png, capsys):
    out = tmp_path / "edit.png"
    code, _, err = run_bagel_cli(
        capsys,
        "edit",
        "--checkpoint",
        str(tiny_checkpoint),
        "--prompt",
        "make it blue",
        "--image",
        str(source_png),
        "--steps",
        "2",
        "--dtype",
        "fp32",
        "--out",
        str(out),
        "--cfg-interval",
        "0",
        "1",
        "--cfg-renorm-type",
        "text_channel",
    )
    assert code == 0, err
    with Image.open(out) as img:
        assert img.size == (80, 64)  # 40x30 -> the tiny checkpoint's VAE resize rule (128, 64, 16)


def test_understand_prints_answer(tiny_checkpoint, source_png, capsys):
    code, out, err = run_bagel_cli(
        capsys,
        "understand",
        "--checkpoint",
        str(tiny_checkpoint),
        "--prompt",
        "What is this?",
        "--image",
        str(source_png),
        "--max-new-tokens",
        "4",
        "--dtype",
        "fp32",
        "--quiet",
    )
    assert code == 0, err
    assert out.endswith("\n") and out.count("\n") >= 1
    assert err == ""  # --quiet: no progress bar


def test_missing_checkpoint_exits_2_with_one_line(tmp_path, capsys):
    missing = tmp_path / "nope"
    code, _, err = run_bagel_cli(
        capsys, "t2i", "--checkpoint", str(missing), "--prompt", "x", "--out", str(tmp_path / "o.png")
    )
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error:") and str(missing) in lines[-1] and "checkpoint" in lines[-1]
    assert not (tmp_path / "o.png").exists()


def test_bad_argument_and_bad_checkpoint_exit_2(tiny_checkpoint_copy, tmp_path, capsys):
    code, _, err = run_bagel_cli(
        capsys,
        "t2i",
        "--checkpoint",
        str(tiny_checkpoint_copy),
        "--prompt",
        "x",
        "--width",
        "30",
        "--height",
        "32",
        "--dtype",
        "fp32",
        "--out",
        str(tmp_path / "o.png"),
    )
    assert code == 2 and "Traceback" not in err
    assert "width" in err.strip().splitlines()[-1]
    (tiny_checkpoint_copy / "ema.safetensors").unlink()
    code, _, err = run_bagel_cli(
        capsys, "understand", "--checkpoint", str(tiny_checkpoint_copy), "--prompt", "x", "--dtype", "fp32"
    )
    assert code == 2 and "Traceback" not in err
    assert "ema.safetensors" in err.strip().splitlines()[-1]


def test_out_suffix_picks_the_format_and_unknown_suffix_fails_before_loading(
    tiny_checkpoint, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "t2i.jpg"
    code, _, err = run_bagel_cli(
        capsys,
        "t2i",
        "--checkpoint",
        str(tiny_checkpoint),
        "--prompt",
        "a cube",
        "--width",
        "32",
        "--height",
        "32",
        "--steps",
        "2",
        "--out",
        str(out),
        "-q",
    )
    assert code == 0, err
    with Image.open(out) as img:
        assert img.format == "JPEG" and img.size == (32, 32)
    forbid_weight_loading(monkeypatch)
    code, _, err = run_bagel_cli(
        capsys, "t2i", "--checkpoint", str(tiny_checkpoint), "--prompt", "a cube", "--out", str(tmp_path / "x.gif")
    )
    assert code == 2
    assert "unsupported image suffix '.gif'" in err


def test_max_new_tokens_zero_is_an_error_not_the_default(tiny_checkpoint, capsys, monkeypatch):
    forbid_weight_loading(monkeypatch)
    code, _, err = run_bagel_cli(
        capsys, "understand", "--checkpoint", str(tiny_checkpoint), "--prompt", "hi", "--max-new-tokens", "0"
    )
    assert code == 2
    assert "max_new_tokens" in err
    assert err.strip().splitlines()[-1].startswith("error: ")


def test_tiny_writer_never_clobbers_a_foreign_folder(tmp_path):
    from training.tiny import main as tiny_main
    from training.tiny import write_tiny_checkpoint

    real = tmp_path / "BAGEL-7B-MoT"
    real.mkdir()
    (real / "ema.safetensors").write_bytes(b"precious")
    (real / "README.md").write_text("real model")
    with pytest.raises(ValueError, match="refusing to overwrite"):
        write_tiny_checkpoint(real)
    assert (real / "ema.safetensors").read_bytes() == b"precious"
    assert tiny_main([str(real)]) == 2
    assert tiny_main([str(real / "README.md")]) == 2  # a file, not a folder
    tiny = write_tiny_checkpoint(tmp_path / "tiny")
    first = (tiny / "ema.safetensors").read_bytes()
    assert write_tiny_checkpoint(tiny, seed=1) == tiny  # an earlier tiny checkpoint may be rewritten
    assert (tiny / "ema.safetensors").read_bytes() != first
    write_tiny_checkpoint(real, force=True)
    assert (real / "ema.safetensors").read_bytes() != b"precious"


def test_bundled_model_is_the_default_checkpoint_and_answers(tmp_path, capsys):
    """Without --checkpoint the CLI runs the bundled unicache-shapes model, which answers in its world (background
    questions are the kind it always gets right, docs/shapes.md)."""
    from unicache_core.shapes import Scene, Shape

    for background in ("gray", "black"):
        image = tmp_path / f"{background}.png"
        Scene(background, (Shape("triangle", "yellow", "large", 4),)).render().save(image)
        code, out, err = run_bagel_cli(
            capsys,
            "understand",
            "--prompt",
            "what color is the background?",
            "--image",
            str(image),
            "--max-new-tokens",
            "4",
            "--dtype",
            "fp32",
            "--quiet",
        )
        assert code == 0, err
        assert out.strip() == background


def test_a_target_that_keeps_nothing_says_so_in_words(tiny_checkpoint, tmp_path, capsys, caplog):
    """At a target of 1e-9 no byte of the compressible KV is held: the report read "798.0 KiB full -> 0 B held (100.0%
    saved, 0.00x less)" and the command's log "(0.0x less)", a ratio over zero bytes."""
    import json
    import logging

    from unicache_core.compression.report_view import summary_text

    report = tmp_path / "r.json"
    argv = ["t2i", "--checkpoint", str(tiny_checkpoint), "--prompt", "a red cube", "--width", "32", "--height", "32"]
    argv += ["--steps", "3", "--kv-method", "h2o", "--kv-target", "1e-9", "--report", str(report)]
    with caplog.at_level(logging.INFO, logger="unicache_core.bagel.cli"):
        code, _, _ = run_bagel_cli(capsys, *argv, "--out", str(tmp_path / "o.png"), "-q")
    assert code == 0
    data = json.loads(report.read_text())
    assert data["summary"]["steady_managed_bytes"] == 0 < data["summary"]["full_managed_bytes"]
    text = summary_text(data)
    assert "0 B held (100% saved: none of it held, every compressible row dropped)" in text, text
    assert "x less" not in text
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV h2o:")]
    assert len(logged) == 1 and "none of it held" in logged[0] and "x less" not in logged[0], logged


@pytest.mark.parametrize("source", ["blank", "empty-file"])
def test_an_empty_prompt_gets_the_nodes_notice_on_the_command_line(tiny_checkpoint, tmp_path, capsys, caplog, source):
    """The nodes warn about an empty or whitespace-only prompt; the command line ran it without a word."""
    import logging

    from unicache_core.bagel.cli.items import CLI_PROMPT_HINT
    from unicache_core.bagel.notices import NODE_PROMPT_HINT

    (tmp_path / "p.txt").write_text("")
    prompt = ["--prompt", "   "] if source == "blank" else ["--prompt-file", str(tmp_path / "p.txt")]
    argv = ["t2i", "--checkpoint", str(tiny_checkpoint), *prompt, "--width", "32", "--height", "32", "--steps", "2"]
    with caplog.at_level(logging.WARNING, logger="unicache_core.bagel.cli"):
        code, _, _ = run_bagel_cli(capsys, *argv, "--out", str(tmp_path / "o.png"), "-q")
    assert code == 0 and (tmp_path / "o.png").exists()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    notice = f"the prompt is empty: BAGEL draws from the other items alone; type an instruction ({CLI_PROMPT_HINT})"
    assert warned == [notice], warned
    assert notice.replace(CLI_PROMPT_HINT, NODE_PROMPT_HINT) in _node_notice(tiny_checkpoint)  # the same words


def _node_notice(checkpoint) -> list[str]:
    from unicache_core.bagel.config import load_bagel_config
    from unicache_core.bagel.items import TextItem
    from unicache_core.bagel.notices import request_warnings

    return request_warnings("t2i", [TextItem("   ")], load_bagel_config(checkpoint))
