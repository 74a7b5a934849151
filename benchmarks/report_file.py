"""Writing a benchmark's report files, through the one output guard of every command
(:mod:`unicache_commands.output_files`): checked before the benchmark runs, written whole or not at all."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path

from unicache_commands.output_files import check_outputs, save_text


def check_report_paths(
    parser: argparse.ArgumentParser,
    outputs: Iterable[tuple[str, Path | None, str]],
    *,
    inputs: Iterable[tuple[str, Path | None]] = (),
    checkpoints: Iterable[Path | str | None] = (),
) -> None:
    """Refuse, through ``parser.error`` (one line, exit status 2), any output ``(flag, path, what)`` the guard
    refuses (:func:`~unicache_commands.output_files.check_outputs`: a checkpoint's or weights file, an input, a
    device or FIFO, a folder, another output), before the benchmark spends its minutes."""
    try:
        check_outputs(outputs, inputs=inputs, checkpoints=checkpoints)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))


def json_and_table(path: Path | None, flag: str = "--json") -> list[tuple[str, Path | None, str]]:
    """The outputs of a ``--json`` report that also writes its table beside it as ``.txt``."""
    return [(flag, path, "JSON report"), (flag, None if path is None else path.with_suffix(".txt"), "table (.txt)")]


def write_json_report(path: Path, report: dict, flag: str = "--json") -> None:
    """Write ``report`` as indented JSON to ``path`` atomically, creating its folder."""
    save_text(json.dumps(report, indent=1) + "\n", path, flag)


def write_text_report(path: Path, text: str, flag: str = "--json") -> None:
    """Write ``text`` (and a final newline) to ``path`` atomically, creating its folder."""
    save_text(text + "\n", path, flag)


def committed_path(path: Path | str) -> str:
    """``path`` as a committed report names it: relative to the repository when it lies inside it (no machine's
    absolute paths in docs/results), else as given."""
    here, repo = Path(path).resolve(), Path(__file__).resolve().parent.parent
    return str(here.relative_to(repo)) if here.is_relative_to(repo) else str(path)
