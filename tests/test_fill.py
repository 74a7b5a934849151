"""Compress as the context fills (docs/compression.md §13): what every method shares, and what UniCache holds while
the context is prefilled.

- ``full``: the rows ``cfg_text`` copies from ``gen`` are held once (copy on write), and its outputs are bit for bit
  those of a cache that keeps each layer in one tensor (the engine before sharing, written out here);
- UniCache: each image's rows are quantized as each layer writes them, so after an item's prefill the caches hold
  its rows at their compressed size, and the prefill's tensor peak falls below full KV's by about what that saves.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.pipeline import BagelPipeline
from unicache_core.bagel.settings import preset
from unicache_core.compression import make_cache_factory
from unicache_core.kv.attention import attention_with_lse, merge_attention
from unicache_core.kv.cache import AttentionCall, FullKVCache, KVCache, unique_nbytes

FAST = dict(num_timesteps=4, timestep_shift=3.0)


class OneTensorCache(KVCache):
    """Each layer's keys and values in one tensor, grown by ``torch.cat``, copied on fork: the full cache as the engine
    had it before forks shared rows (the oracle of bit-identity)."""

    def __init__(self, num_layers: int, **kw):
        super().__init__(num_layers, **kw)
        self.kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers

    def attend(self, layer, q, k, v, call: AttentionCall):
        parts = []
        if self.kv[layer] is not None:
            keys, values = self.kv[layer]
            parts.append(attention_with_lse(q, keys.to(q.dtype), values.to(q.dtype)))
        if call.new_block_mask is not None:
            parts.append(attention_with_lse(q, k, v, mask=call.new_block_mask))
        else:
            parts.append(attention_with_lse(q, k, v, causal=call.causal))
        out, _ = merge_attention(parts)
        if call.update:
            held = self.kv[layer]
            self.kv[layer] = (
                (k.clone(), v.clone()) if held is None else (torch.cat([held[0], k]), torch.cat([held[1], v]))
            )
        return out

    @property
    def num_tokens(self):
        return 0 if self.kv[0] is None else self.kv[0][0].shape[0]

    def nbytes(self):
        return sum(k.nbytes + v.nbytes for k, v in filter(None, self.kv))


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return load_bagel(tiny_checkpoint, dtype=torch.float32)


def _image(seed: int, size=(45, 60)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(*size, 3), dtype=np.uint8))


def test_full_forks_hold_the_shared_rows_once(tiny):
    pipe = BagelPipeline(tiny, make_cache_factory("full"))
    ctxs = pipe.build_generation_contexts("edit", "make it blue", image=_image(0), generator=torch.Generator())
    gen, cfg_text, cfg_img = ctxs.gen.cache, ctxs.cfg_text.cache, ctxs.cfg_img.cache
    assert cfg_text.nbytes() > 0 and gen.num_tokens > cfg_text.num_tokens
    held = unique_nbytes(t for c in (gen, cfg_text, cfg_img) for t in c.tensors())
    assert held == gen.nbytes() + cfg_img.nbytes()  # every row of cfg_text is one of gen's
    assert held < gen.nbytes() + cfg_text.nbytes() + cfg_img.nbytes()
    for layer in range(gen.num_layers):
        assert gen.layers[layer].chunks[0][0] is cfg_text.layers[layer].chunks[0][0]


def test_a_fork_and_its_parent_grow_apart():
    cache = FullKVCache(1)
    rows = [torch.randn(3, 2, 4) for _ in range(3)]
    call = AttentionCall(torch.zeros(3, dtype=torch.int8), torch.arange(3), causal=False, update=True)
    cache.attend(0, rows[0], rows[0], rows[0], call)
    fork = cache.clone(branch="cfg_text")
    cache.attend(0, rows[1], rows[1], rows[1], call)
    fork.attend(0, rows[2], rows[2], rows[2], call)
    assert torch.equal(cache.layer_kv(0)[0], torch.cat(rows[:2]))
    assert torch.equal(fork.layer_kv(0)[0], torch.cat(rows[::2]))
    assert unique_nbytes(cache.tensors() + fork.tensors()) == 3 * 2 * rows[0].nbytes


@pytest.mark.parametrize("task", ["edit", "t2i"])
def test_full_is_bit_identical_to_one_tensor_per_layer(tiny, task):
    items = [_image(1), _image(2, (60, 40)), "make it blue"] if task == "edit" else ["a red square"]
    settings = preset(task, **FAST) if task == "edit" else preset(task, width=64, height=64, **FAST)
    shared = BagelPipeline(tiny, make_cache_factory("full")).generate(task, items, settings, seed=3, decode=False)
    oracle = BagelPipeline(tiny, lambda r: OneTensorCache(r.num_layers, task=r.task, branch=r.branch))
    old = oracle.generate(task, items, settings, seed=3, decode=False)
    assert torch.equal(shared.latents, old.latents)
