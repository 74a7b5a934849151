"""User-facing defaults in the docs and the nodes' tooltips are the numbers of unicache_core/compression/defaults.py
and of the engine's presets (unicache_core/bagel/settings.py): each sentence that states one is rebuilt here from
the code and must appear as written (line breaks aside), so a changed default fails here until its text follows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from comfy_stubs import host_stubs  # noqa: F401  (a fixture)

from unicache_core.bagel.settings import EDIT_DEFAULTS, T2I_DEFAULTS
from unicache_core.compression.defaults import DEFAULT_REDUCTION, RHO0, RHO_FLOOR

ROOT = Path(__file__).resolve().parents[1]
RHO_T2I, RHO_UND, RHO_EDIT = RHO0["t2i"], RHO0["understanding"], RHO0["edit"]
FLOOR_T2I, FLOOR_EDIT = RHO_FLOOR["t2i"], RHO_FLOOR["edit"]
SEER = T2I_DEFAULTS

#: (doc, sentence as it must read) for every sentence of the docs that states a default.
STATED = [
    (
        "docs/nodes.md",
        f"(rho0 {RHO_UND:g} for an answer, {RHO_T2I:g} for text to image and {RHO_EDIT:g} for edits, decaying to "
        f"floors of {FLOOR_T2I:g} and {FLOOR_EDIT:g})",
    ),
    (
        "docs/nodes.md",
        f"after the first {SEER.taylorseer_first_steps} steps each guidance branch runs the model on one step in "
        f"{SEER.taylorseer_interval}",
    ),
    (
        "docs/engine.md",
        f"Defaults: {RHO_UND:g} fixed (understanding), {RHO_T2I:g} decaying to {FLOOR_T2I:g} (T2I), {RHO_EDIT:g} "
        f"decaying to {FLOOR_EDIT:g} (edit)",
    ),
    (
        "docs/engine.md",
        f"the paper's reduction, {DEFAULT_REDUCTION['understanding']:.0%} for understanding and edit, "
        f"{DEFAULT_REDUCTION['t2i']:.0%} for T2I",
    ),
    ("docs/compression.md", f"the task's ρ0 (this project: {RHO_T2I:g} t2i, {RHO_UND:g} understanding and editing"),
    (
        "docs/compression.md",
        f"UniCache's ρ0 is the paper's average retention ({RHO_UND:g} understanding and editing, {RHO_T2I:g} "
        f"text-to-image)",
    ),
    ("docs/compression.md", f"its floor ({FLOOR_EDIT:g} editing, {FLOOR_T2I:g} text-to-image)"),
]


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize(("doc", "sentence"), STATED)
def test_a_default_the_docs_state_is_the_codes(doc, sentence):
    assert _flat(sentence) in _flat((ROOT / doc).read_text(encoding="utf-8")), f"{doc} should say: {sentence}"


def test_sentences_that_join_two_tasks_still_hold():
    """The docs say "understanding and edit(ing)" once for two tasks: true only while both share the value."""
    assert RHO_UND == RHO_EDIT
    assert DEFAULT_REDUCTION["understanding"] == DEFAULT_REDUCTION["edit"]


def test_task_node_tooltips_state_the_presets(host_stubs):
    import nodes

    for node_id, preset in (("UniCacheTextToImage", T2I_DEFAULTS), ("UniCacheImageEdit", EDIT_DEFAULTS)):
        spec = nodes.NODE_CLASS_MAPPINGS[node_id].INPUT_TYPES()
        inputs = {**spec["required"], **spec.get("optional", {})}
        assert f"Official: {preset.num_timesteps}." in inputs["steps"][1]["tooltip"]
        assert inputs["steps"][1]["default"] == preset.num_timesteps
        assert f"Official: {preset.timestep_shift}." in inputs["timestep_shift"][1]["tooltip"]
        seer = inputs["taylorseer"][1]["tooltip"]
        assert (
            f"after {preset.taylorseer_first_steps} steps" in seer and f"1 step in {preset.taylorseer_interval}" in seer
        )
