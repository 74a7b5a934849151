"""Policy-table files: the shipped paper table is the one source of the paper's assignment, and every broken
file (too deeply nested, or without an entry for the request's task) is one PolicyTableError naming it."""

from __future__ import annotations

import json

import pytest

from unicache_core.compression import make_cache_factory
from unicache_core.compression.policy_table import (
    CHECKPOINT_POLICY_FILE,
    MAX_MEASUREMENT_DEPTH,
    PolicyTable,
    PolicyTableError,
    paper_policy_table,
    resolve_policy_table,
)
from unicache_core.kv.cache import RequestInfo
from unicache_core.kv.token_types import TokenType as TT


def _table_json(measurements=None, tasks=("understanding", "t2i", "edit")) -> dict:
    entries = [
        {"task": task, "type": t, "kind": "quantize" if t == "source_vae" else "evict"}
        for task in tasks
        for t in ("instruction", "source_vit", "source_vae")
    ]
    return {
        "format": "unicache-policy-table",
        "version": 1,
        "model_id": "",
        "source": "calibrated",
        "entries": entries,
        "measurements": measurements or {},
    }


def _nested(depth: int):
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_the_default_table_is_the_shipped_paper_table():
    paper = paper_policy_table()
    assert dict(PolicyTable().entries) == dict(paper.entries)
    assert paper.kind("edit", TT.SOURCE_VAE) == "quantize" and paper.kind("understanding", TT.SOURCE_VIT) == "evict"
    assert paper.model_id == "bagel-7b-mot" and paper.source == "paper"
    assert paper.strength("t2i", TT.INSTRUCTION) == 0.5 and paper.strength("understanding", TT.INSTRUCTION) == 0.2


@pytest.mark.parametrize("depth", [MAX_MEASUREMENT_DEPTH + 1, 100_000])
def test_a_deeply_nested_table_is_one_error_naming_the_file(tmp_path, depth):
    path = tmp_path / "deep.json"
    text = json.dumps(_table_json()).replace(
        '"measurements": {}', '"measurements": {"runs": ' + "[" * depth + "]" * depth + "}"
    )
    path.write_text(text, encoding="utf-8")
    with pytest.raises(PolicyTableError, match="deep.json.*(deep|nests)"):
        PolicyTable.load(path)
    # as --policy and as a checkpoint's own table
    with pytest.raises(PolicyTableError, match="deep.json"):
        make_cache_factory("unicache", policy=str(path)).start(RequestInfo(task="edit", num_layers=2))
    (tmp_path / CHECKPOINT_POLICY_FILE).write_text(text, encoding="utf-8")
    with pytest.raises(PolicyTableError, match=CHECKPOINT_POLICY_FILE):
        resolve_policy_table(None, str(tmp_path), "")


def test_a_nested_table_within_the_limit_loads(tmp_path):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(_table_json({"runs": _nested(MAX_MEASUREMENT_DEPTH - 1)})), encoding="utf-8")
    assert PolicyTable.load(path).kind("edit", TT.INSTRUCTION) == "evict"


def test_a_table_without_the_task_names_the_file_and_what_to_do(tmp_path):
    path = tmp_path / "edit_only.json"
    path.write_text(json.dumps(_table_json(tasks=("edit",))), encoding="utf-8")
    factory = make_cache_factory("unicache", policy=str(path))
    factory.start(RequestInfo(task="edit", num_layers=2))  # the task it covers
    with pytest.raises(PolicyTableError, match=r"edit_only.json.*no entry for the 't2i' task.*calibrate"):
        factory.start(RequestInfo(task="t2i", num_layers=2))
    with pytest.raises(ValueError, match=r"token_type=instruction.*edit_only.json.*calibrate"):
        PolicyTable.load(path).kind("t2i", TT.INSTRUCTION)
