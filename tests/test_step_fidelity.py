"""Teacher forcing (``RunHooks.steer``) in the denoising and decoding loops, and the quality bench's step
fidelity (benchmarks.step_path) measured with it."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.step_path import CAP_DB, StepPath, fidelity_db
from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.pipeline import BagelPipeline
from unicache_core.bagel.request import RunHooks
from unicache_core.bagel.settings import preset
from unicache_core.compression import make_cache_factory

SETTINGS = dict(width=32, height=32, num_timesteps=5)


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return load_bagel(tiny_checkpoint, dtype=torch.float32)


def _t2i(pipe: BagelPipeline, seed: int, path: StepPath):
    return pipe.text_to_image("a red circle", preset("t2i", **SETTINGS), seed=seed, hooks=RunHooks(steer=path))


def test_a_run_forced_along_another_runs_path_sees_its_inputs(loaded):
    pipe = BagelPipeline(loaded)
    first, again, other = StepPath(), StepPath(), StepPath()
    _t2i(pipe, 1, first)
    _t2i(pipe, 1, again)
    assert len(first.outputs) == 4 and all(torch.equal(a, b) for a, b in zip(first.outputs, again.outputs))
    assert fidelity_db("t2i", again, first) == CAP_DB  # the same cache on the same path: identical outputs
    _t2i(pipe, 2, other)  # another seed: another path
    assert not torch.equal(other.outputs[1], first.outputs[1])
    forced = StepPath(forced=first)
    result = _t2i(pipe, 2, forced)
    # step 0 starts from seed 2's own noise; every later step from seed 1's latents, so its outputs are seed 1's
    assert not torch.equal(forced.outputs[0], first.outputs[0])
    assert all(torch.equal(a, b) for a, b in zip(forced.outputs[1:], first.outputs[1:]))
    assert torch.equal(forced.nexts[-1], first.nexts[-1]) and result.image is not None


def test_step_fidelity_orders_caches_by_how_much_they_compress(loaded):
    full = StepPath()
    _t2i(BagelPipeline(loaded), 3, full)
    db = {}
    for target in (0.5, 0.1):
        path = StepPath(forced=full)
        _t2i(BagelPipeline(loaded, make_cache_factory("h2o", kv_target=target)), 3, path)
        db[target] = fidelity_db("t2i", path, full)
    assert db[0.5] < CAP_DB and db[0.1] < db[0.5]  # dropping more rows moves every step further from full KV


def test_decoding_follows_the_forced_tokens(loaded):
    pipe = BagelPipeline(loaded)
    free = StepPath()
    answer = pipe.understand(
        "what is this?", None, preset("understanding", max_new_tokens=4), hooks=RunHooks(steer=free)
    )
    assert len(free.outputs) == len(free.nexts) >= 1 and free.nexts[: len(answer.token_ids)] == answer.token_ids
    tok = loaded.tokenizer
    wanted = [t for t in range(tok.vocab_size) if t not in (tok.eos_token_id, tok.bos_token_id)][:3]
    scripted = StepPath()
    scripted.nexts = [*wanted, tok.eos_token_id]  # a path to force: three tokens, then the end
    forced = StepPath(forced=scripted)
    result = pipe.understand(
        "what is this?", None, preset("understanding", max_new_tokens=4), hooks=RunHooks(steer=forced)
    )
    assert result.token_ids == wanted and len(forced.outputs) == 4


def test_steer_must_return_what_the_loop_continues_from(loaded):
    pipe = BagelPipeline(loaded)
    with pytest.raises(ValueError, match="next latent as a float tensor of shape"):
        pipe.text_to_image("x", preset("t2i", **SETTINGS), hooks=RunHooks(steer=lambda i, v, x: x[:1]))
    with pytest.raises(ValueError, match="next token id as an int >= 0, got 'a'"):
        pipe.understand(
            "x", None, preset("understanding", max_new_tokens=2), hooks=RunHooks(steer=lambda i, logits, token: "a")
        )


def test_fidelity_db_by_hand():
    ref, out = StepPath(), StepPath()
    ref.outputs = [torch.tensor([3.0, 4.0]), torch.tensor([0.0, 5.0])]  # |v|^2 = 25 + 25
    out.outputs = [torch.tensor([3.0, 4.5]), torch.tensor([0.0, 5.0])]  # |v' - v|^2 = 0.25
    assert fidelity_db("edit", out, ref) == pytest.approx(10 * math.log10(50 / 0.25))
    p, q = torch.tensor([0.0, 0.0]), torch.tensor([math.log(3.0), 0.0])  # (1/2, 1/2) against (3/4, 1/4)
    ref.outputs, out.outputs = [p], [q]
    kl = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert fidelity_db("und", out, ref) == pytest.approx(-10 * math.log10(kl), rel=1e-5)
    out.outputs = []
    with pytest.raises(ValueError, match="left the path"):
        fidelity_db("und", out, ref)
    with pytest.raises(ValueError, match="one StepPath per run"):
        StepPath()(1, torch.zeros(2), 0)
