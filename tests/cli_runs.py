"""Command lines run inside the test's own process: an entry point's ``main(argv)`` with pytest's captured
stdout and stderr.

Tests about what a command does (its files, answers, exit statuses and one-line errors) call ``main`` here and
skip the 2-4 CPU seconds a fresh interpreter spends importing torch; a few tests per entry point still start the
real process to prove what only a process shows (argv bytes, signals, a closed stdout, logging set up on stderr).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from unicache_core.bagel.checkpoint import loader as loader_module
from unicache_core.bagel.cli import main as bagel_cli


def exit_status(main: Callable[[list[str]], int], argv: Sequence[str]) -> int:
    """``main(argv)``'s exit status; an argparse mistake raises ``SystemExit``, whose code is returned instead."""
    try:
        return main(list(argv))
    except SystemExit as exc:
        return exc.code


def with_flags(base: Sequence[str], *extra: str) -> list[str]:
    """``base`` then ``extra``, where a flag of ``extra`` replaces the same flag of ``base`` and its values (the
    commands refuse a single-value flag given twice; a value never starts with ``-`` in ``base``)."""
    given = {arg for arg in extra if arg.startswith("-")}
    kept, index = [], 0
    while index < len(base):
        if base[index] in given:
            index += 1
            while index < len(base) and not base[index].startswith("-"):
                index += 1
            continue
        kept.append(base[index])
        index += 1
    return kept + list(extra)


def run_bagel_cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """``python -m unicache_core.bagel ARGS`` in this process: ``(exit status, stdout, stderr)``.

    Progress bars and ``error: ...`` lines are written to ``sys.stderr`` and so are captured; log records are
    not (pytest owns the root logger's handlers, so the command's ``logging.basicConfig`` adds none): check
    what must not load with :func:`forbid_weight_loading` instead of looking for log lines.
    """
    capsys.readouterr()  # drop what the test printed before
    code = exit_status(bagel_cli.main, args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def forbid_weight_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any load of a checkpoint's weights fail the test (for mistakes the command must refuse first)."""

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the arguments were checked")

    monkeypatch.setattr(loader_module, "load_bagel", refuse)
