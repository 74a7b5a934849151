"""The item nodes and the task nodes' ``items`` input without a ComfyUI host (issue #43 item 4), and the workflows
saved before them (tests/old_workflows/: the shipped UI and API workflows as they were) against today's nodes.

A task node with ``items`` runs the request ``[items..., its image, its prompt]``: checked here against the engine
running that list directly (same pixels), for an edit, an understanding question and the iterative edit chain.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from comfy_stubs import EDIT_WIDGETS, TINY_NAME, NodeCall, fresh_model_cache, host_stubs  # noqa: F401  (host_stubs, fresh_model_cache: fixtures)
from test_workflows import _check_links, _convert, _object_info

from unicache_core.bagel.items import ImageItem, TextItem

ROOT = Path(__file__).resolve().parent.parent
OLD = ROOT / "tests" / "old_workflows"


@pytest.fixture(scope="module", autouse=True)
def _fresh_model_cache(fresh_model_cache):
    """The nodes' model cache emptied around this module (tests/comfy_stubs.py)."""


def _model():
    import nodes

    (model,) = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheBagelLoader"]).load(TINY_NAME, "fp32", "auto")
    return model


def _node(node_id: str):
    import nodes

    return NodeCall(nodes.NODE_CLASS_MAPPINGS[node_id])


def _pixels(seed: int, batch: int = 1, height: int = 40, width: int = 56) -> torch.Tensor:
    return torch.rand(batch, height, width, 3, generator=torch.Generator().manual_seed(seed))


def _pils(image: torch.Tensor):
    from nodes.convert import image_to_pils

    return image_to_pils(image)


# ------------------------------------------------------------------------------------ declarations


@pytest.mark.parametrize("node_id", ["UniCacheImageItem", "UniCacheTextItem"])
def test_item_nodes_declare_what_they_take(node_id):
    import nodes

    cls = nodes.NODE_CLASS_MAPPINGS[node_id]
    spec = cls.INPUT_TYPES()
    names = list(inspect.signature(cls.execute).parameters)
    assert names == list(spec["required"]) + list(spec.get("optional", {}))
    assert all(opts.get("tooltip") for section in spec.values() for _, opts in section.values())
    assert cls.CATEGORY.startswith("UniCache/") and len(cls.DESCRIPTION) > 40
    assert cls.RETURN_TYPES[0] == "BAGEL_ITEMS" and len(cls.RETURN_NAMES) == len(cls.OUTPUT_TOOLTIPS)
    assert nodes.NODE_DISPLAY_NAME_MAPPINGS[node_id].startswith("UniCache BAGEL ")
    for task in ("UniCacheTextToImage", "UniCacheImageEdit", "UniCacheUnderstand"):
        optional = nodes.NODE_CLASS_MAPPINGS[task].INPUT_TYPES()["optional"]
        assert list(optional)[-1] == "items" and optional["items"][0] == "BAGEL_ITEMS"  # appended: old slots keep


# ------------------------------------------------------------------------------------ requests


def test_two_image_edit_is_the_engines_list(host_stubs):
    from unicache_core.bagel import BagelPipeline, preset

    model = _model()
    reference, source = _pixels(1), _pixels(2, height=48, width=64)
    (items,) = _node("UniCacheImageItem").add(reference)
    image, latent, _, report = _node("UniCacheImageEdit").edit(model, source, "swap them", *EDIT_WIDGETS, items=items)
    assert image.shape == (1, 64, 80, 3) and report["method"] == "full"  # the tiny rule on the last image
    direct = BagelPipeline(model.loaded).generate(
        "edit", [*_pils(reference), *_pils(source), "swap them"], preset("edit", num_timesteps=2), seed=0
    )
    assert np.array_equal((image[0].numpy() * 255).round(), np.asarray(direct.image, dtype=np.float32))


def test_a_batch_is_edited_item_by_item_after_the_same_items(host_stubs):
    model = _model()
    (items,) = _node("UniCacheImageItem").add(_pixels(1, batch=2))  # a batch of two adds two images
    assert len(items.items) == 2
    image, _, _, report = _node("UniCacheImageEdit").edit(model, _pixels(3, batch=2), "x", *EDIT_WIDGETS, items=items)
    assert image.shape[0] == 2 and len(report["batch"]) == 2


