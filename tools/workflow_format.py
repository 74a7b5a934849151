"""The two formats of a shipped workflow graph: the UI workflow (frontend 1.32) and the API prompt.

:func:`build` turns a graph (nodes ``{id, type, title?, pos, widgets: {name: value}, links: {input: (src_id,
slot)}}`` in execution order) into both, from the nodes' own ``INPUT_TYPES`` (their V3 schema's V1 view;
``tools/make_workflows.py`` writes the shipped ones with it).
"""

from __future__ import annotations

from nodes import NODE_CLASS_MAPPINGS

WIDGET_KINDS = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}  # COMBO: a V3 combo (its options in its opts)
#: The frontend's note (UI workflows only: it is not part of a prompt).
NOTE = "Note"
# core nodes: (socket inputs [(name, type)], widget names, outputs [(name, type)])
CORE = {
    "LoadImage": ([], ["image", "upload"], [("IMAGE", "IMAGE"), ("MASK", "MASK")]),
    "SaveImage": ([("images", "IMAGE")], ["filename_prefix"], []),
    "PreviewImage": ([("images", "IMAGE")], [], []),
}


def _schema(node_type: str):
    """(sockets [(name, type)], widgets [(name, opts)], outputs [(name, type)])."""
    if node_type == NOTE:
        return [], [("text", {})], []
    if node_type in CORE:
        sockets, widgets, outputs = CORE[node_type]
        return sockets, [(w, {}) for w in widgets], outputs
    cls = NODE_CLASS_MAPPINGS[node_type]
    spec = cls.INPUT_TYPES()
    sockets, widgets = [], []
    for section in ("required", "optional"):
        for name, (kind, *rest) in spec.get(section, {}).items():
            opts = rest[0] if rest else {}
            if isinstance(kind, list) or kind in WIDGET_KINDS:
                widgets.append((name, opts))
            else:
                sockets.append((name, kind))
    return sockets, widgets, list(zip(cls.RETURN_NAMES, cls.RETURN_TYPES))


def _slots(node: dict) -> list[tuple[str, str, bool]]:
    """The node's input slots in the UI format: its sockets, then each widget it links (a converted widget input,
    e.g. a prompt from a Text Item's ``text``): ``(name, type, is_widget)``."""
    sockets, widgets, _ = _schema(node["type"])
    linked = [name for name, _ in widgets if name in node.get("links", {})]
    kinds = {}
    if linked:
        spec = NODE_CLASS_MAPPINGS[node["type"]].INPUT_TYPES()
        kinds = {n: k for section in ("required", "optional") for n, (k, *_) in spec.get(section, {}).items()}
    return [(name, kind, False) for name, kind in sockets] + [(name, kinds[name], True) for name in linked]


def build(graph: list[dict]) -> tuple[dict, dict]:
    """``graph``: nodes ``{id, type, title?, pos, widgets: {name: value}, links: {input: (src_id, slot)}}``
    in execution order → (UI workflow, API prompt). A link to a widget's name feeds that widget from another
    node's output (the widget keeps its value in ``widgets_values``, as the frontend saves it)."""
    by_id = {n["id"]: n for n in graph}
    links, ui_nodes, api = [], [], {}
    outputs_links: dict[tuple[int, int], list[int]] = {}
    for node in graph:
        for slot, (name, kind, _) in enumerate(_slots(node)):
            if name in node.get("links", {}):
                src, src_slot = node["links"][name]
                link_id = len(links) + 1
                links.append([link_id, src, src_slot, node["id"], slot, kind])
                outputs_links.setdefault((src, src_slot), []).append(link_id)
    link_of = {(link[3], link[4]): link[0] for link in links}
    for order, node in enumerate(graph):
        sockets, widgets, outputs = _schema(node["type"])
        values = []
        api_inputs = {}
        for name, opts in widgets:
            if name == "upload":
                values.append("image")
                continue
            value = node["widgets"][name]
            values.append(value)
            api_inputs[name] = value
            if opts.get("control_after_generate"):
                values.append("fixed")
        slots = _slots(node)
        for name, _, _ in slots:
            if name in node.get("links", {}):
                src, src_slot = node["links"][name]
                api_inputs[name] = [str(src), src_slot]
        title = node.get("title")
        ui_nodes.append(
            {
                "id": node["id"],
                "type": node["type"],
                "pos": list(node["pos"]),
                "size": list(node.get("size", (320, 180))),
                "flags": {},
                "order": order,
                "mode": 0,
                "inputs": [
                    {
                        "name": name,
                        "type": kind,
                        **({"widget": {"name": name}} if is_widget else {}),
                        "link": link_of.get((node["id"], slot)),
                    }
                    for slot, (name, kind, is_widget) in enumerate(slots)
                ],
                "outputs": [
                    {"name": name, "type": kind, "slot_index": slot, "links": outputs_links.get((node["id"], slot), [])}
                    for slot, (name, kind) in enumerate(outputs)
                ],
                "properties": {"Node name for S&R": node["type"]},
                "widgets_values": values,
                **({"title": title} if title else {}),
            }
        )
        if node["type"] == NOTE:  # the frontend's own node: in the UI workflow only
            continue
        api[str(node["id"])] = {
            "class_type": node["type"],
            "inputs": api_inputs,
            "_meta": {"title": title or node["type"]},
        }
    assert set(by_id) == {n["id"] for n in ui_nodes}
    ui = {
        "id": "00000000-0000-4000-8000-0000000000" + f"{graph[0]['id']:02d}",
        "revision": 0,
        "last_node_id": max(by_id),
        "last_link_id": len(links),
        "nodes": ui_nodes,
        "links": links,
        "groups": [],
        "config": {},
        "extra": {"ds": {"scale": 0.8, "offset": [0, 0]}, "frontendVersion": "1.32.9"},
        "version": 0.4,
    }
    return ui, api


__all__ = ["CORE", "NOTE", "WIDGET_KINDS", "build"]
