"""The reference eviction policies (tests/oracles) and the library's budget functions: exact budgets, valid
indices, per-KV-head GQA selection and each method's rule."""

from __future__ import annotations

import math

import pytest
import torch
from oracles import (
    H2OPolicy,
    PyramidKVPolicy,
    ScoreInputs,
    SnapKVPolicy,
    StreamingLLMPolicy,
    VLCachePolicy,
    attention_probabilities,
    budget_from_ratio,
    layer_sparsity,
)

from unicache_core.compression.methods.pyramidkv import pyramid_layer_budgets
from unicache_core.compression.methods.vlcache import vlcache_layer_budgets

POLICIES = [
    (H2OPolicy, {}),
    (H2OPolicy, {"heavy_ratio": 0.375, "recent_ratio": 0.125}),
    (SnapKVPolicy, {"window_size": 4}),
    (SnapKVPolicy, {"window_size": 4, "queries_in_keys": False, "pooling": "maxpool"}),
    (PyramidKVPolicy, {"window_size": 4, "keep_ratio": 0.3}),
    (StreamingLLMPolicy, {}),
    (VLCachePolicy, {}),
    (VLCachePolicy, {"queries_in_keys": False}),
]


def _inputs(t=40, hkv=2, g=3, tq=6, d=8, seed=0, **kw) -> ScoreInputs:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(t, hkv, d, generator=gen)
    queries = torch.randn(tq, hkv * g, d, generator=gen)
    return ScoreInputs(keys=keys, queries=queries, **kw)


def _ids(policy) -> str:
    return type(policy).__name__


@pytest.mark.parametrize("cls,kwargs", POLICIES, ids=[f"{c.__name__}-{i}" for i, (c, _) in enumerate(POLICIES)])
@pytest.mark.parametrize("budget", [0, 1, 7, 39, 40, 55])
def test_exact_budget_and_valid_sorted_indices(cls, kwargs, budget):
    policy = cls(**kwargs)
    inputs = _inputs()
    sel = policy.select(inputs, budget)
    n = min(budget, 40)
    assert sel.dtype == torch.long and tuple(sel.shape) == (2, n)
    if n:
        assert int(sel.min()) >= 0 and int(sel.max()) < 40
        assert bool((sel[:, 1:] > sel[:, :-1]).all()), "indices must be strictly ascending (unique, sorted)"
    assert torch.equal(sel, policy.select(inputs, budget)), "selection must be deterministic"


def test_budget_from_ratio_rounds_half_up_and_clips():
    assert budget_from_ratio(0.5, 5) == 3
    assert budget_from_ratio(0.25, 10) == 3
    assert budget_from_ratio(0.2, 10) == 2
    assert budget_from_ratio(1.0, 7) == 7 and budget_from_ratio(0.0, 7) == 0
    with pytest.raises(ValueError, match="ratio"):
        budget_from_ratio(1.5, 10)
    with pytest.raises(ValueError, match="num_tokens"):
        budget_from_ratio(0.5, -1)


def _gqa_inputs():
    # Two KV heads, g = 2. KV head 0 makes token 3 the target of the queries, KV head 1 token 7.
    t, d = 12, 4
    keys = torch.zeros(t, 2, d)
    keys[3, 0, 0] = 8.0
    keys[7, 1, 0] = 8.0
    queries = torch.zeros(2, 4, d)
    queries[:, :, 0] = 1.0
    return ScoreInputs(keys=keys, queries=queries)


@pytest.mark.parametrize(
    "policy",
    [
        H2OPolicy(recent_fraction=0.0),
        SnapKVPolicy(queries_in_keys=False, kernel_size=1),
        VLCachePolicy(queries_in_keys=False),
    ],
    ids=_ids,
)
def test_gqa_selection_is_per_kv_head(policy):
    sel = policy.select(_gqa_inputs(), 1)
    assert sel[:, 0].tolist() == [3, 7]


