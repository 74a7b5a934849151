"""BAGEL procedures end to end on the tiny checkpoint (docs/bagel.md §4.6, §5), and the token and memory accounting
of a request (unicache_core.bagel.memory.accounting) against what the pipeline builds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from unicache_core.bagel import contexts as C
from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.decoding import decode_text
from unicache_core.bagel.denoise import branch_velocities
from unicache_core.bagel.memory.accounting import (
    RequestTokens,
    count_request,
    generation_positions,
    image_tokens,
    kv_bytes_per_token,
    request_memory_bytes,
    understanding_positions,
)
from unicache_core.bagel.pipeline import BagelPipeline
from unicache_core.bagel.request import GivenLatents, RunHooks
from unicache_core.bagel.settings import GenerationSettings, preset
from unicache_core.errors import CancelledError
from unicache_core.kv.cache import AttentionCall, CacheRequest, FullKVCache, full_cache_factory
from unicache_core.kv.token_types import TokenType

FAST = dict(num_timesteps=4, timestep_shift=3.0)


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return load_bagel(tiny_checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def pipe(loaded):
    return BagelPipeline(loaded)


@pytest.fixture(scope="module")
def source_image():
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, size=(45, 60, 3), dtype=np.uint8))


class CountingFactory:
    """Cache factory whose caches count forward passes per (branch, phase)."""

    def __init__(self):
        self.counts: dict[tuple[str, str], int] = {}
        factory = self

        class Counting(FullKVCache):
            def begin_call(self, call):
                key = (self.branch, call.phase)
                factory.counts[key] = factory.counts.get(key, 0) + 1

        self._cls = Counting

    def __call__(self, request: CacheRequest):
        return self._cls(request.num_layers, task=request.task, branch=request.branch)

    def denoise(self, branch: str) -> int:
        return self.counts.get((branch, "denoise"), 0)


def _pixels(img: Image.Image) -> np.ndarray:
    return np.asarray(img)


# ------------------------------------------------------------------------------------ end to end


def test_text_to_image_end_to_end(pipe):
    res = pipe.text_to_image("a red cube", preset("t2i", width=64, height=48, **FAST), seed=1)
    assert isinstance(res.image, Image.Image) and res.image.mode == "RGB" and res.image.size == (64, 48)
    assert _pixels(res.image).std() > 0
    assert res.latents.shape == (1, 16, 6, 8) and res.num_steps == 3 and res.seed == 1
    # default cfg (text 4, img 1.5, interval (0.4, 1]); shift 3 puts t = 1, 0.857, 0.6 all inside
    assert res.info["forwards"] == {"gen": 3, "cfg_text": 3, "cfg_img": 3}
    assert res.info["context_tokens"]["cfg_text"] == 0
    assert res.info["context_tokens"]["cfg_img"] == res.info["context_tokens"]["gen"]


def test_edit_end_to_end_and_rng_order(pipe, loaded, source_image):
    res = pipe.edit("make it blue", source_image, preset("edit", num_timesteps=2), seed=5)
    # the VAE-resized source size: the tiny checkpoint's rule (128, 64, 16) takes 60x45 to 80x64
    assert res.image.size == (80, 64)
    assert _pixels(res.image).std() > 0
    # The official code draws the VAE-encode noise first, then the latent noise, from one RNG stream.
    g = torch.Generator().manual_seed(5)
    vae_noise = torch.randn(1, 16, 8, 10, generator=g)
    initial = torch.randn(4 * 5, 64, generator=g)
    again = pipe.edit(
        "make it blue",
        source_image,
        preset("edit", num_timesteps=2),
        seed=123,
        given=GivenLatents(vae_noise=vae_noise, initial_noise=initial),
    )
    assert again.image.tobytes() == res.image.tobytes()
    assert torch.equal(again.latents, res.latents)


def test_understanding_end_to_end(pipe, loaded, source_image):
    res = pipe.understand("What is shown?", source_image, preset("understanding", max_new_tokens=5))
    assert isinstance(res.text, str)
    assert len(res.token_ids) <= 5
    assert all(isinstance(t, int) for t in res.token_ids)
    assert loaded.tokenizer.eos_token_id not in res.token_ids
    assert res.text == loaded.tokenizer.decode(res.token_ids).split("<|im_start|>")[0]


def test_text_only_understanding_and_think(pipe):
    plain = pipe.understand("hello", None, preset("understanding", max_new_tokens=3))
    think = pipe.understand("hello", None, preset("understanding", max_new_tokens=3, think=True))
    assert think.info["context_tokens"]["gen"] > plain.info["context_tokens"]["gen"]


def test_t2i_think_mode_appends_plan_to_gen_only(pipe):
    res = pipe.text_to_image(
        "a cat", preset("t2i", width=32, height=32, think=True, think_max_new_tokens=3, **FAST), seed=0
    )
    assert isinstance(res.think_text, str)
    tokens = res.info["context_tokens"]
    # gen = system + prompt + plan; cfg_img = system + prompt; cfg_text = system only
    assert tokens["gen"] > tokens["cfg_img"] > tokens["cfg_text"] > 0


# ------------------------------------------------------------------------------------ determinism


def test_t2i_deterministic_by_seed(pipe):
    a = pipe.text_to_image("a tree", preset("t2i", width=32, height=32, **FAST), seed=7)
    b = pipe.text_to_image("a tree", preset("t2i", width=32, height=32, **FAST), seed=7)
    c = pipe.text_to_image("a tree", preset("t2i", width=32, height=32, **FAST), seed=8)
    assert a.image.tobytes() == b.image.tobytes() and torch.equal(a.latents, b.latents)
    assert not torch.equal(a.latents, c.latents)


def test_injected_initial_noise_reproduces_seed(pipe):
    a = pipe.text_to_image("a tree", preset("t2i", width=32, height=32, **FAST), seed=3)
    noise = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    b = pipe.text_to_image(
        "a tree", preset("t2i", width=32, height=32, **FAST), seed=999, given=GivenLatents(initial_noise=noise)
    )
    assert torch.equal(a.latents, b.latents)


def test_sampled_understanding_deterministic_by_seed(pipe):
    settings = preset("understanding", max_new_tokens=6, do_sample=True, temperature=1.0)
    a = pipe.understand("tell me", None, settings, seed=11)
    b = pipe.understand("tell me", None, settings, seed=11)
    assert a.token_ids == b.token_ids


# ------------------------------------------------------------------------------------ contexts


def test_edit_contexts_layout(pipe, loaded, source_image):
    ctxs = pipe.build_generation_contexts(
        "edit", "make it blue", image=source_image, generator=torch.Generator().manual_seed(0)
    )
    # tiny rules: 60x45 -> 80x64 (VAE 128/64/16: 4x5 latent tokens) -> ViT 112/56/14: 84x70 (5x6 patches)
    n_vae, n_vit = 4 * 5, 5 * 6
    n_txt = len(loaded.tokenizer.encode("make it blue"))
    keys, _, types, pos = ctxs.gen.cache.layer_kv(0)
    B, VAE, VIT, INS = (
        int(TokenType.BOUNDARY),
        int(TokenType.SOURCE_VAE),
        int(TokenType.SOURCE_VIT),
        int(TokenType.INSTRUCTION),
    )
    expected_types = [B] + [VAE] * n_vae + [B, B] + [VIT] * n_vit + [B, B] + [INS] * n_txt + [B]
    assert types.tolist() == expected_types
    expected_pos = [0] * (n_vae + 2) + [1] * (n_vit + 2) + list(range(2, n_txt + 4))
    assert pos.tolist() == expected_pos
    assert ctxs.gen.rope == n_txt + 4 and ctxs.cfg_text.rope == 2 and ctxs.cfg_img.rope == n_txt + 2
    # cfg_text = copy of gen taken after the image: bit-identical prefix
    ck, cv, ctypes, _ = ctxs.cfg_text.cache.layer_kv(1)
    gk, gv, _, _ = ctxs.gen.cache.layer_kv(1)
    assert ck.shape[0] == n_vae + n_vit + 4
    assert torch.equal(ck, gk[: ck.shape[0]]) and torch.equal(cv, gv[: ck.shape[0]])
    _, _, itypes, ipos = ctxs.cfg_img.cache.layer_kv(0)
    assert itypes.tolist() == [B] + [INS] * n_txt + [B] and ipos.tolist() == list(range(n_txt + 2))
    assert (ctxs.height, ctxs.width) == (64, 80)
    assert ctxs.cfg_text.cache.branch == "cfg_text" and ctxs.cfg_img.cache.branch == "cfg_img"


def test_step0_velocity_hook_matches_direct_branch_call(pipe):
    noise = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    res = pipe.text_to_image(
        "a dog",
        preset("t2i", width=32, height=32, **FAST),
        return_step0_velocity=True,
        given=GivenLatents(initial_noise=noise),
    )
    v0 = res.step0_velocity
    assert set(v0) == {"gen", "cfg_text", "cfg_img", "guided"}
    ctxs = pipe.build_generation_contexts("t2i", "a dog", width=32, height=32)
    direct = branch_velocities(pipe.loaded, ctxs, noise, 1.0, branches=("gen",))["gen"]
    assert direct.shape == (4, 64)
    assert torch.equal(direct, v0["gen"])
    # t2i: cfg_img context == gen context, so those velocities agree
    assert torch.allclose(v0["cfg_img"], v0["gen"], atol=1e-6)
    assert not torch.allclose(v0["cfg_text"], v0["gen"], atol=1e-4)


# ------------------------------------------------------------------------------------ cache correctness


@torch.inference_mode()
def test_cached_greedy_decoding_equals_recomputation(pipe, loaded, source_image):
    n_new = 6
    ctx = pipe.build_understanding_context(source_image, "Describe.")
    tok = loaded.tokenizer
    fed, cached_logits = [tok.bos_token_id], []
    for step in range(n_new):
        logits = C.decode_step(loaded, ctx, fed[-1], step, TokenType.DECODED_TEXT)
        cached_logits.append(logits)
        fed.append(int(logits.argmax()))
    for k in range(1, n_new + 1):
        fresh = pipe.build_understanding_context(source_image, "Describe.")
        assert isinstance(fresh.cache, FullKVCache)
        ids = torch.tensor(fed[:k])
        positions = torch.arange(fresh.rope, fresh.rope + k)
        call = AttentionCall(
            token_types=C._types((TokenType.DECODED_TEXT, k), device=torch.device("cpu")),
            rope_positions=positions,
            causal=True,
            update=False,
        )
        hidden = loaded.model.forward_llm(loaded.model.embed_text(ids), positions, fresh.cache, call)
        logits = loaded.model.lm_logits(hidden)[-1]
        assert torch.allclose(logits, cached_logits[k - 1], atol=1e-4, rtol=1e-4)
        assert int(logits.argmax()) == fed[k]
    # the pipeline's own decoding gives the same greedy tokens
    res = pipe.understand("Describe.", source_image, preset("understanding", max_new_tokens=n_new))
    eos = tok.eos_token_id
    expected = fed[1:]
    if eos in expected:
        expected = expected[: expected.index(eos)]
    assert res.token_ids == expected


# ------------------------------------------------------------------------------------ CFG branches


@pytest.mark.parametrize(
    "text_scale, img_scale, interval, expected",
    [
        (1.0, 1.5, (0.0, 1.0), {"gen": 4, "cfg_text": 0, "cfg_img": 0}),
        (4.0, 1.0, (0.0, 1.0), {"gen": 4, "cfg_text": 4, "cfg_img": 0}),
        (4.0, 2.0, (0.0, 1.0), {"gen": 4, "cfg_text": 4, "cfg_img": 4}),
        # shift 1, 5 timesteps: t = 1, .75, .5, .25 -> inside (0.4, 1] for 3 steps
        (4.0, 2.0, (0.4, 1.0), {"gen": 4, "cfg_text": 3, "cfg_img": 3}),
        (0.0, 0.0, (0.0, 1.0), {"gen": 4, "cfg_text": 0, "cfg_img": 0}),
    ],
)
def test_cfg_branches_skipped_as_official(loaded, text_scale, img_scale, interval, expected):
    factory = CountingFactory()
    res = BagelPipeline(loaded, factory).text_to_image(
        "x",
        preset(
            "t2i",
            width=32,
            height=32,
            num_timesteps=5,
            timestep_shift=1.0,
            cfg_text_scale=text_scale,
            cfg_img_scale=img_scale,
            cfg_interval=interval,
        ),
    )
    assert {b: factory.denoise(b) for b in expected} == expected
    assert res.info["forwards"] == expected


def test_scale_one_ignores_image_scale(pipe):
    base = preset("t2i", width=32, height=32, **FAST)
    a = pipe.text_to_image("x", base.replace(cfg_text_scale=1.0, cfg_img_scale=1.5), seed=2)
    b = pipe.text_to_image("x", base.replace(cfg_text_scale=1.0, cfg_img_scale=3.0), seed=2)
    c = pipe.text_to_image("x", base.replace(cfg_text_scale=4.0, cfg_img_scale=3.0), seed=2)
    assert torch.equal(a.latents, b.latents) and not torch.equal(a.latents, c.latents)


# ------------------------------------------------------------------------------------ progress / cancel


def test_progress_once_per_step_and_cancel(pipe):
    calls = []
    settings = preset("t2i", width=32, height=32, num_timesteps=5)
    pipe.text_to_image("x", settings, hooks=RunHooks(progress=lambda s, t: calls.append((s, t))))
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]
    seen = []
    with pytest.raises(CancelledError, match="step 3"):
        pipe.text_to_image(
            "x", settings, hooks=RunHooks(progress=lambda s, t: seen.append(s), cancel=lambda: len(seen) >= 2)
        )
    assert seen == [1, 2]
    tokens = []
    with pytest.raises(CancelledError):
        pipe.understand(
            "x",
            None,
            preset("understanding", max_new_tokens=10),
            hooks=RunHooks(progress=lambda s, t: tokens.append((s, t)), cancel=lambda: len(tokens) >= 3),
        )
    assert tokens == [(1, 10), (2, 10), (3, 10)]


def test_think_mode_reports_plan_tokens_then_denoising_steps(pipe):
    calls = []
    result = pipe.text_to_image(
        "x",
        preset("t2i", width=32, height=32, num_timesteps=3, think=True, think_max_new_tokens=4),
        hooks=RunHooks(progress=lambda s, t: calls.append((s, t))),
    )
    plan_calls = [c for c in calls if c[1] == 4]
    assert plan_calls == [(i + 1, 4) for i in range(len(plan_calls))] and 1 <= len(plan_calls) <= 4
    assert calls[len(plan_calls) :] == [(1, 2), (2, 2)]
    assert result.think_text is not None


# ------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(width=60), "width"),
        (dict(height=0), "height"),
        (dict(width=2048), "width"),
        (dict(num_timesteps=1), "num_timesteps"),
        (dict(cfg_text_scale=-1.0), "cfg_text_scale"),
        (dict(cfg_img_scale=float("nan")), "cfg_img_scale"),
        (dict(cfg_interval=(0.8, 0.2)), "cfg_interval"),
        (dict(cfg_interval=0.4), "cfg_interval"),
        (dict(cfg_renorm_type="local"), "cfg_renorm_type"),
        (dict(cfg_renorm_min=2.0), "cfg_renorm_min"),
        (dict(timestep_shift=0.0), "timestep_shift"),
        (dict(seed=-1), "seed"),
        (dict(initial_noise=torch.zeros(3, 64)), "initial_noise"),
        (dict(prompt=123), "prompt"),
    ],
)
def test_bad_generation_args(pipe, kwargs, name):
    fields = {"width": 32, "height": 32, "num_timesteps": 3, **kwargs}
    prompt, seed, noise = fields.pop("prompt", "x"), fields.pop("seed", 0), fields.pop("initial_noise", None)
    with pytest.raises(ValueError, match=f"`{name}"):
        pipe.text_to_image(prompt, GenerationSettings(**fields), seed=seed, given=GivenLatents(initial_noise=noise))


def test_bad_understanding_and_edit_args(pipe, source_image):
    with pytest.raises(ValueError, match="`max_new_tokens`"):
        pipe.understand("x", None, preset("understanding", max_new_tokens=0))
    with pytest.raises(ValueError, match="`temperature`"):
        pipe.understand("x", None, preset("understanding", do_sample=True, temperature=0.0))
    with pytest.raises(ValueError, match="`image`"):
        pipe.understand("x", "not an image")
    with pytest.raises(ValueError, match="`image`"):
        pipe.edit("x", None)
    with pytest.raises(ValueError, match="`vae_noise`"):
        pipe.edit(
            "x", source_image, preset("edit", num_timesteps=2), given=GivenLatents(vae_noise=torch.zeros(1, 16, 8, 8))
        )
    with pytest.raises(ValueError, match="`settings` must be a UnderstandingSettings .*got GenerationSettings"):
        pipe.understand("x", None, preset("t2i"))
    with pytest.raises(ValueError, match="`hooks` must be a RunHooks .*got function"):
        pipe.text_to_image("x", preset("t2i", width=32, height=32), hooks=lambda done, total: None)
    with pytest.raises(ValueError, match="`given` must be a GivenLatents .*got Tensor"):
        pipe.edit("x", source_image, given=torch.zeros(4, 64))


def test_flow_settings_accept_official_defaults():
    s = GenerationSettings(
        num_timesteps=50,
        timestep_shift=3.0,
        cfg_text_scale=4.0,
        cfg_img_scale=2.0,
        cfg_interval=[0.0, 1.0],
        cfg_renorm_min=0.0,
        cfg_renorm_type="text_channel",
    )
    assert s.cfg_interval == (0.0, 1.0) and s.num_timesteps == 50
    assert preset("edit") == s and preset("t2i") == GenerationSettings()


def test_default_factory_builds_full_caches(pipe):
    ctx = pipe.new_context("t2i", "gen")
    assert isinstance(ctx.cache, FullKVCache) and ctx.cache.task == "t2i" and ctx.rope == 0
    assert pipe.cache_factory is full_cache_factory


def test_sampled_think_plan_draws_precede_the_latent_noise_as_official(pipe):
    """Official RNG order (one global stream): plan samples (+ the loop's final discarded draw) → latent noise."""
    settings = preset(
        "t2i",
        width=32,
        height=32,
        num_timesteps=3,
        think=True,
        think_max_new_tokens=3,
        think_do_sample=True,
        think_temperature=5.0,
    )  # high temperature: the 3-token plan hits the limit
    run = pipe.text_to_image("a dog", settings, seed=11)
    assert run.think_text is not None

    g = torch.Generator().manual_seed(11)
    ctxs = pipe.build_generation_contexts("t2i", "a dog", width=32, height=32, think=True, generator=g)
    text, ids = decode_text(
        pipe.loaded,
        ctxs.gen.clone(branch="gen"),
        max_new_tokens=3,
        do_sample=True,
        temperature=5.0,
        generator=g,
        draw_discarded_sample=True,
    )
    assert text == run.think_text and len(ids) == 3
    noise = torch.randn(2 * 2, 64, generator=g)
    replay = pipe.text_to_image("a dog", settings, seed=11, given=GivenLatents(initial_noise=noise))
    assert replay.think_text == run.think_text
    assert torch.equal(replay.latents, run.latents)
    # without the discarded draw the noise (and so the image) would differ
    g2 = torch.Generator().manual_seed(11)
    ctxs2 = pipe.build_generation_contexts("t2i", "a dog", width=32, height=32, think=True, generator=g2)
    decode_text(
        pipe.loaded, ctxs2.gen.clone(branch="gen"), max_new_tokens=3, do_sample=True, temperature=5.0, generator=g2
    )
    shifted = pipe.text_to_image(
        "a dog", settings, seed=11, given=GivenLatents(initial_noise=torch.randn(4, 64, generator=g2))
    )
    assert not torch.equal(shifted.latents, run.latents)


def test_preview_gives_the_clean_latent_estimate_every_step(loaded):
    """``preview(done, total, x0)``: x0 = x_t - t v after each step; after the last Euler step (dt = t) it IS the
    final latent, so the last preview equals ``result.latents`` exactly."""
    seen = []
    res = BagelPipeline(loaded).text_to_image(
        "a dog",
        preset("t2i", width=32, height=32, num_timesteps=4),
        seed=3,
        hooks=RunHooks(preview=lambda d, t, x0: seen.append((d, t, x0.clone()))),
    )
    assert [(d, t) for d, t, _ in seen] == [(1, 3), (2, 3), (3, 3)]
    assert all(x0.shape == res.latents.shape for _, _, x0 in seen)
    assert torch.allclose(seen[-1][2], res.latents, atol=1e-6)
    assert not torch.allclose(seen[0][2], res.latents, atol=1e-3)  # the first estimate is still rough


# ------------------------------------------------------------------------------------ accounting


def _count(loaded, task, prompt, settings, image=None):
    return count_request(
        loaded.config, loaded.tokenizer, task, prompt, settings, source_size=None if image is None else image.size
    )


def test_edit_branches_hold_the_counted_tokens_and_bytes(pipe, loaded, source_image):
    settings = preset("edit", num_timesteps=2)
    tokens = _count(loaded, "edit", "make it blue", settings, source_image)
    # the tiny rules: 60x45 -> 80x64 (VAE: 4x5 latent tokens) -> ViT 84x70 (5x6 patches)
    assert (tokens.vae, tokens.vit, tokens.latent) == (20, 30, 20) == (*image_tokens(loaded.config, (60, 45)), 20)
    result = pipe.edit("make it blue", source_image, settings, seed=0)
    assert result.info["context_tokens"] == tokens.branches()
    assert result.info["cache_bytes"] == tokens.kv_bytes(loaded.config, loaded.dtype)
    llm = loaded.config.llm
    assert (
        kv_bytes_per_token(loaded.config, torch.float32)
        == 2 * llm.num_hidden_layers * llm.num_key_value_heads * llm.head_dim * 4
    )
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
    assert (
        kv
        < request_memory_bytes(loaded.config, torch.float32, small)
        < request_memory_bytes(loaded.config, torch.float32, large)
    )
    edit = RequestTokens(task="edit", prompt=10, vae=64, vit=49, latent=64)
    assert edit.branches() == {"gen": 64 + 49 + 4 + 12, "cfg_text": 64 + 49 + 4, "cfg_img": 12}
    assert request_memory_bytes(loaded.config, torch.float32, edit) > request_memory_bytes(
        loaded.config, torch.float32, small
    )
