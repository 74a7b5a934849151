"""The engine's command line and its run path are apart (issue 50): no module of unicache_core/bagel both parses
command-line arguments and runs the model. Import directions between the engine's three packages are import-linter's
contract ``engine-in-three-packages`` (tests/test_import_rules.py)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "unicache_core" / "bagel"
#: What running the model looks like in code: a forward of a network, or torch's inference contexts around one.
FORWARD_CALLS = {"forward", "forward_llm", "forward_branches", "forward_inference", "inference_mode", "no_grad"}


def _parses_arguments(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(alias.name == "argparse" for alias in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "argparse":
            return True
    return False


def _runs_the_model(tree: ast.Module) -> list[str]:
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in FORWARD_CALLS:
                calls.append(f"{name} (line {node.lineno})")
    return calls


def _modules():
    for path in sorted(ENGINE.rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def test_no_engine_module_parses_arguments_and_runs_the_model():
    both = [
        f"{rel}: {calls}" for rel, tree in _modules() if _parses_arguments(tree) and (calls := _runs_the_model(tree))
    ]
    assert both == []


def test_the_argument_parsers_are_the_commands():
    """argparse lives in the command line package and in the two other commands' own argument modules."""
    parsers = {rel for rel, tree in _modules() if _parses_arguments(tree)}
    others = {"unicache_core/bagel/calibration/cli.py", "unicache_core/bagel/checkpoint/single_file.py"}
    assert parsers - others and all(rel.startswith("unicache_core/bagel/cli/") for rel in parsers - others)


def test_the_check_finds_a_forward_where_there_is_one():
    """The check itself: the run path's modules that run the model are found running it."""
    running = {rel for rel, tree in _modules() if _runs_the_model(tree)}
    assert {"unicache_core/bagel/contexts.py", "unicache_core/bagel/pipeline.py"} <= running


def _branch_literals(tree: ast.Module) -> list[tuple[int, str]]:
    """String constants compared with a ``branch`` (``view.branch == "gen"``, ``"think" not in s["branches"]``)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        names = ast.unparse(node)
        if "branch" not in names:
            continue
        found += [(node.lineno, s.value) for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)]
    return found


def test_branch_names_compared_in_code_are_real_branches():
    """A branch compared by name is one of kv.token_types.BRANCHES (the think branch was once called "plan": a
    comparison left with the old name would silently never match)."""
    from unicache_core.kv.token_types import BRANCHES

    wrong = []
    for path in sorted((ROOT / "unicache_core").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        wrong += [f"{path.relative_to(ROOT)}:{line}: {value!r}" for line, value in _branch_literals(tree)]
    assert [w for w in wrong if w.rsplit(": ", 1)[1].strip("'") not in BRANCHES] == []
