"""LOOK-M (docs/compression.md §14) against its dense reference (tests/oracles/lookm.py), what its merges keep of
the evicted rows, and the method on every task of the tiny and the bundled shapes models at equal bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from oracles import ScoreInputs
from oracles.lookm import LOOKMPolicy
from PIL import Image

from unicache_core.bagel import BagelPipeline, load_bagel, preset
from unicache_core.compression import make_cache_factory, method_from_name
from unicache_core.compression.merging import merge_rows
from unicache_core.kv.attention import attention_with_lse
from unicache_core.kv.cache import AttentionCall, RequestInfo, StepInfo
from unicache_core.kv.token_types import CANDIDATE_TYPES
from unicache_core.kv.token_types import TokenType as TT

HKV, GROUP, D = 2, 2, 16
SHAPES = Path(__file__).resolve().parents[1] / "models" / "bagel" / "unicache-shapes"


def _types(n_image: int, n_text: int, text_first: bool = False) -> torch.Tensor:
    images = [(TT.BOUNDARY, 1), (TT.SOURCE_VAE, n_image), (TT.BOUNDARY, 2), (TT.SOURCE_VIT, n_image)]
    text = [(TT.BOUNDARY, 2), (TT.INSTRUCTION, n_text), (TT.BOUNDARY, 1)]
    runs = text + images if text_first else images + text
    return torch.cat([torch.full((n,), int(t), dtype=torch.int8) for t, n in runs])


class _Prompt:
    """An edit request's ``gen`` branch: one prefill call over the whole context, then one denoising call."""

    def __init__(self, num_layers: int, causal: bool, seed: int = 0, text_first: bool = False, **settings):
        self.types = _types(60, 12, text_first)
        t = self.types.shape[0]
        gen = torch.Generator().manual_seed(seed)
        self.keys = [torch.randn(t, HKV, D, generator=gen) * 1.5 for _ in range(num_layers)]
        self.values = [torch.randn(t, HKV, D, generator=gen) for _ in range(num_layers)]
        self.queries = [torch.randn(t, HKV * GROUP, D, generator=gen) for _ in range(num_layers)]
        session = make_cache_factory("lookm", **settings).start(
            RequestInfo(task="edit", num_layers=num_layers, num_steps=4)
        )
        self.cache = session.new_cache("gen")
        call = AttentionCall(token_types=self.types, rope_positions=torch.arange(t), causal=causal, update=True)
        self.cache.begin_call(call)
        for layer in range(num_layers):
            self.cache.attend(layer, self.queries[layer], self.keys[layer], self.values[layer], call)
        self.cache.end_call(call)
        self.candidates = torch.nonzero(torch.isin(self.types.long(), torch.tensor([int(c) for c in CANDIDATE_TYPES])))
        self.candidates = self.candidates.squeeze(1)
        self.held_after_prefill = [self.kinds(layer) for layer in range(num_layers)]
        session.begin_step(StepInfo("denoise", 0, 4, ("gen",)))
        latent = AttentionCall(
            token_types=torch.full((8,), int(TT.CURRENT_LATENT), dtype=torch.int8),
            rope_positions=torch.zeros(8, dtype=torch.long),
            causal=False,
            update=False,
            phase="denoise",
            step=0,
        )
        self.cache.begin_call(latent)
        self.compressed_before_step = [self.kinds(layer) for layer in range(num_layers)]
        for layer in range(num_layers):
            q = torch.randn(8, HKV * GROUP, D, generator=gen)
            self.cache.attend(layer, q, torch.randn(8, HKV, D, generator=gen), torch.randn(8, HKV, D), latent)
        self.cache.end_call(latent)

    def kinds(self, layer: int) -> set[str]:
        """The kinds of the layer's candidate stores."""
        return {s.kind for s in self.cache.layer(layer).stores if s.token_type in (*CANDIDATE_TYPES, TT.UNKNOWN)}

    def store(self, layer: int):
        """The one store the eviction pooled the layer's candidate rows into."""
        [store] = [s for s in self.cache.layer(layer).stores if s.token_type == TT.UNKNOWN]
        return store


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("merge", ["pivot", "average", "weighted", "none"])
def test_lookm_keeps_and_merges_the_rows_of_its_oracle(merge, causal):
    run = _Prompt(num_layers=2, causal=causal, kv_target=0.3, merge=merge)
    policy = LOOKMPolicy(merge=merge)
    text = (run.types[run.candidates] == int(TT.INSTRUCTION)).tolist()
    for layer in range(2):
        store = run.store(layer)
        assert store.kind == "evicted" and store.num_tokens < run.candidates.numel()
        # the prompt's attention over the whole context (boundary rows included), restricted to the candidates
        inputs = ScoreInputs(keys=run.keys[layer], queries=run.queries[layer])
        scores = policy.prompt_scores(inputs, causal=causal)[run.candidates]
        kept = policy.select(scores, torch.tensor(text), store.num_tokens)
        assert torch.equal(store.keep_idx.long(), run.candidates[kept])
        keys, values = policy.merged(run.keys[layer][run.candidates], run.values[layer][run.candidates], kept)
        assert torch.allclose(store.keys.double(), keys, atol=1e-5)
        assert torch.allclose(store.values.double(), values, atol=1e-5)
        if merge != "none":  # the merge changed what the kept rows hold
            plain = torch.stack([run.keys[layer][run.candidates[kept[h]], h] for h in range(HKV)])  # [Hkv, k, d]
            assert not torch.allclose(store.keys, plain, atol=1e-3)


