"""Write the shipped example workflows: ``workflows/<name>.json`` (UI format, drag-and-drop, frontend 1.32) and
``workflows/api/<name>.json`` (API format, for ``POST /prompt`` and ``python -m tools.batch``), plus the example
input images ``workflows/assets/unicache_example.png``, ``unicache_position.png`` and, for the several-image
workflows (issue #43), ``unicache_reference.png``.

Run from the repo root after changing a node's inputs: ``.venv/bin/python tools/make_workflows.py``.
Widget order and socket lists come from the nodes' own ``INPUT_TYPES``; tests/test_nodes.py checks the result.
The nodes are ComfyUI V3 classes: outside a ComfyUI this uses the unit tests' stand-in of ``comfy_api.latest``
(tests/comfy_stubs.py), which builds the same V1 view.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))

from comfy_stubs import install_v3_stub  # noqa: E402

install_v3_stub()

from tools.workflow_format import NOTE, build  # noqa: E402
from unicache_core.bagel.settings import BUNDLED_CHECKPOINT  # noqa: E402
from unicache_core.compression.defaults import SCORE_QUERIES_OF_METHOD, UNICACHE_OBJECTIVE  # noqa: E402

EXAMPLE_IMAGE = "unicache_example.png"
#: The understanding workflow's input: one object, asked where it is (``position_scene()``).
POSITION_IMAGE = "unicache_position.png"
#: Prompts in the bundled model's language; the example image is ``example_scene()``.
T2I_PROMPT = "a large red circle at the top left and a small blue square at the center on a white background"
EDIT_PROMPT = "change the background to black"
QUESTION = "where is the red circle?"
#: The several-image workflows' extra input: a one-object scene on gray (``reference_scene()``).
REFERENCE_IMAGE = "unicache_reference.png"
#: Two-image requests and the iterative edit, in the bundled model's language (it never saw two images in one
#: request: docs/nodes.md says so next to these workflows).
TWO_IMAGE_EDIT_PROMPT = "add a small green triangle at the bottom left"
TWO_IMAGE_QUESTION = "how many shapes are there?"
ITERATIVE_PROMPTS = ("change the background to black", "remove the blue square")
#: Said next to the several-image workflows' outputs.
TWO_IMAGES_NOTE = (
    "The bundled unicache-shapes model was trained on one image per request and never saw two: this workflow shows "
    "the wiring (items before the task node's own image and prompt) and runs end to end, but what the model draws "
    "or answers after two images is not a multi-image model's result. For BAGEL-7B-MoT choose its checkpoint "
    "(docs/nodes.md)."
)


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
            "score_queries": SCORE_QUERIES_OF_METHOD,
            "objective": UNICACHE_OBJECTIVE,
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
    return {
        "text_to_image": t2i,
        "image_edit": edit,
        "understanding": und,
        "ab_edit_full_vs_unicache": ab,
        **several_image_workflows(),
    }


def _save(node_id, src, pos, prefix, title=None):
    return {
        "id": node_id,
        "type": "SaveImage",
        "pos": pos,
        "size": (320, 320),
        "title": title,
        "links": {"images": (src, 0)},
        "widgets": {"filename_prefix": prefix},
    }


def _note(node_id, pos):
    return {"id": node_id, "type": NOTE, "pos": pos, "size": (360, 140), "widgets": {"text": TWO_IMAGES_NOTE}}


def _image_item(node_id, image_node, pos, items=None):
    links = {"image": (image_node, 0), **({"items": items} if items else {})}
    return {"id": node_id, "type": "UniCacheImageItem", "pos": pos, "size": (300, 100), "links": links, "widgets": {}}


def several_image_workflows() -> dict[str, list[dict]]:
    """Requests of several images (issue #43): an edit with a reference image before the edited one, a question
    about two images, and an iterative edit (the second edit's context holds the first's image, instruction and
    output: the official list ``[image, "p1", out1, "p2"]``)."""
    two_edit = [
        _loader(),
        _kv(2),
        _load_image(3, (40, 480), REFERENCE_IMAGE),
        _image_item(4, 3, (420, 480)),
        _load_image(5, (40, 840)),
        {
            "id": 6,
            "type": "UniCacheImageEdit",
            "pos": (780, 80),
            "size": (360, 560),
            "links": {"model": (1, 0), "image": (5, 0), "kv": (2, 0), "items": (4, 0)},
            "widgets": {"prompt": TWO_IMAGE_EDIT_PROMPT, **_flow(25, 42, True)},
        },
        _save(7, 6, (1180, 80), "unicache/two_image_edit"),
        _report(8, 6, (1180, 440)),
        _note(9, (1540, 80)),
    ]
    two_und = [
        _loader(),
        _kv(2),
        _load_image(3, (40, 480), REFERENCE_IMAGE),
        _image_item(4, 3, (420, 480)),
        _load_image(5, (40, 840), POSITION_IMAGE),
        {
            "id": 6,
            "type": "UniCacheUnderstand",
            "pos": (780, 80),
            "size": (360, 360),
            "links": {"model": (1, 0), "image": (5, 0), "kv": (2, 0), "items": (4, 0)},
            "widgets": {
                "prompt": TWO_IMAGE_QUESTION,
                "max_new_tokens": 8,
                "do_sample": False,
                "temperature": 0.3,
                "seed": 0,
                "think": False,
            },
        },
        _report(7, None, (1180, 80)),
        _note(8, (1180, 480)),
    ]
    two_und[-2]["links"] = {"report": (6, 1)}
    first, second = ITERATIVE_PROMPTS
    iterative = [
        _loader(),
        _kv(2),
        _load_image(3, (40, 480)),
        _image_item(4, 3, (420, 480)),
        {
            "id": 5,
            "type": "UniCacheTextItem",
            "pos": (420, 640),
            "size": (300, 160),
            "links": {"items": (4, 0)},
            "widgets": {"text": first},
        },
        {
            "id": 6,
            "type": "UniCacheImageEdit",
            "pos": (780, 80),
            "size": (360, 560),
            "title": "Edit 1",
            "links": {"model": (1, 0), "image": (3, 0), "kv": (2, 0), "prompt": (5, 1)},
            "widgets": {"prompt": first, **_flow(25, 42, True)},
        },
        {
            "id": 7,
            "type": "UniCacheImageEdit",
            "pos": (780, 700),
            "size": (360, 560),
            "title": "Edit 2 (after edit 1, in one context)",
            "links": {"model": (1, 0), "image": (6, 0), "kv": (2, 0), "items": (5, 0)},
            "widgets": {"prompt": second, **_flow(25, 42, True)},
        },
        _save(8, 6, (1180, 80), "unicache/iterative_1", "Edit 1"),
        _save(9, 7, (1180, 440), "unicache/iterative_2", "Edit 2"),
        _report(10, 7, (1540, 80), "KV report of edit 2"),
        _note(11, (1540, 480)),
    ]
    return {"two_image_edit": two_edit, "two_image_understanding": two_und, "iterative_edit": iterative}


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


def reference_scene():
    """The several-image workflows' first image: one object of another colour and shape, on gray."""
    from unicache_core.shapes import Scene, Shape

    return Scene("gray", (Shape("triangle", "green", "small", 6),))


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
    example_image(out / "assets" / REFERENCE_IMAGE, reference_scene())
    print(f"wrote {len(workflows())} workflows (UI + API) and the example images under {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
