"""UniCache's pooled quantization (docs/compression.md §11.7) on the bundled model: when a layer's budget cannot
hold its quantized types in stores of their own at 2 bits, they share one store and keep every row, where
separate stores would drop rows (a short question: all of them); with room for 4 bits they stay typed; the
pool is decided once and its attention mass stays with its types."""

from __future__ import annotations

import pytest
import torch

from unicache_core.bagel import BagelPipeline, load_bagel, preset
from unicache_core.bagel.settings import BUNDLED_CHECKPOINT_DIR
from unicache_core.compression import make_cache_factory, session
from unicache_core.compression.defaults import KIVI_GROUPS
from unicache_core.compression.family import FULL_BITS, JointChoice, Segment
from unicache_core.kv.token_types import PROTECTED_TYPES
from unicache_core.kv.token_types import TokenType as TT
from unicache_core.shapes import edit_sample
from unicache_core.shapes.world import understanding_sample

CANDIDATES = (TT.INSTRUCTION, TT.SOURCE_VIT, TT.SOURCE_VAE)


@pytest.fixture(scope="module")
def bundled():
    return load_bagel(BUNDLED_CHECKPOINT_DIR, dtype=torch.float32)


@pytest.fixture
def caches(monkeypatch):
    """Every branch cache the next requests create (new and forked), in creation order."""
    made = []
    new_cache, fork = session.CompressionSession.new_cache, session.CompressionSession.fork

    def spy_new(self, branch):
        made.append(new_cache(self, branch))
        return made[-1]

    def spy_fork(self, parent, branch):
        made.append(fork(self, parent, branch))
        return made[-1]

    monkeypatch.setattr(session.CompressionSession, "new_cache", spy_new)
    monkeypatch.setattr(session.CompressionSession, "fork", spy_fork)
    return made


def _understand(bundled, **settings):
    factory = make_cache_factory("unicache", checkpoint_dir=str(BUNDLED_CHECKPOINT_DIR), **settings)
    scene, q = understanding_sample(3)
    return BagelPipeline(bundled, factory).understand(
        q.question, scene.render(), preset("understanding", max_new_tokens=4)
    )


def _store_bytes(cache, layer: int, rows: int, bits: int = 2) -> int:
    """Bytes of ``rows`` rows at ``bits``, largest group, no residual, in one store of this layer."""
    h, d, dtype = cache.layer(layer).geometry
    segment = Segment(
        full_rows=rows,
        held_rows=rows,
        held_bits=FULL_BITS,
        held_bytes=0,
        shared_rows=True,
        num_kv_heads=h,
        head_dim=d,
        elem=dtype.itemsize,
    )
    return segment.choice_bytes(JointChoice(rows, bits, max(KIVI_GROUPS), 0))


def test_a_budget_under_the_separate_floors_pools_the_types_and_keeps_every_row(bundled, caches):
    result = _understand(bundled, kv_target=0.1)
    (cache,) = caches
    for layer in range(cache.num_layers):
        rows = {t: n for t, n in cache.type_rows(layer).items() if t in CANDIDATES}
        assert len(rows) == 2  # the question and the image's ViT rows, both quantized by the calibrated table
        budget = sum(cache.state[layer].budgets.values())  # with what earlier layers left
        pooled = _store_bytes(cache, layer, sum(rows.values()))
        assert pooled <= budget < _store_bytes(cache, layer, sum(rows.values()), bits=4), (layer, pooled, budget)
        if layer == 0:  # nothing carried in: not even the floors of stores of their own fit
            assert budget < sum(_store_bytes(cache, layer, n) for n in rows.values())
        managed = [s for s in cache.layer(layer).stores if s.token_type not in PROTECTED_TYPES]
        assert len(managed) == 1 and managed[0].token_type == TT.UNKNOWN and managed[0].kind == "quantized"
        assert managed[0].bits == 2 and managed[0].num_tokens == sum(rows.values())  # no row dropped
        assert managed[0].nbytes() <= budget
        assert set(cache.state[layer].pooled) == set(rows) and sum(cache.state[layer].pooled.values()) == pytest.approx(
            1.0
        )
    summary = result.kv_report["summary"]
    assert summary["achieved_ratio"] <= 0.1 and not summary.get("flags"), summary


def test_a_budget_with_room_for_four_bits_keeps_the_types_apart(bundled, caches):
    _understand(bundled, kv_target=0.3)
    (cache,) = caches
    for layer in range(cache.num_layers):
        types = {s.token_type for s in cache.layer(layer).stores if s.kind != "full"}
        assert TT.UNKNOWN not in types and {TT.INSTRUCTION, TT.SOURCE_VIT} <= types, (layer, types)
        assert not cache.state[layer].pooled


