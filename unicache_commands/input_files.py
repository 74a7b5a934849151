"""Files a command reads on a user's behalf (a prompt file, a policy table, a batch's workflow, seeds and prompts):
read only when they are regular files, and never more than a stated size.

A FIFO blocks its reader forever, ``/dev/zero`` never ends (a ``MemoryError`` later) and a device can do anything on
open, so :func:`read_regular_file` looks at the path without opening it, opens a regular file without blocking,
checks again on the open file (the path may have changed in between) and reads at most ``max_bytes + 1`` bytes. Every
failure is one line that starts with the caller's ``label`` (``"--prompts /x/p.txt"``): a missing file is a
:class:`FileNotFoundError`, a folder an :class:`IsADirectoryError`, an unreadable one an :class:`OSError`, anything
else (not a regular file, too large, not UTF-8) a :class:`ValueError`. :func:`parse_json` reads a JSON document
strictly (no key twice, no nesting too deep for the parser), in one line too.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

#: What a path that is not a regular file is, by its ``stat`` type.
_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str:
    """``"a FIFO (named pipe)"``, ``"a character device"``, ... for a ``st_mode`` that is no regular file or folder."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _check_regular(mode: int, label: str, advice: str) -> None:
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(f"{label} is a directory; {advice}")
    if not stat.S_ISREG(mode):
        raise ValueError(f"{label} is {file_kind(mode)}, not a regular file; {advice}")


def read_regular_file(path: str | Path, *, label: str, max_bytes: int, advice: str = "pass a regular file") -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them (see the module docstring).

    Args:
        path: the file (a symlink is followed).
        label: how errors name it, first (``"--seeds /x/s.txt"``, ``"policy table '/x/t.json'"``).
        max_bytes: the largest file accepted.
        advice: what to do instead, ending each error.
    """
    path = Path(path)
    try:
        mode = os.stat(path).st_mode  # never opened when it is no regular file: opening a FIFO would block
    except FileNotFoundError:
        broken = f" (a broken symlink to {os.readlink(path)})" if path.is_symlink() else ""
        raise FileNotFoundError(f"{label} does not exist{broken}; {advice}") from None
    except OSError as exc:  # a symlink loop, a path through a file, no permission on a folder
        raise OSError(f"{label} cannot be read ({exc.strerror or exc}); {advice}") from None
    _check_regular(mode, label, advice)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise OSError(f"{label} cannot be read ({exc.strerror or exc}); {advice}") from None
    with os.fdopen(fd, "rb") as fh:
        status = os.fstat(fh.fileno())
        _check_regular(status.st_mode, label, advice)  # the path may name another file by now
        if status.st_size > max_bytes:
            raise ValueError(f"{label} is {status.st_size} bytes, more than the {max_bytes} accepted; {advice}")
        try:
            data = fh.read(max_bytes + 1)
        except OSError as exc:
            raise OSError(f"{label} cannot be read ({exc.strerror or exc}); {advice}") from None
    if len(data) > max_bytes:  # it grew while it was read
        raise ValueError(f"{label} holds more than the {max_bytes} bytes accepted; {advice}")
    return data


def read_text_file(path: str | Path, *, label: str, max_bytes: int, advice: str = "pass a UTF-8 text file") -> str:
    """:func:`read_regular_file` decoded as strict UTF-8, a leading byte-order mark (U+FEFF) dropped: an editor's
    BOM is no text anyone typed."""
    data = read_regular_file(path, label=label, max_bytes=max_bytes, advice=advice)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{label} is not valid UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start}); save it as UTF-8"
        ) from None
    return text.removeprefix("\ufeff")


class _DuplicateKey(ValueError):
    pass


class _BadNumber(ValueError):
    """A number no reader takes: more digits than Python converts, or (``finite``) NaN or an infinity."""


def _refuse_duplicates(pairs: list[tuple[str, object]]) -> dict:
    seen: dict[str, object] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def _where(text: str, pattern: str, token: str | None = None) -> str:
    """``"line L column C"`` of the first match of ``pattern`` outside the document's strings (the first equal to
    ``token`` when given), or ``"an unknown place"``."""
    import re

    for match in re.finditer(r'"(?:[^"\\]|\\.)*"|(' + pattern + ")", text):
        found = match.group(1)
        if found is not None and (token is None or found == token):
            line = text.count("\n", 0, match.start()) + 1
            column = match.start() - (text.rfind("\n", 0, match.start()) + 1) + 1
            return f"line {line} column {column}"
    return "an unknown place"


def parse_json(text: str, *, label: str, finite: bool = False) -> object:
    """``text`` parsed as JSON, strictly: a key given twice in one object (``json`` would keep the last silently), a
    document nested too deeply for the parser (a ``RecursionError``), an integer of more digits than Python converts
    (``sys.get_int_max_str_digits()``: its own error names neither file nor place) and invalid JSON are each one
    ``ValueError`` starting with ``label`` (``"--items /x/i.json"``). ``finite``: ``NaN``, ``Infinity`` and numbers
    that overflow to an infinity (``1e400``) are refused too (JSON has no such values; Python's reader takes them)."""
    import json
    import math
    import sys

    most = sys.get_int_max_str_digits() or 1 << 62

    def integer(digits: str) -> int:
        if len(digits.lstrip("-")) > most:
            raise _BadNumber(
                f"an integer of {len(digits.lstrip('-'))} digits (at most {most} are read)", rf"-?\d{{{most + 1},}}"
            )
        return int(digits)

    def number(digits: str) -> float:
        value = float(digits)
        if finite and not math.isfinite(value):
            raise _BadNumber(f"the number {digits[:40]} (no finite float holds it)", r"-?\d[\d.eE+-]*", digits)
        return value

    def constant(name: str) -> float:
        if finite:
            raise _BadNumber(f"{name} (not a JSON number)", r"NaN|-?Infinity")
        return float(name)

    try:
        return json.loads(
            text, object_pairs_hook=_refuse_duplicates, parse_int=integer, parse_float=number, parse_constant=constant
        )
    except _DuplicateKey as exc:
        raise ValueError(
            f"{label}: the key {str(exc)!r} is given twice in one object (JSON keeps only the last); keep one"
        ) from None
    except _BadNumber as exc:
        what, *where = exc.args
        raise ValueError(f"{label}: {what} at {_where(text, *where)}; write the value it should be") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{label}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise ValueError(f"{label}: the JSON is nested too deeply to read; write it flat") from None


__all__ = ["file_kind", "parse_json", "read_regular_file", "read_text_file"]
