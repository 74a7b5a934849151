"""TaylorSeer (unicache_core/bagel/taylorseer.py) against the official rule, re-derived here.

:class:`OfficialRule` restates, in this file's own code, the official per-branch state of ByteDance-Seed/Bagel
57c390a (``cache_init``, ``cal_type``, ``derivative_approximation``, ``taylor_formula`` in
``modeling/cache_utils/taylorseer.py``; one state per CFG branch, a ``total`` module per decoder layer in
``qwen2_navit.py``). A run on the tiny checkpoint records every decoder layer's output at every step the engine
computed and every branch velocity it used; the official rule, fed those outputs, must pick the same full steps
and, on every forecast step, forecast the velocity the engine used (``llm2vae`` of the final norm of its last
layer's forecast).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from cli_runs import run_bagel_cli
from comfy_stubs import TINY_NAME, NodeCall, host_stubs  # noqa: F401  (host_stubs: a fixture)
from PIL import Image

from unicache_core.bagel import BagelPipeline, load_bagel, preset
from unicache_core.bagel import denoise as denoise_module
from unicache_core.bagel.contexts import latent_gen_mask
from unicache_core.bagel.memory.accounting import count_request, request_memory_bytes, request_memory_parts
from unicache_core.bagel.memory.plan import PlanSettings, official_config, plan_memory
from unicache_core.bagel.taylorseer import TaylorRule, TaylorSeer
from unicache_core.compression import METHODS, make_cache_factory
from unicache_core.compression.schedule import RetentionSchedule
from unicache_core.compression.stats import step_chunk


@pytest.fixture(scope="module")
def loaded(tiny_checkpoint):
    return load_bagel(tiny_checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def source_image():
    rng = np.random.default_rng(3)
    return Image.fromarray(rng.integers(0, 256, size=(48, 64, 3), dtype=np.uint8))


class OfficialRule:
    """One CFG branch's state as the official code keeps it: a forward counter, the activated (full) steps, the
    interval counter and a dict of Taylor factors per decoder layer."""

    def __init__(self, interval: int, first: int, order: int, num_layers: int):
        self.interval, self.first, self.order = interval, first, order
        self.counter, self.activated, self.step = 0, [0], 0
        self.cache: dict[int, dict[int, torch.Tensor]] = {layer: {} for layer in range(num_layers)}

    def kind(self) -> str:
        """``cal_type``: the interval counter of a branch's forward (called once per forward, before its layers)."""
        if self.step < self.first or self.counter == self.interval - 1:
            self.counter = 0
            self.activated.append(self.step)
            return "full"
        self.counter += 1
        return "Taylor"

    def full(self, outputs: list[torch.Tensor]) -> None:
        """``taylor_cache_init`` and ``derivative_approximation`` of every layer's output."""
        for layer, feature in enumerate(outputs):
            if self.step == 0:
                self.cache[layer] = {}
            distance = self.activated[-1] - self.activated[-2]
            factors = {0: feature}
            for i in range(self.order):
                if self.cache[layer].get(i) is None or not self.step > self.first - 2:
                    break
                factors[i + 1] = (factors[i] - self.cache[layer][i]) / distance
            self.cache[layer] = factors

    def forecast(self) -> list[torch.Tensor]:
        """``taylor_formula`` of every layer."""
        x = self.step - self.activated[-1]
        outputs = []
        for layer in sorted(self.cache):
            out = 0
            for i in range(len(self.cache[layer])):
                out += (1 / math.factorial(i)) * self.cache[layer][i] * (x**i)
            outputs.append(out)
        return outputs


def _recorded_run(loaded, monkeypatch, call):
    """``call()`` with every decoder layer's denoising output recorded per (branch, step), and the raw branch
    velocities of every step: ``(result, outputs, velocities)``."""
    outputs: dict[tuple[str, int], dict[int, torch.Tensor]] = {}
    handles = []
    for index, layer in enumerate(loaded.model.language_model.model.layers):

        def record(module, args, output, index=index):
            cache, attention_call = args[4], args[5]
            if attention_call.phase == "denoise":
                outputs.setdefault((cache.branch, attention_call.step), {})[index] = output.detach().clone()

        handles.append(layer.register_forward_hook(record))
    velocities: list[dict[str, torch.Tensor]] = []
    guided_velocity = denoise_module.guided_velocity

    def spy(*args, **kwargs):
        v, raw = guided_velocity(*args, **kwargs)
        velocities.append({name: t.clone() for name, t in raw.items()})
        return v, raw

    monkeypatch.setattr(denoise_module, "guided_velocity", spy)
    try:
        result = call()
    finally:
        for handle in handles:
            handle.remove()
    return result, outputs, velocities