def test_gqa_scores_average_the_query_heads_of_a_group():
    inputs = _inputs(t=16, hkv=2, g=2, tq=3, seed=3)
    probs = attention_probabilities(inputs.queries, inputs.keys)  # [Hq, Tq, T]
    expected = torch.stack([probs[0:2].mean(0).sum(0), probs[2:4].mean(0).sum(0)], dim=1)
    assert torch.allclose(H2OPolicy().score(inputs), expected, atol=1e-6)


def test_h2o_keeps_recent_window_and_heaviest():
    t = 20
    acc = torch.stack([torch.randperm(t, generator=torch.Generator().manual_seed(s)).float() for s in (1, 2)], dim=1)
    inputs = ScoreInputs(keys=torch.randn(t, 2, 4), accumulated=acc)
    sel = H2OPolicy(recent_fraction=0.25).select(inputs, 8)  # recent 2, heavy 6
    for h in range(2):
        heavy = set(torch.topk(acc[:18, h], 6).indices.tolist())
        assert set(sel[h].tolist()) == heavy | {18, 19}


def test_h2o_ratio_split_and_budget():
    policy = H2OPolicy(heavy_ratio=0.375, recent_ratio=0.125)
    assert policy.budget_for(100) == 50
    assert policy.recent_count(50) == 13  # 12.5 rounds half up
    assert H2OPolicy(heavy_ratio=0.1, recent_ratio=0.1).recent_count(20) == 10


def test_h2o_ties_prefer_recent_tokens():
    inputs = ScoreInputs(keys=torch.randn(10, 1, 4), accumulated=torch.ones(10, 1))
    assert H2OPolicy(recent_fraction=0.0).select(inputs, 3)[0].tolist() == [7, 8, 9]


def test_h2o_update_scores_is_cumulative():
    base = _inputs(t=16, seed=5)
    policy = H2OPolicy()
    first = policy.update_scores(None, base)
    second_inputs = _inputs(t=16, seed=6)
    second_inputs = ScoreInputs(keys=base.keys, queries=second_inputs.queries)
    both = policy.update_scores(first, second_inputs)
    assert torch.allclose(both, first + policy.update_scores(None, second_inputs), atol=1e-6)
    # Each query row distributes mass 1 over the keys: the totals count the queries.
    assert math.isclose(float(both.sum(0)[0]), 12.0, rel_tol=1e-5)


def test_query_lse_gives_pre_eviction_shares():
    inputs = _inputs(t=16, hkv=1, g=2, tq=2, seed=7)
    extra = torch.randn(30, 1, 8) * 2
    full = torch.cat([inputs.keys, extra])
    scores_full = attention_probabilities(inputs.queries, full)  # [Hq, Tq, 46]
    logits = torch.einsum("qhd,khd->hqk", inputs.queries, full.expand(-1, 2, -1)) / math.sqrt(8)
    lse = torch.logsumexp(logits, dim=-1).permute(1, 0)
    shares = H2OPolicy().score(ScoreInputs(keys=inputs.keys, queries=inputs.queries, query_lse=lse))
    expected = scores_full[..., :16].mean(0).sum(0)
    assert torch.allclose(shares[:, 0], expected, atol=1e-5)
    assert float(shares.sum()) < 2.0 - 1e-3  # part of the mass sits on the other keys


def test_force_keep_is_honoured_inside_the_budget():
    acc = torch.arange(10, dtype=torch.float32)[:, None]
    force = torch.zeros(10, dtype=torch.bool)
    force[0] = True
    inputs = ScoreInputs(keys=torch.randn(10, 1, 4), accumulated=acc, force_keep=force)
    assert H2OPolicy(recent_fraction=0.0).select(inputs, 3)[0].tolist() == [0, 8, 9]


