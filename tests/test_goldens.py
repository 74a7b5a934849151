"""Our engine's outputs against its committed goldens (tests/goldens/engine_outputs.json).

Every method on the shipped workflows' three requests, at its default target and at 10%, on the bundled model:
the images' pixels and final latents, the answers, and every step of the KV reports must be what they were when
the goldens were written. A change that moves them on purpose refreshes the goldens
(``PYTHONPATH=tests .venv/bin/python -m goldens.engine_cases --write``) and says in its commit which outputs moved
and why.
"""

from __future__ import annotations

import json

import pytest
from goldens.engine_cases import CASES, GOLDENS, load_bundled, run_case


@pytest.fixture(scope="module")
def bundled():
    return load_bundled()


def _differences(want: dict, got: dict, path: str = "") -> list[str]:
    """Every leaf where ``got`` differs from ``want``, as ``path: want -> got``."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for key in sorted(set(want) | set(got)):
            out += _differences(want.get(key), got.get(key), f"{path}/{key}")
        return out
    return [] if want == got else [f"{path}: {want!r} -> {got!r}"]


@pytest.mark.heavy
def test_every_method_reproduces_its_goldens(bundled):
    goldens = json.loads(GOLDENS.read_text())["cases"]
    assert sorted(goldens) == sorted(case.name for case in CASES), "refresh the goldens: the case list changed"
    moved = {}
    for case in CASES:
        diff = _differences(goldens[case.name], run_case(bundled, case))
        if diff:
            moved[case.name] = diff[:6]
    assert not moved, "outputs moved from their goldens:\n" + "\n".join(
        f"{name}:\n  " + "\n  ".join(lines) for name, lines in moved.items()
    )


def test_the_goldens_tell_methods_apart():
    """The goldens are a real check: the methods' images, answers or reports differ from full KV's."""
    goldens = json.loads(GOLDENS.read_text())["cases"]
    for task in ("t2i", "edit"):
        full = goldens[f"{task}/full/default"]
        for method in ("unicache", "h2o", "kivi"):
            other = goldens[f"{task}/{method}/0.1"]
            assert other["pixels_sha256"] != full["pixels_sha256"], (task, method)
            assert other["kv"]["summary"]["steady_managed_bytes"] < full["kv"]["summary"]["steady_managed_bytes"]
