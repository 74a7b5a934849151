"""Interleaved requests on the tiny checkpoint: several images and texts in one request, built exactly as the
official ``interleave_inference`` builds its contexts (docs/bagel.md §5.1), and iterative editing.

Every test derives what the contexts must hold from the official rules (a text: ``cfg_text`` <- copy of ``gen``, then
the text to ``gen`` and ``cfg_img``; an image: VAE then ViT block to ``gen`` (ViT only for understanding), one RoPE
position each, then ``cfg_text`` <- copy of ``gen``) and the checkpoint's resize rules, and compares it with what the
caches saw: the token types and RoPE positions of every cached row per branch, the image index of every image block,
the latent block's position per branch and the KV lengths.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.items import GENERATE, ImageItem, request_items
from unicache_core.bagel.memory.accounting import count_items, image_tokens, kv_bytes_per_token
from unicache_core.bagel.pipeline import BagelPipeline
from unicache_core.bagel.request import GivenLatents
from unicache_core.bagel.seeding import seeded_generator
from unicache_core.bagel.settings import preset
from unicache_core.compression import make_cache_factory
from unicache_core.kv.cache import CacheRequest, FullKVCache
from unicache_core.kv.token_types import TokenType

B, INS, VIT, VAE = (
    int(t) for t in (TokenType.BOUNDARY, TokenType.INSTRUCTION, TokenType.SOURCE_VIT, TokenType.SOURCE_VAE)
)
FAST = dict(num_timesteps=3)


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return load_bagel(tiny_checkpoint, dtype=torch.float32)


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def image_a():
    return _image(60, 45, 0)  # tiny rules: VAE 80x64 (20 latent tokens), ViT 84x70 (30 patches)


@pytest.fixture(scope="module")
def image_b():
    return _image(100, 40, 1)  # a different size: VAE 128x48 (24 tokens)


class Recorder:
    """A cache factory whose full caches record every appended block and each branch's content at step 0."""

    def __init__(self):
        self.appends: list[dict] = []  # {branch, phase, image, types, positions}
        self.step0: dict[str, dict] = {}  # branch -> {types, positions, query}
        self.answer_start: int | None = None
        recorder = self

        class Recording(FullKVCache):
            def begin_call(self, call):
                if call.update and call.phase == "prefill":
                    recorder.appends.append(
                        {
                            "branch": self.branch,
                            "image": call.image,
                            "types": call.token_types.tolist(),
                            "positions": call.rope_positions.tolist(),
                        }
                    )
                elif call.phase == "denoise" and call.step == 0:
                    state = self.layers[0]
                    recorder.step0[self.branch] = {
                        "types": state.token_types.tolist(),
                        "positions": state.rope_positions.tolist(),
                        "query": int(call.rope_positions[0]),
                    }
                elif call.phase == "decode" and recorder.answer_start is None:
                    recorder.answer_start = int(call.rope_positions[0])

        self._cls = Recording

    def __call__(self, request: CacheRequest):
        return self._cls(request.num_layers, task=request.task, branch=request.branch)


def _text(loaded, text: str, start: int) -> tuple[list[int], list[int]]:
    n = len(loaded.tokenizer.encode(text))
    return [B, *[INS] * n, B], list(range(start, start + n + 2))


def _image_block(kind: int, tokens: int, position: int) -> tuple[list[int], list[int]]:
    return [B, *[kind] * tokens, B], [position] * (tokens + 2)


class Expected:
    """The official contexts of a list, built by the rules of the module docstring from token counts alone."""

    def __init__(self, loaded, *, generation: bool):
        self.loaded, self.generation = loaded, generation
        self.gen = ([], [])
        self.cfg_img = ([], [])
        self.cfg_text = ([], [])
        self.gen_rope = self.img_rope = 0
        self.blocks: list[tuple[int | None, list[int]]] = []  # (image index, types) of gen's appends
        self.images = 0

    @staticmethod
    def _add(branch, block):
        branch[0].extend(block[0])
        branch[1].extend(block[1])

    def text(self, text: str) -> None:
        self.cfg_text = (list(self.gen[0]), list(self.gen[1]), self.gen_rope)
        block = _text(self.loaded, text, self.gen_rope)
        self._add(self.gen, block)
        self.blocks.append((None, block[0]))
        self.gen_rope += len(block[0])
        if self.generation:
            self._add(self.cfg_img, _text(self.loaded, text, self.img_rope))
            self.img_rope += len(block[0])

    def image(self, size: tuple[int, int]) -> None:
        vae, vit = image_tokens(self.loaded.config, size)
        kinds = [(VAE, vae), (VIT, vit)] if self.generation else [(VIT, vit)]
        for kind, tokens in kinds:
            block = _image_block(kind, tokens, self.gen_rope)
            self._add(self.gen, block)
            self.blocks.append((self.images, block[0]))
            self.gen_rope += 1
        self.images += 1
        self.cfg_text = (list(self.gen[0]), list(self.gen[1]), self.gen_rope)