def test_snapkv_keeps_its_window_when_queries_are_prompt_tokens():
    inputs = _inputs(t=30, tq=5, seed=11)
    sel = SnapKVPolicy(window_size=5).select(inputs, 9)
    for h in range(2):
        assert {25, 26, 27, 28, 29} <= set(sel[h].tolist())
    small = SnapKVPolicy(window_size=5).select(inputs, 3)
    assert small.tolist() == [[27, 28, 29], [27, 28, 29]]


def test_snapkv_uses_only_the_last_window_queries():
    a = _inputs(t=30, tq=8, seed=12)
    q = a.queries.clone()
    q[:4] = torch.randn(4, q.shape[1], q.shape[2]) * 5
    b = ScoreInputs(keys=a.keys, queries=q)
    policy = SnapKVPolicy(window_size=4, queries_in_keys=False)
    assert torch.allclose(policy.score(a), policy.score(b))


def test_snapkv_pooling_changes_the_choice():
    # Logits: an isolated peak at token 2 and a cluster of three moderately attended tokens 10..12.
    t, d = 20, 4
    logits = torch.full((t,), -10.0)
    logits[2] = math.log(0.3)
    logits[10:13] = math.log(0.2)
    keys = torch.zeros(t, 1, d)
    keys[:, 0, 0] = logits * math.sqrt(d)  # default scale 1/sqrt(d)
    queries = torch.zeros(1, 1, d)
    queries[0, 0, 0] = 1.0
    inputs = ScoreInputs(keys=keys, queries=queries)
    plain = SnapKVPolicy(kernel_size=1, queries_in_keys=False).select(inputs, 1)
    pooled = SnapKVPolicy(kernel_size=5, queries_in_keys=False).select(inputs, 1)
    assert plain.tolist() == [[2]]
    assert pooled[0, 0].item() in (10, 11, 12)  # every cluster member's pool covers the whole cluster


def test_streaming_llm_keeps_sinks_and_recent():
    inputs = ScoreInputs(keys=torch.randn(50, 3, 4))
    sel = StreamingLLMPolicy().select(inputs, 10)
    assert all(row == [0, 1, 2, 3, 44, 45, 46, 47, 48, 49] for row in sel.tolist())
    assert StreamingLLMPolicy().select(inputs, 2)[0].tolist() == [0, 1]
    assert StreamingLLMPolicy(n_sink=0).select(inputs, 3)[0].tolist() == [47, 48, 49]


def test_pyramid_budgets_average_to_target_and_decrease_with_depth():
    t, w, c, layers = 4096, 64, 0.6, 28
    budgets = pyramid_layer_budgets(t, w, c, layers)
    assert len(budgets) == layers
    assert abs(sum(budgets) / layers - t * (1 - c)) <= 1.0
    assert all(a >= b for a, b in zip(budgets, budgets[1:])) and budgets[0] > budgets[-1]
    assert max(budgets) <= t - w


def test_pyramid_budgets_clip_and_fallback():
    # low compression: max would exceed T - w, so it is clipped and min raised; mean still matches
    budgets = pyramid_layer_budgets(1000, 64, 0.2, 8)
    assert max(budgets) <= 1000 - 64 and abs(sum(budgets) / 8 - 800) <= 1.0
    # short prompt: constraints fail, every layer falls back to SnapKV's T(1-c)
    assert pyramid_layer_budgets(100, 64, 0.5, 4) == [50, 50, 50, 50]
    assert pyramid_layer_budgets(4096, 64, 0.5, 1) == [2048]


def test_pyramidkv_policy_picks_its_layer_budget():
    policy = PyramidKVPolicy(window_size=8, keep_ratio=0.25)
    t, layers = 256, 4
    expected = pyramid_layer_budgets(t, 8, 0.75, layers)
    for layer in range(layers):
        inputs = _inputs(t=t, tq=8, seed=layer, layer=layer, num_layers=layers)
        assert policy.select_layer(inputs).shape[1] == expected[layer]


