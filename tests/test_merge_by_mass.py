"""UniCache's merge of the rows it drops into the rows it keeps, each weighted by its attention mass
(docs/compression.md §11.17): the rule itself, its bounded pivot search, the quantized store it feeds, and the method's
default."""

from __future__ import annotations

import pytest
import torch

from unicache_core.compression import merging, method_from_name
from unicache_core.compression.family import JointChoice
from unicache_core.compression.merging import merge_rows, pivots
from unicache_core.compression.methods.unicache import UniCache
from unicache_core.compression.ops import compress_rows
from unicache_core.kv.attention import attention_with_lse
from unicache_core.kv.quantized_store import QuantizedStore
from unicache_core.kv.segmented_cache import SegmentedLayer
from unicache_core.kv.token_types import TokenType as TT

H, D = 2, 16


def test_a_kept_row_becomes_the_mass_weighted_mean_of_its_group():
    # two kept rows (0, 3), two dropped rows nearest each: 1 and 2 near row 0, 4 near row 3
    keys = torch.tensor([[1.0, 0], [0.9, 0.1], [1.0, 0.05], [0, 1.0], [0.1, 0.9]]).expand(H, -1, -1).contiguous()
    values = torch.arange(10.0).reshape(5, 2).expand(H, -1, -1).contiguous()
    kept = torch.tensor([[0, 3]] * H)
    mass = torch.tensor([[2.0, 1.0, 0.0, 1.0, 3.0], [1.0, 1.0, 1.0, 0.0, 0.0]])
    k, v = merge_rows(keys, values, kept, "mass", mass)
    # head 0: row 0 <- (2 v0 + 1 v1 + 0 v2) / 3, row 3 <- (1 v3 + 3 v4) / 4
    assert torch.allclose(v[0, 0], (2 * values[0, 0] + values[0, 1]) / 3)
    assert torch.allclose(v[0, 1], (values[0, 3] + 3 * values[0, 4]) / 4)
    assert torch.allclose(k[0, 1], (keys[0, 3] + 3 * keys[0, 4]) / 4)
    # head 1: row 0 <- the plain mean of 0, 1, 2; row 3 and its dropped row drew no mass: row 3 stays as it was
    assert torch.allclose(v[1, 0], values[1, :3].mean(0)) and torch.equal(v[1, 1], values[1, 3])
    assert torch.equal(k[1, 1], keys[1, 3])
    # NaN or negative mass counts as none: the same as zero
    nan = mass.clone()
    nan[0, 2], nan[1, 3] = float("nan"), -5.0
    assert all(torch.equal(a, b) for a, b in zip(merge_rows(keys, values, kept, "mass", nan), (k, v)))


def test_the_mass_merge_needs_the_mass():
    keys = torch.randn(H, 6, D)
    with pytest.raises(ValueError, match="pass `mass`"):
        merge_rows(keys, keys, torch.tensor([[0, 1]] * H), "mass")


def test_weighting_by_the_attention_drawn_beats_averaging_and_dropping():
    """Clusters of nearby keys whose rows the queries attend unequally: the kept row of each cluster, merged with
    weights equal to the attention each row drew, gives attention outputs nearer the full cache's than LOOK-M's
    plain average and than dropping."""
    gen = torch.Generator().manual_seed(5)
    clusters, size, group = 8, 5, 2
    centres = torch.randn(clusters, H, D, generator=gen) * 2.5
    keys = centres.repeat_interleave(size, dim=0) + 0.35 * torch.randn(clusters * size, H, D, generator=gen)
    values = torch.randn(clusters * size, H, D, generator=gen)
    q = torch.randn(24, H * group, D, generator=gen) * 1.5
    full, _ = attention_with_lse(q, keys, values)
    # the mass each row drew: softmax probabilities summed over the queries and the query heads of its KV head
    logits = torch.einsum("qhd,thd->hqt", q, keys.repeat_interleave(group, dim=1)) / D**0.5
    mass = logits.softmax(-1).sum(1).reshape(H, group, -1).sum(1)  # [Hkv, T]
    kept = torch.stack([torch.stack([mass[h, c * size : (c + 1) * size].argmax() + c * size for c in range(clusters)]) for h in range(H)])  # fmt: skip  # noqa: E501
    errors = {}
    for rule in ("none", "average", "mass"):
        k, v = merge_rows(keys.transpose(0, 1), values.transpose(0, 1), kept, rule, mass)
        out, _ = attention_with_lse(q, k.transpose(0, 1), v.transpose(0, 1))
        errors[rule] = float((out - full).norm() / full.norm())
    assert errors["mass"] < errors["average"] < errors["none"]


