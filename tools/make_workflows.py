"""Write the shipped example workflows: ``workflows/<name>.json`` (UI format, drag-and-drop, frontend 1.32) and
``workflows/api/<name>.json`` (API format, for ``POST /prompt`` and ``python -m tools.batch``), plus the example
input images ``workflows/assets/unicache_example.png`` and ``unicache_position.png``.

Run from the repo root after changing a node's inputs: ``.venv/bin/python tools/make_workflows.py``.
Widget order and socket lists come from the nodes' own ``INPUT_TYPES``; tests/test_nodes.py checks the result.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nodes import NODE_CLASS_MAPPINGS  # noqa: E402
from unicache_core.bagel.settings import BUNDLED_CHECKPOINT  # noqa: E402
from unicache_core.compression.defaults import SCORE_QUERIES  # noqa: E402

WIDGET_KINDS = {"INT", "FLOAT", "STRING", "BOOLEAN"}
EXAMPLE_IMAGE = "unicache_example.png"
#: The understanding workflow's input: one object, asked where it is (``position_scene()``).
POSITION_IMAGE = "unicache_position.png"
#: Prompts in the bundled model's language; the example image is ``example_scene()``.
T2I_PROMPT = "a large red circle at the top left and a small blue square at the center on a white background"
EDIT_PROMPT = "change the background to black"
QUESTION = "where is the red circle?"
# core nodes: (socket inputs [(name, type)], widget names, outputs [(name, type)])
CORE = {
    "LoadImage": ([], ["image", "upload"], [("IMAGE", "IMAGE"), ("MASK", "MASK")]),
    "SaveImage": ([("images", "IMAGE")], ["filename_prefix"], []),
    "PreviewImage": ([("images", "IMAGE")], [], []),
}


def _schema(node_type: str):
    """(sockets [(name, type)], widgets [(name, opts)], outputs [(name, type)])."""
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


def build(graph: list[dict]) -> tuple[dict, dict]:
    """``graph``: nodes ``{id, type, title?, pos, widgets: {name: value}, links: {input: (src_id, slot)}}``
    in execution order → (UI workflow, API prompt)."""
    by_id = {n["id"]: n for n in graph}
    links, ui_nodes, api = [], [], {}
    outputs_links: dict[tuple[int, int], list[int]] = {}
    for node in graph:
        sockets, _, _ = _schema(node["type"])
        for slot, (name, kind) in enumerate(sockets):
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
        for name, _ in sockets:
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
                    {"name": name, "type": kind, "link": link_of.get((node["id"], slot))}
                    for slot, (name, kind) in enumerate(sockets)
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


def _loader(node_id=1, pos=(40, 80)):
    return {
        "id": node_id,
        "type": "UniCacheBagelLoader",
        "pos": pos,
        "size": (320, 134),
        "widgets": {"checkpoint": BUNDLED_CHECKPOINT, "dtype": "auto", "device": "auto", "weight_dtype": "default"},
    }


def _kv(node_id, method="unicache", pos=(40, 260), title=None):
    return {
        "id": node_id,
        "type": "UniCacheKVConfig",
        "pos": pos,
        "size": (320, 180),
        "title": title,
        "widgets": {
            "method": method,
            "kv_target": 0.0,
            "rho": 0.0,
            "rho_floor": -1.0,
            "policy": "default",
            "score_queries": SCORE_QUERIES,
        },
    }


def _flow(steps, seed, edit: bool):
    return {
        "steps": steps,
        "seed": seed,
        "cfg_text_scale": 4.0,
        "cfg_img_scale": 2.0 if edit else 1.5,
        "cfg_interval_lo": 0.0 if edit else 0.4,
        "cfg_interval_hi": 1.0,
        "timestep_shift": 3.0,
        "cfg_renorm_min": 0.0,
        "cfg_renorm_type": "text_channel" if edit else "global",
        "think": False,
        "taylorseer": False,
    }


def _load_image(node_id, pos=(40, 480), image=EXAMPLE_IMAGE):
    return {"id": node_id, "type": "LoadImage", "pos": pos, "size": (320, 320), "widgets": {"image": image}}


def _report(node_id, src, pos, title=None):
    return {
        "id": node_id,
        "type": "UniCacheKVReport",
        "pos": pos,
        "size": (420, 360),
        "title": title,
        "links": {"report": (src, 3 if src else 1)},
        "widgets": {},
    }


def workflows() -> dict[str, list[dict]]:
    t2i = [
        _loader(),
        _kv(2),
        {
            "id": 3,
            "type": "UniCacheTextToImage",
            "pos": (420, 80),
            "size": (360, 520),
            "links": {"model": (1, 0), "kv": (2, 0)},
            "widgets": {"prompt": T2I_PROMPT, "width": 128, "height": 128, **_flow(25, 42, False)},
        },
        {
            "id": 4,
            "type": "SaveImage",
            "pos": (820, 80),
            "size": (320, 320),
            "links": {"images": (3, 0)},
            "widgets": {"filename_prefix": "unicache/t2i"},
        },
        _report(5, 3, (820, 440)),
        {
            "id": 6,
            "type": "PreviewImage",
            "pos": (1280, 440),
            "size": (420, 320),
            "links": {"images": (5, 0)},
            "widgets": {},
        },
    ]
    edit = [
        _loader(),
        _kv(2),
        _load_image(3),
        {
            "id": 4,
            "type": "UniCacheImageEdit",
            "pos": (420, 80),
            "size": (360, 520),
            "links": {"model": (1, 0), "image": (3, 0), "kv": (2, 0)},
            "widgets": {"prompt": EDIT_PROMPT, **_flow(25, 42, True)},
        },
        {
            "id": 5,
            "type": "SaveImage",
            "pos": (820, 80),
            "size": (320, 320),
            "links": {"images": (4, 0)},
            "widgets": {"filename_prefix": "unicache/edit"},
        },
        _report(6, 4, (820, 440)),
        {
            "id": 7,
            "type": "PreviewImage",
            "pos": (1280, 440),
            "size": (420, 320),
            "links": {"images": (6, 0)},
            "widgets": {},
        },
    ]
    und = [
        _loader(),
        _kv(2),
        _load_image(3, image=POSITION_IMAGE),
        {
            "id": 4,
            "type": "UniCacheUnderstand",
            "pos": (420, 80),
            "size": (360, 360),
            "links": {"model": (1, 0), "image": (3, 0), "kv": (2, 0)},
            "widgets": {
                "prompt": QUESTION,
                "max_new_tokens": 8,
                "do_sample": False,
                "temperature": 0.3,
                "seed": 0,
                "think": False,
            },
        },
        _report(5, None, (820, 80)),
        {
            "id": 6,
            "type": "PreviewImage",
            "pos": (1280, 80),
            "size": (420, 320),
            "links": {"images": (5, 0)},
            "widgets": {},
        },
    ]
    und[4]["links"] = {"report": (4, 1)}
    ab = [
        _loader(),
        _kv(2, "full", (40, 260), "KV A: full"),
        _kv(3, "unicache", (40, 480), "KV B: unicache"),
        _load_image(4, (40, 700)),
        {
            "id": 5,
            "type": "UniCacheImageEdit",
            "pos": (420, 80),
            "size": (360, 520),
            "title": "Edit A (full KV)",
            "links": {"model": (1, 0), "image": (4, 0), "kv": (2, 0)},
            "widgets": {"prompt": EDIT_PROMPT, **_flow(25, 42, True)},
        },
        {
            "id": 6,
            "type": "UniCacheImageEdit",
            "pos": (420, 640),
            "size": (360, 520),
            "title": "Edit B (UniCache KV)",
            "links": {"model": (1, 0), "image": (4, 0), "kv": (3, 0)},
            "widgets": {"prompt": EDIT_PROMPT, **_flow(25, 42, True)},
        },
        {
            "id": 7,
            "type": "SaveImage",
            "pos": (820, 80),
            "size": (320, 320),
            "title": "A: full",
            "links": {"images": (5, 0)},
            "widgets": {"filename_prefix": "unicache/ab_full"},
        },
        {
            "id": 8,
            "type": "SaveImage",
            "pos": (820, 640),
            "size": (320, 320),
            "title": "B: unicache",
            "links": {"images": (6, 0)},
            "widgets": {"filename_prefix": "unicache/ab_unicache"},
        },
        _report(9, 5, (1180, 80), "KV report A (full)"),
        _report(10, 6, (1180, 640), "KV report B (unicache)"),
    ]
    return {"text_to_image": t2i, "image_edit": edit, "understanding": und, "ab_edit_full_vs_unicache": ab}


def example_scene():
    """The example input: three shapes of the world the bundled model knows (docs/shapes.md)."""
    from unicache_core.shapes import Scene, Shape

    return Scene(
        "white",
        (
            Shape("circle", "red", "large", 0),
            Shape("square", "blue", "small", 4),
            Shape("triangle", "yellow", "large", 8),
        ),
    )


def position_scene():
    """The understanding example: one object off-centre, so its answer ("top right") needs where it is. The bundled
    model answers every cell of a one-object scene right; with three objects it is right about half the time
    (models/bagel/unicache-shapes/README.md)."""
    from unicache_core.shapes import Scene, Shape

    return Scene("white", (Shape("circle", "red", "large", 2),))


def example_image(path: Path, scene=None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    (scene or example_scene()).render().save(path, optimize=True)


def main() -> int:
    out = ROOT / "workflows"
    for name, graph in workflows().items():
        ui, api = build(graph)
        (out / "api").mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(ui, indent=1) + "\n")
        (out / "api" / f"{name}.json").write_text(json.dumps(api, indent=1) + "\n")
    example_image(out / "assets" / EXAMPLE_IMAGE)
    example_image(out / "assets" / POSITION_IMAGE, position_scene())
    print(f"wrote {len(workflows())} workflows (UI + API) and the example images under {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