@pytest.mark.parametrize(
    "changes",
    [
        {},  # the official defaults (3 / 5 / 6): CFG branches stop at t <= 0.4
        {"cfg_interval": (0.0, 0.7), "taylorseer_interval": 2, "taylorseer_first_steps": 3, "taylorseer_order": 2},
    ],
    ids=["official", "late_cfg_other_knobs"],
)
def test_full_steps_and_forecasts_equal_the_official_rule(loaded, monkeypatch, changes):
    """With guidance on from a later step (``cfg_interval`` hi 0.7) the CFG branches count their own forwards from
    there, as the official per-branch counters do."""
    settings = preset("t2i", width=64, height=48, num_timesteps=26, taylorseer=True, **changes)
    pipe = BagelPipeline(loaded, make_cache_factory("full"))
    result, outputs, velocities = _recorded_run(
        loaded, monkeypatch, lambda: pipe.text_to_image("a red circle", settings, seed=4)
    )
    layers = loaded.config.llm.num_hidden_layers
    rule = {
        name: OfficialRule(
            settings.taylorseer_interval, settings.taylorseer_first_steps, settings.taylorseer_order, layers
        )
        for name in ("gen", "cfg_text", "cfg_img")
    }
    full, forecast = set(), set()
    for step, raw in enumerate(velocities):
        for name, velocity in raw.items():  # the branches this step used, in their run order
            state = rule[name]
            if state.kind() == "full":
                full.add((name, step))
                assert (name, step) in outputs, f"{name} step {step} is full officially but ran no decoder layer"
                state.full([outputs[(name, step)][layer] for layer in range(layers)])
            else:
                forecast.add((name, step))
                hidden = state.forecast()[-1]  # only the last layer's forecast reaches the output
                mask = latent_gen_mask(hidden.shape[0] - 2, hidden.device)
                expected = loaded.model.latent_velocity(loaded.model.final_norm(hidden, mask)[1:-1])
                torch.testing.assert_close(velocity, expected, rtol=0, atol=0, msg=f"{name} step {step}")
            state.step += 1
    assert set(outputs) == full, "the engine ran the decoder on exactly the official full steps"
    assert forecast and all(len(per_layer) == layers for per_layer in outputs.values())
    # the expansion reached its highest order (the official cap), so every order was exercised
    assert max(len(f) for state in rule.values() for f in state.cache.values()) == settings.taylorseer_order + 1
    if "cfg_interval" in changes:  # the CFG branches started later than gen, so their forward numbers differ
        first_cfg = min(step for name, step in outputs if name == "cfg_text")
        assert first_cfg > 0 and ("cfg_text", first_cfg + settings.taylorseer_first_steps) not in outputs
    counts = {name: sum(1 for n, _ in full if n == name) for name in rule}
    assert result.info["forwards"] == counts
    assert result.info["forecasts"] == {name: sum(1 for n, _ in forecast if n == name) for name in rule}
    summary = result.kv_report["summary"]
    assert summary["denoise_forwards"] == {k: v for k, v in counts.items() if v}
    assert summary["forecast_steps"] == sorted({step for _, step in forecast})
    # a branch's factors: at most order + 1 latent blocks [4 * 3 + 2, hidden] (fp32), the last layer's only
    per_branch = (settings.taylorseer_order + 1) * (4 * 3 + 2) * loaded.config.llm.hidden_size * 4
    assert per_branch <= result.info["taylorseer_peak_bytes"] <= 3 * per_branch


def test_the_rule_alone():
    """Which forwards are full, and the expansion by hand: for ``f(n) = a + b n + c n^2`` differenced at 4, 7 and
    10, ``F_1 = b + 17 c`` (the backward difference) and ``F_2 = 2 c``, so ``f(10 + x)`` is forecast as
    ``f(10) + (b + 17 c) x + c x^2``."""
    rule = TaylorRule(interval=3, first_steps=5, order=2)
    assert [n for n in range(20) if rule.is_full(n)] == [0, 1, 2, 3, 4, 7, 10, 13, 16, 19]
    assert all(TaylorRule(1, 1, 6).is_full(n) for n in range(10))
    seer = TaylorSeer(rule, [["gen"]] * 20)
    a, b, c = 1.0, 0.5, -0.25
    feature = lambda n: torch.tensor([[a + b * n + c * n * n]], dtype=torch.float64)  # noqa: E731
    for n in (4, 7, 10):
        seer.factors["gen"].update(n, feature(n))
    for x in (1, 2):
        expected = feature(10) + (b + 17 * c) * x + c * x * x
        torch.testing.assert_close(seer.factors["gen"].forecast(10 + x), expected)
    assert len(seer.factors["gen"].factors) == 3
    assert seer.next_full(10, ["gen"]) == {"gen": 13} and seer.next_full(19, ["gen"]) == {"gen": None}
    assert seer.forecast_branches(11, ["gen"]) == ("gen",) and seer.forecast_branches(13, ["gen"]) == ()


