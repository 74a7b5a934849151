"""The sizes the project's style keeps small (docs/architecture.md, "Rules checked here"): files under 500 lines
over the library, the nodes and the programs around them, the library's public functions at most 10
parameters, and every function of the library, the command helpers and the nodes at most 60 lines of code.

A file that is over 500 lines today is listed in ``LONG_FILES`` with the most lines it may reach: it may shrink
(and must leave the list once it is under 500) but not grow past its ceiling. ``LONG_FUNCTIONS`` does the same
for functions: 60 lines of body (its docstring left out) is what one screen shows at this project's 120 columns
beside the signature, so a reader sees a whole function at once; the few longer ones are listed with a ceiling.
Import rules are import-linter's (tests/test_import_rules.py)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("unicache_core", "unicache_commands", "nodes", "tools", "training", "benchmarks")
MAX_LINES = 500
#: Files already over MAX_LINES and the most lines each may grow to before it is split.
LONG_FILES = {
    "benchmarks/kv_attention.py": 650,
}
MAX_PARAMETERS = 10
#: Public functions already over MAX_PARAMETERS and the most each may take (they may only go down).
WIDE_FUNCTIONS: dict[str, int] = {}
MAX_FUNCTION_LINES = 60
#: Functions (``path::qualified name``) already over MAX_FUNCTION_LINES and the most lines each may grow to.
LONG_FUNCTIONS: dict[str, int] = {
    "unicache_core/bagel/calibration/run.py::calibrate": 71,
    "unicache_core/bagel/checkpoint/single_file.py::inspect_single_file": 71,
    "unicache_core/bagel/tokenizer.py::BagelTokenizer.__init__": 67,
    "unicache_core/compression/report_view.py::render_plot": 67,
}
#: Where function lengths are counted: the code a reader of the library and the nodes follows.
LENGTH_PACKAGES = ("unicache_core", "unicache_commands", "nodes")
#: Where signatures are counted: the library's API. (ComfyUI V1 node methods take every widget as a keyword, the
#: host's convention, and the training and benchmark scripts are programs, not an API.)
API_PACKAGES = ("unicache_core",)


def _python_files():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path.relative_to(ROOT).as_posix(), path


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_files_stay_under_500_lines():
    too_long = []
    for rel, path in _python_files():
        lines = _lines(path)
        ceiling = LONG_FILES.get(rel, MAX_LINES)
        if lines > ceiling:
            too_long.append(f"{rel}: {lines} lines (at most {ceiling}; split it by concept)")
    assert too_long == []


def test_the_long_file_list_holds_only_long_files():
    listed = {rel: _lines(ROOT / rel) for rel in LONG_FILES if (ROOT / rel).is_file()}
    assert set(listed) == set(LONG_FILES), "a listed file is gone: remove it from LONG_FILES"
    short = [rel for rel, lines in listed.items() if lines <= MAX_LINES]
    assert short == [], "these are under 500 lines now: remove them from LONG_FILES"


def _public_functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            yield node


def test_public_functions_take_at_most_10_parameters():
    too_many = []
    for rel, path in _python_files():
        if not rel.startswith(API_PACKAGES):
            continue
        for node in _public_functions(ast.parse(path.read_text(encoding="utf-8"))):
            args = node.args
            names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
            if len(names) > WIDE_FUNCTIONS.get(f"{rel}::{node.name}", MAX_PARAMETERS):
                too_many.append(f"{rel}:{node.lineno} {node.name}() has {len(names)} parameters")
    assert too_many == [], "group them into a settings object or a dataclass"


def test_the_wide_function_list_holds_only_wide_functions():
    widths = {}
    for rel, path in _python_files():
        for node in _public_functions(ast.parse(path.read_text(encoding="utf-8"))):
            args = node.args
            count = len([a for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")])
            widths[f"{rel}::{node.name}"] = max(count, widths.get(f"{rel}::{node.name}", 0))
    stale = [name for name in WIDE_FUNCTIONS if widths.get(name, 0) <= MAX_PARAMETERS]
    assert stale == [], "these take at most 10 parameters now (or are gone): remove them from WIDE_FUNCTIONS"


def test_the_checks_see_the_code(tmp_path):
    # the walkers find what they measure: every package has files, and a long signature is counted
    counted = {rel.split("/")[0] for rel, _ in _python_files()}
    assert counted == set(PACKAGES)
    wide = "def wide(" + ", ".join(f"p{i}" for i in range(11)) + "):\n    pass\n"
    found = [n.name for n in _public_functions(ast.parse(wide)) if len(n.args.args) > MAX_PARAMETERS]
    assert found == ["wide"]


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the function's last line."""
    body = node.body
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        if len(body) == 1:
            return 0
        first = body[1]
    return (node.end_lineno or node.lineno) - first.lineno + 1


def _function_lengths() -> dict[str, int]:
    """``path::Outer.name`` -> body lines of every function (methods and nested functions named by their scope)."""
    lengths: dict[str, int] = {}

    def visit(node: ast.AST, scope: str, rel: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{scope}.{child.name}" if scope else child.name
                if not isinstance(child, ast.ClassDef):
                    lengths[f"{rel}::{name}"] = max(_body_lines(child), lengths.get(f"{rel}::{name}", 0))
                visit(child, name, rel)
            else:
                visit(child, scope, rel)

    for rel, path in _python_files():
        if rel.startswith(LENGTH_PACKAGES):
            visit(ast.parse(path.read_text(encoding="utf-8")), "", rel)
    return lengths


def test_functions_stay_under_60_lines():
    too_long = [
        f"{name}: {lines} lines (at most {LONG_FUNCTIONS.get(name, MAX_FUNCTION_LINES)}; split it into named steps)"
        for name, lines in sorted(_function_lengths().items())
        if lines > LONG_FUNCTIONS.get(name, MAX_FUNCTION_LINES)
    ]
    assert too_long == []


def test_the_long_function_list_holds_only_long_functions():
    lengths = _function_lengths()
    stale = [name for name in LONG_FUNCTIONS if lengths.get(name, 0) <= MAX_FUNCTION_LINES]
    assert stale == [], "these are at most 60 lines now (or gone): remove them from LONG_FUNCTIONS"


def test_the_length_rule_counts_bodies_without_docstrings():
    source = 'def f():\n    """Doc\n    string."""\n' + "    x = 1\n" * 61
    (node,) = ast.parse(source).body
    assert isinstance(node, ast.FunctionDef) and _body_lines(node) == 61 > MAX_FUNCTION_LINES
