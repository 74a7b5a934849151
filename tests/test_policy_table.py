"""Policy-table files: the shipped paper table is the one source of the paper's assignment, and every broken
file (too deeply nested, or without an entry for the request's task) is one PolicyTableError naming it."""

from __future__ import annotations

import json
import re

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


def _paper_json() -> dict:
    from importlib import resources

    path = resources.files("unicache_core.compression").joinpath("tables", "bagel-7b-mot.json")
    return json.loads(path.read_text(encoding="utf-8"))


def _load_text(tmp_path, text: str) -> str:
    """The one PolicyTableError line loading ``text`` as a table file gives."""
    path = tmp_path / "t.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(PolicyTableError) as caught:
        PolicyTable.load(path)
    message = str(caught.value)
    assert "\n" not in message and "t.json" in message, message
    return message


def test_a_group_larger_than_a_segment_is_refused_naming_the_field_and_its_bound(tmp_path):
    """A table's sizes are bounded by the model's longest segment: a key group of 10^12 rows passed the table's own
    check (>= 1) and the run tried to allocate 256 TB; it is refused when the table is bound to a request of the
    model (the command line's check, the node's run), naming `quantization.groups` and the bound."""
    data = _paper_json()
    data["quantization"]["groups"] = [32, 1_000_000_000_000]
    path = tmp_path / "big.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    factory = make_cache_factory("unicache", policy=str(path))
    request = RequestInfo(task="edit", num_layers=2, model_id="bagel-7b-mot", segment_rows=32768)
    with pytest.raises(
        PolicyTableError,
        match=r"big.json.*`quantization.groups` holds 1000000000000, more rows than "
        r"one segment of this model can hold \(32768\); give sizes of at most 32768 rows",
    ):
        factory.start(request)
    data["quantization"] = {"groups": [32], "residual_max": 40000}
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(PolicyTableError, match=r"`quantization.residual_max` = 40000 is more rows"):
        make_cache_factory("unicache", policy=str(path)).start(request)
    data["quantization"] = {"groups": [32768]}  # at the bound: taken
    path.write_text(json.dumps(data), encoding="utf-8")
    assert make_cache_factory("unicache", policy=str(path)).start(request) is not None


def test_the_command_line_refuses_a_table_too_large_for_the_model_before_loading(
    tiny_checkpoint, tmp_path, capsys, monkeypatch
):
    from cli_runs import forbid_weight_loading, run_bagel_cli

    from unicache_core.bagel.checkpoint.model_id import model_id_of

    forbid_weight_loading(monkeypatch)
    data = _paper_json()
    data["quantization"]["groups"] = [1_000_000_000_000]
    data["model_id"] = model_id_of(tiny_checkpoint)
    (tmp_path / "big.json").write_text(json.dumps(data), encoding="utf-8")
    out = tmp_path / "o.png"
    code, _, err = run_bagel_cli(
        capsys,
        "t2i",
        "--checkpoint",
        str(tiny_checkpoint),
        "--prompt",
        "x",
        "--kv-method",
        "unicache",
        "--policy",
        str(tmp_path / "big.json"),
        "--out",
        str(out),
        "-q",
    )
    assert code == 2 and err.count("\n") == 1 and "`quantization.groups` holds 1000000000000" in err, err
    assert not out.exists()


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda t: t.replace('"threshold": 0.3', '"threshold": NaN'), r"NaN \(not a JSON number\) at line \d+"),
        (lambda t: t.replace('"strength": 0.5', '"strength": 0.5, "k90": NaN', 1), r"NaN \(not a JSON number\)"),
        (lambda t: t.replace('"threshold": 0.3', '"threshold": 1e400'), r"the number 1e400 \(no finite float"),
        (
            lambda t: t.replace('"threshold": 0.3', '"threshold": ' + "1" * 5001),
            r"an integer of 5001 digits \(at most 4300 are read\) at line \d+ column \d+",
        ),
        (lambda t: t.replace('"version": 2', '"version": 2, "version": 1'), r"the key 'version' is given twice"),
        (lambda t: t.replace('"entries": [', '"entries": [], "entries": [', 1), r"the key 'entries' is given twice"),
        (
            lambda t: t.replace('"strength": 0.5', '"strenght": 0.5', 1),
            r"`entries\[0\]` has the unknown key 'strenght' \(a misspelt key is never ignored",
        ),
        (lambda t: t.replace('"strength": 0.5', '"strength": 0.5, "bogus": 1', 1), r"unknown key 'bogus'"),
        (lambda t: t.replace('"threshold": 0.3', '"threshhold": 0.3'), r"the table has the unknown key 'threshhold'"),
        (lambda t: t.replace('"model_id": "bagel-7b-mot", ', ""), r"`model_id` is missing: name the model"),
    ],
    ids=[
        "nan-threshold",
        "nan-k90",
        "overflow",
        "5001-digits",
        "duplicate-key",
        "two-entries",
        "misspelt-key",
        "unknown-entry-key",
        "unknown-top-key",
        "no-model-id",
    ],
)
def test_a_table_file_is_read_strictly(tmp_path, edit, said):
    """Each of these loaded (NaN, an unknown key, a duplicate key keeping the last, a table naming no model) or
    gave Python's own words naming neither file nor field (5001 digits); each is one line naming the file."""
    text = json.dumps(_paper_json())
    changed = edit(text)
    assert changed != text
    assert re.search(said, _load_text(tmp_path, changed)), _load_text(tmp_path, changed)


def test_a_table_that_names_no_model_is_used_with_a_warning(tmp_path):
    data = _paper_json()
    data["model_id"] = ""
    path = tmp_path / "any.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    table, info = resolve_policy_table(str(path), "", "sha256:mine")
    assert table.model_id == "" and "names no model" in info["warning"] and "sha256:mine" in info["warning"]
    assert resolve_policy_table(str(tmp_path / "any.json"), "", "")[1]["warning"] is None  # no model to check


def test_a_dangling_checkpoint_table_link_is_named_as_one(tmp_path):
    (tmp_path / CHECKPOINT_POLICY_FILE).symlink_to(tmp_path / "gone.json")
    with pytest.raises(PolicyTableError, match=r"unicache_policy.json' is a dangling symlink \(to '.*gone.json'"):
        resolve_policy_table(None, str(tmp_path), "")
