"""The library's one scorer and its baseline methods against the dense reference policies of tests/oracles.

The library scores keys in query chunks from the LSE attention already returns
(:mod:`unicache_core.compression.scoring`) and evicts pooled candidate rows through a real compressing
session; the oracles score with the whole ``[Hq, Tq, T]`` probability tensor. On random tensors, every
baseline must keep exactly the rows its oracle keeps at the same count; where the library departs from the
oracle (PyramidKV trims the rounding surplus of its layer budgets), the difference is asserted.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from oracles import (
    H2OPolicy,
    KIVIPolicy,
    PyramidKVPolicy,
    ScoreInputs,
    SnapKVPolicy,
    StreamingLLMPolicy,
    VLCachePolicy,
    layer_sparsity,
    observation_attention,
)
from oracles.attention_stats import type_masses
from oracles.keepsets import MonotonicKeepSet

from unicache_core.compression import make_cache_factory
from unicache_core.compression.defaults import VLCACHE_THRESHOLD
from unicache_core.compression.family import FULL_BITS, JointPlan
from unicache_core.compression.methods.vlcache import vlcache_layer_budgets
from unicache_core.compression.ops import evicted_bytes, rows_for_bytes
from unicache_core.compression.policy_table import paper_policy_table
from unicache_core.compression.scoring import key_scores, mass_from_lse, row_max_logits
from unicache_core.kv.attention import attention_with_lse
from unicache_core.kv.cache import AttentionCall, RequestInfo, StepInfo
from unicache_core.kv.token_types import CANDIDATE_TYPES
from unicache_core.kv.token_types import TokenType as TT

HKV, GROUP, D = 2, 2, 16
LATENTS = 96  # latent queries of a denoising call (more than SnapKV's window of 64)


def _lse(q, *keys):
    """``[Tq, Hq]`` log-sum-exp of ``q`` over every given key set (the whole resident context)."""
    parts = [attention_with_lse(q, k, k)[1] for k in keys]
    return torch.logsumexp(torch.stack(parts), dim=0)


def _context(num_candidates: int, seed: int):
    """Token types (boundaries around instruction, source-ViT and source-VAE runs) and per-layer K/V."""
    gen = torch.Generator().manual_seed(seed)
    third = num_candidates // 3
    runs = [
        (TT.BOUNDARY, 1),
        (TT.SOURCE_VAE, third),
        (TT.BOUNDARY, 2),
        (TT.SOURCE_VIT, third),
        (TT.BOUNDARY, 2),
        (TT.INSTRUCTION, num_candidates - 2 * third),
        (TT.BOUNDARY, 1),
    ]
    types = torch.cat([torch.full((n,), int(t), dtype=torch.int8) for t, n in runs])
    return types, gen


class _Run:
    """One edit request with a single ``gen`` branch: a full-KV prefill, then denoising steps through the seam."""

    def __init__(self, method: str, num_layers: int, num_candidates: int, seed: int = 0, **settings):
        self.types, gen = _context(num_candidates, seed)
        t = self.types.shape[0]
        self.keys = [torch.randn(t, HKV, D, generator=gen) * 1.5 for _ in range(num_layers)]
        self.values = [torch.randn(t, HKV, D, generator=gen) for _ in range(num_layers)]
        self.gen = gen
        self.session = make_cache_factory(method, **settings).start(
            RequestInfo(task="edit", num_layers=num_layers, num_steps=12)
        )
        self.cache = self.session.new_cache("gen")
        prefill = AttentionCall(token_types=self.types, rope_positions=torch.arange(t), causal=False, update=True)
        self.cache.begin_call(prefill)
        for layer in range(num_layers):
            q = torch.randn(t, HKV * GROUP, D, generator=gen)
            self.cache.attend(layer, q, self.keys[layer], self.values[layer], prefill)
        self.cache.end_call(prefill)
        self.candidates = torch.nonzero(torch.isin(self.types.long(), torch.tensor([int(c) for c in CANDIDATE_TYPES])))
        self.candidates = self.candidates.squeeze(1)

    def denoise(self, step: int) -> list[dict]:
        """Run denoising step ``step``; per layer its latent queries, new keys and LSE over everything resident."""
        self.session.begin_step(StepInfo("denoise", step, 12, ("gen",)))
        call = AttentionCall(
            token_types=torch.full((LATENTS,), int(TT.CURRENT_LATENT), dtype=torch.int8),
            rope_positions=torch.zeros(LATENTS, dtype=torch.long),
            causal=False,
            update=False,
            phase="denoise",
            step=step,
        )
        self.cache.begin_call(call)
        seen = []
        for layer in range(self.cache.num_layers):
            q = torch.randn(LATENTS, HKV * GROUP, D, generator=self.gen) * 1.5
            k_new = torch.randn(LATENTS, HKV, D, generator=self.gen)
            self.cache.attend(layer, q, k_new, torch.randn_like(k_new), call)
            seen.append({"q": q, "k_new": k_new, "lse": _lse(q, self.keys[layer], k_new)})
        self.cache.end_call(call)
        self.session.end_step(StepInfo("denoise", step, 12, ("gen",)))
        return seen

    def pooled_store(self, layer: int):
        [store] = [s for s in self.cache.layer(layer).stores if s.token_type == TT.UNKNOWN]
        return store

    def oracle_inputs(self, layer: int, seen: dict, window: int | None = None) -> ScoreInputs:
        q, lse = seen["q"], seen["lse"]
        if window is not None:
            q, lse = q[-window:], lse[-window:]
        return ScoreInputs(keys=self.keys[layer][self.candidates], queries=q, query_lse=lse)

    def kept_rows(self, selection: torch.Tensor) -> torch.Tensor:
        """``[Hkv, n]`` append indices of an oracle's selection over the candidate pool."""
        return self.candidates[selection]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_scorer_matches_dense_attention(seed):
    gen = torch.Generator().manual_seed(seed)
    q, keys, extra = (
        torch.randn(40, 6, 8, generator=gen),
        torch.randn(70, 2, 8, generator=gen),
        torch.randn(30, 2, 8, generator=gen),
    )
    lse = _lse(q, keys, extra)
    inputs = ScoreInputs(keys=keys, queries=q, query_lse=lse)
    scores, _ = key_scores(q, keys, lse)
    assert torch.allclose(scores, observation_attention(inputs).sum(dim=1).t(), atol=1e-5)
    causal = torch.ones(40, 70, dtype=torch.bool).tril(diagonal=30)  # the queries are the last 40 keys
    logits = torch.einsum("qhd,khd->hqk", q, keys.repeat_interleave(3, dim=1)) / 8**0.5
    causal_lse = torch.logsumexp(logits.masked_fill(~causal, float("-inf")), dim=-1).t()  # [Tq, Hq]
    scores, _ = key_scores(q, keys, causal_lse, visible=causal)
    dense = observation_attention(ScoreInputs(keys=keys, queries=q), causal=True).sum(dim=1).t()
    assert torch.allclose(scores, dense, atol=1e-5)
    # per-type masses: the LSE share of a key set equals the dense probabilities summed over its keys
    types = torch.randint(1, 4, (70,), generator=gen)
    part = torch.cat([keys, extra])
    dense_masses = type_masses(
        observation_attention(ScoreInputs(keys=part, queries=q), per_query_head=True),
        torch.cat([types, torch.zeros(30, dtype=torch.long)]),
    )
    for t in (1, 2, 3):
        sel = types == t
        assert mass_from_lse(_lse(q, keys[sel]), lse) == pytest.approx(dense_masses[TT(t)], abs=1e-6)


