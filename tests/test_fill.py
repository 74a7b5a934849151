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

from benchmarks.quality import paper_table_for
from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.memory.trace import TensorMemoryTracker
from unicache_core.bagel.pipeline import BagelPipeline
from unicache_core.bagel.settings import BUNDLED_CHECKPOINT_DIR, preset
from unicache_core.compression import make_cache_factory
from unicache_core.compression.compressing_cache import CompressingKVCache
from unicache_core.compression.full_cache import ReportingFullKVCache
from unicache_core.compression.view import key_of
from unicache_core.kv.attention import attention_with_lse, merge_attention
from unicache_core.kv.cache import AttentionCall, FullKVCache, KVCache, unique_nbytes
from unicache_core.kv.stores import FullStore
from unicache_core.kv.token_types import CANDIDATE_TYPES

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


@pytest.fixture(scope="module")
def shapes():
    return load_bagel(BUNDLED_CHECKPOINT_DIR, dtype=torch.float32)


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


def _record_prefill(monkeypatch, cls) -> list[tuple[str, int | None, int]]:
    """``(branch, image, bytes the session holds)`` after every prefill call of a cache of ``cls``."""
    seen: list[tuple[str, int | None, int]] = []
    end_call = cls.end_call

    def recording(self, call):
        end_call(self, call)
        if call.phase == "prefill":
            seen.append((self.branch, call.image, self.coordinator.held_bytes()))

    monkeypatch.setattr(cls, "end_call", recording)
    return seen


def _edit(loaded, method: str, images: int, hooks=None):
    pipe = BagelPipeline(loaded, make_cache_factory(method, checkpoint_dir=str(BUNDLED_CHECKPOINT_DIR)))
    items = [_image(10 + i, (128, 128)) for i in range(images)] + ["make the circle blue"]
    return pipe.generate("edit", items, preset("edit", num_timesteps=3), seed=1, hooks=hooks)


def test_unicache_stores_each_image_quantized_before_the_next_is_prefilled(shapes, monkeypatch):
    full_seen = _record_prefill(monkeypatch, ReportingFullKVCache)
    _edit(shapes, "full", 2)
    stores: list[list[str]] = []
    end_call = CompressingKVCache.end_call

    def kinds(self, call):
        if call.phase == "prefill" and call.image is not None and self.branch == "gen":
            stores.append([type(s).__name__ for s in self.layers[-1].stores if s.token_type in CANDIDATE_TYPES])
        end_call(self, call)

    monkeypatch.setattr(CompressingKVCache, "end_call", kinds)
    uc_seen = _record_prefill(monkeypatch, CompressingKVCache)
    result = _edit(shapes, "unicache", 2)
    assert [s[:2] for s in full_seen] == [s[:2] for s in uc_seen]
    images = [i for i, (_, image, _) in enumerate(uc_seen) if image is not None]
    assert len(images) == 4  # each image's VAE and ViT block
    for i in images:  # after each image block: every image row quantized, held at about a fifth of full KV's
        assert uc_seen[i][2] < 0.3 * full_seen[i][2], (i, uc_seen[i], full_seen[i])
    assert all(kind == "QuantizedStore" for block in stores for kind in block)
    assert len(stores) == 4 and all(stores)
    for step in result.kv_report["steps"]:
        assert step["held_bytes"] <= uc_seen[-1][2] * 1.0001 or step["step"] == 0
    assert not result.kv_report["summary"]["flags"]


def test_the_prefill_peak_falls_by_what_the_quantized_rows_save(shapes, monkeypatch):
    """Tensor accounting of every LLM prefill call (the VAE encode's activations, which dominate this small model's
    prefill phase, are left out): the peak inside a call is the KV held plus the call's own activations, the same for
    both methods, so the peaks differ by what the caches hold."""
    peaks: dict[str, list[int]] = {}
    held: dict[str, list[int]] = {}
    for method in ("full", "unicache"):
        cls = ReportingFullKVCache if method == "full" else CompressingKVCache
        tracker = TensorMemoryTracker()
        calls: list[int] = []
        with monkeypatch.context() as m:
            seen = _record_prefill(m, cls)
            begin_call, end_call = cls.begin_call, cls.end_call

            def begin(self, call, begin_call=begin_call, tracker=tracker):
                if call.phase == "prefill":
                    tracker.reset_peak()
                begin_call(self, call)

            def end(self, call, end_call=end_call, tracker=tracker, calls=calls):
                end_call(self, call)
                if call.phase == "prefill":
                    calls.append(tracker.peak_bytes)

            m.setattr(cls, "begin_call", begin)
            m.setattr(cls, "end_call", end)
            with tracker:
                _edit(shapes, method, 2)
        peaks[method], held[method] = calls, [s[2] for s in seen]
    assert len(peaks["full"]) == len(peaks["unicache"]) == 6  # gen: 2 x (VAE, ViT) + text; cfg_img: text
    saved = held["full"][-2] - held["unicache"][-2]  # after the last image, before the instruction
    assert saved > 0.7 * held["full"][-2]
    # the instruction's prefill of gen runs with both images held: its peak falls by at least about what they save, and
    # by less than that plus full KV's own transient of the call (its chunks joined into one copy of the layer, which
    # the compressed stores, each read where it is, never make)
    fall = peaks["full"][-2] - peaks["unicache"][-2]
    assert 0.9 * saved < fall < saved + held["full"][-2] / 4, (peaks, held)
    assert max(peaks["unicache"]) < max(peaks["full"]) - 0.9 * saved


