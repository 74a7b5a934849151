"""Bytes moved between a request's branches and layers (docs/compression.md §11.8): floors first, then by the
branches' weights in the output (``unicache_core/compression/grants.py``), and the weights the engine passes down."""

from __future__ import annotations

import random

import pytest
import torch
from PIL import Image

from unicache_core.bagel import BagelPipeline, load_bagel, preset
from unicache_core.bagel.sampling import guidance_weights
from unicache_core.compression.family import QuantGeometry
from unicache_core.compression.grants import Level, UnitNeed, branch_grants
from unicache_core.compression.methods.unicache import quantized_ladder
from unicache_core.kv.cache import CacheFactory, CacheSession, RequestInfo

LADDER = (Level(50, 4.0**-2), Level(150, 4.0**-4), Level(300, 0.0))


def test_hand_worked_case_moves_bytes_to_the_heavier_branch():
    # a (weight 64) and b (weight 1), one layer each, both above their floors. What they hold above them (50 + 80 =
    # 130 B) is spent on the steepest steps first: a's 2 -> 4 bits (64 * (1/16 - 1/256) / 100 B = 0.0375 per byte, 100
    # B), then b's (0.0586 / 20 B = 0.0029, 20 B), then a's step to full precision takes the last 10 B.
    needs = {
        "gen": {0: UnitNeed(100, LADDER)},
        "cfg_img": {0: UnitNeed(100, (Level(20, 4.0**-2), Level(40, 4.0**-4), Level(100, 0.0)))},
    }
    assert branch_grants(needs, {"gen": 64.0, "cfg_img": 1.0}) == {"gen": {0: 60}, "cfg_img": {0: -60}}
    # equal weights: b's 2 -> 4 bits (20 B) first, then a's (100 B), and b's next step gets the last 10 B
    assert branch_grants(needs, {"gen": 1.0, "cfg_img": 1.0}) == {"gen": {0: 50}, "cfg_img": {0: -50}}


def test_equal_units_keep_their_own_bytes():
    needs = {"gen": {0: UnitNeed(100, LADDER), 1: UnitNeed(100, LADDER)}}
    assert branch_grants(needs, {"gen": 4.0}) == {}


def test_floors_come_first():
    # b's budget is under its floor: the other pays for it in proportion to what it has above its own (§11.8)
    needs = {"gen": {0: UnitNeed(1000, LADDER[:1])}, "cfg_img": {0: UnitNeed(10, (Level(40, 4.0**-2),))}}
    assert branch_grants(needs) == {"gen": {0: -30}, "cfg_img": {0: 30}}
    # no rung is bought when a level does not fit: nothing moves
    assert branch_grants({"gen": {0: UnitNeed(60, LADDER)}, "cfg_img": {0: UnitNeed(60, LADDER)}}) == {}


def test_never_over_budget_nor_full():
    rng = random.Random(7)
    for _ in range(300):
        needs = {}
        for branch in ("gen", "cfg_text", "cfg_img"):
            plan = {}
            for layer in range(rng.randint(1, 4)):
                rows = rng.randint(1, 300)
                ladder = quantized_ladder(rows, 2, 32, rng.choice((2, 4)), QuantGeometry())
                if rng.random() < 0.2:
                    ladder = ladder[:1]  # a layer with rows the table evicts: floor only
                full = ladder[-1].bytes
                plan[layer] = UnitNeed(rng.randint(0, full), ladder)
            needs[branch] = plan
        weights = {b: rng.choice((64.0, 36.0, 1.0, 0.0)) for b in needs}
        grants = branch_grants(needs, weights)
        given = [grants.get(b, {}).get(layer, 0) for b, plan in needs.items() for layer in plan]
        assert sum(given) <= 0  # the request never holds more than its budget
        for b, plan in needs.items():
            for layer, need in plan.items():
                got = need.budget + grants.get(b, {}).get(layer, 0)
                assert got >= 0
                assert got <= max(need.budget, need.levels[-1].bytes)  # never more than full (or its own budget)


def test_quantized_ladder_is_cheapest_first():
    ladder = quantized_ladder(256, 2, 32, 4, QuantGeometry())
    assert [lv.error for lv in ladder] == [4.0**-2, 4.0**-4, 4.0**-8, 0.0]
    assert [lv.bytes for lv in ladder] == sorted({lv.bytes for lv in ladder})
    assert ladder[-1].bytes == 256 * 2 * 2 * 32 * 4  # full precision: K and V of every row
    assert quantized_ladder(0, 2, 32, 4, QuantGeometry()) == (Level(0, 0.0),)


def test_guidance_weights_are_the_cfg_coefficients():
    # guided = s_i * (v_text + s_t * (v - v_text)) + (1 - s_i) * v_img
    assert guidance_weights(4.0, 2.0) == (("gen", 8.0), ("cfg_text", -6.0), ("cfg_img", -1.0))
    assert guidance_weights(4.0, 1.0) == (("gen", 4.0), ("cfg_text", -3.0))
    assert guidance_weights(1.0, 2.0) == (("gen", 1.0),)


class _Recorder(CacheFactory):
    """A factory that records the request each session starts with (full KV otherwise)."""

    def __init__(self):
        self.requests: list[RequestInfo] = []

    def start(self, request: RequestInfo) -> CacheSession:
        self.requests.append(request)
        return CacheSession(request)


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return load_bagel(tiny_checkpoint, dtype=torch.float32)


@pytest.mark.parametrize(
    ("task", "weights"),
    [
        ("edit", {"gen": 8.0, "cfg_text": -6.0, "cfg_img": -1.0}),
        ("t2i", {"gen": 6.0, "cfg_text": -4.5, "cfg_img": -0.5}),
    ],
)
def test_engine_passes_the_branch_weights(loaded, task, weights):
    recorder = _Recorder()
    pipe = BagelPipeline(loaded, recorder)
    if task == "edit":
        source = Image.new("RGB", (32, 32), (120, 30, 30))
        pipe.edit("make it blue", source, preset("edit", num_timesteps=2), seed=1)
    else:
        pipe.text_to_image("a red square", preset("t2i", num_timesteps=2, width=32, height=32), seed=1)
    request = recorder.requests[-1]
    assert request.task == task
    assert dict(request.branch_weights) == weights
    assert request.branch_weight("gen") == weights["gen"] and request.branch_weight("think") == 1.0
    with pytest.raises(ValueError, match="branch_weights"):
        RequestInfo(task="edit", num_layers=2, branch_weights=(("nope", 1.0),))
