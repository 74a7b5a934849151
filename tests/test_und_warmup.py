"""The understanding warm-up before stage 2: its samples, its rate, resuming inside it, the fresh stage-2
optimiser after it, and a run without it (``und_warmup=0``) trained exactly as before it existed."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_pre_hook

from training import TrainConfig, run, trainer
from training.bagel_stage import BAGEL_STATE, UND_WARMUP_STATE, SampleMaker, is_generation_parameter, train_und_warmup
from training.config import learning_rate
from training.model import ShapesGeometry, build_models, shapes_config, shapes_tokenizer, shapes_tokenizer_files
from training.state import saved_step
from training.vae_stage import Pool
from unicache_core.shapes import world

#: A small geometry and a run of a few steps of each stage (eager, so that a resumed run can match bitwise).
GEOMETRY = dict(
    hidden=32,
    layers=2,
    heads=2,
    kv_heads=1,
    intermediate=64,
    vit_hidden=32,
    vit_layers=1,
    vit_heads=1,
    ae_ch=32,
    ae_mult=(1, 1, 1, 1),
    ae_res_blocks=1,
)
WARMUP_STEPS, STAGE2_STEPS = 5, 3


def _config(**overrides) -> TrainConfig:
    base = dict(
        model=GEOMETRY,
        vae_steps=2,
        vae_batch=2,
        pool_size=4,
        steps=STAGE2_STEPS,
        batch={"t2i": 1, "edit": 1, "und": 2},
        save_every=2,
        warmup=2,
        compile=False,
        und_warmup=WARMUP_STEPS,
        und_warmup_batch=2,
        vae_eval_scenes=4,
        latent_stat_pairs=8,
    )
    base.update(overrides)
    return TrainConfig(**base)


def _fresh_model(cfg: TrainConfig):
    bagel_cfg = shapes_config(shapes_tokenizer_files()[2], ShapesGeometry(**cfg.model))
    return build_models(bagel_cfg, cfg.seed, unit_input_init=cfg.unit_input_init)


def _params(path) -> dict:
    return {k[6:]: v for k, v in load_file(str(path)).items() if k.startswith("param.")}


def _adam_steps(path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["state"])["adam_steps"]


class _Spy:
    """Records every optimiser step (the optimiser and its groups' rates) and the weights stage 2 starts from,
    until ``close()``."""

    def __init__(self, monkeypatch):
        from training import bagel_stage

        self.optimisers: list = []  # in order of their first step
        self.rates: dict[int, list[list[float]]] = {}
        self.stage2_start: dict[str, torch.Tensor] = {}
        self._hook = register_optimizer_step_pre_hook(self._before_step)

        def train_bagel(model, *args, **kwargs):
            self.stage2_start = {n: p.detach().clone() for n, p in model.named_parameters()}
            return bagel_stage.train_bagel(model, *args, **kwargs)

        monkeypatch.setattr(trainer, "train_bagel", train_bagel)

    def _before_step(self, opt, args, kwargs):
        if id(opt) not in self.rates:
            self.optimisers.append(opt)
            self.rates[id(opt)] = []
        self.rates[id(opt)].append([g["lr"] for g in opt.param_groups])

    def close(self):
        self._hook.remove()


@pytest.fixture(scope="module")
def warm_run(tmp_path_factory):
    """One uninterrupted run with a warm-up: ``(info, work, spy)``."""
    tmp = tmp_path_factory.mktemp("warm")
    with pytest.MonkeyPatch.context() as mp:
        spy = _Spy(mp)
        try:
            info = run(tmp / "ckpt", tmp / "work", _config())
        finally:
            spy.close()
    return info, tmp / "work", spy


def test_warmup_samples_are_one_object_position_questions():
    cfg = _config(und_warmup_batch=6)
    bagel_cfg = shapes_config(shapes_tokenizer_files()[2], ShapesGeometry(**GEOMETRY))
    _, vae = build_models(bagel_cfg, 0)
    tok = shapes_tokenizer()
    empty_pool = Pool([], torch.zeros(0), torch.zeros(0))  # the warm-up draws no pool pair
    maker = SampleMaker(cfg, bagel_cfg, empty_pool, tok, vae)
    seen = set()
    for step in range(4):
        asked = maker.und_warmup_questions(step)
        assert len(asked) == 6
        for scene, q in asked:
            (obj,) = scene.objects
            assert q.kind == "position" and q.question == f"where is the {obj.name}?"
            assert q.answer == obj.position
            seen.add((scene.background, obj))
        samples = maker.und_warmup_draw(step)
        assert samples["t2i"] == [] and samples["edit"] == [] and len(samples["und"]) == 6
        for sample, (scene, q) in zip(samples["und"], asked):
            vit, question, answer = sample.blocks
            assert torch.equal(vit.pixels, maker.vit(scene).pixels)
            assert tok.decode(question.ids[1:-1]) == q.question and not question.loss
            assert tok.decode(answer.ids[1:-1]) == q.answer and answer.loss
    assert len(seen) > 20  # fresh scenes every step, not a fixed few
    # the stream depends on (seed, step) only
    assert maker.und_warmup_questions(3) == maker.und_warmup_questions(3) != maker.und_warmup_questions(2)
    # the world's question source: one object when asked for, 1..3 otherwise (the default stream is unchanged)
    assert {len(world.understanding_sample(s, "position")[0].objects) for s in range(40)} == {1, 2, 3}
    assert all(len(world.understanding_sample(s, max_objects=1)[0].objects) == 1 for s in range(40))


def test_warmup_rate_schedule_and_fresh_stage2_optimiser(warm_run):
    info, work, spy = warm_run
    cfg = _config()
    vae_opt, warm_opt, stage2_opt = spy.optimisers
    # the warm-up: its own schedule over its own steps, every group at the same rate, no generation parameter
    expected = [
        learning_rate(s, WARMUP_STEPS, cfg.und_warmup_lr, cfg.warmup, cfg.min_lr_ratio) for s in range(WARMUP_STEPS)
    ]
    assert [rates[0] for rates in spy.rates[id(warm_opt)]] == expected
    assert all(len(set(rates)) == 1 for rates in spy.rates[id(warm_opt)])
    names = {id(p): n for n, p in _fresh_model(cfg)[0].named_parameters()}
    warm_params = {id(p) for g in warm_opt.param_groups for p in g["params"]}
    assert warm_params and all(g["lr_scale"] == 1.0 for g in warm_opt.param_groups)
    # stage 2: its schedule from step 0 over its own steps (unchanged by the warm-up), generation path scaled
    stage2 = [learning_rate(s, STAGE2_STEPS, cfg.lr, cfg.warmup, cfg.min_lr_ratio) for s in range(STAGE2_STEPS)]
    assert [sorted(set(r)) for r in spy.rates[id(stage2_opt)]] == [[lr, lr * cfg.gen_lr_scale] for lr in stage2]
    assert [row[0] for row in info["bagel_log"]] == [STAGE2_STEPS]
    # fresh moments: the stage-2 state counts its own steps only, the warm-up state its own
    warm_steps, stage2_steps = _adam_steps(work / UND_WARMUP_STATE), _adam_steps(work / BAGEL_STATE)
    assert not any(is_generation_parameter(n) for n in warm_steps) and len(names) > len(warm_steps)
    assert set(warm_steps.values()) == {WARMUP_STEPS}
    assert stage2_steps["connector.fc1.weight"] == STAGE2_STEPS
    assert set(stage2_steps.values()) == {STAGE2_STEPS}
    # stage 2 starts from the warm-up's weights; the warm-up left the generation path at its initial values
    warm = _params(work / UND_WARMUP_STATE)
    fresh = dict(_fresh_model(cfg)[0].named_parameters())
    assert set(spy.stage2_start) == set(warm)
    assert all(torch.equal(spy.stage2_start[n], warm[n]) for n in warm)
    assert all(torch.equal(warm[n], fresh[n].detach()) for n in warm if is_generation_parameter(n))
    assert not torch.equal(warm["connector.fc1.weight"], fresh["connector.fc1.weight"].detach())
    # the record: the warm-up's steps, log and seconds
    record = json.loads((work.parent / "ckpt" / "training.json").read_text())
    assert record["config"]["und_warmup"] == WARMUP_STEPS and record["und_warmup_log"][-1][0] == WARMUP_STEPS
    assert record["und_warmup_log"] == info["und_warmup_log"] and info["seconds"]["und_warmup_s"] > 0
    assert all(row[2] == 0.0 and row[3] > 0 for row in info["und_warmup_log"])  # understanding only: no MSE
    assert vae_opt is not warm_opt and warm_opt is not stage2_opt


def test_a_run_interrupted_in_the_warmup_resumes_there_to_the_same_weights(warm_run, tmp_path):
    info, reference, _ = warm_run

    def stop_in_the_warmup(stage, done, total):
        if stage == "und_warmup" and done == 3:
            raise KeyboardInterrupt

    out, work = tmp_path / "ckpt", tmp_path / "work"
    with pytest.raises(KeyboardInterrupt):
        run(out, work, _config(), stop_in_the_warmup)
    assert saved_step(work / UND_WARMUP_STATE) == 2 and not (work / BAGEL_STATE).exists()
    first = json.loads((work / "times.json").read_text())["und_warmup_s"]
    resumed = run(out, work, _config())
    assert resumed["seconds"]["sessions"] == 2 and resumed["seconds"]["und_warmup_s"] > first > 0
    assert [row[0] for row in resumed["und_warmup_log"]] == [WARMUP_STEPS]
    for name in (UND_WARMUP_STATE, BAGEL_STATE):
        ours, theirs = _params(work / name), _params(reference / name)
        assert ours.keys() == theirs.keys()
        for key in ours:
            torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=1e-6, msg=f"{name}: {key}")
    # a resumed session must keep the run's warm-up length: stage 2 has begun after 5 warm-up steps
    with pytest.raises(ValueError, match="warm-up of 5 steps, but this run asks for --und-warmup 2"):
        run(out, work, _config(und_warmup=2))
    from training.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main([str(out), "--work", str(work), "--und-warmup", "0"])
    assert exc.value.code == 2


def test_no_warmup_is_the_run_without_the_option(tmp_path, monkeypatch, capsys):
    """``und_warmup=0``: no warm-up state, nothing recorded for it, and stage 2 starts from the initial
    weights."""
    from training.__main__ import main

    spy = _Spy(monkeypatch)
    cfg = _config(und_warmup=0)
    try:
        info = run(tmp_path / "ckpt", tmp_path / "work", cfg)
    finally:
        spy.close()
    assert len(spy.optimisers) == 2  # the VAE's and stage 2's
    started = spy.stage2_start
    assert not (tmp_path / "work" / UND_WARMUP_STATE).exists()
    assert info["und_warmup_log"] == [] and info["seconds"]["und_warmup_s"] == 0.0
    fresh = dict(_fresh_model(cfg)[0].named_parameters())
    assert started.keys() == fresh.keys() and all(torch.equal(started[n], fresh[n].detach()) for n in fresh)
    # the CLI: the pilot's warm-up by default, --und-warmup 0 turns it off and nothing else
    defaults = TrainConfig()
    assert (defaults.und_warmup, defaults.und_warmup_lr, defaults.und_warmup_batch) == (600, 2e-4, 16)
    seen = {}

    def fake_run(out, work, cfg, progress=None):
        seen["cfg"] = cfg
        raise KeyboardInterrupt  # stop before any work

    monkeypatch.setattr(trainer, "run", fake_run)
    assert main([str(tmp_path / "out"), "--und-warmup", "0"]) == 130
    assert seen["cfg"] == TrainConfig(und_warmup=0)
    assert main([str(tmp_path / "out"), "--und-warmup", "50", "--und-warmup-lr", "1e-4"]) == 130
    assert seen["cfg"] == TrainConfig(und_warmup=50, und_warmup_lr=1e-4)
    for bad in (["--und-warmup", "-1"], ["--und-warmup-lr", "0"]):
        with pytest.raises(SystemExit) as exc:
            main([str(tmp_path / "out"), *bad])
        assert exc.value.code == 2
        assert "--und-warmup must be >= 0 and --und-warmup-lr > 0" in capsys.readouterr().err


def test_model_card_states_the_warmup():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("model_card", root / "tools" / "model_card.py")
    card_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(card_module)
    record = json.loads((root / "models" / "bagel" / "unicache-shapes" / "training.json").read_text())
    cfg = dict(record["config"], und_warmup=600, und_warmup_lr=2e-4, und_warmup_batch=16)
    seconds = dict(record["seconds"], und_warmup_s=120.0)
    text = card_module.card(dict(record, config=cfg, seconds=seconds), None)
    assert "600 understanding-only warm-up steps" in text
    assert "Understanding warm-up: 600 steps in 2.0 min." in text
    without = dict(
        record,
        config=dict(record["config"], und_warmup=0),
        seconds={k: v for k, v in record["seconds"].items() if k != "und_warmup_s"},
    )
    before = card_module.card(without, None)
    assert "warm-up" not in before
    total = lambda t: float(t.split("Total: ")[1].split(" min")[0])  # noqa: E731
    assert total(text) == pytest.approx(total(before) + 2.0, abs=0.051)


def test_warmup_kinds_are_taken_in_turn_and_checked_by_the_cli(tmp_path, capsys):
    """``und_warmup_kinds=["position", "shape"]``: sample i of a step asks kind i % 2 about its one object; the
    CLI refuses an unknown kind before any work."""
    import pytest

    from training.__main__ import main

    cfg = _config(und_warmup_batch=4, und_warmup_kinds=["position", "shape"])
    bagel_cfg = shapes_config(shapes_tokenizer_files()[2], ShapesGeometry(**GEOMETRY))
    _, vae = build_models(bagel_cfg, 0)
    maker = SampleMaker(cfg, bagel_cfg, Pool([], torch.zeros(0), torch.zeros(0)), shapes_tokenizer(), vae)
    for step in range(3):
        asked = maker.und_warmup_questions(step)
        assert [q.kind for _, q in asked] == ["position", "shape", "position", "shape"]
        for scene, q in asked:
            (obj,) = scene.objects
            assert q.answer == (obj.position if q.kind == "position" else obj.shape)
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "out"), "--und-warmup-kinds", "position,colour"])
    assert exc.value.code == 2 and "--und-warmup-kinds: got 'position,colour'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="one or more of"):  # the API path: the warm-up itself refuses none
        train_und_warmup(None, maker, dataclasses.replace(cfg, und_warmup_kinds=[]), tmp_path)
    assert not (tmp_path / "out").exists()
