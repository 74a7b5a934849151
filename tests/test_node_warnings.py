"""Inputs that run but may not do what was meant get a warning on the node (``ui.unicache_warnings``, drawn by
web/unicache.js) and in the log (issue 52): the library's lines (unicache_core/bagel/notices.py) and what the nodes
send, without a host (tests/comfy_stubs.py). The real host and frontend: tests/host/test_warnings_host.py."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from comfy_stubs import EDIT_WIDGETS, TINY_NAME, NodeCall, fresh_model_cache, host_stubs  # noqa: F401  (host_stubs, fresh_model_cache: fixtures)
from PIL import Image

from unicache_core.bagel.items import ImageItem, TextItem
from unicache_core.bagel.notices import TRAINED_IMAGES_KEY, request_warnings, trained_images
from unicache_core.bagel.transforms import ImageTransforms


@pytest.fixture(scope="module", autouse=True)
def _fresh_model_cache(fresh_model_cache):
    """The nodes' model cache emptied around this module (tests/comfy_stubs.py)."""


def _node(node_id: str) -> NodeCall:
    import nodes

    return NodeCall(nodes.NODE_CLASS_MAPPINGS[node_id])


def _config(tiny_checkpoint):
    from unicache_core.bagel.config import load_bagel_config

    return load_bagel_config(tiny_checkpoint)


def test_library_lines(tiny_checkpoint):
    config = _config(tiny_checkpoint)
    a, b = Image.new("RGB", (64, 64)), Image.new("RGB", (200, 40))
    assert request_warnings("edit", [ImageItem(a), TextItem("make it blue")], config) == []
    (line,) = request_warnings("edit", [ImageItem(a), TextItem("  ")], config)
    assert line.startswith("the prompt is empty: BAGEL edits")
    (line,) = request_warnings("understanding", [TextItem(""), ImageItem(a), TextItem("what?")], config)
    assert line.startswith("items[0] (a text item) is empty")
    (line,) = request_warnings("edit", [TextItem("a"), TextItem("make it blue")], config)
    assert line.startswith("an edit with no image")
    (line,) = request_warnings("edit", [ImageItem(a), ImageItem(b), TextItem("swap")], config)
    width, height = ImageTransforms.from_config(config).vae.resize.size_for(200, 40)
    assert f"64x64 -> 64x64, 200x40 -> {width}x{height}" in line
    lines = request_warnings("edit", [ImageItem(a), ImageItem(a), TextItem("swap")], config, trained=1)
    assert lines == [
        "2 images in one request, but this checkpoint was trained on 1 per request (its training.json): it runs, "
        "expect weaker results than with 1"
    ]
    assert request_warnings("edit", [ImageItem(a), ImageItem(a), TextItem("swap")], config, trained=2) == []


def test_trained_images_comes_from_training_json(tmp_path, tiny_checkpoint):
    assert trained_images(tiny_checkpoint) is None  # no training.json: nothing is claimed
    assert trained_images(None) is None
    (tmp_path / "training.json").write_text(json.dumps({TRAINED_IMAGES_KEY: 1}))
    assert trained_images(tmp_path) == 1
    (tmp_path / "training.json").write_text(json.dumps({TRAINED_IMAGES_KEY: True}))
    assert trained_images(tmp_path) is None
    (tmp_path / "training.json").write_text("{not json")
    assert trained_images(tmp_path) is None
    shipped = json.loads(open("models/bagel/unicache-shapes/training.json").read())
    assert shipped[TRAINED_IMAGES_KEY] == 1


def test_nodes_send_and_log_their_warnings(host_stubs, caplog):
    (model,) = _node("UniCacheBagelLoader")(TINY_NAME, "fp32", "auto")
    text_item = _node("UniCacheTextItem")
    with caplog.at_level(logging.WARNING, logger="nodes.base"):
        items, text = text_item("")
    assert text == "" and text_item.ui["unicache_warnings"][0].startswith("this Text Item is empty")
    assert "Text Item: this Text Item is empty" in caplog.text
    text_item("change the background")
    assert text_item.ui == {"unicache_warnings": []}  # sent empty: the frontend clears the last run's warning
    edit = _node("UniCacheImageEdit")
    source = torch.rand(1, 48, 64, 3, generator=torch.Generator().manual_seed(0))
    edit(model, source, "", *EDIT_WIDGETS, items=items)
    assert [w.split(":")[0] for w in edit.ui["unicache_warnings"]] == [
        "items[0] (a text item) is empty",
        "the prompt is empty",
    ]
    edit(model, source, "make it blue", *EDIT_WIDGETS)
    assert edit.ui == {"unicache_warnings": []}
    understand = _node("UniCacheUnderstand")
    out = understand(model, "", 2, False, 0.3, 0, False, image=source)
    assert out["ui"]["unicache_warnings"][0].startswith("the prompt is empty: BAGEL answers")