def _check_generation(recorder: Recorder, want: Expected) -> None:
    gen_appends = [(a["image"], a["types"]) for a in recorder.appends if a["branch"] == "gen"]
    assert gen_appends == want.blocks
    got = recorder.step0
    assert (got["gen"]["types"], got["gen"]["positions"], got["gen"]["query"]) == (*want.gen, want.gen_rope)
    assert (got["cfg_text"]["types"], got["cfg_text"]["positions"], got["cfg_text"]["query"]) == want.cfg_text
    assert (got["cfg_img"]["types"], got["cfg_img"]["positions"], got["cfg_img"]["query"]) == (
        *want.cfg_img,
        want.img_rope,
    )
    cfg_img_appends = [a for a in recorder.appends if a["branch"] == "cfg_img"]
    assert all(a["image"] is None and VIT not in a["types"] and VAE not in a["types"] for a in cfg_img_appends)


# ------------------------------------------------------------------------------------ contexts


def test_two_image_edit_builds_the_official_contexts(loaded, image_a, image_b):
    recorder = Recorder()
    prompt = "put the circle of the first image into the second"
    settings = preset("edit", **FAST)
    result = BagelPipeline(loaded, recorder).generate("edit", [image_a, image_b, prompt], settings, seed=3)
    want = Expected(loaded, generation=True)
    want.image(image_a.size)
    want.image(image_b.size)
    want.text(prompt)
    _check_generation(recorder, want)
    # gen = A B text; cfg_text = A B (the copy before the text); cfg_img = text; the output takes B's size
    assert result.image.size == (128, 48) and result.info["images"] == 2
    tokens = count_items(
        loaded.config, loaded.tokenizer, "edit", request_items([image_a, image_b, prompt], generation=True), settings
    )
    assert result.info["context_tokens"] == tokens.branches()
    assert result.info["cache_bytes"] == tokens.kv_bytes(loaded.config, loaded.dtype)
    assert tokens.images == ((20, 30), (24, 24)) and tokens.latent == 24


def test_two_image_understanding_builds_one_official_context(loaded, image_a, image_b):
    recorder = Recorder()
    prompt = "what differs between the two pictures?"
    settings = preset("understanding", max_new_tokens=3)
    result = BagelPipeline(loaded, recorder).understand_items([image_a, image_b, prompt], settings)
    want = Expected(loaded, generation=False)
    want.image(image_a.size)
    want.image(image_b.size)
    want.text(prompt)
    gen_appends = [(a["image"], a["types"]) for a in recorder.appends if a["branch"] == "gen"]
    assert gen_appends == want.blocks
    positions = [p for a in recorder.appends if a["branch"] == "gen" for p in a["positions"]]
    assert positions == want.gen[1] and recorder.answer_start == want.gen_rope  # ViT A at 0, ViT B at 1, text
    assert {a["branch"] for a in recorder.appends} == {"gen"}
    tokens = count_items(
        loaded.config,
        loaded.tokenizer,
        "understanding",
        request_items([image_a, image_b, prompt], generation=False),
        settings,
    )
    assert result.info["context_tokens"]["gen"] == tokens.branches()["gen"] - tokens.decoded == len(want.gen[0])


