"""The KV-cache seam end to end: a compressing cache plugs into the BAGEL pipeline with no other change."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from oracles import ScoreInputs, StreamingLLMPolicy
from PIL import Image

from unicache_core.bagel import BagelPipeline, load_bagel, preset
from unicache_core.kv.cache import AttentionCall, CacheRequest, FullKVCache
from unicache_core.kv.quantized_store import QuantizedStore
from unicache_core.kv.segmented_cache import SegmentedKVCache
from unicache_core.kv.stores import EvictedStore
from unicache_core.kv.token_types import TokenType


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return load_bagel(tiny_checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def source_image():
    rng = np.random.default_rng(3)
    return Image.fromarray(rng.integers(0, 255, (40, 56, 3), dtype=np.uint8))


COMPRESSION_LOG: list[tuple[str, int, int]] = []  # module level: clones (deep copies) must share it


class CompressOnFirstDenoise(SegmentedKVCache):
    """Test cache: at the first denoising call, quantize source-VAE (KIVI 4-bit) and halve source-ViT."""

    def __init__(self, request: CacheRequest):
        super().__init__(request.num_layers, task=request.task, branch=request.branch)
        self.compressed = False

    def begin_call(self, call: AttentionCall) -> None:
        if call.phase != "denoise" or self.compressed:
            return
        self.compressed = True
        before = self.nbytes()
        sink = StreamingLLMPolicy(n_sink=4)
        for layer in range(self.num_layers):
            types = {t for t, _, _ in self.segments(layer)}
            if TokenType.SOURCE_VAE in types:
                seg = self.segment_kv(layer, TokenType.SOURCE_VAE)
                store = QuantizedStore.from_kv(seg.keys, seg.values, seg.token_index, bits=4, group_size=32, residual=8)
                self.replace_segment(layer, TokenType.SOURCE_VAE, store)
            if TokenType.SOURCE_VIT in types:
                seg = self.segment_kv(layer, TokenType.SOURCE_VIT)
                keep = sink.select(ScoreInputs(keys=seg.keys), seg.num_tokens // 2)
                store = EvictedStore.from_selection(seg.keys, seg.values, seg.token_index, keep, TokenType.SOURCE_VIT)
                self.replace_segment(layer, TokenType.SOURCE_VIT, store)
        COMPRESSION_LOG.append((self.branch, before, self.nbytes()))


def _edit(pipe, image):
    return pipe.edit("make it blue", image, preset("edit", num_timesteps=3), seed=5, return_step0_velocity=True)


def test_segmented_cache_reproduces_full_cache(loaded, source_image):
    full = _edit(BagelPipeline(loaded), source_image)
    seg = _edit(
        BagelPipeline(loaded, lambda r: SegmentedKVCache(r.num_layers, task=r.task, branch=r.branch)), source_image
    )
    # same keys, same softmax; only the summation order of the per-segment LSE merge differs
    for ours, ref in ((seg.step0_velocity["guided"], full.step0_velocity["guided"]), (seg.latents, full.latents)):
        assert ((ours - ref).norm() / ref.norm()).item() < 1e-5


def test_compressing_cache_plugs_in_without_other_changes(loaded, source_image):
    requests, caches = [], []
    COMPRESSION_LOG.clear()

    def factory(request: CacheRequest):
        requests.append(request)
        caches.append(CompressOnFirstDenoise(request))
        return caches[-1]

    full = _edit(BagelPipeline(loaded), source_image)
    out = _edit(BagelPipeline(loaded, factory), source_image)
    # every context asked for its own cache with the task; cfg_text is a clone of gen (same class, own state)
    assert {(r.task, r.branch) for r in requests} == {("edit", "gen"), ("edit", "cfg_img")}
    branches = [b for b, _, _ in COMPRESSION_LOG]
    assert sorted(branches) == ["cfg_img", "cfg_text", "gen"]
    for branch, before, after in COMPRESSION_LOG:
        if branch == "cfg_img":  # text only: nothing to compress
            assert after == before
        else:
            assert after < 0.7 * before, (branch, before, after)
    gen = next(c for c in caches if c.branch == "gen")
    kinds = {store.token_type: type(store) for store in gen.stores(0)}
    assert kinds[TokenType.SOURCE_VAE] is QuantizedStore and kinds[TokenType.SOURCE_VIT] is EvictedStore
    diff = (out.latents - full.latents).abs().max().item()
    assert 0 < diff and torch.isfinite(out.latents).all()
    assert out.image.size == full.image.size


def test_full_cache_rejects_bad_layer_and_mismatched_metadata():
    cache = FullKVCache(2)
    k = torch.randn(3, 1, 4)
    call = AttentionCall(
        token_types=torch.zeros(2, dtype=torch.int8), rope_positions=torch.arange(2), causal=True, update=True
    )
    with pytest.raises(ValueError, match="layer"):
        cache.attend(2, torch.randn(3, 2, 4), k, k, call)
    with pytest.raises(ValueError, match="token_types"):
        cache.attend(0, torch.randn(3, 2, 4), k, k, call)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_cache_fused_sdpa_path_matches_lse_path(monkeypatch, dtype):
    """The off-CPU path (one SDPA call over cached+new keys) equals the CPU flash+LSE path, causal or not."""
    import unicache_core.kv.cache as kvcache

    def run(prefer_sdpa: bool):
        monkeypatch.setattr(kvcache, "_prefer_fused_sdpa", lambda q: prefer_sdpa)
        cache, outs = FullKVCache(1), []
        for n, causal, update in ((5, True, True), (7, False, True), (1, True, True), (6, False, False)):
            g = torch.Generator().manual_seed(100 + n)
            q = torch.randn(n, 4, 8, generator=g).to(dtype)
            k = torch.randn(n, 2, 8, generator=g).to(dtype)
            v = torch.randn(n, 2, 8, generator=g).to(dtype)
            call = AttentionCall(
                token_types=torch.zeros(n, dtype=torch.int8),
                rope_positions=torch.arange(n),
                causal=causal,
                update=update,
            )
            outs.append(cache.attend(0, q, k, v, call))
        return outs, cache.num_tokens

    fused, n_fused = run(True)
    lse_path, n_lse = run(False)
    assert n_fused == n_lse == 13
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(fused, lse_path):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("cache_cls", ["full", "full_sdpa", "segmented"])
def test_packed_block_causal_call_equals_sequential_calls(monkeypatch, cache_cls):
    """[text (causal) + image (bidirectional)] in ONE call with a block-causal mask == two separate calls."""
    import unicache_core.kv.cache as kvcache
    from unicache_core.kv.attention import block_causal_mask

    monkeypatch.setattr(kvcache, "_prefer_fused_sdpa", lambda q: cache_cls == "full_sdpa")

    def make():
        return SegmentedKVCache(1) if cache_cls == "segmented" else FullKVCache(1)

    g = torch.Generator().manual_seed(21)
    ctx_q, ctx_k, ctx_v = (
        torch.randn(4, 4, 8, generator=g),
        torch.randn(4, 2, 8, generator=g),
        torch.randn(4, 2, 8, generator=g),
    )
    q, k, v = torch.randn(7, 4, 8, generator=g), torch.randn(7, 2, 8, generator=g), torch.randn(7, 2, 8, generator=g)
    types = torch.tensor([5, 1, 1, 5, 5, 2, 5], dtype=torch.int8)

    def call(n, causal, mask=None, t=None):
        return AttentionCall(
            token_types=types[:n] if t is None else t,
            rope_positions=torch.arange(n),
            causal=causal,
            update=True,
            new_block_mask=mask,
        )

    seq = make()
    seq.attend(0, ctx_q, ctx_k, ctx_v, call(4, True))
    out_text = seq.attend(0, q[:4], k[:4], v[:4], call(4, True, t=types[:4]))
    out_image = seq.attend(0, q[4:], k[4:], v[4:], call(3, False, t=types[4:]))

    packed = make()
    packed.attend(0, ctx_q, ctx_k, ctx_v, call(4, True))
    out = packed.attend(0, q, k, v, call(7, True, mask=block_causal_mask([4, 3], [True, False])))
    torch.testing.assert_close(out, torch.cat([out_text, out_image]), rtol=1e-5, atol=1e-5)
    assert packed.num_tokens == seq.num_tokens == 11
