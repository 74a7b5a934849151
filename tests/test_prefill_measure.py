"""The prefill measurement point (docs/compression.md §12.2): a method measures in the prefill call of the text that
follows the input images (its queries over the images' rows) and compresses at the end of that block, or before the
branch's first denoising step reads it; a method that does not ask keeps the first-step timeline."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from unicache_core.compression import make_cache_factory
from unicache_core.compression.methods import SnapKV
from unicache_core.compression.plan import CallPlan
from unicache_core.compression.protocol import Measurement
from unicache_core.compression.scoring import CallProbe
from unicache_core.kv.cache import AttentionCall, RequestInfo, StepInfo
from unicache_core.kv.token_types import TokenType as TT

LAYERS, HKV, D = 2, 2, 16
BLOCKS = [  # an edit's gen context: the image's VAE and ViT blocks, then the instruction
    (0, [(TT.BOUNDARY, 1), (TT.SOURCE_VAE, 48), (TT.BOUNDARY, 1)]),
    (0, [(TT.BOUNDARY, 1), (TT.SOURCE_VIT, 40), (TT.BOUNDARY, 1)]),
    (None, [(TT.BOUNDARY, 1), (TT.INSTRUCTION, 12), (TT.BOUNDARY, 1)]),
]


@dataclass(frozen=True, kw_only=True)
class FirstStepSnapKV(SnapKV, register=False):
    """SnapKV as it was before it measured the prompt: its window is the first denoising step's latents."""

    measures_prompt = False


@dataclass(frozen=True, kw_only=True)
class EndOfBlock(SnapKV, register=False):
    """Compresses right at the end of the measured block, and records what its probe showed."""

    def plan_prefill(self, view, call) -> CallPlan:
        plan = super().plan_prefill(view, call)
        return replace(plan, compress_after=plan.measure)

    def measure(self, probe: CallProbe) -> Measurement:
        found = super().measure(probe)
        images = sum(s.num_tokens for s in probe.stores if s.image is not None)
        return replace(found, extra={"image_rows": images, "queries": int(probe.q.shape[0])})


def _types(parts) -> torch.Tensor:
    return torch.cat([torch.full((n,), int(t), dtype=torch.int8) for t, n in parts])


def _call(cache, call: AttentionCall, gen: torch.Generator) -> None:
    n = call.token_types.shape[0]
    cache.begin_call(call)
    for layer in range(LAYERS):
        k, v = torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen)
        cache.attend(layer, torch.randn(n, HKV, D, generator=gen), k, v, call)
    cache.end_call(call)


def _prefilled(method):
    session = make_cache_factory(method).start(RequestInfo("edit", LAYERS, 3, "synthetic"))
    cache = session.new_cache("gen")
    gen = torch.Generator().manual_seed(0)
    for image, parts in BLOCKS:
        types = _types(parts)
        call = AttentionCall(types, torch.zeros(types.shape[0], dtype=torch.long), causal=image is None, update=True)
        _call(cache, replace(call, image=image), gen)
    return session, cache, gen


def _first_step(session, cache, gen) -> list[int]:
    """The first denoising step; the rows per KV head each layer held when the step's call read it."""
    session.begin_step(StepInfo("denoise", 0, 3, ("gen",)))
    latents = _types([(TT.CURRENT_LATENT, 4)])
    call = AttentionCall(latents, torch.zeros(4, dtype=torch.long), False, False, phase="denoise", step=0)
    read: list[int] = []
    attend = cache.attend

    def counting(layer, q, k, v, c):
        read.append(sum(s.num_tokens for s in cache.layer(layer).stores))
        return attend(layer, q, k, v, c)

    cache.attend = counting
    _call(cache, call, gen)
    session.end_step(StepInfo("denoise", 0, 3, ("gen",)))
    return read


def test_the_instructions_window_is_measured_at_prefill_and_compresses_before_the_first_read():
    """SnapKV's paper timeline: the instruction after the image is its observation window."""
    session, cache, gen = _prefilled(SnapKV(kv_target=0.3, window=8))
    view = session.view(cache)
    assert view.measured_phase == "prefill" and view.compressions == 0
    full_rows = cache.layer(0).appended_tokens
    for layer in range(LAYERS):
        scores = view.layer(layer).last_scores
        assert scores is not None and scores.shape == (full_rows, HKV)
        assert cache.state[layer].last_score_queries == 8  # the instruction block's last 8 queries
        assert float(scores[:92].sum()) > 0  # the images' rows drew the window's attention
    read = _first_step(session, cache, gen)
    for layer in range(LAYERS):  # the window's own rows (the instruction's last 8, a boundary among them) are kept
        held = torch.cat([s.token_index.long().reshape(-1) for s in cache.layer(layer).stores])
        assert set(range(full_rows - 8, full_rows)) <= set(held.tolist())
    assert all(rows < full_rows for rows in read)  # the first step already reads the compressed cache
    report = session.finish()
    assert report["steps"][0]["branches"]["gen"]["compressed_after"]
    assert report["steps"][0]["branches"]["gen"]["observed"] is False  # nothing measured in the step


def test_without_the_prompt_window_the_first_step_is_measured_and_compresses_after():
    session, cache, gen = _prefilled(FirstStepSnapKV(kv_target=0.3, window=8))
    assert session.view(cache).measured_phase is None
    assert all(state.last_scores is None for state in cache.state)
    full_rows = cache.layer(0).appended_tokens
    assert _first_step(session, cache, gen) == [full_rows] * LAYERS  # read in full, compressed after
    assert session.state.branch("gen").compressions == 1
    assert cache.layer(0).num_tokens < full_rows


def test_a_method_compresses_at_the_end_of_the_measured_block():
    session, cache, _ = _prefilled(EndOfBlock(kv_target=0.3, window=8))
    assert session.state.branch("gen").compressions == 1  # before any denoising step
    assert any(s.kind == "evicted" for s in cache.layer(0).stores)
    for layer in range(LAYERS):
        measured = cache.state[layer].measured
        assert measured == {"image_rows": 88, "queries": 14}  # the text's 14 queries over the image's 88 rows
