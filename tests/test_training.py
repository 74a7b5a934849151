"""The training code stays alive: a few steps of both stages, resume, export, and the pipeline loads it."""

import json

import pytest
import torch
from safetensors import safe_open

from training import TrainConfig, run
from training.bagel_stage import SampleMaker
from training.batches import pack
from training.model import ShapesGeometry, build_models, shapes_config, shapes_tokenizer, shapes_tokenizer_files
from training.vae_stage import build_pool
from unicache_core.bagel import BagelPipeline, load_bagel, preset
from unicache_core.shapes import t2i_sample

SMALL = dict(
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


def _cfg(**kw):
    # eager: compiling the layers costs ~30 s a run (test_compiled_bf16_step_matches_eager_fp32 covers that path);
    # the pool holds 4 pairs, the VAE is scored on 2 held-out scenes and the latent statistics come from 4 pairs
    # (the shipped 64 and 256 made those passes 80% of a run's time, 8/4/8 still a third; what the tests check does
    # not depend on the counts, and a batch draws 2 samples per task from the pool)
    base = dict(
        model=SMALL,
        vae_steps=4,
        vae_batch=2,
        pool_size=4,
        steps=4,
        stop_at=0,
        batch={"t2i": 2, "edit": 2, "und": 2},
        save_every=2,
        warmup=2,
        compile=False,
        und_warmup=0,
        vae_eval_scenes=2,
        latent_stat_pairs=4,
    )
    base.update(kw)
    return TrainConfig(**base)


def _state_step(path):
    with safe_open(str(path), "pt") as f:
        return json.loads(f.metadata()["state"])["step"]


def test_train_resume_export_and_load(tmp_path):
    out, work = tmp_path / "ckpt", tmp_path / "work"
    info = run(out, work, _cfg())
    assert _state_step(work / "bagel_state.safetensors") == 4
    assert [row[0] for row in info["bagel_log"]] == [4]
    # resuming continues from the saved step instead of starting over
    info = run(out, work, _cfg(steps=6, vae_steps=4))
    assert _state_step(work / "bagel_state.safetensors") == 6
    assert [row[0] for row in info["bagel_log"]] == [4, 6]
    assert info["latent_scale"] > 0
    # a finished run only re-exports (no pool is encoded again); seconds add up over the sessions
    again = run(out, work, _cfg(steps=6, vae_steps=4))
    assert again["bagel_log"] == info["bagel_log"] and again["seconds"]["pool_s"] <= info["seconds"]["pool_s"] + 0.5
    assert again["seconds"]["sessions"] == 3 and again["seconds"]["vae_s"] >= info["seconds"]["vae_s"]
    # a longer schedule stopped where the saved state is: nothing more is trained, the config records both
    stopped = run(out, work, _cfg(steps=10, stop_at=6, vae_steps=4))
    assert stopped["bagel_log"] == info["bagel_log"] and stopped["config"]["stop_at"] == 6
    loaded = load_bagel(out, dtype=torch.float32)
    assert loaded.config.ae.scale_factor == info["latent_scale"]
    assert loaded.config.transforms.vae.max_size == 128
    pipe = BagelPipeline(loaded)
    scene = t2i_sample(0)
    res = pipe.text_to_image(scene.caption(), preset("t2i", width=128, height=128, num_timesteps=3), seed=0)
    assert res.image.size == (128, 128)
    ans = pipe.understand("what color is the background?", scene.render(), preset("understanding", max_new_tokens=2))
    assert isinstance(ans.text, str)


def test_a_stopped_session_keeps_the_training_time_of_its_last_saved_state(tmp_path):
    """A run interrupted after a save still counts its stage-2 time up to that state in ``times.json`` (the next
    session resumes there and adds its own), so a split run's record does not undercount."""
    import pytest

    out, work = tmp_path / "ckpt", tmp_path / "work"

    def stop_after_step_3(stage, done, total):
        if stage == "bagel" and done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(out, work, _cfg(steps=6, save_every=2), stop_after_step_3)
    assert _state_step(work / "bagel_state.safetensors") == 2
    first = json.loads((work / "times.json").read_text())["bagel_s"]
    assert first > 0
    info = run(out, work, _cfg(steps=6, save_every=2))
    assert info["seconds"]["sessions"] == 2 and info["seconds"]["bagel_s"] > first
    assert json.loads((out / "training.json").read_text())["seconds"] == info["seconds"]


def _small_maker(**cfg_kw) -> tuple[SampleMaker, object]:
    """A sample maker over a 4-pair pool of the SMALL model (random weights); ``(maker, tokenizer)``."""
    vocab = shapes_tokenizer_files()[2]
    cfg = shapes_config(vocab, ShapesGeometry(**SMALL))
    _, vae = build_models(cfg, 0)
    tok = shapes_tokenizer()
    return SampleMaker(_cfg(**cfg_kw), cfg, build_pool(vae, 4), tok, vae), tok


def test_packed_batch_masks_follow_bagel_blocks():
    maker, tok = _small_maker(drop_text=0.0, drop_image=0.0)
    samples = maker.draw(0)
    batch = pack(samples, start_id=tok.start_of_image, end_id=tok.end_of_image, vit_patch=14, max_latent_size=64)
    edit_group = batch.groups[1]
    mask = edit_group.mask[0]
    n = len(samples["edit"][0].blocks[2].ids)  # [vs vae(64) ve] [vs vit(64) ve] [im_start text im_end] [vs noisy ve]
    end = 132 + n + 66
    assert mask[:66, :66].all() and not mask[:66, 66:].any()  # source VAE block: bidirectional, sees nothing later
    assert mask[66:132, :132].all() and not mask[66:132, 132:].any()
    text = mask[132 : 132 + n, 132 : 132 + n]
    assert torch.equal(text, torch.tril(torch.ones_like(text)))  # text is causal, sees both images
    assert mask[132 : 132 + n, :132].all() and not mask[132 : 132 + n, 132 + n :].any()
    assert mask[132 + n : end, :end].all()  # the noisy latents see everything before and each other
    # positions: one RoPE position per image block, one per text token, the latents at the next one
    pos = batch.positions[edit_group.offset : edit_group.offset + edit_group.length]
    assert (pos[:66] == 0).all() and (pos[66:132] == 1).all()
    assert pos[132 : 132 + n].tolist() == list(range(2, 2 + n)) and (pos[132 + n : end] == 2 + n).all()
    assert batch.gen_mask[edit_group.offset + 1 : edit_group.offset + 65].all()
    assert not batch.gen_mask[edit_group.offset + 66 : edit_group.offset + 132 + n].any()
    # one MSE target per noisy latent token (t2i and edit samples), CE targets are answer ids shifted by one
    assert batch.mse_slots.numel() == batch.mse_targets.shape[0] == 64 * 4
    answer = samples["und"][0].blocks[2].ids
    assert batch.ce_targets[: len(answer) - 1].tolist() == answer[1:]


def test_unit_input_init_scales_the_image_input_path_only():
    files, _, vocab, _, _ = shapes_tokenizer_files()
    cfg = shapes_config(vocab)
    plain_model, plain_vae = build_models(cfg, 0)
    model, vae = build_models(cfg, 0, unit_input_init=True)
    for weight in (model.connector.fc1.weight, model.vae2llm.weight):
        assert abs(float(weight.std()) * weight.shape[1] ** 0.5 - 1.0) < 0.1
    assert abs(float(plain_model.vae2llm.weight.std()) - 0.02) < 0.003  # the default: N(0, 0.02)
    # the LLM and the VAE are unchanged: the input path draws from its own stream
    q, plain_q = (m.language_model.model.layers[0].self_attn.q_proj.weight for m in (model, plain_model))
    assert torch.equal(q, plain_q) and abs(float(q.std()) - 0.02) < 0.002
    assert all(torch.equal(a, b) for a, b in zip(vae.state_dict().values(), plain_vae.state_dict().values()))
    # the understanding side only: the ViT and connector as above, the generation inputs stay at N(0, 0.02)
    und_model, _ = build_models(cfg, 0, unit_input_init="und")
    assert torch.equal(und_model.connector.fc1.weight, model.connector.fc1.weight)
    assert torch.equal(und_model.vae2llm.weight, plain_model.vae2llm.weight)
    assert torch.equal(und_model.time_embedder.mlp[0].weight, plain_model.time_embedder.mlp[0].weight)
    assert build_models(cfg, 0, unit_input_init=["vae2llm"])[0].vae2llm.weight.equal(model.vae2llm.weight)
    import pytest

    with pytest.raises(ValueError, match="vit_modle"):
        build_models(cfg, 0, unit_input_init="vit_modle,connector")


def test_vae_from_a_finished_run_replaces_stage_one(tmp_path):
    import pytest
    from safetensors.torch import load_file

    first = run(tmp_path / "a", tmp_path / "a.work", _cfg())
    second = run(tmp_path / "b", tmp_path / "b.work", _cfg(vae_from=str(tmp_path / "a")))
    assert not (tmp_path / "b.work" / "vae_state.safetensors").exists()  # no VAE step was trained
    a, b = load_file(str(tmp_path / "a" / "ae.safetensors")), load_file(str(tmp_path / "b" / "ae.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert second["vae_log"] == first["vae_log"] and second["latent_scale"] == first["latent_scale"]
    assert second["seconds"]["vae_s"] == first["seconds"]["vae_s"]  # its VAE time is counted once, not zero
    again = run(tmp_path / "b", tmp_path / "b.work", _cfg(vae_from=str(tmp_path / "a")))
    assert again["seconds"]["vae_s"] == first["seconds"]["vae_s"]  # a resumed session does not count it twice
    with pytest.raises(ValueError, match="vae_lr"):
        run(tmp_path / "c", tmp_path / "c.work", _cfg(vae_from=str(tmp_path / "a"), vae_lr=1e-3))
    with pytest.raises(ValueError, match="needs ae.safetensors"):
        run(tmp_path / "d", tmp_path / "d.work", _cfg(vae_from=str(tmp_path / "missing")))


def test_understanding_samples_ask_several_kinds_and_hold_some_back():
    maker, tok = _small_maker(
        batch={"t2i": 0, "edit": 0, "und": 6}, und_questions=3, und_late_kinds=["background", "exists"], und_late_from=5
    )
    kinds_by_question = {
        q: kind
        for kind, q in (("background", "what color is the background?"), ("count", "how many shapes are there?"))
    }

    def asked(step):
        out = []
        for sample in maker.draw(step)["und"]:
            vit, *turns = sample.blocks
            assert vit.kind == "vit" and len(turns) % 2 == 0
            questions = [tok.decode(b.ids[1:-1]) for b in turns[0::2]]
            assert [b.loss for b in turns] == [False, True] * (len(turns) // 2)  # only the answers carry the loss
            out.append(questions)
        return out

    early = asked(0)
    # count is always askable and never held back, so each image gets 1..3 questions, none repeated
    assert all(1 <= len(qs) <= 3 and len(set(qs)) == len(qs) for qs in early)
    assert max(len(qs) for qs in early) == 3
    flat = [q for qs in early for q in qs]
    assert not any(q.startswith("is there") or kinds_by_question.get(q) == "background" for q in flat)
    late = [q for step in range(5, 12) for qs in asked(step) for q in qs]
    assert any(kinds_by_question.get(q) == "background" for q in late) and any(q.startswith("is there") for q in late)
    # the packed batch predicts every answer: one CE target per answer token + its end token
    samples = maker.draw(0)
    batch = pack(samples, start_id=tok.start_of_image, end_id=tok.end_of_image, vit_patch=14, max_latent_size=64)
    answers = [b.ids for s in samples["und"] for b in s.blocks[2::2]]
    assert batch.ce_targets.tolist() == [i for ids in answers for i in ids[1:]]


def test_training_cli_checks_its_options_before_any_work(tmp_path, capsys):
    """Bad --und-* and --unit-input-init values stop with one line naming them (the parse itself, --vae-from unset,
    must succeed)."""
    import pytest

    from training.__main__ import main

    cases = [
        (["--und-late", "colour"], "unknown question kind(s) ['colour']"),
        (["--und-late", "count,exists,background"], "leaves no kind every scene can answer"),
        (["--und-questions", "0"], "--und-questions must be >= 1, got 0"),
        (["--unit-input-init", "vit"], "unknown input module(s) ['vit']"),
    ]
    for extra, message in cases:
        with pytest.raises(SystemExit) as exc:
            main([str(tmp_path / "out"), *extra])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.work").exists()


def test_caption_use_probe_compares_right_wrong_and_no_caption(tmp_path):
    """The probe scores the same noisy latents with the scene's caption, another's and none; the text changes the
    prediction (so the three differ), the noise is fixed (so a second call repeats), and the CLI writes JSON."""
    import pytest

    from training.probes import caption_use
    from training.probes import main as probe_main

    out = tmp_path / "ckpt"
    run(out, tmp_path / "work", _cfg())
    loaded = load_bagel(out, dtype=torch.float32)
    first = caption_use(loaded.model, loaded.vae, loaded.tokenizer, scenes=3, times=(0.9,))
    assert list(first) == ["0.9"] and set(first["0.9"]) == {"right", "wrong", "none"}
    assert all(v > 0 for v in first["0.9"].values())
    assert first["0.9"]["right"] != first["0.9"]["none"] and first["0.9"]["right"] != first["0.9"]["wrong"]
    assert caption_use(loaded.model, loaded.vae, loaded.tokenizer, scenes=3, times=(0.9,)) == first
    with pytest.raises(ValueError, match="got 1"):
        caption_use(loaded.model, loaded.vae, loaded.tokenizer, scenes=1)
    assert probe_main([str(out), "--scenes", "3", "--json", str(tmp_path / "probe.json")]) == 0
    report = json.loads((tmp_path / "probe.json").read_text())
    assert report["scenes"] == 3 and report["mse"]["0.9"] == {c: round(v, 4) for c, v in first["0.9"].items()}


def test_masked_attention_equals_sdpa_per_sample():
    """The written-out attention (GQA heads stacked, masked fp32 softmax) is exact attention under each sample's
    mask."""
    from torch.nn import functional as F

    from training.attention import MaskedAttention, SampleGroup

    gen = torch.Generator().manual_seed(0)
    groups, offset = [], 0
    for count, length in ((3, 17), (2, 40)):
        mask = torch.rand(count, length, length, generator=gen) < 0.4
        mask[:, torch.arange(length), torch.arange(length)] = True  # every row sees at least itself
        groups.append(SampleGroup(offset, count, length, mask))
        offset += count * length
    q, k, v = (torch.randn(offset, h, 32, generator=gen) for h in (4, 2, 2))
    out = MaskedAttention(1, groups).attend(0, q, k, v, None)
    for g in groups:
        sl = slice(g.offset, g.offset + g.count * g.length)
        qs, ks, vs = (t[sl].view(g.count, g.length, t.shape[1], 32).transpose(1, 2) for t in (q, k, v))
        ref = F.scaled_dot_product_attention(
            qs, ks.repeat_interleave(2, 1), vs.repeat_interleave(2, 1), attn_mask=g.mask[:, None]
        )
        torch.testing.assert_close(out[sl], ref.transpose(1, 2).reshape(-1, 4, 32), atol=1e-5, rtol=1e-5)
    # a key a query may not see has no influence on it
    k2 = k.clone()
    g = groups[0]
    hidden = (~g.mask[0, 0]).nonzero()[0].item()  # a key the first query of sample 0 does not see
    k2[hidden] += 100.0
    assert torch.equal(MaskedAttention(1, groups).attend(0, q, k2, v, None)[0], out[0])


@pytest.mark.heavy
def test_compiled_bf16_step_matches_eager_fp32():
    """The shipped training path (decoder layers compiled, bf16 autocast) computes the eager fp32 loss within bf16
    rounding, and its gradients reach every expert of every layer.

    The layers are compiled as training compiles them (:func:`~training.bagel_stage.compile_layers`: dynamic
    shapes, inductor, forward and backward graphs), with two differences: inductor writes scalar C++ kernels
    instead of SIMD ones, and compiles them in this process instead of a pool of compile workers. Generating and
    compiling the SIMD kernels of a decoder layer's dynamic-shape forward and backward took 148 CPU seconds on a
    machine that never compiled them (the slowest test of the suite by far), the scalar ones 82-93; the workers'
    start and their contention with the other xdist worker added ~50 CPU s to the suite. What the test checks
    (capture, autograd, lowering, bf16 numerics) is the same. Marked ``heavy``: it runs first."""
    import torch._inductor.config as inductor_config

    from training.bagel_stage import bagel_loss, compile_layers
    from training.config import autocast

    maker, tok = _small_maker(drop_text=0.0, drop_image=0.0)
    batch = pack(maker.draw(0), start_id=tok.start_of_image, end_id=tok.end_of_image, vit_patch=14, max_latent_size=64)
    cfg = shapes_config(shapes_tokenizer_files()[2], ShapesGeometry(**SMALL))
    model, _ = build_models(cfg, 0)
    ref, ref_mse, ref_ce = bagel_loss(model, batch, _cfg(precision="fp32"))
    fast_cfg = _cfg(precision="bf16", compile=True)
    compile_layers(model)
    with inductor_config.patch({"cpp.vec_isa_ok": False, "compile_threads": 1}), autocast(fast_cfg):
        loss, mse, ce = bagel_loss(model, batch, fast_cfg)
        assert loss.dtype == torch.float32
        assert abs(mse - ref_mse) < 0.02 * ref_mse and abs(ce - ref_ce) < 0.02 * ref_ce
        loss.backward()
    for name, p in model.language_model.model.layers.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name

    with pytest.raises(ValueError, match="fp16"):
        autocast(_cfg(precision="fp16"))


def test_weight_average_is_exported_and_resumed(tmp_path):
    """With ema_decay the checkpoint holds the averaged weights (not the last step's), and a resumed run continues
    the average saved with the state instead of restarting it."""
    from safetensors.torch import load_file

    from training.state import WeightAverage

    out, work = tmp_path / "ckpt", tmp_path / "work"
    run(out, work, _cfg(ema_decay=0.5))
    state = load_file(str(work / "bagel_state.safetensors"))
    exported = load_file(str(out / "ema.safetensors"))
    name = "language_model.model.layers.0.mlp.up_proj.weight"
    assert torch.equal(exported[name], state["ema." + name].to(exported[name].dtype))
    assert not torch.equal(state["ema." + name], state["param." + name])  # the average lags the weights
    info = run(out, work, _cfg(ema_decay=0.5, steps=6))
    resumed = load_file(str(work / "bagel_state.safetensors"))
    assert [row[0] for row in info["bagel_log"]] == [4, 6]
    # two more steps of d = min(0.5, ...) = 0.5: the saved average moved halfway to the weights, twice, from where
    # it was (a restarted average would start from the resumed weights instead)
    assert not torch.equal(resumed["ema." + name], resumed["param." + name])
    # the update rule: d ramps as (1 + step) / (10 + step) up to the decay
    module = torch.nn.Linear(2, 2)
    avg = WeightAverage(module, 0.9)
    start = module.weight.detach().clone()
    with torch.no_grad():
        module.weight.add_(1.0)
    avg.update(0)  # d = 0.1
    torch.testing.assert_close(avg.shadow["weight"], start + 0.9)
    with avg.swapped_in():
        torch.testing.assert_close(module.weight, start + 0.9)
    torch.testing.assert_close(module.weight, start + 1.0)
    import pytest

    with pytest.raises(ValueError, match="holds a weight average but this run has none"):
        run(out, work, _cfg(steps=8, ema_decay=0.0))  # resuming without the average the state was saved with
    plain = tmp_path / "plain.work"
    run(tmp_path / "plain", plain, _cfg(ema_decay=0.0))
    with pytest.raises(ValueError, match="holds no weight average"):
        run(tmp_path / "plain", plain, _cfg(steps=6, ema_decay=0.5))


def test_generation_path_learning_rate_scale(tmp_path):
    """``gen_lr_scale`` scales the rate of exactly the generation path: at 0 the gen expert, the latent in/out
    modules and the timestep embedder keep their initial values while the understanding side trains."""
    from safetensors.torch import load_file

    from training.bagel_stage import is_generation_parameter

    assert is_generation_parameter("language_model.model.layers.3.mlp_moe_gen.up_proj.weight")
    assert is_generation_parameter("vae2llm.weight") and is_generation_parameter("time_embedder.mlp.0.bias")
    assert not is_generation_parameter("language_model.model.layers.3.mlp.up_proj.weight")
    assert not is_generation_parameter("connector.fc1.weight") and not is_generation_parameter(
        "language_model.lm_head.weight"
    )
    work = tmp_path / "work"
    run(tmp_path / "ckpt", work, _cfg(gen_lr_scale=0.0))
    trained = {k[6:]: v for k, v in load_file(str(work / "bagel_state.safetensors")).items() if k.startswith("param.")}
    initial, _ = build_models(shapes_config(shapes_tokenizer_files()[2], ShapesGeometry(**SMALL)), 0)
    moved = {n: not torch.equal(p.detach(), trained[n]) for n, p in initial.named_parameters() if p.requires_grad}
    assert not any(m for n, m in moved.items() if is_generation_parameter(n))
    assert moved["language_model.model.layers.0.mlp.up_proj.weight"] and moved["connector.fc1.weight"]


def test_training_cli_defaults_are_the_shipped_run(tmp_path, monkeypatch):
    """``make train`` with no options trains exactly TrainConfig's defaults (the bundled model's recipe)."""
    from training import trainer
    from training.__main__ import main

    seen = {}

    def fake_run(out, work, cfg, progress=None):
        seen["cfg"] = cfg
        raise KeyboardInterrupt  # stop before any work

    monkeypatch.setattr(trainer, "run", fake_run)
    assert main([str(tmp_path / "out")]) == 130
    assert seen["cfg"] == TrainConfig()
    main([str(tmp_path / "out"), "--und-late", "", "--unit-input-init", "none", "--gen-lr-scale", "1"])
    assert seen["cfg"].und_late_kinds == [] and seen["cfg"].unit_input_init is False and seen["cfg"].gen_lr_scale == 1.0
