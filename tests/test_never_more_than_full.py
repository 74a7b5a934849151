"""No method ever holds more managed (compressible) KV bytes than no compression at all.

Property test (a seeded sweep) over every method x task x target x segment lengths 1..5000 (every length up to
40, then edge and log-uniform lengths), on the compression layer
itself: synthetic typed segments are appended to real branch caches of a real session, each method's own
plan decides at which steps a cache is measured and compressed, the measurements are synthetic (random
per-key scores and type masses, as the scorer would leave them), and after the prefill and after every
step each layer's managed bytes (the stores of candidate types: payload, scales, residual, indices) are
at most the K+V bytes those rows hold uncompressed. The whole pipeline gets the same check on the tiny
checkpoint in tests/test_kv_methods.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from unicache_core.compression import METHODS, make_cache_factory, unicache_allocation
from unicache_core.compression.family import JointPlan
from unicache_core.compression.policy_table import PolicyTable, paper_policy_table
from unicache_core.compression.report import MANAGED_TYPES
from unicache_core.kv.cache import AttentionCall, RequestInfo
from unicache_core.kv.token_types import CANDIDATE_TYPES
from unicache_core.kv.token_types import TokenType as TT

LAYERS, HKV, D = 2, 2, 16  # two layer chunks (layer 0 alone, then the rest)
STEPS = 6  # denoising steps or decoded tokens: unicache compresses after steps 0 and 5 (ends of chunks)
#: kv_target per named target (None: the method's default), as the quality bench's targets
TARGETS = {
    "default": {"understanding": None, "t2i": None, "edit": None},
    "paper": {"understanding": 0.2, "t2i": 0.4, "edit": 0.2},
    "robust": {"understanding": 0.1, "t2i": 0.25, "edit": 0.1},
    "extreme": {"understanding": 0.05, "t2i": 0.15, "edit": 0.05},
    "none": {"understanding": 1.0, "t2i": 1.0, "edit": 1.0},
}
#: lengths where group, residual and metadata boundaries sit
EDGE_LENGTHS = (1, 2, 3, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 511, 512, 513, 5000)
#: every length up to here is a segment of every method x task (short prompts, one group, the residual caps)
DENSE_MAX = 40


def _dense_requests(task_index: int) -> list[tuple[str, list[int]]]:
    """(target, segment lengths) that give every length 1..DENSE_MAX to the first segment of some request and,
    for understanding and edit, to the others in another order; the target rotates over TARGETS with the
    length, so each target sees lengths of every residue."""
    names = list(TARGETS)
    out = []
    for length in range(1, DENSE_MAX + 1):
        others = [(length * 13) % DENSE_MAX + 1, (length * 29 + 7) % DENSE_MAX + 1]
        out.append((names[(length + task_index) % len(names)], [length, *others]))
    return out


def _spread_lengths(rng: random.Random) -> list[int]:
    """Three segment lengths: an edge length, then log-uniform draws over 1..5000."""
    return [rng.choice(EDGE_LENGTHS)] + [max(1, min(5000, round(10 ** rng.uniform(0, 3.7)))) for _ in range(2)]


def _joint_table() -> PolicyTable:
    """Every candidate type joint, with bits that fall as the budget does (full precision at generous budgets)."""
    plan = JointPlan(((0.5, 16), (0.3, 8), (0.15, 4), (0.05, 2)))
    paper = paper_policy_table()
    return PolicyTable(
        entries={key: "joint" for key in paper.entries}, plans={key: plan for key in paper.entries}, source="calibrated"
    )


def _quantize_table() -> PolicyTable:
    """Every candidate type quantized (the bundled model's calibrated routes): several quantized types per layer,
    so the pooled store of docs/compression.md §11.7 is exercised."""
    return PolicyTable(entries={key: "quantize" for key in paper_policy_table().entries}, source="calibrated")


def _context(task: str, lengths: list[int]) -> list[tuple[TT, int]]:
    a, b, c = lengths
    if task == "understanding":
        return [(TT.BOUNDARY, 1), (TT.SOURCE_VIT, a), (TT.BOUNDARY, 1), (TT.INSTRUCTION, b), (TT.BOUNDARY, 1)]
    if task == "t2i":
        return [(TT.BOUNDARY, 1), (TT.INSTRUCTION, a), (TT.BOUNDARY, 1)]
    return [
        (TT.BOUNDARY, 1),
        (TT.SOURCE_VAE, a),
        (TT.BOUNDARY, 2),
        (TT.SOURCE_VIT, b),
        (TT.BOUNDARY, 2),
        (TT.INSTRUCTION, c),
        (TT.BOUNDARY, 1),
    ]


def _append(cache, types: torch.Tensor, gen: torch.Generator, dtype: torch.dtype) -> None:
    """Append rows of ``types`` to every layer (what an attention call with ``update`` stores)."""
    cache.types = torch.cat([cache.types, types])
    for layer in range(LAYERS):
        n = types.shape[0]
        k = torch.randn(n, HKV, D, generator=gen).to(dtype)
        cache.layer(layer).append(k, torch.randn(n, HKV, D, generator=gen).to(dtype), types)


def _measure(session, cache, call: AttentionCall, plan, gen: torch.Generator) -> None:
    """What the cache's scorer leaves after ``call``: masses per type (and per-key scores when planned)."""
    for layer in range(LAYERS):
        ls = cache.state[layer]
        n = cache.layer(layer).appended_tokens
        if plan.measure:
            scores = torch.rand(n, HKV, generator=gen)
            ls.last_scores = scores
            ls.scores = scores.clone() if ls.scores is None else ls.scores + scores
            ls.measured = {"sparsity": float(torch.rand(1, generator=gen))}
        if plan.observe or plan.measure:
            masses = {
                t: float(torch.rand(1, generator=gen)) * 0.3 for t in CANDIDATE_TYPES if cache.layer(layer).find(t)
            }
            ls.masses = masses
            if call.phase != "prefill":
                session.state.note_masses(cache.branch, layer, int(call.step), masses)


def _check(caches, where: str) -> None:
    for cache in caches:
        for layer in range(LAYERS):
            held = sum(s.nbytes() for s in cache.layer(layer).stores if s.token_type in MANAGED_TYPES)
            full = cache.managed_full_bytes(layer)
            assert held <= full, f"{where}: branch {cache.branch} layer {layer} holds {held} B > full {full} B"


def run_request(
    method: str,
    task: str,
    kv_target,
    lengths: list[int],
    dtype: torch.dtype,
    seed: int,
    policy: PolicyTable | None = None,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    settings = {"policy": policy} if policy is not None else {}
    session = make_cache_factory(method, kv_target=kv_target, **settings).start(
        RequestInfo(task, LAYERS, STEPS, "synthetic")
    )
    main = session.new_cache("gen")
    context = torch.cat([torch.full((n,), int(t), dtype=torch.int8) for t, n in _context(task, lengths)])
    prefill = AttentionCall(context, torch.arange(context.shape[0]), causal=True, update=True, phase="prefill")
    plan = session.plan_call(main, prefill)
    _append(main, context, gen, dtype)
    _measure(session, main, prefill, plan, gen)
    caches = [main] if task == "understanding" else [main, session.fork(main, "cfg_text")]
    _check(caches, "prefill")
    phase = "decode" if task == "understanding" else "denoise"
    for step in range(STEPS):
        for cache in caches:
            types = torch.full(
                (1 if phase == "decode" else 4,),
                int(TT.DECODED_TEXT if phase == "decode" else TT.CURRENT_LATENT),
                dtype=torch.int8,
            )
            call = AttentionCall(
                types,
                torch.arange(types.shape[0]),
                causal=phase == "decode",
                update=phase == "decode",
                phase=phase,
                step=step,
            )
            plan = session.plan_call(cache, call)
            if plan.compress_before:
                session.compress(cache, call)
            _measure(session, cache, call, plan, gen)
            if call.update:
                _append(cache, types, gen, dtype)
            if plan.compress_after:
                session.compress(cache, call)
        _check(caches, f"step {step}")


TASKS = ("understanding", "t2i", "edit")
METHODS_UNDER_TEST = [m for m in METHODS if m != "full"]


@pytest.mark.parametrize("method", METHODS_UNDER_TEST + ["unicache_all_quantized"])
def test_managed_bytes_never_exceed_full(method: str) -> None:
    """Every task x target x segment length: lengths 1..40 densely (the target rotating with the length), then
    two requests per (task, target) with an edge length and log-uniform lengths up to 5000; fp32 and bf16
    alternate (bf16 is where 2-bit rows and their metadata save least). ``unicache_all_quantized``: UniCache
    with every type quantized, where its types may share one pooled store."""
    policy = _quantize_table() if method == "unicache_all_quantized" else None
    seed = 1000 * (METHODS_UNDER_TEST + ["unicache_all_quantized"]).index(method)
    method = "unicache" if policy is not None else method
    for t, task in enumerate(TASKS):
        for target, lengths in _dense_requests(t):
            seed += 1
            run_request(
                method,
                task,
                TARGETS[target][task],
                lengths,
                torch.bfloat16 if seed % 2 else torch.float32,
                seed,
                policy,
            )
        for target in TARGETS:
            for _ in range(2):
                seed += 1
                run_request(
                    method,
                    task,
                    TARGETS[target][task],
                    _spread_lengths(random.Random(seed)),
                    torch.bfloat16 if seed % 2 else torch.float32,
                    seed,
                    policy,
                )


def test_every_edge_length_for_the_quantizing_methods() -> None:
    """The lengths where quantizing stops paying (one group, a residual as long as the segment), in bf16
    (where 2-bit rows save least): unicache under the paper's routes and a joint table, and kivi over a
    pool of that length (t2i: the instruction alone); task and target rotate."""
    for i, length in enumerate(EDGE_LENGTHS):
        task, target = ("understanding", "t2i", "edit")[i % 3], ("default", "robust", "extreme")[(i // 3) % 3]
        for policy in (None, _joint_table(), _quantize_table()):
            run_request("unicache", task, TARGETS[target][task], [length, length, length], torch.bfloat16, i, policy)
        run_request("kivi", "t2i", TARGETS[target]["t2i"], [length, length, length], torch.bfloat16, i)


@pytest.mark.parametrize("quantize_all", [False, True])
def test_fewer_value_bits_never_exceed_full(monkeypatch, quantize_all: bool) -> None:
    """The same sweep with UniCache's values allowed below 2 bits under the floor (docs/compression.md §11.13; off by
    default): 2-bit keys with 1-bit values, keys grouped per token, and the paper's subsets, every length 1..40 and
    every edge length, fp32 and bf16."""
    monkeypatch.setattr(unicache_allocation, "VALUE_FLOOR_BITS", 1)
    policy = _quantize_table() if quantize_all else None
    seed = 50_000 + 1000 * quantize_all
    for t, task in enumerate(TASKS):
        for target, lengths in _dense_requests(t):
            seed += 1
            run_request("unicache", task, TARGETS[target][task], lengths, torch.bfloat16 if seed % 2 else torch.float32,
                        seed, policy)  # fmt: skip
        for i, length in enumerate(EDGE_LENGTHS):
            seed += 1
            target = ("robust", "extreme")[i % 2]
            run_request("unicache", task, TARGETS[target][task], [length, length, length],
                        torch.bfloat16 if seed % 2 else torch.float32, seed, policy)  # fmt: skip
