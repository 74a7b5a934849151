"""UniCache's byte allocation is pure (unicache_core/compression/unicache_allocation.py): at every compression of a
real edit on the bundled model, planning the layers twice from the same view, budget and settings gives the same
plans and leaves the view as it was; its inputs and results are named records and every policy kind a ``Kind``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from unicache_core.bagel import BagelPipeline, load_bagel, preset
from unicache_core.bagel.settings import BUNDLED_CHECKPOINT_DIR
from unicache_core.compression import make_cache_factory, unicache_allocation
from unicache_core.compression.methods import unicache
from unicache_core.compression.routing import Kind
from unicache_core.kv.token_types import CANDIDATE_TYPES
from unicache_core.shapes import edit_sample


@pytest.fixture(scope="module")
def bundled():
    return load_bagel(BUNDLED_CHECKPOINT_DIR, dtype=torch.float32)


def _plain(plans):
    """The plans without their score tensors (the same tensor objects both times: compared by identity)."""
    return {
        index: (
            [
                (k.segments, k.rows, k.bits, k.group, k.residual, k.recent, k.expected_bytes, id(k.scores))
                for k in p.keeps
            ],
            dict(p.budgets or {}),
            dict(p.flags),
            dict(p.pooled),
        )
        for index, p in plans.items()
    }


def _layers_seen(view):
    layers = [view.layer(i) for i in range(view.num_layers)]
    return [(dict(layer.segment_rows), dict(layer.pooled), layer.held_bytes(layer.segment_rows)) for layer in layers]


def test_the_allocation_is_a_pure_function_of_view_budget_and_settings(bundled, monkeypatch):
    real = unicache_allocation.plan_layers
    calls = []

    def twice(view, chunks, settings):
        before = _layers_seen(view)
        first = real(view, chunks, settings)
        second = real(view, chunks, settings)
        assert _plain(first.plans) == _plain(second.plans) and first.unused == second.unused
        assert _layers_seen(view) == before  # planning wrote nothing the view shows
        calls.append((chunks, settings, first))
        return first

    monkeypatch.setattr(unicache, "plan_layers", twice)
    edit = edit_sample(5)
    factory = make_cache_factory("unicache", checkpoint_dir=str(BUNDLED_CHECKPOINT_DIR), rho=0.3, rho_floor=0.05)
    BagelPipeline(bundled, factory).edit(
        edit.instruction, edit.source.render(), preset("edit", num_timesteps=5), seed=5
    )
    assert len(calls) >= 2  # the first compression and at least one re-allocation
    for chunks, settings, plans in calls:
        assert dataclasses.is_dataclass(settings)
        with pytest.raises(dataclasses.FrozenInstanceError):
            settings.recent_fraction = 0.5  # type: ignore[misc]
        assert all(isinstance(c, unicache_allocation.ChunkBudget) for c in chunks)  # none: the rows are gen's
        for chunk in chunks:
            assert set(chunk.caps) <= set(CANDIDATE_TYPES) and chunk.floor <= chunk.rho
            assert all(isinstance(settings.table.kind("edit", t), Kind) for t in chunk.caps)
        assert set(plans.plans) == {i for chunk in chunks for i in chunk.layers}
    assert any(p.keeps for _, _, plans in calls for p in plans.plans.values())
    assert any(chunks for chunks, _, _ in calls)  # some compression shrank something
