"""Bad item lists (issue #43 item 8): one clear line each, refused before any forward pass.

Every case runs through the public entries (``BagelPipeline.generate`` / ``understand_items``) on the tiny checkpoint
with a cache factory that counts forward passes: a refusal must come with no forward run (nothing half-done) and a
message of one line naming the item and what to do.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.items import GENERATE, ImageItem, TextItem, request_items, rounds
from unicache_core.bagel.memory.accounting import check_image_positions, check_item_positions
from unicache_core.bagel.pipeline import BagelPipeline
from unicache_core.bagel.request import GivenLatents
from unicache_core.bagel.settings import preset
from unicache_core.kv.cache import CacheRequest, FullKVCache

FAST = dict(num_timesteps=3)


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return load_bagel(tiny_checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def picture():
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, size=(45, 60, 3), dtype=np.uint8))


class Counting:
    """Counts the forward passes of every cache it makes."""

    def __init__(self):
        self.forwards = 0
        counter = self

        class Cache(FullKVCache):
            def begin_call(self, call):
                counter.forwards += 1

        self._cls = Cache

    def __call__(self, request: CacheRequest):
        return self._cls(request.num_layers, task=request.task, branch=request.branch)


def _refused(loaded, run, match: str) -> str:
    counter = Counting()
    pipe = BagelPipeline(loaded, counter)
    with pytest.raises(ValueError, match=match) as info:
        run(pipe)
    message = str(info.value)
    assert "\n" not in message and counter.forwards == 0, message
    return message


EDIT = preset("edit", **FAST)


@pytest.mark.parametrize(
    "items, match",
    [
        ([], r"`items` is empty: give at least one text"),
        ("a prompt", r"`items` must be a list of texts and images .* got str"),
        ([Image.new("RGB", (8, 8))], r"`items` holds 1 item\(s\) but no text"),
        ([Image.new("RGB", (0, 10)), "x"], r"`items\[0\]` has zero size \(0x10\)"),
        ([Image.new("RGB", (1, 1)), "x"], r"`items\[0\]` is 1x1 px: a one-pixel side holds no picture"),
        ([Image.new("RGB", (30, 30)), Image.new("RGB", (40, 1)), "x"], r"`items\[1\]` is 40x1 px"),
        ([Image.new("RGB", (8, 8)), 3, "x"], r"`items\[1\]` must be a text .* got int"),
        ([Image.new("RGB", (8, 8)), "x\udcff"], r"`items\[1\]` is not valid Unicode text"),
        ([Image.new("RGB", (8, 8)), GENERATE, "x"], r"`items\[1\]` \(GENERATE\) would be generated with no text"),
        ([Image.new("RGB", (8, 8)), "x", GENERATE], r"the request's final image would be generated with no text"),
        (["x", "y"], r"an edit needs an image to edit"),
    ],
)
def test_bad_generation_lists_are_refused_in_one_line(loaded, items, match):
    _refused(loaded, lambda pipe: pipe.generate("edit", items, EDIT), match)


@pytest.mark.parametrize(
    "items, match",
    [
        ([Image.new("RGB", (8, 8)), GENERATE, "x"], r"`items\[1\]` is a GENERATE marker, but an understanding"),
        ([ImageItem(Image.new("RGB", (8, 8)), latent=torch.zeros(1, 16, 2, 2)), "x"], r"carries a source latent"),
        ([Image.new("RGB", (8, 8))], r"but no text"),
    ],
)
def test_bad_understanding_lists_are_refused_in_one_line(loaded, items, match):
    _refused(loaded, lambda pipe: pipe.understand_items(items, preset("understanding", max_new_tokens=2)), match)


def test_latents_and_noise_of_a_later_image_are_checked_before_the_first_encode(loaded, picture):
    second_bad = [picture, ImageItem(picture, latent=torch.zeros(1, 16, 3, 8)), "x"]
    _refused(loaded, lambda pipe: pipe.generate("edit", second_bad, EDIT), r"`items\[1\].latent` is 3x8 latent cells")
    nan = torch.full((1, 16, 8, 10), float("nan"))
    with pytest.raises(Exception, match=r"`items\[1\].latent` holds"):
        BagelPipeline(loaded, Counting()).generate("edit", [picture, ImageItem(picture, latent=nan), "x"], EDIT)
    wrong_noise = [picture, ImageItem(picture, vae_noise=torch.zeros(1, 16, 4, 4)), "x"]
    _refused(
        loaded,
        lambda pipe: pipe.generate("edit", wrong_noise, EDIT),
        r"`items\[1\].vae_noise` must be a tensor of shape \(1, 16, 8, 10\)",
    )
    both = [ImageItem(picture, latent=torch.ones(1, 16, 8, 10), vae_noise=torch.zeros(1, 16, 8, 10)), "x"]
    _refused(loaded, lambda pipe: pipe.generate("edit", both, EDIT), r"`items\[0\].vae_noise` is the sampling noise")
    latent_in_given = GivenLatents(source_latent=torch.ones(1, 16, 8, 10))
    _refused(
        loaded,
        lambda pipe: pipe.generate("edit", [picture, "x"], EDIT, given=latent_in_given),
        r"give each image's source latent or VAE noise in its ImageItem",
    )
    _refused(loaded, lambda pipe: pipe.generate("understanding", [picture, "x"], EDIT), r"`task` must be 't2i' or")


def test_mixed_sizes_are_welcome_and_the_last_sets_the_output(loaded, picture):
    tall = Image.new("RGB", (40, 90), (200, 10, 10))
    result = BagelPipeline(loaded).generate("edit", [picture, tall, "x"], EDIT)
    assert result.image.size == (64, 128) and result.info["images"] == 2


def test_more_images_than_positions_names_the_count_the_limit_and_what_fits(loaded):
    config = SimpleNamespace(llm=SimpleNamespace(max_position_embeddings=40))
    items = request_items([Image.new("RGB", (8, 8))] * 30 + ["make one of them red"], generation=True)
    with pytest.raises(ValueError) as info:
        check_item_positions(config, loaded.tokenizer, items, generation=True, think=False)
    message = str(info.value)
    text = len(loaded.tokenizer.encode("make one of them red")) + 2 + 1  # the text block and the latent block
    assert "holds 30 images" in message and "max_position_embeddings = 40" in message
    assert f"at most {(40 - text) // 2} images fit" in message and "\n" not in message
    check_item_positions(config, loaded.tokenizer, items[-((40 - text) // 2) - 1 :], generation=True, think=False)


def test_rounds_split_at_the_markers():
    a, b = Image.new("RGB", (8, 8)), Image.new("RGB", (8, 8))
    items = request_items([a, "one", GENERATE, b, "two", GENERATE, "three"], generation=True)
    parts = rounds(items)
    assert [len(p) for p in parts] == [2, 2, 1] and parts[2] == (TextItem("three"),)
    assert isinstance(parts[1][0], ImageItem) and parts[1][0].image is b


@pytest.mark.parametrize("generation, extra", [(False, 512), (True, 0), (True, 300)])
def test_the_images_that_fit_are_counted_with_the_decoded_positions(generation, extra):
    """The count the refusal names is one the same check takes: the answer's decoded positions (max_new_tokens,
    think_max_new_tokens) are counted too. It said "at most 4091" for 4200 images on 4,096 positions and then refused
    4091 for max_new_tokens."""
    config = SimpleNamespace(llm=SimpleNamespace(max_position_embeddings=4096))
    per_image, text = (2 if generation else 1), 66

    def check(images: int) -> None:
        used = text + images * per_image + (1 if generation else 0)
        check_image_positions(config, used, images, generation=generation, extra=extra)

    with pytest.raises(ValueError) as info:
        check(4200)
    fit = int(re.search(r"at most (\d+) images fit", str(info.value)).group(1))
    assert "\n" not in str(info.value) and ("`max_new_tokens`" in str(info.value)) == bool(extra)
    check(fit)  # taken
    with pytest.raises(ValueError, match=f"at most {fit} images fit"):
        check(fit + 1)
