"""Reading a policy-table file strictly (:class:`~.policy_table.PolicyTable` is built from what this returns).

The file is read as every input is (:mod:`unicache_commands.input_files`): a regular file of bounded size (a FIFO,
a device, a folder, a dangling link each named as such), strict JSON (no key twice, no ``NaN`` or infinity, no
integer Python cannot convert, no nesting too deep). :func:`table_fields` then checks every key of the table and of
each entry: an unknown key (a misspelt ``"strenght"``) is refused, never ignored, and the table must say which model
it was made for (``model_id``; ``""``: any model, which :func:`~.policy_table.resolve_policy_table` says in the
report). :func:`check_table_sizes` bounds the table's sizes by the model's longest segment. Every problem is one
:class:`PolicyTableError` naming the file and the field.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from unicache_commands.input_files import parse_json, read_text_file

from ..kv.token_types import CANDIDATE_TYPES, TASKS, TokenType
from .defaults import DEFAULT_K90_THRESHOLD
from .family import JointPlan, QuantGeometry
from .routing import POLICY_KINDS

#: Deepest nesting of a table's free ``measurements`` JSON (calibration writes a few levels).
MAX_MEASUREMENT_DEPTH = 64
#: Largest policy-table file read (the calibrated tables with their measurements are well under 1 MB).
MAX_TABLE_BYTES = 64 << 20
#: The version :meth:`~.policy_table.PolicyTable.save` writes, and every version a table file may have.
TABLE_VERSION = 2
READABLE_VERSIONS = (1, 2)
#: Every key of a table file (``model_id``, ``format``, ``version`` and ``entries`` required) and of an entry.
TABLE_KEYS = ("format", "version", "model_id", "source", "threshold", "quantization", "entries", "measurements")
ENTRY_KEYS = ("task", "type", "kind", "strength", "k90", "plan")
#: Where to start a table from, ending every error.
_FIX = (
    "write it with `python -m unicache_core.bagel.calibrate` or start from "
    "unicache_core/compression/tables/bagel-7b-mot.json"
)


class PolicyTableError(ValueError):
    """A policy-table file is malformed, of another version, or made for another model."""


def _nesting_depth(value: object) -> int:
    """Depth of nested JSON containers in ``value`` (0 for a scalar), counted without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children: Iterable
        if isinstance(item, Mapping):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth + 1)
        if deepest > MAX_MEASUREMENT_DEPTH:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def read_table_json(path: Path) -> object:
    """The parsed JSON of the table file ``path`` (see the module docstring); a :class:`PolicyTableError` else."""
    label = f"policy table {str(path)!r}"
    try:  # a regular file of bounded size only: a FIFO would block, /dev/zero never end
        text = read_text_file(path, label=label, max_bytes=MAX_TABLE_BYTES, advice="pass a JSON file")
    except FileNotFoundError:
        if os.path.islink(path):
            raise PolicyTableError(
                f"{label} is a dangling symlink (to {os.readlink(path)!r}, which does not exist); point it at a "
                "policy-table JSON file or remove it"
            ) from None
        raise PolicyTableError(f"{label} does not exist; pass an existing JSON file") from None
    except IsADirectoryError:
        raise PolicyTableError(f"{label} is a folder; pass the JSON file inside it") from None
    except (OSError, ValueError) as exc:
        raise PolicyTableError(str(exc)) from None
    try:
        return parse_json(text, label=label, finite=True)
    except ValueError as exc:
        if "nested too deeply" in str(exc):
            raise PolicyTableError(
                f"{label} nests JSON too deeply to be read; a policy table is a flat list of entries: {_FIX}"
            ) from None
        raise PolicyTableError(f"{exc}; {_FIX}") from None


def _ratio(value: object) -> bool:
    return (
        not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and 0.0 <= value <= 1.0
    )


def _unknown(keys: Iterable[str], known: tuple[str, ...], where: str) -> str | None:
    unknown = sorted(set(keys) - set(known))
    if not unknown:
        return None
    return (
        f"{where} has the unknown key {unknown[0]!r} (a misspelt key is never ignored; the keys are {', '.join(known)})"
    )


def _entry(i: int, row: object, bad) -> tuple[tuple[str, TokenType], dict[str, Any]]:
    """The key and the fields of ``entries[i]``."""
    if not isinstance(row, Mapping):
        raise bad(f"`entries[{i}]` must be an object, got {row!r}")
    if (unknown := _unknown(row, ENTRY_KEYS, f"`entries[{i}]`")) is not None:
        raise bad(unknown)
    task = row.get("task")
    if task not in TASKS:
        raise bad(f"`entries[{i}].task` must be one of {TASKS}, got {task!r}")
    names = ", ".join(t.name.lower() for t in CANDIDATE_TYPES)
    try:
        ttype = TokenType.parse(row["type"])
    except (ValueError, TypeError, KeyError):
        raise bad(f"`entries[{i}].type` {row.get('type')!r} is not a token type ({names})") from None
    if ttype not in CANDIDATE_TYPES:
        raise bad(f"`entries[{i}].type` {ttype.name.lower()} is protected or unknown; only {names} get a policy")
    kind = row.get("kind")
    if kind not in POLICY_KINDS:
        raise bad(f"`entries[{i}].kind` must be one of {POLICY_KINDS}, got {kind!r}")
    fields: dict[str, Any] = {"kind": kind}
    for name in ("k90", "strength"):
        if name in row:
            if not _ratio(row[name]):
                raise bad(f"`entries[{i}].{name}` must be a number in [0, 1], got {row[name]!r}")
            fields[name] = float(row[name])
    if "plan" in row:
        try:
            fields["plan"] = JointPlan.from_list(row["plan"])
        except ValueError as exc:
            raise bad(f"`entries[{i}].plan`: {exc}") from None
    elif kind == "joint":
        raise bad(f"`entries[{i}]` is joint but has no `plan` (its bits per budget level)")
    return (task, ttype), fields


