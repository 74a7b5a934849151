"""UniCache's pooled quantization (docs/compression.md §11.7) on the bundled model: when a layer's budget cannot
hold its quantized types in stores of their own at 2 bits, they share one store and keep every row, where
separate stores would drop rows (a short question: all of them); with room for more bits they share one where
apart would lose more by the mass-weighted error; the pool is decided once and its attention mass stays with its
types."""

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


def test_a_budget_with_room_for_four_bits_pools_where_apart_loses_more(bundled, caches):
    """At 30% the types apart would have room for 4 bits, but the question's few rows would keep fewer bits than one
    store gives every row (their groups' scales cost more per row): by the mass-weighted error of
    :func:`~unicache_core.compression.family.choice_error`, one store wins, at 8 bits, every row kept."""
    _understand(bundled, kv_target=0.3)
    (cache,) = caches
    for layer in range(cache.num_layers):
        rows = {t: n for t, n in cache.type_rows(layer).items() if t in CANDIDATES}
        managed = [s for s in cache.layer(layer).stores if s.token_type not in PROTECTED_TYPES]
        assert set(cache.state[layer].pooled) == set(rows)
        assert len(managed) == 1 and managed[0].bits == 8 and managed[0].num_tokens == sum(rows.values())


def test_the_pool_rule_weighs_each_types_error_by_its_mass():
    """choice_error: a row at b bits loses 4**-b, a dropped one all of it."""
    from unicache_core.compression.family import choice_error

    seg = Segment(full_rows=100, held_rows=100, held_bits=FULL_BITS, held_bytes=0, shared_rows=True,
                  num_kv_heads=2, head_dim=16, elem=4)  # fmt: skip
    assert choice_error(seg, JointChoice(100, 4, 32, 0)) == pytest.approx(4.0**-4)
    assert choice_error(seg, JointChoice(50, 2, 32, 0)) == pytest.approx(0.5 * 4.0**-2 + 0.5)
    assert choice_error(seg, JointChoice(100)) == 0.0
    # one type at 8 bits and one at 2 lose more than both at 4 unless the 2-bit one draws almost no attention
    assert 0.5 * 4.0**-8 + 0.5 * 4.0**-2 > 4.0**-4 > 0.99 * 4.0**-8 + 0.01 * 4.0**-2


def test_the_pool_is_decided_once_and_its_mass_stays_with_its_types(bundled, caches):
    """A schedule from rho 0.3 down to 0.05: pooled at the first compression for the floor's budget, so later
    re-allocations shrink one store; the types' masses keep coming from the pooled store."""
    edit = edit_sample(5)
    factory = make_cache_factory("unicache", checkpoint_dir=str(BUNDLED_CHECKPOINT_DIR), rho=0.3, rho_floor=0.05)
    report = (
        BagelPipeline(bundled, factory)
        .edit(edit.instruction, edit.source.render(), preset("edit", num_timesteps=13), seed=5)
        .kv_report
    )
    gen = next(c for c in caches if c.branch == "gen")
    assert gen.request_state.branch("gen").compressions >= 2  # re-allocated after the first compression
    rhos = [s["branches"]["gen"]["rho"] for s in report["steps"] if "gen" in s["branches"]]
    assert rhos[-1] < rhos[0] and rhos[-1] > 0.05 - 1e-9
    cfg_text = next(c for c in caches if c.branch == "cfg_text")
    pooled_layers = 0
    for layer in range(gen.num_layers):
        ls = gen.state[layer]
        # the image's types, which gen shares with cfg_text, pool apart from gen's own instruction (§13)
        assert set(ls.pooled) == {TT.SOURCE_VIT, TT.SOURCE_VAE}
        managed = [s for s in gen.layer(layer).stores if s.token_type not in PROTECTED_TYPES]
        assert managed[-1].token_type == TT.INSTRUCTION and len(managed) in (2, 3)
        images = managed[:-1]  # one pooled store, or where every budget held them as written (§13) their own stores
        assert [s.token_type for s in images] == [TT.UNKNOWN] or {s.token_type for s in images} == set(ls.pooled)
        pooled_layers += images[0].token_type == TT.UNKNOWN
        shared = [s for s in cfg_text.layer(layer).stores if s.token_type not in PROTECTED_TYPES]
        assert [s.qkeys.packed.data_ptr() for s in shared] == [s.qkeys.packed.data_ptr() for s in images]
        assert TT.UNKNOWN not in ls.masses and all(ls.masses.get(t, 0.0) > 0 for t in ls.pooled), ls.masses
    assert pooled_layers >= gen.num_layers // 2
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
    every layer and the request stays within its budget (docs/compression.md §11.8; what the others' plans leave
    comes to it too, §11.15)."""
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
        assert store.kind == "quantized" and store.num_tokens == rows  # at 2 bits or more (§11.15's pass-on)
        assert (
            store.nbytes() > own_budget and cfg_img.request_state.grant("cfg_img", layer) >= store.nbytes() - own_budget
        )
    grants = [c.request_state.grant(c.branch, layer) for c in branches.values() for layer in range(c.num_layers)]
    assert sum(grants) <= 0 and min(grants) < 0  # given = taken (rounding keeps the rest)
    summary = report["summary"]
    assert summary["achieved_ratio"] <= 0.1 and summary["within_budget"] and not summary.get("flags"), summary
