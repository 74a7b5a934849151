"""The training code stays alive: a few steps of both stages, resume, export, and the pipeline loads it."""

import json

import torch
from safetensors import safe_open

from unicache_core.bagel import BagelPipeline, load_bagel
from unicache_core.bagel.training import TrainConfig, run
from unicache_core.bagel.training.trainer import SampleMaker, build_pool, pack
from unicache_core.bagel.training.model import build_models, shapes_config, shapes_tokenizer, shapes_tokenizer_files
from unicache_core.shapes import t2i_sample

SMALL = dict(hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64, vit_hidden=32, vit_layers=1, vit_heads=1,
             ae_ch=32, ae_mult=(1, 1, 1, 1), ae_res_blocks=1)


def _cfg(**kw):
    base = dict(model=SMALL, vae_steps=4, vae_batch=2, pool_size=8, steps=4, stop_at=0, batch={"t2i": 2, "edit": 2, "und": 2},
                save_every=2, warmup=2)
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
    res = pipe.text_to_image(scene.caption(), width=128, height=128, num_timesteps=3, seed=0)
    assert res.image.size == (128, 128)
    ans = pipe.understand(scene.render(), "what color is the background?", max_new_tokens=2)
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
    cfg = shapes_config(vocab, **SMALL)
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
    text = mask[132:132 + n, 132:132 + n]
    assert torch.equal(text, torch.tril(torch.ones_like(text)))  # text is causal, sees both images
    assert mask[132:132 + n, :132].all() and not mask[132:132 + n, 132 + n:].any()
    assert mask[132 + n:end, :end].all()  # the noisy latents see everything before and each other
    # positions: one RoPE position per image block, one per text token, the latents at the next one
    pos = batch.positions[edit_group.offset: edit_group.offset + edit_group.length]
    assert (pos[:66] == 0).all() and (pos[66:132] == 1).all()
    assert pos[132:132 + n].tolist() == list(range(2, 2 + n)) and (pos[132 + n:end] == 2 + n).all()
    assert batch.gen_mask[edit_group.offset + 1: edit_group.offset + 65].all()
    assert not batch.gen_mask[edit_group.offset + 66: edit_group.offset + 132 + n].any()
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
    maker, tok = _small_maker(batch={"t2i": 0, "edit": 0, "und": 6}, und_questions=3,
                              und_late_kinds=["background", "exists"], und_late_from=5)
    kinds_by_question = {q: kind for kind, q in (("background", "what color is the background?"),
                                                 ("count", "how many shapes are there?"))}

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
    """Bad --und-* and --unit-input-init values stop with one line naming them (the parse itself, --vae-from unset, must succeed)."""
    import pytest

    from unicache_core.bagel.training.__main__ import main

    cases = [(["--und-late", "colour"], "unknown question kind(s) ['colour']"),
             (["--und-late", "count,exists,background"], "leaves no kind every scene can answer"),
             (["--und-questions", "0"], "--und-questions must be >= 1, got 0"),
             (["--unit-input-init", "vit"], "unknown input module(s) ['vit']")]
    for extra, message in cases:
        with pytest.raises(SystemExit) as exc:
            main([str(tmp_path / "out"), *extra])
        assert exc.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.work").exists()


def test_caption_use_probe_compares_right_wrong_and_no_caption(tmp_path):
    """The probe scores the same noisy latents with the scene's caption, another's and none; the text changes the
    prediction (so the three differ), the noise is fixed (so a second call repeats), and the CLI writes JSON."""
    import pytest

    from unicache_core.bagel.training.probes import caption_use, main as probe_main

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