def test_a_byte_target_is_not_applied_before_the_context_is_filled(shapes, monkeypatch):
    pipe = BagelPipeline(
        shapes, make_cache_factory("unicache", checkpoint_dir=str(BUNDLED_CHECKPOINT_DIR), kv_target=200_000)
    )
    kinds: list[type] = []
    end_call = CompressingKVCache.end_call

    def record(self, call):
        end_call(self, call)
        if call.phase == "prefill" and self.branch == "gen":
            kinds.extend(type(s) for s in self.layers[0].stores if s.token_type in CANDIDATE_TYPES)

    monkeypatch.setattr(CompressingKVCache, "end_call", record)
    result = pipe.generate("edit", [_image(3, (128, 128)), "make it red"], preset("edit", num_timesteps=3), seed=1)
    assert kinds and all(k is FullStore for k in kinds)
    assert any(s["branches"]["gen"]["managed_bytes"] < 200_000 for s in result.kv_report["steps"])


@pytest.mark.parametrize(("table", "objective"), [("calibrated", "speed"), ("paper", "memory"), ("paper", "speed")])
def test_understanding_stores_image_i_compressed_before_image_i_plus_one(shapes, monkeypatch, table, objective):
    """Each image's ViT rows are compressed as written: when image 1's block begins, image 0's rows already are. With
    the calibrated table the ViT rows are a type it quantizes; with the paper's (BAGEL-7B-MoT's) a type it evicts:
    under the ``memory`` objective stored at the target's setting too until the question's scores say what its budget
    keeps, under ``speed`` evicted to the full-precision rows 0.2 of their bytes hold, by their own block's scores."""
    at_begin: list[tuple[int | None, list[str]]] = []
    bits: list[int] = []
    rows: list[float] = []  # each image store's rows per head, a share of its segment's
    begin_call = CompressingKVCache.begin_call

    def record(self, call):
        if call.phase == "prefill" and call.update:
            held = [s for s in self.layers[-1].stores if s.image is not None]
            at_begin.append((call.image, [type(s).__name__ for s in held]))
            bits.extend(getattr(s, "bits", 16) for s in held)
            full = self.segment_rows(len(self.layers) - 1)
            rows.extend(s.num_tokens / full[key_of(s)] for s in held)
        begin_call(self, call)

    monkeypatch.setattr(CompressingKVCache, "begin_call", record)
    policy = {"policy": paper_table_for(BUNDLED_CHECKPOINT_DIR)} if table == "paper" else {}
    factory = make_cache_factory("unicache", checkpoint_dir=str(BUNDLED_CHECKPOINT_DIR), objective=objective, **policy)
    items = [_image(20, (96, 96)), _image(21, (96, 96)), "where is the red circle?"]
    result = BagelPipeline(shapes, factory).understand_items(items, preset("understanding", max_new_tokens=2))
    stored = "EvictedStore" if (table, objective) == ("paper", "speed") else "QuantizedStore"
    images = [stores for image, stores in at_begin if image == 1]
    assert images and images[0] and all(kind == stored for kind in images[0])  # image 0's, compressed
    assert at_begin[-1][0] is None and len(at_begin[-1][1]) == 2  # the question: both images' rows held, compressed
    assert all(kind == stored for kind in at_begin[-1][1]) and not result.kv_report["summary"]["flags"]
    vit = result.kv_report["summary"]["images"]["0"]["types"]["source_vit"]
    if stored == "EvictedStore":  # full-precision rows, a fifth of them less their row index
        assert set(bits) == {16} and 0.15 < min(rows) <= max(rows) < 0.2
    else:  # written at the target's setting (0.2 of fp32: 4 bits); the evicted type's budget then takes its rows to
        # fewer bits or fewer rows, the quantized type's to fewer bits
        assert set(bits) == {4}
    if table == "paper":
        assert 0 < vit["held_bytes"] <= 0.2 * vit["full_bytes"]
