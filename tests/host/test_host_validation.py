"""Inputs ComfyUI's own validation lets through, in a real ComfyUI 0.3.75 server: ``nan``/``inf`` floats and sizes
off the latent grid are refused at ``/prompt`` (HTTP 400 naming the value, via the nodes' ``VALIDATE_INPUTS``);
an edit source ``LATENT`` of another model's format is an ``execution_error`` naming it. The host keeps working."""

from __future__ import annotations

import json

import pytest
from hostlib import checkpoint_choice, describe, messages, node, t2i_graph, understand_graph

pytestmark = pytest.mark.host

BUNDLED_NAME = "bagel-tiny"


@pytest.fixture(scope="module")
def info(comfy):
    return comfy.object_info()


def _refusal(comfy, graph: dict, node_id: str) -> str:
    """POST the graph; it must be refused with HTTP 400 and node ``node_id``'s error; returns its details."""
    status, body = comfy.queue(graph)
    assert status == 400, json.dumps(body)[:2000]
    errors = (body.get("node_errors") or {}).get(node_id, {}).get("errors", [])
    assert errors, json.dumps(body)[:2000]
    return " ".join(e.get("details", "") for e in errors)


@pytest.mark.parametrize(
    "inputs, needle",
    [
        ({"width": 40}, "width = 40 is not a multiple of 16"),
        ({"height": 72}, "height = 72 is not a multiple of 16"),
        ({"cfg_text_scale": "nan"}, "cfg_text_scale = nan is not a finite number"),
        ({"cfg_img_scale": "inf"}, "cfg_img_scale = inf is not a finite number"),
        ({"timestep_shift": "-inf"}, "timestep_shift = -inf is not a finite number"),
        ({"cfg_renorm_min": 2.0}, "cfg_renorm_min = 2.0 is outside [0.0, 1.0]"),
    ],
)
def test_t2i_bad_value_is_http_400_naming_it(comfy, info, inputs, needle):
    graph = t2i_graph(info, BUNDLED_NAME, width=32, height=32, steps=2)
    graph["3"]["inputs"].update(inputs)
    assert needle in _refusal(comfy, graph, "3")


def test_nan_temperature_and_kv_values_are_http_400(comfy, info):
    graph = understand_graph(info, BUNDLED_NAME, temperature="nan")
    assert "temperature = nan" in _refusal(comfy, graph, "3")
    for name in ("kv_target", "rho", "rho_floor"):
        graph = understand_graph(info, BUNDLED_NAME, kv={name: "nan"})
        assert f"{name} = nan is not a finite number" in _refusal(comfy, graph, "2")


def _edit_graph(info, latent_node: dict) -> dict:
    return {
        "1": node(info, "UniCacheBagelLoader", checkpoint=checkpoint_choice(info, BUNDLED_NAME)),
        "2": node(info, "EmptyImage", width=64, height=64, batch_size=1, color=0x808080),
        "5": latent_node,
        "3": node(
            info,
            "UniCacheImageEdit",
            {"model": ["1", 0], "image": ["2", 0], "latent": ["5", 0]},
            steps=2,
            prompt="make it blue",
        ),
        "4": node(info, "PreviewImage", {"images": ["3", 0]}),
    }


@pytest.mark.parametrize(
    "latent_class, needle",
    [
        ("EmptySD3LatentImage", "holds only the value 0: an empty latent"),
        ("EmptyLatentImage", "not a LATENT [batch, 16, H/8, W/8] of BAGEL's FLUX VAE"),
    ],
)
def test_edit_source_latent_of_another_format_is_execution_error(comfy, info, latent_class, needle):
    graph = _edit_graph(info, node(info, latent_class, width=64, height=64, batch_size=1))
    entry = comfy.run(graph)
    assert entry["status"]["status_str"] == "error", describe(entry)
    err = messages(entry, "execution_error")
    assert err and err[0]["node_type"] == "UniCacheImageEdit", describe(entry)
    message = err[0]["exception_message"]
    assert needle in message and message.strip().count("\n") == 0, message
    after = comfy.run(understand_graph(info, BUNDLED_NAME, prompt="Still working?"))
    assert after["status"]["status_str"] == "success", describe(after)


DEEP_JSON = "[" * 100_000 + "]" * 100_000  # deeper than Python's JSON parser can follow


@pytest.fixture(scope="module")
def deep_tables(comfy, bundled_checkpoint):
    """A checkpoint whose own unicache_policy.json and a listed policy table nest JSON too deeply."""
    import shutil

    folder = comfy.base / "models" / "bagel" / "deep-policy-tiny"
    shutil.copytree(bundled_checkpoint, folder)
    (folder / "unicache_policy.json").write_text(DEEP_JSON)
    tables = comfy.base / "models" / "unicache_policies"
    tables.mkdir(parents=True, exist_ok=True)
    (tables / "deep-table.json").write_text(DEEP_JSON)
    return comfy.object_info()


