"""The compression defaults are written once, in unicache_core/compression/defaults.py: no other code file
repeats one of its per-task tables (reduction, retention, rho0, floor) or writes the score queries as a
number literal."""

from __future__ import annotations

import ast
from pathlib import Path

from unicache_core.compression import defaults
from unicache_core.kv.token_types import TASKS

ROOT = Path(__file__).resolve().parents[1]
HOME = ROOT / "unicache_core" / "compression" / "defaults.py"


def _code_files():
    for folder in ("unicache_core", "unicache_commands", "nodes", "benchmarks", "tools", "training"):
        yield from (ROOT / folder).rglob("*.py")


def _number(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool)


#: The per-task tables of defaults.py (and the retained share the reduction implies).
KNOWN_TABLES = (
    defaults.DEFAULT_REDUCTION,
    defaults.RHO0,
    defaults.RHO_FLOOR,
    {task: round(1.0 - r, 6) for task, r in defaults.DEFAULT_REDUCTION.items()},
)


def _repeats_a_known_table(node: ast.Dict) -> bool:
    """A dict literal keyed by the tasks whose values (or one value of each task's preset dict) are one of
    the known per-task tables."""
    try:
        value = ast.literal_eval(node)
    except ValueError:
        return False
    if set(value) != set(TASKS):
        return False
    for table in KNOWN_TABLES:
        if all(value[t] == table[t] or (isinstance(value[t], dict) and table[t] in value[t].values()) for t in TASKS):
            return True
    return False


def _widget_default(node: ast.AST) -> bool:
    """``("INT", {"default": 256, ...})``: a node input whose default is a number literal."""
    return isinstance(node, ast.Tuple) and any(
        isinstance(part, ast.Dict)
        and any(
            isinstance(k, ast.Constant) and k.value == "default" and _number(v) for k, v in zip(part.keys, part.values)
        )
        for part in node.elts
    )


def _literals(path: Path):
    """(line, what) of every per-task number table and every ``score_queries`` 256 literal of one file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict) and node.keys:
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
            if set(keys) == set(TASKS) and _repeats_a_known_table(node):
                yield node.lineno, "per-task numbers"
            for key, value in zip(node.keys, node.values):
                if (
                    isinstance(key, ast.Constant)
                    and key.value == "score_queries"
                    and (_number(value) or _widget_default(value))
                ):
                    yield node.lineno, "score_queries literal"
        if isinstance(node, ast.keyword) and node.arg == "score_queries" and _number(node.value):
            yield node.value.lineno, "score_queries literal"
        if isinstance(node, ast.arguments):
            named = node.posonlyargs + node.args
            pairs = list(zip(named[len(named) - len(node.defaults) :], node.defaults))
            pairs += [(a, d) for a, d in zip(node.kwonlyargs, node.kw_defaults) if d is not None]
            for arg, default in pairs:
                if arg.arg == "score_queries" and _number(default):
                    yield default.lineno, "score_queries default"


def test_per_task_numbers_and_score_queries_live_only_in_defaults():
    found = [
        f"{path.relative_to(ROOT)}:{line} {what}"
        for path in _code_files()
        if path != HOME
        for line, what in _literals(path)
    ]
    assert found == []
    assert set(defaults.DEFAULT_REDUCTION) == set(defaults.RHO0) == set(defaults.RHO_FLOOR) == set(TASKS)
    assert all(defaults.RHO_FLOOR[t] <= defaults.RHO0[t] for t in TASKS)