def test_settings_are_checked_and_the_cli_names_the_flag(tiny_checkpoint, tmp_path, capsys):
    base = preset("t2i")
    assert (base.taylorseer, base.taylorseer_interval, base.taylorseer_first_steps, base.taylorseer_order) == (
        False,
        3,
        5,
        6,
    )
    for field, value in (
        ("taylorseer_interval", 0),
        ("taylorseer_first_steps", 0),
        ("taylorseer_order", 7),
        ("taylorseer_order", 2.0),
        ("taylorseer", 1),
    ):
        with pytest.raises(ValueError, match=f"`{field}`"):
            base.replace(**{field: value})
    code, _, err = run_bagel_cli(
        capsys,
        "t2i",
        "--checkpoint",
        str(tiny_checkpoint),
        "--prompt",
        "x",
        "--taylorseer",
        "--taylorseer-first-steps",
        "0",
    )
    assert code == 2 and err.strip().splitlines() == [
        "error: --taylorseer-first-steps: `taylorseer_first_steps` must be an integer >= 1 and <= 1000, got 0"
    ]


def test_cli_t2i_50_steps_runs_a_third_of_the_forwards_after_the_first_five(tiny_checkpoint, tmp_path, capsys):
    """The issue's check: the same call with and without ``--taylorseer``; the report counts the forwards."""
    import json

    summaries = {}
    for flag in ((), ("--taylorseer",)):
        report = tmp_path / f"report{len(flag)}.json"
        args = ["t2i", "--checkpoint", str(tiny_checkpoint), "--prompt", "a red circle", "--steps", "50"]
        args += ["--width", "32", "--height", "32", "--out", str(tmp_path / f"out{len(flag)}.png"), "--report"]
        code, _, err = run_bagel_cli(capsys, *args, str(report), "-q", *flag)
        assert code == 0, err
        summaries[flag] = json.loads(report.read_text())["summary"]
    plain, seer = summaries[()], summaries[("--taylorseer",)]
    assert plain["denoise_forwards"]["gen"] == 49 and not plain["forecast_forwards"] and not plain["forecast_steps"]
    assert seer["denoise_forwards"]["gen"] == 19 and seer["forecast_forwards"]["gen"] == 30
    # after the first five steps: 14 of 44 forwards, one in three (steps 7, 10, ..., 46)
    assert seer["denoise_forwards"]["gen"] - 5 == len(range(7, 49, 3)) == 14
    assert seer["forecast_steps"][:4] == [5, 6, 8, 9]


@pytest.mark.parametrize("method", METHODS)
def test_every_kv_method_runs_with_forecast_steps(loaded, source_image, method):
    """An edit with TaylorSeer under every KV method: the same forecast steps, no more bytes than full KV's."""
    settings = preset("edit", num_timesteps=14, taylorseer=True)
    result = BagelPipeline(loaded, make_cache_factory(method)).edit("make it blue", source_image, settings, seed=2)
    summary = result.kv_report["summary"]
    assert summary["forecast_steps"] == [5, 6, 8, 9, 11, 12]
    assert result.info["forwards"] == {"gen": 7, "cfg_text": 7, "cfg_img": 7}
    assert summary["steady_managed_bytes"] <= summary["full_managed_bytes"]
    for record in result.kv_report["steps"]:
        for name, branch in record["branches"].items():
            assert branch["forecast"] == (name in record["forecast"])
            if branch["forecast"]:
                assert branch["attended_rows"] == 0 and not branch["observed"] and not branch["compressed_after"]