@pytest.mark.parametrize(
    "layout",
    [
        ("t0", "A", "t1"),  # cfg_text: gen before the last text = t0 A
        ("A", "t1", "B"),  # the last item is an image: cfg_text = gen
        ("t0", "t1"),  # two texts: cfg_text = t0
    ],
)
def test_cfg_text_holds_what_the_official_copies_leave(loaded, image_a, image_b, layout):
    images = {"A": image_a, "B": image_b}
    items = [images.get(name, name) for name in layout]
    recorder = Recorder()
    BagelPipeline(loaded, recorder).generate("t2i", items, preset("t2i", width=32, height=32, **FAST), seed=0)
    want = Expected(loaded, generation=True)
    for name in layout:
        want.image(images[name].size) if name in images else want.text(name)
    _check_generation(recorder, want)


def test_think_mode_puts_the_system_prompt_first(loaded, image_a, image_b):
    from unicache_core.bagel.contexts import GEN_THINK_SYSTEM_PROMPT

    recorder = Recorder()
    settings = preset("edit", think=True, think_max_new_tokens=2, **FAST)
    BagelPipeline(loaded, recorder).generate("edit", [image_a, image_b, "swap them"], settings, seed=0)
    system = len(loaded.tokenizer.encode(GEN_THINK_SYSTEM_PROMPT)) + 2
    gen_prefill = [a for a in recorder.appends if a["branch"] == "gen"]
    assert gen_prefill[0]["types"] == [B, *[INS] * (system - 2), B] and gen_prefill[1]["image"] == 0
    cfg_text = recorder.step0["cfg_text"]
    assert cfg_text["types"][:system] == gen_prefill[0]["types"] and cfg_text["query"] == system + 4


# ------------------------------------------------------------------------------------ one mechanism


def test_the_single_image_calls_are_their_item_lists(loaded, image_a):
    pipe = BagelPipeline(loaded)
    settings = preset("edit", **FAST)
    single = pipe.edit("make it blue", image_a, settings, seed=5)
    listed = pipe.generate("edit", [image_a, "make it blue"], settings, seed=5)
    assert np.array_equal(np.asarray(single.image), np.asarray(listed.image))
    t2i = preset("t2i", width=32, height=32, **FAST)
    assert torch.equal(
        pipe.text_to_image("a dog", t2i, seed=2).latents, pipe.generate("t2i", ["a dog"], t2i, seed=2).latents
    )
    und = preset("understanding", max_new_tokens=4)
    assert (
        pipe.understand("what is it?", image_a, und).token_ids
        == pipe.understand_items([image_a, "what is it?"], und).token_ids
    )


def test_images_draw_their_encode_noise_in_item_order(loaded, image_a, image_b):
    """One seeded generator: A's encode noise, then B's, then the initial latent noise (the official order)."""
    pipe = BagelPipeline(loaded)
    settings = preset("edit", **FAST)
    seeded = pipe.generate("edit", [image_a, image_b, "swap"], settings, seed=11)
    g = seeded_generator(11)
    noise_a = torch.randn(1, 16, 8, 10, generator=g)  # 80x64 px -> 8x10 VAE cells
    noise_b = torch.randn(1, 16, 6, 16, generator=g)  # 128x48 px
    initial = torch.randn(24, 64, generator=g)
    given = pipe.generate(
        "edit",
        [ImageItem(image_a, vae_noise=noise_a), ImageItem(image_b, vae_noise=noise_b), "swap"],
        settings,
        seed=999,
        given=GivenLatents(initial_noise=initial),
    )
    assert torch.equal(seeded.latents, given.latents)
    swapped = pipe.generate("edit", [image_b, image_a, "swap"], settings, seed=11)
    assert swapped.image.size == (80, 64)  # the last image sets the output size


def test_t2i_with_reference_images_keeps_its_size(loaded, image_a):
    result = BagelPipeline(loaded).generate(
        "t2i", [image_a, "the same, as a drawing"], preset("t2i", width=48, height=32, **FAST)
    )
    assert result.image.size == (48, 32) and result.info["images"] == 1


# ------------------------------------------------------------------------------------ iterative editing