def test_the_sparsity_count_matches_the_dense_threshold_filter():
    gen = torch.Generator().manual_seed(5)
    q, keys = torch.randn(24, 4, 8, generator=gen) * 2, torch.randn(50, 2, 8, generator=gen) * 2
    threshold = row_max_logits(q, keys) + torch.log(torch.tensor(VLCACHE_THRESHOLD))
    _, counts = key_scores(q, keys, _lse(q, keys), count_above=threshold)
    dense = observation_attention(ScoreInputs(keys=keys, queries=q), per_query_head=True)
    assert 1.0 - float(counts.sum()) / (24 * 50 * 4) == pytest.approx(layer_sparsity(dense, VLCACHE_THRESHOLD))


def test_h2o_keeps_the_rows_of_its_oracle():
    run = _Run("h2o", num_layers=2, num_candidates=300, kv_target=0.3)
    seen = run.denoise(0)
    for layer in range(2):
        store = run.pooled_store(layer)
        oracle = H2OPolicy(recent_fraction=0.25).select(run.oracle_inputs(layer, seen[layer]), store.num_tokens)
        assert torch.equal(store.keep_idx.long(), run.kept_rows(oracle))


def test_snapkv_keeps_the_rows_of_its_oracle():
    run = _Run("snapkv", num_layers=2, num_candidates=300, kv_target=0.25)
    seen = run.denoise(0)
    for layer in range(2):
        store = run.pooled_store(layer)
        policy = SnapKVPolicy(window_size=64, kernel_size=5, queries_in_keys=False)
        oracle = policy.select(run.oracle_inputs(layer, seen[layer]), store.num_tokens)
        assert torch.equal(store.keep_idx.long(), run.kept_rows(oracle))