@pytest.mark.parametrize("case", ["checkpoint's own table", "listed table"])
def test_too_deep_policy_table_is_one_line_naming_the_file(comfy, deep_tables, case):
    if case == "listed table":
        graph = understand_graph(deep_tables, BUNDLED_NAME, kv={"method": "unicache", "policy": "deep-table.json"})
        name = "deep-table.json"
    else:
        graph = understand_graph(deep_tables, "deep-policy-tiny", kv={"method": "unicache"})
        name = "deep-policy-tiny/unicache_policy.json"
    entry = comfy.run(graph)
    assert entry["status"]["status_str"] == "error", describe(entry)
    message = messages(entry, "execution_error")[0]["exception_message"]
    assert name in message and "nests JSON too deeply" in message and message.strip().count("\n") == 0, message
    after = comfy.run(understand_graph(deep_tables, BUNDLED_NAME, prompt="Still working?"))
    assert after["status"]["status_str"] == "success", describe(after)


def test_a_refusal_is_one_error_tagged_with_the_input_it_is_about(comfy, info):
    """ComfyUI files the one message of ``validate_inputs`` once per input of the node: 13 errors on the task node,
    each tagged with another input (``steps - width = 40 ...``). The pack's answer has it once, on ``width``."""
    graph = t2i_graph(info, BUNDLED_NAME, width=32, height=32, steps=2)
    graph["3"]["inputs"]["width"] = 40
    status, body = comfy.queue(graph)
    assert status == 400, json.dumps(body)[:2000]
    errors = body["node_errors"]["3"]["errors"]
    assert [e["extra_info"]["input_name"] for e in errors] == ["width"], json.dumps(errors)[:2000]
    assert errors[0]["details"].startswith("width - width = 40 is not a multiple of 16"), errors
    assert json.dumps(body).count("width = 40 is not a multiple of 16") == 1, json.dumps(body)[:2000]


def test_a_kv_setting_of_another_method_is_http_400_naming_it_once(comfy, info):
    """The KV Config's ``rho`` with method ``h2o`` ran as plain H2O without a word; the command line refuses it."""
    graph = understand_graph(info, BUNDLED_NAME, kv={"method": "h2o", "rho": 0.5})
    status, body = comfy.queue(graph)
    assert status == 400, json.dumps(body)[:2000]
    errors = body["node_errors"]["2"]["errors"]
    assert [e["extra_info"]["input_name"] for e in errors] == ["rho"], json.dumps(errors)[:2000]
    assert "rho = 0.5 applies to the unicache method only, not to 'h2o'" in errors[0]["details"], errors


@pytest.fixture(scope="module")
def odd_tables(comfy):
    """A listed policy table with a quantization group of 10^12 rows, and a FIFO in the policy folder."""
    import os
    from importlib import resources

    tables = comfy.base / "models" / "unicache_policies"
    tables.mkdir(parents=True, exist_ok=True)
    paper = json.loads(resources.files("unicache_core.compression").joinpath("tables", "bagel-7b-mot.json").read_text())
    paper["quantization"]["groups"] = [1_000_000_000_000]
    paper["model_id"] = ""  # any model: the tiny checkpoint's run reaches the size check
    (tables / "huge-group.json").write_text(json.dumps(paper))
    os.mkfifo(tables / "fifo-table.json")
    return comfy.object_info()


@pytest.mark.parametrize(
    "table, said",
    [
        ("huge-group.json", "`quantization.groups` holds 1000000000000, more rows than one segment of this model"),
        ("fifo-table.json", "fifo-table.json' is a FIFO (named pipe), not a regular file"),
    ],
)
def test_a_listed_table_the_run_cannot_use_is_one_line_naming_it(comfy, odd_tables, table, said):
    """A group of 10^12 rows was an execution_error of 34 traceback lines (a 256 TB allocation); a FIFO in the
    folder's list was "not found". Each is one line naming the table."""
    graph = understand_graph(odd_tables, BUNDLED_NAME, kv={"method": "unicache", "policy": table})
    entry = comfy.run(graph)
    assert entry["status"]["status_str"] == "error", describe(entry)
    error = messages(entry, "execution_error")[0]
    message = error["exception_message"]
    assert said in message and message.strip().count("\n") == 0, message
    assert error["exception_type"].endswith(("PolicyTableError", "ValueError")), error["exception_type"]
    after = comfy.run(understand_graph(odd_tables, BUNDLED_NAME, prompt="Still working?"))
    assert after["status"]["status_str"] == "success", describe(after)
