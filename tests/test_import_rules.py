"""The architecture's import rules (docs/architecture.md), checked by import-linter's ``lint-imports`` with the
contracts of ``[tool.importlinter]`` in pyproject.toml: kept on this tree, and broken (exit 1, the contract named)
on a copy of this tree that breaks one rule on purpose."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
#: The packages import-linter reads (``root_packages``): copied whole into the broken trees below.
PACKAGES = ("nodes", "unicache_core", "unicache_commands", "tools", "training", "benchmarks")


def _lint_imports() -> str:
    """The ``lint-imports`` command of this interpreter's environment."""
    script = Path(sys.executable).parent / "lint-imports"
    found = str(script) if script.is_file() else shutil.which("lint-imports")
    assert found, "lint-imports is not installed: pip install -e '.[test]' (import-linter is pinned there)"
    return found


def _contracts() -> list[dict]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return config["tool"]["importlinter"]["contracts"]


def _run(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` over the tree at ``root`` (its own packages first on the path, no cache written)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [_lint_imports(), "--no-cache", str(root / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_contract_is_kept_on_this_tree():
    contracts = _contracts()
    result = _run(ROOT)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"Contracts: {len(contracts)} kept, 0 broken." in output
    # the rules the architecture page states are among them
    types = {c["id"]: c["type"] for c in contracts}
    assert types["layers"] == "layers"
    assert types["no-host-in-library"] == "forbidden"
    layers = next(c for c in contracts if c["id"] == "layers")["layers"]
    assert layers == ["nodes", "unicache_core.bagel", "unicache_core.compression", "unicache_core.kv"]


def _broken_copy(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of the tree's packages and pyproject.toml with ``line`` added at the top of ``module``'s file."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / (module.replace(".", "/") + ".py")
    if not path.is_file():
        path = tmp_path / module.replace(".", "/") / "__init__.py"
    text = path.read_text(encoding="utf-8")
    # after the module docstring and `from __future__` (a statement before them would not parse)
    anchor = text.index("from __future__ import annotations\n") + len("from __future__ import annotations\n")
    path.write_text(text[:anchor] + line + "\n" + text[anchor:], encoding="utf-8")
    return tmp_path


@pytest.mark.parametrize(
    ("module", "line", "contract", "import_shown"),
    [
        # upward: the KV core reaching into the ComfyUI nodes
        ("unicache_core.kv.cache", "from nodes import host", "layers", "unicache_core.kv.cache -> nodes.host"),
        # upward: compression reaching into the engine
        (
            "unicache_core.compression.ops",
            "from unicache_core.bagel import settings",
            "layers",
            "unicache_core.compression.ops -> unicache_core.bagel.settings",
        ),
        # the library importing ComfyUI, and Ray
        (
            "unicache_core.bagel.pipeline",
            "import comfy.model_management",
            "no-host-in-library",
            "unicache_core.bagel.pipeline -> comfy",
        ),
        ("unicache_core.kv.stores", "import ray", "no-host-in-library", "unicache_core.kv.stores -> ray"),
        # a node module other than nodes.host importing ComfyUI directly
        ("nodes.task_nodes", "import folder_paths", "one-comfy-adapter", "nodes.task_nodes -> folder_paths"),
        # the batch runner's client pulling in torch
        ("tools.batch.client", "import torch", "host-clients-without-torch", "tools.batch.client -> torch"),
        # the commands' shared helpers pulling in the library
        (
            "unicache_commands.flags",
            "import unicache_core.sizes",
            "command-helpers-stand-alone",
            "unicache_commands.flags -> unicache_core.sizes",
        ),
        # the engine's memory planning reaching up into its command line
        (
            "unicache_core.bagel.memory.plan",
            "from ..cli import checks",
            "engine-in-three-packages",
            "unicache_core.bagel.memory.plan -> unicache_core.bagel.cli.checks",
        ),
        # the engine's run path reaching up into memory planning
        (
            "unicache_core.bagel.denoise",
            "from .memory import plan",
            "engine-in-three-packages",
            "unicache_core.bagel.denoise -> unicache_core.bagel.memory.plan",
        ),
        # a circle between two sibling modules (quant is imported by quantized_store)
        (
            "unicache_core.kv.quant",
            "from . import quantized_store",
            "no-import-circles",
            "No cycles are allowed in unicache_core.kv",
        ),
    ],
)
def test_a_deliberate_violation_breaks_its_contract(tmp_path, module, line, contract, import_shown):
    tree = _broken_copy(tmp_path, module, line)
    result = _run(tree)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    name = next(c["name"] for c in _contracts() if c["id"] == contract)
    # the report's header line of the broken contract (import-linter wraps long names over lines)
    flat = re.sub(r"\s+", " ", output)
    assert f"{name} BROKEN" in flat, output
    assert import_shown in flat, output
    # one violation may break several rules (an upward import into nodes.host also reaches ComfyUI)
    assert re.search(r"Contracts: \d+ kept, [1-9]\d* broken\.", output), output