def test_vlcache_budgets_sum_and_follow_density():
    sparsities = [0.9, 0.5, 0.99, 0.7]
    budgets = vlcache_layer_budgets(sparsities, 100, 1000)
    assert sum(budgets) == 100
    density = [1 - g for g in sparsities]
    order_d = sorted(range(4), key=lambda i: density[i])
    assert [budgets[i] for i in order_d] == sorted(budgets)
    for b, dens in zip(budgets, density):
        assert abs(b - 100 * dens / sum(density)) <= 1.5


def test_vlcache_budgets_clip_and_redistribute():
    budgets = vlcache_layer_budgets([0.0, 1.0, 0.9], 60, 40)
    assert sum(budgets) == 60 and all(1 <= b <= 40 for b in budgets)
    assert budgets[0] == 40 and budgets[1] == 1
    assert vlcache_layer_budgets([1.0, 1.0, 1.0], 30, 40) == [10, 10, 10]
    with pytest.raises(ValueError, match="total"):
        vlcache_layer_budgets([0.5, 0.5], 1, 10)


def test_layer_sparsity_threshold_filter():
    probs = torch.tensor([[[1.0, 0.5, 0.005, 0.0]]])
    assert layer_sparsity(probs, 0.01) == pytest.approx(0.5)
    valid = torch.tensor([[True, True, False, False]])
    assert layer_sparsity(probs, 0.01, valid) == pytest.approx(0.0)
    uniform = _inputs(t=20, tq=3)
    gamma = VLCachePolicy().sparsity(uniform)
    assert 0.0 <= gamma < 0.5  # random keys: attention is not sparse at a 1% threshold


def test_vlcache_keeps_post_modality_queries_and_heaviest():
    inputs = _inputs(t=30, tq=4, seed=21)
    sel = VLCachePolicy().select(inputs, 10)
    for h in range(2):
        assert {26, 27, 28, 29} <= set(sel[h].tolist())


@pytest.mark.parametrize(
    "make,field",
    [
        (lambda: H2OPolicy().select(_inputs(), -1), "budget"),
        (lambda: SnapKVPolicy().select(ScoreInputs(keys=torch.randn(5, 1, 4)), 2), "queries"),
        (lambda: VLCachePolicy().select(ScoreInputs(keys=torch.randn(5, 1, 4)), 2), "queries"),
        (lambda: H2OPolicy().select(ScoreInputs(keys=torch.randn(5, 1, 4)), 2), "queries"),
        (lambda: ScoreInputs(keys=torch.randn(5, 2, 4), queries=torch.randn(2, 3, 4)), "queries"),
        (lambda: ScoreInputs(keys=torch.randn(5, 2, 4), queries=torch.randn(2, 2, 3)), "queries"),
        (lambda: ScoreInputs(keys=torch.randn(5, 2, 4), accumulated=torch.randn(4, 2)), "accumulated"),
        (lambda: ScoreInputs(keys=torch.randn(5, 4)), "keys"),
        (lambda: ScoreInputs(keys=torch.randn(5, 1, 4), layer=3, num_layers=2), "layer"),
        (lambda: SnapKVPolicy(kernel_size=4), "kernel_size"),
        (lambda: SnapKVPolicy(window_size=0), "window_size"),
        (lambda: SnapKVPolicy(pooling="median"), "pooling"),
        (lambda: StreamingLLMPolicy(n_sink=-1), "n_sink"),
        (lambda: H2OPolicy(heavy_ratio=0.2), "heavy_ratio"),
        (lambda: H2OPolicy(recent_fraction=1.5), "recent_fraction"),
        (lambda: PyramidKVPolicy(keep_ratio=0.0), "keep_ratio"),
        (lambda: PyramidKVPolicy(beta=0.5), "beta"),
        (lambda: VLCachePolicy(threshold=2.0), "threshold"),
        (lambda: pyramid_layer_budgets(100, 8, 1.0, 4), "compression"),
        (lambda: vlcache_layer_budgets([0.5, 1.5], 4, 10), "sparsities"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(make, field):
    with pytest.raises(ValueError, match=field):
        make()
