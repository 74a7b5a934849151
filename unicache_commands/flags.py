"""Command-line helpers shared by the project's tools: one-line errors, non-empty path arguments, and no flag
silently dropped.

argparse keeps the last value of a flag given twice (``--image a.png --image b.png`` runs on ``b.png`` and says
nothing). :class:`OneLineParser` makes every flag that stores one value (argparse's ``store`` action, the default)
refuse a second use in one line instead; a flag opts into repeating by its action (``action="append"``, whose
values are all kept). ``repeat_hint=`` adds a flag's own advice to that line. A long flag's value that starts with
``-`` (``--image-sizes -5x-5``) is passed to the flag's own check, not refused by argparse as an unknown flag.
Every program of the project parses with it: ``python -m unicache_core.bagel``, ``.calibrate``, ``tools.batch``,
``training``, the single-file converter (the library's commands through :mod:`unicache_core.cli`), the benchmarks
and the tools.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

#: Namespace attribute holding, while one command line is parsed, the first value of each single-value flag seen
#: (removed before the namespace is returned).
_SEEN = "_one_line_parser_seen"


class SingleValueAction(argparse._StoreAction):
    """argparse's ``store`` that refuses a second use of its flag in one command line (see the module docstring).

    ``repeat_hint``: advice appended to the error (``"one image is taken: pass --image once"``).
    """

    def __init__(self, option_strings, dest, *, repeat_hint: str | None = None, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.repeat_hint = repeat_hint

    def __call__(self, parser, namespace, values, option_string=None):
        seen = namespace.__dict__.setdefault(_SEEN, {})
        if option_string is not None and id(self) in seen:
            first_flag, first = seen[id(self)]
            hint = self.repeat_hint or f"it takes one value: pass {option_string} once"
            parser.error(
                f"{option_string} given twice ({first_flag} {_shown(first)}, then {option_string} {_shown(values)}); "
                f"{hint}"
            )
        seen[id(self)] = (option_string, values)
        super().__call__(parser, namespace, values, option_string)


def _shown(values) -> str:
    """A flag's parsed value(s) as typed (``a.png``, ``0.2 0.8``), for the repeat error."""
    if isinstance(values, (list, tuple)):
        return " ".join(str(v) for v in values)
    return str(values)


def refuse_repeated_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make every ``store`` flag added to ``parser`` from now on a :class:`SingleValueAction` (its groups and
    subcommands' parsers made by :class:`OneLineParser` included); returns ``parser``."""
    parser.register("action", None, SingleValueAction)
    parser.register("action", "store", SingleValueAction)
    return parser


class OneLineParser(argparse.ArgumentParser):
    """argparse with the one-line error format of every tool here (``error: ...``, exit status 2) whose
    single-value flags refuse to be given twice (:func:`refuse_repeated_flags`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        refuse_repeated_flags(self)

    def error(self, message: str):
        self.exit(2, f"error: {' '.join(message.split())} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        # a value that starts with "-" ("--image-sizes -5x-5") stays a value
        args = self._dash_values(list(sys.argv[1:] if args is None else args))
        namespace, extras = super().parse_known_args(args, namespace)
        namespace.__dict__.pop(_SEEN, None)
        return namespace, extras

    def _dash_values(self, args: list[str]) -> list[str]:
        """``--flag -5x-5`` → ``--flag=-5x-5`` for a long flag of one value, when the next word is no flag of this
        parser: argparse would take ``-5x-5`` for an unknown flag and say "expected one argument", where the
        flag's own check names what is wrong with the value."""
        known = {o for action in self._actions for o in action.option_strings}
        single = {
            o
            for action in self._actions
            for o in action.option_strings
            if o.startswith("--") and action.nargs is None and isinstance(action, argparse._StoreAction)
        }
        out: list[str] = []
        index = 0
        while index < len(args):
            word = args[index]
            if word == "--":
                out += args[index:]
                break
            following = args[index + 1] if index + 1 < len(args) else None
            if (
                word in single
                and following is not None
                and following.startswith("-")
                and following != "-"
                and following.split("=", 1)[0] not in known
            ):
                out.append(f"{word}={following}")
                index += 2
                continue
            out.append(word)
            index += 1
        return out


def path_arg(value: str) -> Path:
    """A path argument; the empty string is refused (``Path('')`` would silently mean the current folder)."""
    if not value:
        raise argparse.ArgumentTypeError("empty path ''")
    return Path(value)


def printable(value: object) -> str:
    """``value`` (a path, a name) as an error line may show it: unchanged when every character prints, else with its
    control characters escaped as JSON escapes them (``a\\u0000b.png``, ``\\u001b[31m``): a NUL, a newline or a
    terminal escape in a file name never reaches the terminal raw, nor splits the one line."""
    import json

    text = str(value)
    return text if text.isprintable() else json.dumps(text)[1:-1]


__all__ = ["OneLineParser", "SingleValueAction", "path_arg", "printable", "refuse_repeated_flags"]
