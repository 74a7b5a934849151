"""Token and memory accounting of a request (unicache_core.bagel.accounting) against what the pipeline builds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from unicache_core.bagel.accounting import (
    RequestTokens, count_request, generation_positions, image_tokens, kv_bytes_per_token, request_memory_bytes,
    understanding_positions,
)
from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.pipeline import BagelPipeline
from unicache_core.bagel.settings import preset


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return load_bagel(tiny_checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def pipe(loaded):
    return BagelPipeline(loaded)


@pytest.fixture(scope="module")
def source_image():
    rng = np.random.default_rng(1)
    return Image.fromarray(rng.integers(0, 256, size=(45, 60, 3), dtype=np.uint8))


def _count(loaded, task, prompt, settings, image=None):
    return count_request(loaded.config, loaded.tokenizer, task, prompt, settings,
                         source_size=None if image is None else image.size)


def test_edit_branches_hold_the_counted_tokens_and_bytes(pipe, loaded, source_image):
    settings = preset("edit", num_timesteps=2)
    tokens = _count(loaded, "edit", "make it blue", settings, source_image)
    # the tiny rules: 60x45 -> 80x64 (VAE: 4x5 latent tokens) -> ViT 84x70 (5x6 patches)
    assert (tokens.vae, tokens.vit, tokens.latent) == (20, 30, 20) == (*image_tokens(loaded.config, (60, 45)), 20)
    result = pipe.edit("make it blue", source_image, settings, seed=0)
    assert result.info["context_tokens"] == tokens.branches()
    assert result.info["cache_bytes"] == tokens.kv_bytes(loaded.config, loaded.dtype)
    llm = loaded.config.llm
    assert kv_bytes_per_token(loaded.config, torch.float32) == 2 * llm.num_hidden_layers * llm.num_key_value_heads \
        * llm.head_dim * 4
    assert kv_bytes_per_token(loaded.config, torch.bfloat16) * 2 == kv_bytes_per_token(loaded.config, torch.float32)


def test_t2i_think_branches_are_upper_bounds(pipe, loaded):
    settings = preset("t2i", width=32, height=32, num_timesteps=2, think=True, think_max_new_tokens=3)
    tokens = _count(loaded, "t2i", "a cat", settings)
    result = pipe.text_to_image("a cat", settings, seed=0)
    counted, held = tokens.branches(), result.info["context_tokens"]
    assert set(counted) == {"gen", "cfg_text", "cfg_img", "plan"} and tokens.latent == 4
    assert held["cfg_text"] == counted["cfg_text"] > 0 and held["cfg_img"] == counted["cfg_img"]
    assert counted["cfg_img"] < held["gen"] <= counted["gen"]  # the plan (at most 3 tokens) went into gen


def test_understanding_holds_the_context_and_the_fed_tokens(pipe, loaded, source_image):
    settings = preset("understanding", max_new_tokens=4)
    tokens = _count(loaded, "understanding", "What is it?", settings, source_image)
    assert tokens.vae == 0 and tokens.vit == 30 and tokens.decoded == 4
    result = pipe.understand("What is it?", source_image, settings)
    fed = min(len(result.token_ids) + 1, settings.max_new_tokens)  # <|im_start|> and the kept tokens
    context = tokens.branches()["gen"] - tokens.decoded
    assert result.info["context_tokens"]["gen"] == context
    assert result.info["cache_bytes"] == (context + fed) * kv_bytes_per_token(loaded.config, loaded.dtype)


def test_positions_are_the_contexts_ropes(pipe, loaded, source_image):
    tok = loaded.tokenizer
    for think in (False, True):
        ctx = pipe.build_understanding_context(source_image, "Describe.", think=think)
        assert understanding_positions(tok, "Describe.", has_image=True, think=think) == ctx.rope
        ctxs = pipe.build_generation_contexts("edit", "make it blue", image=source_image, think=think)
        # the latent block takes one more position after the context
        assert generation_positions(tok, "make it blue", has_image=True, think=think) == ctxs.gen.rope + 1


def test_memory_estimate_grows_with_the_request(loaded):
    small = RequestTokens(task="t2i", prompt=10, latent=64)
    large = RequestTokens(task="t2i", prompt=10, latent=4096)
    kv = sum(small.kv_bytes(loaded.config, torch.float32).values())
    assert kv < request_memory_bytes(loaded.config, torch.float32, small) < request_memory_bytes(
        loaded.config, torch.float32, large)
    edit = RequestTokens(task="edit", prompt=10, vae=64, vit=49, latent=64)
    assert edit.branches() == {"gen": 64 + 49 + 4 + 12, "cfg_text": 64 + 49 + 4, "cfg_img": 12}
    assert request_memory_bytes(loaded.config, torch.float32, edit) > request_memory_bytes(
        loaded.config, torch.float32, small)