def test_the_pivot_search_is_bounded_and_finds_the_same_pivots(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    dropped, kept = torch.randn(H, 300, D, generator=gen), torch.randn(H, 40, D, generator=gen)
    whole = pivots(dropped, kept)
    monkeypatch.setattr(merging, "PIVOT_ELEMENTS", 7 * H * 40)  # seven dropped rows per chunk
    calls = []
    real_einsum = torch.einsum
    monkeypatch.setattr(torch, "einsum", lambda *a: calls.append(a[1].shape[1]) or real_einsum(*a))
    bounded = pivots(dropped, kept)
    assert max(calls) == 7 and len(calls) == -(-300 // 7)
    assert torch.equal(bounded[0], whole[0]) and torch.allclose(bounded[1], whole[1])


def test_rows_dropped_before_quantizing_are_merged_into_the_kept_ones_for_the_same_bytes():
    gen = torch.Generator().manual_seed(0)
    t = 96
    k, v = torch.randn(t, H, D, generator=gen), torch.randn(t, H, D, generator=gen)
    scores = torch.rand(t, H, generator=gen)

    def store(merge: str) -> QuantizedStore:
        layer = SegmentedLayer()
        layer.append(k, v, torch.full((t,), int(TT.SOURCE_VIT), dtype=torch.int8))
        out = compress_rows(layer, [0], JointChoice(40, 4, 16, 0), scores, merge=merge)
        assert isinstance(out, QuantizedStore)
        return out

    plain, merged = store("none"), store("mass")
    assert merged.nbytes() == plain.nbytes() and torch.equal(merged.token_index, plain.token_index)
    kept = plain.token_index.long()  # [Hkv, 40], each head's best-scored rows
    want_k, want_v = merge_rows(k.transpose(0, 1), v.transpose(0, 1), kept, "mass", scores.t())
    got_k, got_v = (x.transpose(0, 1) for x in merged.dequantize())
    plain_k, plain_v = (x.transpose(0, 1) for x in plain.dequantize())
    # the merged store holds the merged rows, to 4-bit rounding, not the plain ones
    assert (got_v - want_v).abs().mean() < 0.5 * (plain_v - want_v).abs().mean()
    assert (got_k - want_k).abs().mean() < 0.5 * (plain_k - want_k).abs().mean()


def test_unicache_merges_by_mass_unless_told_otherwise():
    assert UniCache().merge == "mass"
    assert method_from_name("unicache").merge == "mass"
    assert method_from_name("unicache", merge="none").merge == "none"
    with pytest.raises(ValueError, match="`merge` must be one of none, average, pivot, weighted, mass, got 'sum'"):
        method_from_name("unicache", merge="sum")


def test_an_edit_merges_its_text_and_vit_rows_and_only_drops_its_vae_rows(monkeypatch):
    """Every change UniCache plans for a real edit at 5% on the bundled model: the instruction's and the ViT's stores
    merge what they drop, any store holding source-VAE rows (a place of the source's pixels) only drops."""
    from unicache_core.bagel import BagelPipeline, load_bagel, preset
    from unicache_core.bagel.settings import BUNDLED_CHECKPOINT_DIR
    from unicache_core.compression import make_cache_factory
    from unicache_core.compression.methods import unicache
    from unicache_core.shapes import edit_sample

    keeps = []
    real = unicache.plan_layers

    def record(view, chunks, settings):
        planned = real(view, chunks, settings)
        keeps.extend(keep for plan in planned.plans.values() for keep in plan.keeps)
        return planned

    monkeypatch.setattr(unicache, "plan_layers", record)
    edit = edit_sample(3)
    factory = make_cache_factory("unicache", checkpoint_dir=str(BUNDLED_CHECKPOINT_DIR), kv_target=0.05)
    model = load_bagel(BUNDLED_CHECKPOINT_DIR, dtype=torch.float32)
    BagelPipeline(model, factory).edit(edit.instruction, edit.source.render(), preset("edit", num_timesteps=3), seed=3)
    semantic = [k for k in keeps if {s.type for s in k.segments} <= {TT.INSTRUCTION, TT.SOURCE_VIT}]
    vae = [k for k in keeps if TT.SOURCE_VAE in {s.type for s in k.segments}]
    assert semantic and vae
    assert all(k.merge == "mass" for k in semantic) and all(k.merge == "none" for k in vae)
