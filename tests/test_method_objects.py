"""Methods are small frozen objects with a one-way plan: a new one is one file (tests/methods/knorm.py, a key-norm
press), registered by its class and usable by name everywhere a built-in method is; methods never change a cache
themselves, and their settings are checked where they are made."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.pipeline import BagelPipeline
from unicache_core.bagel.settings import preset
from unicache_core.compression import H2O, METHODS, SnapKV, UniCache, make_cache_factory, method_from_name
from unicache_core.kv.token_types import CANDIDATE_TYPES

KNORM = Path(__file__).parent / "methods" / "knorm.py"


@pytest.fixture
def knorm():
    """The key-norm press, registered while the test runs (it never leaks into other tests' method lists)."""
    sys.modules.pop("methods.knorm", None)
    module = importlib.import_module("methods.knorm")
    yield module.KeyNorm
    METHODS.pop("knorm", None)
    sys.modules.pop("methods.knorm", None)


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return load_bagel(tiny_checkpoint, dtype=torch.float32)


def test_a_new_eviction_method_is_one_short_file(knorm):
    assert len(KNORM.read_text().splitlines()) < 80
    assert METHODS["knorm"] is knorm and method_from_name("knorm", kv_target=0.3) == knorm(kv_target=0.3)
    assert list(METHODS)[:8] == ["full", "unicache", "h2o", "snapkv", "pyramidkv", "streamingllm", "kivi", "vlcache"]


def test_the_new_method_keeps_the_smallest_keys_within_its_bytes(knorm, loaded):
    pipe = BagelPipeline(loaded, make_cache_factory("knorm", kv_target=0.25))
    session = pipe.start_session("edit", 3)
    source = Image.new("RGB", (48, 32), (30, 120, 200))
    ctxs = pipe.build_generation_contexts("edit", "make it red", image=source, session=session)
    gen = ctxs.gen.cache
    # the keys as they are before the compression: the oracle ranks them itself
    before = []
    for layer in range(gen.num_layers):
        rows = {}
        for store in gen.layer(layer).stores:
            if store.token_type in CANDIDATE_TYPES:
                for i, index in enumerate(store.token_index.tolist()):
                    rows[index] = store.keys[i].float().norm(dim=-1)  # [Hkv]
        before.append(rows)
    session.compress(gen, None)
    for layer in range(gen.num_layers):
        (store,) = [s for s in gen.layer(layer).stores if s.kind == "evicted"]
        for head in range(store.num_kv_heads):
            norms = {index: float(n[head]) for index, n in before[layer].items()}
            kept = set(store.keep_idx[head].tolist())
            dropped = set(norms) - kept
            assert kept and dropped and max(norms[i] for i in kept) <= min(norms[i] for i in dropped)
    held, _ = gen.split_bytes()
    assert held <= 0.25 * gen.managed_full_bytes()
    result = pipe.edit("make it red", source, preset("edit", num_timesteps=3), seed=1)
    assert result.kv_report["method"] == "knorm" and result.kv_report["summary"]["within_budget"]


def test_methods_are_frozen_values_checked_where_they_are_made():
    method = SnapKV(window=16, kernel=3, kv_target="30%")
    assert method.kv_target == 0.3 and method.settings()["window"] == 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        method.window = 8  # type: ignore[misc]
    with pytest.raises(ValueError, match="`window` must be an integer >= 1"):
        SnapKV(window=0)
    with pytest.raises(ValueError, match="`recent_fraction` must be a number in"):
        H2O(recent_fraction=2.0)
    with pytest.raises(ValueError, match="`rho` applies to the unicache method only, not to 'snapkv'"):
        method_from_name("snapkv", rho=0.3)
    with pytest.raises(ValueError, match="`kernel` is not a setting of the kivi method"):
        method_from_name("kivi", kernel=3)
    assert UniCache(rho=0.3).settings()["rho"] == 0.3


def test_a_plan_is_computed_without_touching_the_cache(loaded):
    """``Method.plan`` reads a view and returns a plan; the cache changes only when it applies the plan."""
    pipe = BagelPipeline(loaded, make_cache_factory("h2o", kv_target=0.2))
    session = pipe.start_session("edit", 3)
    ctxs = pipe.build_generation_contexts("edit", "x", image=Image.new("RGB", (32, 32)), session=session)
    gen = ctxs.gen.cache
    for layer in range(gen.num_layers):
        gen.state[layer].scores = torch.rand(gen.layer(layer).appended_tokens, gen.layer(layer).geometry[0])
    stores = [list(gen.layer(i).stores) for i in range(gen.num_layers)]
    plan = session.method.plan(session.view(gen))
    assert all(list(gen.layer(i).stores) == stores[i] for i in range(gen.num_layers))  # nothing changed yet
    assert plan.layers and all(len(lp.keeps) == 1 for lp in plan.layers.values())
    gen.apply(plan)
    assert all(
        s.kind == "evicted"
        for i in range(gen.num_layers)
        for s in gen.layer(i).stores
        if s.token_type in CANDIDATE_TYPES
    )
