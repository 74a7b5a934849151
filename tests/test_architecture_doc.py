"""docs/architecture.md names real code: every backticked path exists, and every ``path.py::Name`` or
``path.py::Class.member`` it cites is defined there (so the page fails here when code moves without it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
#: A backticked repository path (``nodes/host.py``, ``tools/batch/``), optionally with ``::Name[.member]``.
REFERENCE = re.compile(r"`((?:[\w.-]+/)+[\w.-]*|[\w.-]+\.(?:py|js|sh))(?:::([\w.]+))?`")
#: A backticked module name of one of the project's packages (``unicache_core.bagel.checkpoint``).
MODULE = re.compile(r"`((?:unicache_core|nodes|tools|training|benchmarks)(?:\.\w+)+)`")


def _defined(path: Path, dotted: str) -> bool:
    """Is ``Name`` (or ``Class.member``) defined at the top level of ``path``?"""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    for part in dotted.split("."):
        found = None
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == part:
                found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    found = node
        if found is None:
            return False
        body = getattr(found, "body", [])
    return True


def test_every_path_and_name_in_the_architecture_page_exists():
    text = DOC.read_text(encoding="utf-8")
    references = REFERENCE.findall(text)
    assert len(references) > 50  # the page cites the code it describes
    missing = []
    for path, name in references:
        target = ROOT / path
        if not target.exists():
            missing.append(path)
        elif name and not (target.suffix == ".py" and _defined(target, name)):
            missing.append(f"{path}::{name}")
    for module in MODULE.findall(text):
        base = ROOT / module.replace(".", "/")
        if not (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()):
            missing.append(module)
    assert missing == []


def _contract_ids() -> set[str]:
    import tomllib

    with (ROOT / "pyproject.toml").open("rb") as file:
        return {c["id"] for c in tomllib.load(file)["tool"]["importlinter"]["contracts"]}


def test_the_rules_table_is_the_import_contracts():
    """The "Rules checked here" table lists every import-linter contract of pyproject.toml and nothing else, and
    every contract the page cites elsewhere ("contract `name`") exists."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Rules checked here", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `([\w-]+)` \|", section, flags=re.MULTILINE)
    ids = _contract_ids()
    assert len(listed) == len(set(listed)) and set(listed) == ids
    cited = re.findall(r"contracts? `([\w-]+)`", text)
    assert cited and set(cited) <= ids, set(cited) - ids