def _header(data: Mapping, bad) -> None:
    """The table's format, version and keys."""
    if (unknown := _unknown(data, TABLE_KEYS, "the table")) is not None:
        raise bad(unknown)
    if data.get("format") != "unicache-policy-table":
        raise bad(f"`format` must be 'unicache-policy-table', got {data.get('format')!r}")
    if data.get("version") not in READABLE_VERSIONS:
        raise bad(
            f"unsupported `version` {data.get('version')!r} (this library reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))})"
        )
    if "model_id" not in data:
        raise bad(
            "`model_id` is missing: name the model the table was made for (the id calibration writes, e.g. "
            "'bagel-7b-mot'), or \"\" for a table meant for any model, so that a table of another model is refused"
        )


def table_fields(data: object, origin: str) -> dict[str, Any]:
    """The :class:`~.policy_table.PolicyTable` fields of a parsed table; every problem is one
    :class:`PolicyTableError` naming ``origin`` and the field."""

    def bad(msg: str) -> PolicyTableError:
        return PolicyTableError(f"{origin}: {msg}; {_FIX}")

    if not isinstance(data, Mapping):
        raise bad(f"expected a JSON object, got {type(data).__name__}")
    _header(data, bad)
    model_id = data["model_id"]
    if not isinstance(model_id, str):
        raise bad(f"`model_id` must be a string, got {model_id!r}")
    source = data.get("source", "paper")
    if source not in ("paper", "calibrated"):
        raise bad(f"`source` must be 'paper' or 'calibrated', got {source!r}")
    threshold = data.get("threshold", DEFAULT_K90_THRESHOLD)
    if not _ratio(threshold):
        raise bad(f"`threshold` must be a number in [0, 1], got {threshold!r}")
    rows = data.get("entries")
    if not isinstance(rows, list) or not rows:
        raise bad("`entries` must be a non-empty list")
    try:
        geometry = QuantGeometry.from_dict(data.get("quantization", {}))
    except ValueError as exc:
        raise bad(f"`quantization`: {exc}") from None
    tables: dict[str, dict] = {"entries": {}, "k90": {}, "strength": {}, "plan": {}}
    for i, row in enumerate(rows):
        key, fields = _entry(i, row, bad)
        if key in tables["entries"]:
            raise bad(f"`entries[{i}]` repeats ({key[0]}, {key[1].name.lower()})")
        tables["entries"][key] = fields.pop("kind")
        for name, value in fields.items():
            tables[name][key] = value
    measurements = data.get("measurements", {})
    if not isinstance(measurements, Mapping):
        raise bad("`measurements` must be an object")
    if _nesting_depth(measurements) > MAX_MEASUREMENT_DEPTH:
        raise bad(f"`measurements` nests more than {MAX_MEASUREMENT_DEPTH} levels deep")
    return {
        "entries": tables["entries"],
        "threshold": float(threshold),
        "k90": tables["k90"],
        "model_id": model_id,
        "source": source,
        "strengths": tables["strength"],
        "measurements": dict(measurements),
        "plans": tables["plan"],
        "geometry": geometry,
    }


def check_table_sizes(geometry: QuantGeometry, segment_rows: int, origin: str) -> None:
    """Refuse a table whose sizes exceed what one segment of the model holds (``segment_rows``: its longest text or
    one image's tokens): a key group of more rows than any segment pads every quantized segment up to it (a group of
    10^12 rows tried to allocate 256 TB), and a residual of more rows than a segment means nothing."""
    fix = f"give sizes of at most {segment_rows} rows (the paper's groups: 32, 64, 128; residual_max 32)"
    for group in geometry.groups:
        if group > segment_rows:
            raise PolicyTableError(
                f"{origin}: `quantization.groups` holds {group}, more rows than one segment of this model can hold "
                f"({segment_rows}); {fix}"
            )
    if geometry.residual_max > segment_rows:
        raise PolicyTableError(
            f"{origin}: `quantization.residual_max` = {geometry.residual_max} is more rows than one segment of this "
            f"model can hold ({segment_rows}); {fix}"
        )


__all__ = [
    "ENTRY_KEYS",
    "MAX_MEASUREMENT_DEPTH",
    "MAX_TABLE_BYTES",
    "PolicyTableError",
    "READABLE_VERSIONS",
    "TABLE_KEYS",
    "TABLE_VERSION",
    "check_table_sizes",
    "read_table_json",
    "table_fields",
]