def test_the_pool_is_decided_once_and_its_mass_stays_with_its_types(bundled, caches):
    """The paper's schedule (rho 0.5 down to 0.1): pooled at the first compression for the floor's budget, so
    later re-allocations shrink one store; the types' masses keep coming from the pooled store."""
    edit = edit_sample(5)
    factory = make_cache_factory("unicache", checkpoint_dir=str(BUNDLED_CHECKPOINT_DIR), rho=0.5, rho_floor=0.1)
    report = (
        BagelPipeline(bundled, factory)
        .edit(edit.instruction, edit.source.render(), preset("edit", num_timesteps=13), seed=5)
        .kv_report
    )
    gen = next(c for c in caches if c.branch == "gen")
    assert gen.request_state.branch("gen").compressions >= 2  # re-allocated after the first compression
    rhos = [s["branches"]["gen"]["rho"] for s in report["steps"] if "gen" in s["branches"]]
    assert rhos[-1] < rhos[0] and rhos[-1] > 0.1 - 1e-9
    cfg_text = next(c for c in caches if c.branch == "cfg_text")
    for layer in range(gen.num_layers):
        ls = gen.state[layer]
        # the image's types, which gen shares with cfg_text, pool apart from gen's own instruction (§13)
        assert set(ls.pooled) == {TT.SOURCE_VIT, TT.SOURCE_VAE}
        managed = [s for s in gen.layer(layer).stores if s.token_type not in PROTECTED_TYPES]
        assert [s.token_type for s in managed] == [TT.UNKNOWN, TT.INSTRUCTION]
        shared = [s for s in cfg_text.layer(layer).stores if s.token_type not in PROTECTED_TYPES]
        assert len(shared) == 1 and shared[0].qkeys.packed.data_ptr() == managed[0].qkeys.packed.data_ptr()
        assert TT.UNKNOWN not in ls.masses and all(ls.masses.get(t, 0.0) > 0 for t in ls.pooled), ls.masses
    chunk_masses = gen.request_state.stats.cell_masses(1, 2, list(CANDIDATES), branch="gen")
    assert chunk_masses is not None and all(m > 0 for m in chunk_masses.values()), chunk_masses
    assert not report["summary"].get("flags")


def test_a_fork_keeps_its_parents_pool(bundled, caches):
    _understand(bundled, kv_target=0.1)
    (cache,) = caches
    clone = cache.clone(branch="other")
    assert all(clone.state[layer].pooled == cache.state[layer].pooled for layer in range(cache.num_layers))
    assert all(clone.state[layer].pooled for layer in range(cache.num_layers))
    clone.state[0].pooled.clear()
    assert cache.state[0].pooled  # the copy is its own


def test_a_branch_under_its_floor_is_paid_for_by_the_others(bundled, caches):
    """An edit at 10%: the image-free CFG branch holds only the instruction, whose 2-bit floor is above that
    branch's own budget; the other branches' bytes above their floors pay for it, so it keeps every row in
    every layer and the request stays within its budget (docs/compression.md §11.8)."""
    edit = edit_sample(5)
    factory = make_cache_factory("unicache", checkpoint_dir=str(BUNDLED_CHECKPOINT_DIR), kv_target=0.1)
    report = (
        BagelPipeline(bundled, factory)
        .edit(edit.instruction, edit.source.render(), preset("edit", num_timesteps=6), seed=5)
        .kv_report
    )
    branches = {c.branch: c for c in caches}
    cfg_img = branches["cfg_img"]
    for layer in range(cfg_img.num_layers):
        rows = cfg_img.type_rows(layer)[TT.INSTRUCTION]
        own_budget = int(0.1 * rows * cfg_img.row_bytes(layer))
        (store,) = [s for s in cfg_img.layer(layer).stores if s.token_type == TT.INSTRUCTION]
        assert store.kind == "quantized" and store.bits == 2 and store.num_tokens == rows
        assert (
            store.nbytes() > own_budget and cfg_img.request_state.grant("cfg_img", layer) >= store.nbytes() - own_budget
        )
    grants = [c.request_state.grant(c.branch, layer) for c in branches.values() for layer in range(c.num_layers)]
    assert sum(grants) <= 0 and min(grants) < 0  # given = taken (rounding keeps the rest)
    summary = report["summary"]
    assert summary["achieved_ratio"] <= 0.1 and summary["within_budget"] and not summary.get("flags"), summary