def test_pyramidkv_keeps_its_oracles_rows_within_the_matched_total():
    layers, run = 4, _Run("pyramidkv", num_layers=4, num_candidates=2700, kv_target=0.5)
    seen = run.denoise(0)
    counts = [run.pooled_store(layer).num_tokens for layer in range(layers)]
    total = run.candidates.numel()
    budget = run.cache.state[0].budgets["candidate"]
    matched = rows_for_bytes(budget, total, HKV, D, 4)  # rows one layer's byte target buys
    carried = spent = 0
    branch_rows = 0  # rows the branch's byte target buys, layer by layer on the running total
    for _ in range(layers):
        carried += budget
        rows = rows_for_bytes(carried - spent, total, HKV, D, 4)
        spent += evicted_bytes(rows, total, HKV, D, 4)
        branch_rows += rows
    assert branch_rows >= layers * matched  # the running total carries what each layer's rounding leaves
    policy = PyramidKVPolicy(window_size=64, keep_ratio=branch_rows / layers / total, queries_in_keys=False)
    pyramid = [policy.layer_budget(total, layer, layers) for layer in range(layers)]
    assert pyramid[0] > pyramid[-1]  # a real pyramid, not the flat fallback
    # the documented difference: the library trims the rounding surplus from the deepest layers, so the
    # branch never holds more rows than its byte target buys; the other layers keep the oracle's budgets
    assert sum(counts) <= branch_rows and sum(pyramid) - sum(counts) == max(0, sum(pyramid) - branch_rows)
    assert sum(run.pooled_store(layer).nbytes() for layer in range(layers)) <= layers * budget
    assert counts[:-1] == pyramid[:-1] and counts[-1] <= pyramid[-1]
    for layer in range(layers):
        oracle = policy.select(run.oracle_inputs(layer, seen[layer]), counts[layer])
        assert torch.equal(run.pooled_store(layer).keep_idx.long(), run.kept_rows(oracle))


def test_streamingllm_keeps_the_rows_of_its_oracle():
    run = _Run("streamingllm", num_layers=1, num_candidates=120, kv_target=0.2)
    run.denoise(0)
    store = run.pooled_store(0)
    oracle = StreamingLLMPolicy(n_sink=4).select(ScoreInputs(keys=run.keys[0][run.candidates]), store.num_tokens)
    assert torch.equal(store.keep_idx.long(), run.kept_rows(oracle))
    assert run.kept_rows(oracle)[0, :4].tolist() == run.candidates[:4].tolist()  # the sinks