def test_iterative_edit_chain_is_the_official_list(host_stubs):
    """Edit 1 (image A, prompt from the text item), then Edit 2 (items [A, p1], image = Edit 1's output, p2): Edit
    2 runs [A, p1, out1, p2] exactly as the engine runs that list."""
    from unicache_core.bagel import BagelPipeline, preset

    model = _model()
    source = _pixels(4)
    (items,) = _node("UniCacheImageItem").add(source)
    items, first = _node("UniCacheTextItem").add("make it blue", items=items)
    edit = _node("UniCacheImageEdit")
    out1, *_ = edit.edit(model, source, first, *EDIT_WIDGETS)
    out2, *_ = edit.edit(model, out1, "move it left", *EDIT_WIDGETS, items=items)
    request = [*_pils(source), TextItem("make it blue"), *_pils(out1), "move it left"]
    direct = BagelPipeline(model.loaded).generate("edit", request, preset("edit", num_timesteps=2), seed=0)
    assert np.array_equal((out2[0].numpy() * 255).round(), np.asarray(direct.image, dtype=np.float32))


def test_understanding_and_t2i_take_items(host_stubs):
    model = _model()
    (items,) = _node("UniCacheImageItem").add(_pixels(5))
    out = _node("UniCacheUnderstand").understand(
        model, "how many?", 3, False, 0.3, 0, False, image=_pixels(6), items=items
    )
    assert isinstance(out["result"][0], str) and out["result"][1]["task"] == "understanding"
    text_only, _ = _node("UniCacheTextItem").add("a picture")
    out = _node("UniCacheUnderstand").understand(model, "what is it?", 3, False, 0.3, 0, False, items=text_only)
    assert isinstance(out["result"][0], str)
    image, *_ = _node("UniCacheTextToImage").generate(
        model, "the same", 32, 48, 2, 0, 4.0, 1.5, 0.4, 1.0, 3.0, 0.0, "global", False, items=items
    )
    assert image.shape == (1, 48, 32, 3)  # text-to-image keeps its own size


def test_item_latents_and_mistakes_are_one_line(host_stubs):
    from nodes.items_nodes import request_items

    model = _model()
    pixels = _pixels(7, batch=2)
    with pytest.raises(ValueError, match=r"`latent` holds 1 latent\(s\) for 2 image\(s\); encode the same batch"):
        _node("UniCacheImageItem").add(pixels, latent={"samples": torch.randn(1, 16, 5, 7)})
    (items,) = _node("UniCacheImageItem").add(pixels, latent={"samples": torch.randn(2, 16, 5, 7)})
    converted = request_items(items, model.loaded)
    # VAEEncode's 5x7 cells go on BAGEL's 2x2 grid: 4x6 cells, the image item's latent is [1, 16, 4, 6]
    assert all(isinstance(i, ImageItem) and tuple(i.latent.shape) == (1, 16, 4, 6) for i in converted)
    (flat,) = _node("UniCacheImageItem").add(pixels[:1], latent={"samples": torch.zeros(1, 16, 4, 6)})
    with pytest.raises(ValueError, match=r"`items\[0\] latent` holds only the value 0"):
        request_items(flat, model.loaded)
    with pytest.raises(ValueError, match=r"`items` must come from UniCache BAGEL Image Item or Text Item"):
        _node("UniCacheImageEdit").edit(model, pixels, "x", *EDIT_WIDGETS, items="a list")
    (tiny,) = _node("UniCacheImageItem").add(torch.rand(1, 1, 1, 3))
    with pytest.raises(ValueError, match=r"`items\[0\]` is 1x1 px"):
        _node("UniCacheImageEdit").edit(model, pixels[:1], "x", *EDIT_WIDGETS, items=tiny)
    with pytest.raises(ValueError, match=r"`items\[0\]` carries a source latent"):
        _node("UniCacheUnderstand").understand(model, "x", 2, False, 0.3, 0, False, items=items)


# ------------------------------------------------------------------------------------ workflows saved before


@pytest.mark.parametrize("name", sorted(p.stem for p in OLD.glob("*.json")))
def test_workflows_saved_before_the_item_inputs_still_load(name, host_stubs):
    """Each old UI workflow converts, with today's nodes, to its old API prompt (same node ids, widget values in
    place, links to the same sockets), and that prompt names only inputs today's nodes take, all required ones."""
    import nodes

    info = _object_info()
    ui = json.loads((OLD / f"{name}.json").read_text())
    api = json.loads((OLD / "api" / f"{name}.json").read_text())
    converted, problems = _convert(ui, info)
    problems += _check_links(ui, info)
    assert problems == []
    assert converted == {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in api.items()}
    for node in api.values():
        cls = nodes.NODE_CLASS_MAPPINGS.get(node["class_type"])
        if cls is None:
            continue  # a core node
        spec = cls.INPUT_TYPES()
        assert set(node["inputs"]) <= set(spec["required"]) | set(spec.get("optional", {})), node["class_type"]
        assert set(spec["required"]) <= set(node["inputs"]), node["class_type"]
    assert len(list(OLD.glob("*.json"))) == 4