def test_iterative_edit_feeds_its_output_back_in_one_request(loaded, image_a):
    recorder = Recorder()
    settings = preset("edit", **FAST)
    items = [image_a, "make it blue", GENERATE, "move it left"]
    result = BagelPipeline(loaded, recorder).generate("edit", items, settings, seed=4)
    assert len(result.rounds) == 1 and result.rounds[0].image.size == result.image.size == (80, 64)
    # round 2's contexts: gen = A, "make it blue", the first output, "move it left"; its image is image 1
    want = Expected(loaded, generation=True)
    want.image(image_a.size)
    want.text("make it blue")
    want.image((80, 64))
    want.text("move it left")
    round2 = [a for a in recorder.appends if a["branch"] == "gen"][3:]
    assert [(a["image"], a["types"]) for a in round2] == want.blocks
    _check_generation_last(recorder, want)
    # the same contexts as the one-round list with that output in place of the marker (RNG aligned by hand)
    g = seeded_generator(4)
    torch.randn(1, 16, 8, 10, generator=g)  # A's encode noise (the one-round run draws it from seed 4 too)
    torch.randn(20, 64, generator=g)  # round 1's initial noise
    noise_out = torch.randn(1, 16, 8, 10, generator=g)
    initial = torch.randn(20, 64, generator=g)
    one_round = BagelPipeline(loaded).generate(
        "edit",
        [image_a, "make it blue", ImageItem(result.rounds[0].image, vae_noise=noise_out), "move it left"],
        settings,
        seed=4,
        given=GivenLatents(initial_noise=initial),
    )
    assert torch.equal(one_round.latents, result.latents)


def _check_generation_last(recorder: Recorder, want: Expected) -> None:
    """The last round's branch contents at its step 0 (the recorder keeps the latest step 0 of each branch)."""
    got = recorder.step0
    assert (got["gen"]["types"], got["gen"]["positions"], got["gen"]["query"]) == (*want.gen, want.gen_rope)
    assert (got["cfg_text"]["types"], got["cfg_text"]["positions"], got["cfg_text"]["query"]) == want.cfg_text
    assert (got["cfg_img"]["types"], got["cfg_img"]["query"]) == (want.cfg_img[0], want.img_rope)


# ------------------------------------------------------------------------------------ every method, forks


@pytest.mark.parametrize("method", ["unicache", "h2o", "kivi", "snapkv"])
def test_every_method_runs_a_two_image_edit(loaded, image_a, image_b, method):
    pipe = BagelPipeline(loaded, make_cache_factory(method))
    result = pipe.generate("edit", [image_a, image_b, "swap"], preset("edit", **FAST), seed=0)
    assert result.image.size == (128, 48) and result.kv_report["method"] == method


@pytest.mark.parametrize("method", ["full", "unicache"])
def test_the_cfg_text_fork_shares_the_images_rows(loaded, image_a, image_b, method):
    """A session holds the images' rows once for gen and cfg_text (the fork shares its parent's tensors and only the
    last item's copy is taken): what it holds is gen + cfg_img plus cfg_text's text rows. UniCache holds the images'
    VAE rows (its paper table quantizes them) already quantized, as they were written (docs/compression.md §13), and its
    ViT rows (it evicts them later) in full precision until the first step's scores choose which it keeps (the
    ``speed`` objective; ``memory`` writes them quantized too)."""
    from unicache_core.bagel.interleave import build_generation_contexts
    from unicache_core.bagel.source_images import prepare_image

    pipe = BagelPipeline(loaded, make_cache_factory(method))
    items = request_items([image_a, image_b, "swap"], generation=True)
    session = pipe.start_session("edit", 2)
    g = seeded_generator(0)
    prepared = {
        item: prepare_image(loaded, item.image, generation=True, vae=loaded.vae, generator=g)
        for item in items
        if isinstance(item, ImageItem)
    }
    with torch.inference_mode():
        contexts = build_generation_contexts(loaded, session, items, prepared)
    per_token = kv_bytes_per_token(loaded.config, loaded.dtype)
    images = (20 + 30) + (24 + 24)
    branches = {name: ctx.cache.nbytes() for name, ctx in contexts.branches().items()}
    shared = sum(branches.values()) - session.held_bytes()  # bytes counted once
    if method == "full":  # every row cfg_text holds is gen's, the images' boundaries too
        assert shared == branches["cfg_text"] == (images + 8) * per_token
    else:  # the 8 boundary rows and the 2 x 24 ViT rows in full, the 20 + 30 VAE rows quantized at rho0's bits
        vit = 24 + 24
        assert (8 + vit) * per_token < shared < (8 + vit) * per_token + (images - vit) * per_token / 4