def test_unicache_measures_on_full_steps_and_keeps_rho_on_the_steps_schedule(loaded, source_image, monkeypatch):
    """UniCache with forecast steps (docs/compression.md §11.12): statistics only from computed steps; each step
    chunk is measured at the branch's last computed step in it (step 4 for chunk 1-5, whose end is forecast); the
    retention schedule takes the chunk of that step (not of the branch's forward count); never more bytes than
    full KV's at any step."""
    settings = preset("edit", num_timesteps=30, taylorseer=True)
    observed_chunks: list[int] = []
    observe = RetentionSchedule.observe

    def spy(self, chunk, mass):
        observed_chunks.append(chunk)
        return observe(self, chunk, mass)

    monkeypatch.setattr(RetentionSchedule, "observe", spy)
    full = BagelPipeline(loaded, make_cache_factory("full")).edit("make it blue", source_image, settings, seed=6)
    # rho at its floor only after a later chunk: a low floor keeps the branches measuring to the end
    factory = make_cache_factory("unicache", rho_floor=0.01)
    uni = BagelPipeline(loaded, factory).edit("make it blue", source_image, settings, seed=6)
    seer = TaylorSeer(TaylorRule.from_settings(settings), [["gen", "cfg_text", "cfg_img"]] * settings.num_steps)
    steps = uni.kv_report["steps"]
    observed = set()
    for record, full_record in zip(steps, full.kv_report["steps"], strict=True):
        assert record["managed_bytes_all"] <= full_record["managed_bytes_all"]
        assert record["held_bytes"] <= full_record["held_bytes"]
        for name, branch in record["branches"].items():
            assert branch["forecast"] == (not seer.is_full(name, record["step"]))
            assert branch["observed"] == branch["compressed_after"]
            if branch["observed"]:
                observed.add((name, record["step"]))
    last_of_chunk = {
        (name, step)
        for name, full_steps in seer.full_steps.items()
        for step, following in zip(full_steps, full_steps[1:])
        if step_chunk(following) != step_chunk(step)
    }
    assert observed, "UniCache measured nothing"
    assert all(step == 0 or (name, step) in last_of_chunk for name, step in observed), sorted(observed)
    assert {("gen", 0), ("gen", 4), ("gen", 10), ("gen", 13)} <= observed  # chunk ends 5 and 15 are forecast
    assert set(observed_chunks) - {0} == {step_chunk(step) for _, step in observed if step}
    for name in ("gen", "cfg_text", "cfg_img"):  # rho moves only where the branch measured, and never rises
        rhos = [(r["step"], r["branches"][name]["rho"]) for r in steps if r["branches"][name]["rho"] is not None]
        for (_, before), (step, after) in zip(rhos, rhos[1:]):
            assert after <= before and (after == before or (name, step) in observed)


def test_memory_plan_and_node_memory_count_the_factors(loaded):
    """The factors' bytes: ``order + 1`` latent-block tensors per CFG branch, the last layer's (BAGEL-7B's
    geometry: 1024 px edit, bf16), in the LLM phase; the official per-layer figure as a detail."""
    config = official_config()
    plans = {
        seer: plan_memory(config, PlanSettings(task="edit", width=1024, height=1024, taylorseer=seer), 1 << 50)
        for seer in (False, True)
    }
    per_branch = 7 * (64 * 64 + 2) * 3584 * 2
    assert plans[True].breakdown["taylorseer"] == 3 * per_branch
    assert plans[True].breakdown["taylorseer_official"] == 28 * 3 * per_branch
    assert "taylorseer" not in plans[False].breakdown
    for plan in plans.values():  # the factors live in the LLM phase; at 1024 px the VAE decode is larger
        parts = plan.breakdown
        llm = parts["kv_full"] + parts["upcast"] + parts["attention"] + parts["mlp"] + parts.get("taylorseer", 0)
        assert parts["working"] == max(llm, parts["vae_working"] + parts["cuda_vae_workspace"])
        assert llm < parts["working"]
    settings = preset("t2i", width=64, height=64, taylorseer=True)
    tokens = count_request(loaded.config, loaded.tokenizer, "t2i", "a red circle", settings)
    parts = request_memory_parts(loaded.config, loaded.dtype, tokens, taylor_order=settings.taylorseer_order)
    assert parts["taylorseer"] == 3 * 7 * (16 + 2) * loaded.config.llm.hidden_size * 4
    assert (
        request_memory_bytes(loaded.config, loaded.dtype, tokens, taylor_order=6) >= parts["kv"] + parts["taylorseer"]
    )


def test_nodes_take_an_optional_taylorseer_input(host_stubs):  # noqa: F811
    import nodes

    (model,) = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheBagelLoader"]).load(TINY_NAME, "fp32", "auto")
    for node_id in ("UniCacheTextToImage", "UniCacheImageEdit"):
        spec = nodes.NODE_CLASS_MAPPINGS[node_id].INPUT_TYPES()
        assert "taylorseer" not in spec["required"] and spec["optional"]["taylorseer"][1]["default"] is False
    t2i = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheTextToImage"])
    args = (model, "a red cube", 32, 32, 10, 7, 4.0, 1.5, 0.4, 1.0, 3.0, 0.0, "global", False)
    *_, plain = t2i.generate(*args)
    *_, seer = t2i.generate(*args, taylorseer=True)
    assert plain["summary"]["forecast_steps"] == [] and seer["summary"]["forecast_steps"] == [5, 6, 8]
    edit = NodeCall(nodes.NODE_CLASS_MAPPINGS["UniCacheImageEdit"])
    image = torch.rand(1, 32, 32, 3, generator=torch.Generator().manual_seed(0))
    *_, report = edit.edit(
        model, image, "make it blue", 8, 0, 4.0, 2.0, 0.0, 1.0, 3.0, 0.0, "text_channel", False, taylorseer=True
    )
    assert report["summary"]["forecast_steps"] == [5, 6]