def test_lookm_compresses_at_the_end_of_the_prefill_before_anything_reads_it():
    run = _Prompt(num_layers=1, causal=True, kv_target=0.25)
    assert run.held_after_prefill == [{"full"}] and run.compressed_before_step == [{"evicted"}]


def test_text_rows_are_kept_before_any_image_row():
    run = _Prompt(num_layers=2, causal=False, seed=3, text_first=True, kv_target=0.3)
    text = {int(i) for i in torch.nonzero(run.types == int(TT.INSTRUCTION)).squeeze(1)}
    for layer in range(2):
        store = run.store(layer)
        for head in range(HKV):
            assert text <= set(store.keep_idx[head].tolist())  # 12 text rows fit in 0.3 x 132 rows
    # without the prior the same budget keeps only some of them: they are not in the recent window here
    plain = _Prompt(num_layers=2, causal=False, seed=3, text_first=True, kv_target=0.3, prefer_text=False)
    assert any(not text <= set(plain.store(layer).keep_idx[h].tolist()) for layer in range(2) for h in range(HKV))


def test_merging_duplicate_keys_keeps_what_the_evicted_rows_gave_attention():
    """Rows whose keys coincide are one row to attention: merged by averaging, their values give the full cache's
    output exactly, where eviction keeps one row's value; the pivotal merge lies between the two, and the weighted
    merge (which merges only the rows at least as similar as the mean, a rounding-level cut here) beats eviction."""
    gen = torch.Generator().manual_seed(11)
    clusters, size = 6, 4
    centres = torch.randn(clusters, HKV, D, generator=gen) * 2
    keys = centres.repeat_interleave(size, dim=0)  # [24, Hkv, d]: each key four times
    values = torch.randn(clusters * size, HKV, D, generator=gen)
    kept = torch.arange(clusters).mul(size).add(size - 1).unsqueeze(0).expand(HKV, -1)  # one row of each cluster
    q = torch.randn(32, HKV * GROUP, D, generator=gen)
    full, _ = attention_with_lse(q, keys, values)
    errors = {}
    for rule in ("none", "pivot", "average", "weighted"):
        k, v = merge_rows(keys.transpose(0, 1), values.transpose(0, 1), kept, rule)
        out, _ = attention_with_lse(q, k.transpose(0, 1), v.transpose(0, 1))
        errors[rule] = float((out - full).norm() / full.norm())
    assert errors["average"] < 1e-5 and errors["none"] > 0.1
    assert errors["average"] < errors["pivot"] < errors["none"] and errors["weighted"] < errors["none"]


def test_a_bad_setting_is_one_clear_error():
    with pytest.raises(ValueError, match="`merge` must be one of none, average, pivot, weighted"):
        method_from_name("lookm", merge="mean")
    with pytest.raises(ValueError, match="recent_fraction"):
        method_from_name("lookm", recent_fraction=1.5)


@pytest.fixture(scope="module")
def source():
    return Image.fromarray(np.random.default_rng(7).integers(0, 255, (48, 64, 3), dtype=np.uint8))


def _tasks(pipe, source, size):
    edit = pipe.edit("make the square blue", source, preset("edit", num_timesteps=3), seed=3)
    t2i = pipe.text_to_image("a red circle", preset("t2i", width=size, height=size, num_timesteps=3), seed=1)
    und = pipe.understand("What colour is the square?", source, preset("understanding", max_new_tokens=3))
    return {"edit": edit, "t2i": t2i, "understanding": und}


@pytest.mark.parametrize("model", ["tiny", "shapes"])
def test_lookm_runs_every_task_at_the_bytes_of_an_eviction_baseline(model, tiny_checkpoint, source):
    checkpoint = tiny_checkpoint if model == "tiny" else SHAPES
    loaded = load_bagel(checkpoint, dtype=torch.float32)
    size = 32 if model == "tiny" else 64
    results = {}
    for method in ("lookm", "h2o"):
        pipe = BagelPipeline(loaded, make_cache_factory(method, checkpoint_dir=str(checkpoint), kv_target=0.25))
        results[method] = _tasks(pipe, source, size)
    for task, result in results["lookm"].items():
        report = result.kv_report
        summary = report["summary"]
        assert report["method"] == "lookm" and summary["within_budget"], (task, summary)
        assert summary["steady_managed_bytes"] == results["h2o"][task].kv_report["summary"]["steady_managed_bytes"]
        first = report["steps"][0]["branches"]  # the first step already reads the compressed prompt
        assert sum(b["managed_bytes"] for b in first.values()) < sum(b["full_managed_bytes"] for b in first.values())
        for step in report["steps"]:
            for record in step["branches"].values():
                assert record["managed_bytes"] <= record["full_managed_bytes"]
    assert results["lookm"]["edit"].image.size == results["h2o"]["edit"].image.size
