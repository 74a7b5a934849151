"""Round four of the hardening (issue 49), outputs and flags: no command writes over its own inputs (an image, an
image an items file names, a t2i reference, a calibration image folder, a checkpoint's file or its sidecar, a
device), an empty output path is refused, and every program of the repository refuses a repeated single-value flag.
Each refusal is one line naming the flag, before any work, and leaves every file as it was."""

from __future__ import annotations

import ast
import hashlib
import json
from pathlib import Path

import pytest
from cli_runs import exit_status
from PIL import Image
from test_cli_errors import _exit_code, _one_line_error, no_weights  # noqa: F401  (no_weights: a fixture)

from unicache_commands.output_files import check_outputs

ROOT = Path(__file__).resolve().parents[1]


def _image(path: Path, color=(200, 10, 10)) -> Path:
    Image.new("RGB", (32, 32), color).save(path)
    return path


def _digests(*paths: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def _run(checkpoint: Path, command: str, *args: str) -> list[str]:
    return [command, "--checkpoint", str(checkpoint), "--steps", "2", "--dtype", "fp32", "-q", *args]


@pytest.fixture
def work(tmp_path):
    c, d = _image(tmp_path / "c.png"), _image(tmp_path / "d.png", (10, 10, 200))
    (tmp_path / "items.json").write_text(json.dumps({"items": [{"image": "c.png"}, {"text": "x"}]}))
    return tmp_path, c, d


@pytest.mark.parametrize(
    "case, argv, needle",
    [
        ("edit onto its source", ["edit", "--image", "{c}", "--prompt", "x", "--out", "{c}"], "same file as --image"),
        (
            "edit onto its second image",
            ["edit", "--image", "{c}", "--image", "{d}", "--prompt", "x", "--out", "{d}"],
            "same file as --image",
        ),
        ("edit onto an items image", ["edit", "--items", "{items}", "--out", "{c}"], "image {c}; the image file would"),
        (
            "t2i onto its reference",
            ["t2i", "--width", "32", "--height", "32", "--image", "{c}", "--prompt", "x", "--out", "{c}"],
            "same file as --image",
        ),
        (
            "report onto an items image",
            ["edit", "--items", "{items}", "--out", "{w}/o.png", "--report", "{c}"],
            "--report: {c} is the same file as --items",
        ),
    ],
)
def test_no_output_over_an_input(tiny_checkpoint, work, no_weights, capsys, case, argv, needle):
    w, c, d = work
    names = {"c": str(c), "d": str(d), "items": str(w / "items.json"), "w": str(w)}
    before = _digests(c, d, w / "items.json")
    argv = _run(tiny_checkpoint, argv[0], *(a.format(**names) for a in argv[1:]))
    assert _exit_code(argv) == 2
    err = _one_line_error(capsys)
    assert needle.format(**names) in err and "give" in err, err
    assert _digests(c, d, w / "items.json") == before
    assert not (w / "o.png").exists()


def test_calibration_never_writes_into_its_image_folder(tiny_checkpoint, tmp_path, capsys):
    from unicache_core.bagel.calibration.cli import main

    folder = tmp_path / "cal"
    folder.mkdir()
    base = _image(folder / "base.png")
    (tmp_path / "p.txt").write_text("make it blue\n")
    before = _digests(base)
    argv = ["--checkpoint", str(tiny_checkpoint), "--task", "edit", "--prompts", str(tmp_path / "p.txt")]
    argv += ["--images", str(folder), "--out", str(base), "--steps", "2", "--size", "32", "--dtype", "fp32"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out: {base} is inside the folder --images {folder}") and err.count("\n") == 1
    assert _digests(base) == before and sorted(p.name for p in folder.iterdir()) == ["base.png"]


@pytest.mark.parametrize(
    "target, needle",
    [
        ("llm_config.json", "--json: {ck}/llm_config.json is a file of the checkpoint"),
        ("merges.json", "--json: {ck}/merges.txt is a file of the checkpoint"),  # the .txt table beside it
        ("/dev/null", "--json: /dev/null exists and is not a regular file"),
        ("", "argument --json: empty path ''"),
    ],
)
def test_benchmark_report_never_replaces_a_checkpoint_file_or_a_device(
    tiny_checkpoint_copy, capsys, monkeypatch, target, needle
):
    from benchmarks import bagel_e2e

    monkeypatch.setattr(bagel_e2e, "run", lambda cfg: pytest.fail("the benchmark ran before --json was checked"))
    ck = tiny_checkpoint_copy
    files = sorted(ck.iterdir())
    before = _digests(*files)
    path = target if target in ("", "/dev/null") else str(ck / target)
    assert exit_status(bagel_e2e.main, ["--json", path]) == 2
    err = capsys.readouterr().err
    assert needle.format(ck=ck) in err and err.count("\n") == 1, err
    assert sorted(ck.iterdir()) == files and _digests(*files) == before


def test_two_outputs_of_one_command_are_never_the_same_file(tmp_path):
    with pytest.raises(ValueError, match=r"--json: .*x.txt is the same file as --json .*x.txt; the table"):
        check_outputs([("--json", tmp_path / "x.txt", "JSON report"), ("--json", tmp_path / "x.txt", "table")])
    with pytest.raises(ValueError, match=r"--out: the path is empty; give the path of the image"):
        check_outputs([("--out", "", "image")])


@pytest.mark.parametrize("flag", ["--out", "--summary"])
def test_batch_refuses_an_empty_output_path(tmp_path, capsys, monkeypatch, flag):
    from tools.batch import cli

    monkeypatch.chdir(tmp_path)
    workflow = tmp_path / "wf.json"
    workflow.write_text("{}")
    argv = [str(workflow), "--host", "http://127.0.0.1:9", "--count", "1", "--out", str(tmp_path / "o")]
    argv = [a if a != str(tmp_path / "o") or flag != "--out" else "" for a in argv]
    if flag == "--summary":
        argv += ["--summary", ""]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: empty path ''" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wf.json"]


# ------------------------------------------------------------------------------------------- repeated flags

#: Programs of the repository that parse a command line (the library's own commands are tested elsewhere).
PROGRAMS = sorted(
    str(p.relative_to(ROOT))
    for folder in ("benchmarks", "tools", "training")
    for p in (ROOT / folder).rglob("*.py")
    if "ArgumentParser(" in p.read_text() or "OneLineParser(" in p.read_text()
)
#: Run outside this project's interpreter (their own venv or a bare script): plain argparse there.
OWN_INTERPRETER = {"tools/comfyhost.py", "tools/official_reference.py"}


def test_the_program_list_is_found():
    assert {"benchmarks/bagel_e2e.py", "benchmarks/rss.py", "tools/kv_plot.py", "training/tiny.py"} <= set(PROGRAMS)


@pytest.mark.parametrize("program", [p for p in PROGRAMS if p not in OWN_INTERPRETER])
def test_every_program_parses_with_the_projects_parser(program):
    """``argparse.ArgumentParser`` keeps the last of a flag given twice; the project's parser refuses it."""
    tree = ast.parse((ROOT / program).read_text())
    plain = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "ArgumentParser"
        and getattr(node.func.value, "id", None) == "argparse"
    ]
    assert plain == [], f"{program} builds a plain argparse.ArgumentParser at line(s) {plain}"


@pytest.mark.parametrize(
    "module, argv, needle",
    [
        ("benchmarks.bagel_e2e", ["--json", "a.json", "--json", "b.json"], "--json given twice"),
        ("benchmarks.bagel_e2e", ["--steps", "2", "--steps", "3"], "--steps given twice"),
        ("benchmarks.multi_image", ["--samples", "2", "--samples", "3"], "--samples given twice"),
        ("benchmarks.kv_attention", ["--repeats", "1", "--repeats", "2"], "--repeats given twice"),
        ("benchmarks.rss", ["load", "x", "--dtype", "bf16", "--dtype", "fp32"], "--dtype given twice"),
        ("tools.kv_plot", ["--out", "a.png", "--out", "b.png"], "--out given twice"),
    ],
)
def test_a_repeated_flag_is_refused_by_the_benchmarks_and_tools(capsys, module, argv, needle):
    import importlib

    main = importlib.import_module(module).main
    assert exit_status(main, argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("error: ") and err.count("\n") == 1, err
