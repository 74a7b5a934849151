"""An evicted text held at full precision takes the quantize route where that loses less (docs/compression.md §11.16):
under the paper's table at 20% of full KV, an instruction whose attention is spread keeps every row at low bits, one
whose attention the few rows an eviction keeps draw nearly all of is still evicted; both from the scores alone, through
a real UniCache session and cache."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from unicache_core.compression import make_cache_factory
from unicache_core.compression.family import FULL_BITS, QuantGeometry, Segment, choice_error, choose
from unicache_core.compression.policy_table import paper_policy_table
from unicache_core.compression.report import MANAGED_TYPES
from unicache_core.kv.cache import AttentionCall, RequestInfo
from unicache_core.kv.quantized_store import QuantizedStore
from unicache_core.kv.stores import EvictedStore
from unicache_core.kv.token_types import TokenType as TT

LAYERS, HKV, D, N = 2, 2, 16, 80


def _types(parts) -> torch.Tensor:
    return torch.cat([torch.full((n,), int(t), dtype=torch.int8) for t, n in parts])


def _compress(scores: torch.Tensor, objective: str = "memory"):
    """A t2i request's context (an ``N``-row instruction between two boundaries) at 20% of full KV under the paper's
    table (no checkpoint of its own: the shipped one); each layer's instruction rows scored ``scores`` (``[N]``, the
    same for every KV head); one compression, under ``objective`` (the ``memory`` objective's choice between the two
    routes is what this file checks). Returns the cache."""
    assert paper_policy_table().kind("t2i", "instruction") == "evict"
    session = make_cache_factory("unicache", kv_target=0.2, objective=objective).start(
        RequestInfo("t2i", LAYERS, 4, "synthetic")
    )
    cache = session.new_cache("gen")
    gen = torch.Generator().manual_seed(3)
    types = _types([(TT.BOUNDARY, 1), (TT.INSTRUCTION, N), (TT.BOUNDARY, 1)])
    n = types.shape[0]
    call = AttentionCall(types, torch.arange(n), causal=True, update=True)
    cache.begin_call(call)
    for layer in range(LAYERS):
        q, k, v = (torch.randn(n, HKV, D, generator=gen) for _ in range(3))
        cache.attend(layer, q, k, v, call)
    cache.end_call(call)
    for layer in range(LAYERS):
        ls = cache.state[layer]
        full = torch.zeros(cache.layer(layer).appended_tokens, HKV)
        full[1 : N + 1] = scores[:, None]
        ls.scores = ls.last_scores = full
        ls.masses = {TT.INSTRUCTION: 1.0}
        session.state.note_masses("gen", layer, 0, ls.masses)
    step0 = AttentionCall(
        _types([(TT.CURRENT_LATENT, 4)]), torch.zeros(4, dtype=torch.long), False, False, phase="denoise", step=0
    )
    session.compress(cache, step0)
    return cache


def _instruction(cache, layer: int):
    stores = [s for s in cache.layer(layer).stores if s.token_type == TT.INSTRUCTION and s.num_tokens]
    assert len(stores) == 1
    return stores[0]


def _within_the_target(cache) -> None:
    """The candidate rows of every layer together hold at most 20% of their full bytes (a layer may take what the one
    before it left)."""
    held = sum(
        s.nbytes() for layer in range(LAYERS) for s in cache.layer(layer).stores if s.token_type in MANAGED_TYPES
    )
    assert 0 < held <= 0.2 * sum(cache.managed_full_bytes(layer) for layer in range(LAYERS))


def test_a_spread_instruction_is_held_whole_at_low_bits():
    cache = _compress(torch.rand(N, generator=torch.Generator().manual_seed(0)) + 0.5)  # no row draws much more
    _within_the_target(cache)
    for layer in range(LAYERS):
        store = _instruction(cache, layer)
        assert isinstance(store, QuantizedStore) and store.bits in (2, 4), store
        assert store.num_tokens == N  # every row kept


def test_under_speed_a_spread_instruction_is_evicted_all_the_same():
    """The ``speed`` objective never takes the low-bit route: the rows attended are the paper's."""
    cache = _compress(torch.rand(N, generator=torch.Generator().manual_seed(0)) + 0.5, objective="speed")
    _within_the_target(cache)
    for layer in range(LAYERS):
        store = _instruction(cache, layer)
        assert isinstance(store, EvictedStore) and 0 < store.num_tokens <= 0.2 * N, store


def test_a_concentrated_instruction_is_still_evicted():
    scores = torch.full((N,), 1e-6)
    scores[torch.tensor([3, 17, 40, 62, 77])] = 1000.0  # five rows draw all but a millionth of the attention
    cache = _compress(scores)
    _within_the_target(cache)
    for layer in range(LAYERS):
        store = _instruction(cache, layer)
        assert not isinstance(store, QuantizedStore), store  # full precision
        assert 5 <= store.num_tokens <= 0.2 * N
        kept = set((store.token_index.long().reshape(-1) - 1).tolist())  # append index 0 is the first boundary
        assert {3, 17, 40, 62, 77} <= kept


@pytest.mark.parametrize("elem", [2, 4])
def test_the_evict_route_takes_the_choice_that_loses_less(elem):
    """``choose(kind="evict")``: the eviction (most full-precision rows) against the quantize route by
    ``choice_error``; without masses the rows count alike and low bits (nearly every row) win at a fifth of the
    bytes."""
    n = 200
    seg = Segment(n, n, FULL_BITS, 2 * n * HKV * D * elem, True, HKV, D, elem)
    budget = seg.full_bytes // 5
    evicted = seg.most_rows(FULL_BITS, budget, QuantGeometry(), n)
    quantized = choose(seg, "quantize", budget, QuantGeometry())
    alike = choose(seg, "evict", budget, QuantGeometry())
    assert alike == quantized and alike.quantized and alike.rows > 4 * evicted.rows
    assert choice_error(seg, alike) < choice_error(seg, evicted)
    # the best-scored rows the eviction keeps draw all but 0.1% of the attention: eviction loses less than 2-4 bits
    focused = Segment(**{**seg.__dict__, "kept_mass": tuple(min(1.0, 0.999 + k / 1e6) for k in range(n + 1))})
    assert choose(focused, "evict", budget, QuantGeometry()) == evicted
    assert seg.choice_bytes(alike) <= budget and seg.choice_bytes(evicted) <= budget


def test_an_evicted_text_held_at_low_bits_keeps_its_best_rows_whole_with_what_its_bytes_leave():
    """The quantize route of an evicted segment lets its full-precision residual (its best-scored rows) grow into the
    bytes every row at low bits leaves, past KIVI's 32 rows (MiKV's mix of low-bit rows and whole heavy hitters,
    docs/compression.md §11.16), where a quantized type stops at 32."""
    n, d = 800, 128
    seg = Segment(n, n, FULL_BITS, 2 * n * HKV * d * 2, True, HKV, d, 2)
    budget = seg.full_bytes // 4  # every row at 2 bits in groups of 32 leaves bytes for more than 32 whole rows
    kivi_like = choose(seg, "quantize", budget, QuantGeometry())
    mixed = choose(seg, "evict", budget, QuantGeometry())
    assert (mixed.rows, mixed.bits, mixed.group) == (kivi_like.rows, kivi_like.bits, kivi_like.group) == (n, 2, 32)
    assert kivi_like.residual == 32 < mixed.residual <= n // 2
    assert seg.choice_bytes(kivi_like) < seg.choice_bytes(mixed) <= budget
    wider = replace(mixed, residual=mixed.residual + 1)
    assert seg.choice_bytes(wider) > budget  # the residual takes every row the bytes leave
