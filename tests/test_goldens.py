"""Our engine's outputs against its committed goldens (tests/goldens/engine_outputs.json).

Every method on the shipped workflows' three requests, at its default target and at 10%, on the bundled model:
the images' pixels and final latents, the answers, and every step of the KV reports must be what they were when
the goldens were written: the discrete parts exactly, the continuous ones within the tolerances that different
CPUs' rounding needs (tests/goldens/engine_cases.py says how they were measured). A change that moves them on
purpose refreshes the goldens (``PYTHONPATH=tests .venv/bin/python -m goldens.engine_cases --write``) and says in
its commit which outputs moved and why.
"""

from __future__ import annotations

import json

import pytest
from goldens.engine_cases import CASES, GOLDENS, PIXEL_ATOL, differences, load_bundled, run_case


@pytest.fixture(scope="module")
def bundled():
    return load_bundled()


@pytest.mark.heavy
def test_every_method_reproduces_its_goldens(bundled):
    goldens = json.loads(GOLDENS.read_text())["cases"]
    assert sorted(goldens) == sorted(case.name for case in CASES), "refresh the goldens: the case list changed"
    moved = {}
    for case in CASES:
        diff = differences(goldens[case.name], run_case(bundled, case))
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
            moved = max(abs(a - b) for a, b in zip(other["pixel_blocks"], full["pixel_blocks"]))
            assert moved > 10 * PIXEL_ATOL, (task, method, moved)
            assert other["kv"]["summary"]["steady_managed_bytes"] < full["kv"]["summary"]["steady_managed_bytes"]


def test_the_tolerances_let_a_small_change_through_and_catch_a_large_one():
    goldens = json.loads(GOLDENS.read_text())["cases"]
    want = goldens["edit/full/default"]
    nudged = json.loads(json.dumps(want))
    nudged["latent_sample"][0] += 1e-3  # a last-bits difference between machines
    nudged["pixel_blocks"][5] += 0.5
    nudged["kv"]["summary"]["peak_bytes"] = want["kv"]["summary"]["peak_bytes"]
    assert differences(want, nudged) == []
    moved = json.loads(json.dumps(want))
    moved["latent_sample"][0] += 0.05
    moved["kv"]["whole_total"] = int(want["kv"]["whole_total"] * 1.01)  # one percent more bytes or rows
    assert [line.split(":")[0] for line in differences(want, moved)] == ["/kv/whole_total", "/latent_sample"]
