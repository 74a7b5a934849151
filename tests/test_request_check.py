"""A request is checked and tokenised once (issue 50 item 3): the :class:`CheckedRequest` that the ComfyUI node makes
is the one the memory plan counts and the engine runs, and its RoPE positions, counted from its tokens, are the ones
the item list's own count gives."""

from __future__ import annotations

import pytest
import torch
from comfy_stubs import EDIT_WIDGETS, TINY_NAME, NodeCall, fresh_model_cache, host_stubs  # noqa: F401  (fixtures)
from PIL import Image

from unicache_core.bagel import request_check
from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.items import GENERATE, ImageItem, TextItem
from unicache_core.bagel.request_check import check_request, check_single, request_positions
from unicache_core.bagel.settings import preset
from unicache_core.bagel.tokens import item_positions


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return load_bagel(tiny_checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module", autouse=True)
def _fresh_model_cache(fresh_model_cache):
    """The nodes' model cache emptied around this module (tests/comfy_stubs.py)."""


def _image(width: int, height: int) -> Image.Image:
    return Image.new("RGB", (width, height), (200, 30, 30))


LISTS = {
    "one image": [_image(40, 56), "make it blue"],
    "two images": [_image(40, 56), _image(64, 48), "swap the two"],
    "texts between": ["first", _image(40, 56), "then", _image(32, 32), "and at last"],
    "rounds": [_image(40, 56), "make it blue", GENERATE, "move it left"],
    "text only": ["a red circle"],
}


#: Every list under every task that takes it (an understanding request holds no GENERATE marker).
CASES = [(name, task) for name in sorted(LISTS) for task in ("understanding", "edit", "t2i")]
CASES = [(name, task) for name, task in CASES if not (task == "understanding" and GENERATE in LISTS[name])]


@pytest.mark.parametrize("think", [False, True])
@pytest.mark.parametrize(("name", "task"), CASES)
def test_positions_from_the_tokens_are_the_item_lists(loaded, name, task, think):
    items = LISTS[name]
    overrides = {"width": 32, "height": 32} if task == "t2i" else {}
    settings = preset(task, think=think, **overrides)
    checked = check_request(loaded.config, loaded.tokenizer, task, items, settings)
    generation = task != "understanding"
    expected = item_positions(loaded.tokenizer, checked.items, generation=generation, think=think)
    assert checked.positions == expected == request_positions(checked.tokens, think=think)
    assert checked.task == task and checked.settings is settings and not checked.single


def test_a_single_call_names_its_prompt(loaded):
    long_prompt = "word " * (loaded.config.llm.max_position_embeddings + 10)
    with pytest.raises(ValueError, match=r"^`prompt` is too long"):
        check_single(loaded.config, loaded.tokenizer, "edit", long_prompt, _image(40, 56), preset("edit"))
    with pytest.raises(ValueError, match=r"^`items` is too long"):
        check_request(loaded.config, loaded.tokenizer, "edit", [_image(40, 56), long_prompt], preset("edit"))
    checked = check_single(loaded.config, loaded.tokenizer, "edit", "x", _image(40, 56), preset("edit"))
    assert checked.single and isinstance(checked.items[0], ImageItem) and checked.items[1] == TextItem("x")


def test_the_node_checks_and_counts_a_two_image_edit_once(host_stubs, monkeypatch):
    """A two-image edit through the node: its items counted once (not by the node, then the memory plan, then the
    engine), the memory plan given those tokens, the engine given that same record."""
    import nodes
    from unicache_core.bagel import tokens as token_counts
    from unicache_core.bagel.memory import comfy_placement
    from unicache_core.bagel.pipeline import BagelPipeline

    counted, planned, ran = [], [], []
    count_items, memory_required = request_check.count_items, comfy_placement.memory_required
    generate_request = BagelPipeline.generate_request

    def counting(*args, **kwargs):
        counted.append(count_items(*args, **kwargs))
        return counted[-1]

    def planning(config, dtype, tokens, *args, **kwargs):
        planned.append(tokens)
        return memory_required(config, dtype, tokens, *args, **kwargs)

    def running(self, request, **kwargs):
        ran.append(request)
        return generate_request(self, request, **kwargs)

    def never(*args, **kwargs):
        raise AssertionError("the request was counted again")

    monkeypatch.setattr(request_check, "count_items", counting)
    monkeypatch.setattr(comfy_placement, "memory_required", planning)
    monkeypatch.setattr(BagelPipeline, "generate_request", running)
    monkeypatch.setattr(token_counts, "item_positions", never)
    monkeypatch.setattr(token_counts, "count_request", never)

    (model,) = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheBagelLoader"]).load(TINY_NAME, "fp32", "auto")
    reference = torch.rand(1, 40, 56, 3, generator=torch.Generator().manual_seed(1))
    source = torch.rand(1, 48, 64, 3, generator=torch.Generator().manual_seed(2))
    (items,) = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheImageItem"]).add(reference)
    edit = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheImageEdit"])
    image, *_ = edit.edit(model, source, "swap them", *EDIT_WIDGETS, items=items)
    assert image.shape == (1, 64, 80, 3)
    assert len(counted) == 1 and len(ran) == 1
    assert planned == [counted[0]] and ran[0].tokens is counted[0]
    assert len(ran[0].items) == 3 and len(counted[0].images) == 2