def test_vlcache_keeps_its_oracles_rows_and_sparsity_budgets():
    layers, run = 3, _Run("vlcache", num_layers=3, num_candidates=240, kv_target=0.3)
    seen = run.denoise(0)
    counts = [run.pooled_store(layer).num_tokens for layer in range(layers)]
    sparsities = []
    for layer in range(layers):
        policy = VLCachePolicy(threshold=VLCACHE_THRESHOLD, queries_in_keys=False)
        # over the cached keys: a denoising call's own latent block is not part of the cache
        sparsities.append(policy.sparsity(ScoreInputs(keys=run.keys[layer], queries=seen[layer]["q"])))
        assert run.cache.state[layer].measured["sparsity"] == pytest.approx(sparsities[layer], abs=1e-6)
        oracle = policy.select(run.oracle_inputs(layer, seen[layer]), counts[layer])
        assert torch.equal(run.pooled_store(layer).keep_idx.long(), run.kept_rows(oracle))
    assert counts == vlcache_layer_budgets(sparsities, sum(counts), run.candidates.numel())


def test_kivi_quantizes_like_its_oracle():
    run = _Run("kivi", num_layers=1, num_candidates=300, kv_target=0.3)
    run.denoise(0)
    store = run.pooled_store(0)
    oracle = KIVIPolicy(bits=store.bits, group_size=store.group_size, residual=store.residual)
    keys, values = run.keys[0][run.candidates], run.values[0][run.candidates]
    t, hkv, d = keys.shape
    assert store.nbytes() == oracle.nbytes(t, hkv, d, keys.element_size())
    # a code one step off would differ by a whole scale (>= 1e-3 here): the tolerance only absorbs fp32 rounding
    for mine, theirs in zip(store.dequantize(torch.float32), oracle.round_trip(keys, values)):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)


def test_unicache_keep_sets_only_shrink():
    # the paper's pure eviction of its evicted types (a joint entry at full precision): the paper table's own evict
    # entries quantize these spread rows instead, which loses less (docs/compression.md §11.16)
    paper = paper_policy_table()
    evicted = {(task, t) for (task, t), kind in paper.entries.items() if kind == "evict"}
    table = replace(
        paper,
        entries={key: "joint" if key in evicted else kind for key, kind in paper.entries.items()},
        plans={key: JointPlan(((1.0, FULL_BITS),)) for key in evicted},
    )
    run = _Run("unicache", num_layers=1, num_candidates=300, rho=0.4, rho_floor=0.1, policy=table)
    keep_sets: dict = {}
    for step in range(12):  # compressions after steps 0, 5 and 10
        run.denoise(step)
        for store in run.cache.layer(0).stores:
            if store.kind != "evicted":
                continue
            rows = store.keep_idx.long()
            if store.token_type not in keep_sets:
                keep_sets[store.token_type] = MonotonicKeepSet(int(run.types.shape[0]), HKV)
            # a selection inside the previous keep set comes back unchanged; an evicted row coming back would not
            assert torch.equal(keep_sets[store.token_type].update(rows), rows)
    assert set(keep_sets) == {TT.INSTRUCTION, TT.SOURCE_VIT}
    assert run.session.state.branch("gen").compressions == 3


def test_oracles_import_only_the_vocabulary():
    """The reference policies are written from the papers' formulas: of the library they may import only the
    vocabulary (token types) and the documented default numbers, never the code they check."""
    import ast
    import pathlib

    allowed = {"unicache_core.kv.token_types", "unicache_core.compression.defaults"}
    imported = set()
    for path in (pathlib.Path(__file__).parent / "oracles").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("unicache_core"):
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(a.name for a in node.names if a.name.startswith("unicache_core"))
    assert imported and imported <= allowed, sorted(imported - allowed)
