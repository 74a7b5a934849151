"""The shipped workflows (workflows/*.json and workflows/api/*.json): node types registered (or known core nodes),
widget values valid (combo values offered, numbers within bounds), the UI and API versions describe the same
graph, and both are what tools/make_workflows.py writes from the nodes' current INPUT_TYPES."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from comfy_stubs import host_stubs  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / "workflows"
WORKFLOW_NAMES = (
    "text_to_image",
    "image_edit",
    "understanding",
    "ab_edit_full_vs_unicache",
    "two_image_edit",
    "two_image_understanding",
    "iterative_edit",
)

# Core nodes the shipped workflows may use: widget inputs in order, as ComfyUI 0.3.75's /object_info has them.
CORE_NODES = {
    "LoadImage": {"widgets": [("image", "COMBO_FILES", {})], "outputs": ["IMAGE", "MASK"]},
    "SaveImage": {"widgets": [("filename_prefix", "STRING", {})], "outputs": []},
    "PreviewImage": {"widgets": [], "outputs": []},
}
WIDGET_KINDS = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}  # COMBO: a V3 combo, its choices in "options"
SEED_CONTROL = {"fixed", "increment", "decrement", "randomize"}


def _mappings():
    import nodes

    return nodes.NODE_CLASS_MAPPINGS


def _object_info():
    """``{type: (widget specs in order, output types)}`` for our nodes and the core nodes we use."""
    info = {}
    for node_id, cls in _mappings().items():
        spec = cls.INPUT_TYPES()
        widgets, optional = [], set()
        for section in ("required", "optional"):
            for name, (kind, *rest) in spec.get(section, {}).items():
                opts = rest[0] if rest else {}
                if isinstance(kind, list) or kind in WIDGET_KINDS:
                    widgets.append((name, kind, opts))
                    if section == "optional":
                        optional.add(name)
        info[node_id] = {
            "widgets": widgets,
            "optional_widgets": optional,
            "outputs": list(cls.RETURN_TYPES),
            "sockets": {
                n: k
                for s in ("required", "optional")
                for n, (k, *_) in spec.get(s, {}).items()
                if not (isinstance(k, list) or k in WIDGET_KINDS)
            },
        }
    for name, core in CORE_NODES.items():
        info.setdefault(name, {**core, "sockets": {}})
    return info


def _convert(ui: dict, info: dict) -> tuple[dict, list[str]]:
    """UI → API (docs/comfyui.md Appendix A) with the value checks."""
    links = {link[0]: link for link in ui["links"]}
    prompt, problems = {}, []
    for node in ui["nodes"]:
        if node["type"] in ("Note", "MarkdownNote") or node.get("mode", 0) in (2, 4):
            continue
        spec = info.get(node["type"])
        if spec is None:
            problems.append(f"node {node['id']}: unknown type {node['type']}")
            continue
        inputs, linked = {}, set()
        for socket in node.get("inputs", []):
            if socket.get("link") is not None:
                src = links[socket["link"]]
                inputs[socket["name"]] = [str(src[1]), src[2]]
                linked.add(socket["name"])
        values = list(node.get("widgets_values") or [])
        pos = 0
        for name, kind, opts in spec["widgets"]:
            if pos >= len(values):
                if name in spec.get("optional_widgets", ()):
                    continue  # saved before the optional widget existed: the frontend gives it its default
                problems.append(f"node {node['id']} {node['type']}: no value for widget {name}")
                break
            value = values[pos]
            pos += 1
            if opts.get("control_after_generate"):
                if pos >= len(values) or values[pos] not in SEED_CONTROL:
                    problems.append(f"node {node['id']} {node['type']}.{name}: missing control_after_generate value")
                else:
                    pos += 1
            if name in linked:
                continue
            inputs[name] = value
            offered = kind if isinstance(kind, list) else opts.get("options") if kind == "COMBO" else None
            if offered is not None and value not in offered:
                problems.append(f"node {node['id']} {node['type']}.{name}: {value!r} not offered")
            if kind in ("INT", "FLOAT"):
                if (
                    isinstance(value, bool)
                    or not isinstance(value, (int, float))
                    or (kind == "INT" and not isinstance(value, int))
                ):
                    problems.append(f"node {node['id']} {node['type']}.{name}: {value!r} is not a {kind}")
                elif not opts.get("min", value) <= value <= opts.get("max", value):
                    problems.append(f"node {node['id']} {node['type']}.{name}: {value} out of range")
            if kind == "BOOLEAN" and not isinstance(value, bool):
                problems.append(f"node {node['id']} {node['type']}.{name}: {value!r} is not a BOOLEAN")
            if kind == "STRING" and not isinstance(value, str):
                problems.append(f"node {node['id']} {node['type']}.{name}: {value!r} is not a STRING")
        if node["type"] != "LoadImage" and pos != len(values):  # LoadImage has the frontend's upload widget
            problems.append(f"node {node['id']} {node['type']}: {len(values) - pos} extra widget values")
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt, problems


def _check_links(ui: dict, info: dict) -> list[str]:
    problems = []
    by_id = {n["id"]: n for n in ui["nodes"]}
    for link_id, src, src_slot, dst, dst_slot, kind in ui["links"]:
        out_type = info[by_id[src]["type"]]["outputs"][src_slot]
        target = by_id[dst]["inputs"][dst_slot]
        want = info[by_id[dst]["type"]]["sockets"].get(target["name"], target["type"])
        if not (out_type == kind == target["type"] == want) or target["link"] != link_id:
            problems.append(f"link {link_id}: {out_type} -> {by_id[dst]['type']}.{target['name']} ({want})")
        if link_id not in by_id[src]["outputs"][src_slot]["links"]:
            problems.append(f"link {link_id} missing from node {src}'s output {src_slot}")
    return problems


@pytest.mark.parametrize("name", WORKFLOW_NAMES)
def test_workflow_valid_and_api_matches(name, host_stubs):
    info = _object_info()
    ui = json.loads((WORKFLOWS / f"{name}.json").read_text())
    api = json.loads((WORKFLOWS / "api" / f"{name}.json").read_text())
    for key in ("last_node_id", "last_link_id", "nodes", "links", "version"):
        assert key in ui, key
    assert max(n["id"] for n in ui["nodes"]) <= ui["last_node_id"]
    converted, problems = _convert(ui, info)
    problems += _check_links(ui, info)
    # LoadImage's combo lists the input folder: the host test copies the shipped asset there
    for node in api.values():
        if node["class_type"] == "LoadImage":
            assert (WORKFLOWS / "assets" / node["inputs"]["image"]).is_file()
        if node["class_type"] == "UniCacheBagelLoader":
            assert node["inputs"]["checkpoint"] == "unicache-shapes"  # the bundled trained model
    assert problems == []
    assert converted == {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in api.items()}


def test_shipped_workflows_are_the_generated_ones():
    """workflows/ is what tools/make_workflows.py writes from the nodes' current INPUT_TYPES (rerun it after a
    change)."""
    spec = importlib.util.spec_from_file_location("make_workflows", ROOT / "tools" / "make_workflows.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    graphs = gen.workflows()
    assert sorted(graphs) == sorted(WORKFLOW_NAMES)
    for name, graph in graphs.items():
        ui, api = gen.build(graph)
        assert json.loads((WORKFLOWS / f"{name}.json").read_text()) == ui, name
        assert json.loads((WORKFLOWS / "api" / f"{name}.json").read_text()) == api, name
