"""Train the bundled shapes model: the VAE first, then the MoT LLM, ViT and connector on all three tasks.

Stage 1 (VAE, :mod:`.vae_stage`): reconstruction (L1 + MSE) of 64 px crops, then of whole 128 px world
images, with a small KL term; the latent's shift and scale are then measured on the data so that the LLM
sees unit-variance latents (``ae_config.json``'s ``shift_factor``/``scale_factor``, as BAGEL's FLUX VAE uses
them).

Before stage 2 an understanding warm-up may run (``und_warmup`` steps, :func:`.bagel_stage.train_und_warmup`):
one-object scenes asked where their object is, the understanding path alone at a low rate, its own AdamW;
stage 2 then starts from its weights with a fresh optimiser, its step count and schedule unchanged.

Stage 2 (BAGEL, :mod:`.bagel_stage`): a pool of edit pairs from the training seeds is encoded once with the
frozen VAE; every step draws text-to-image, edit and understanding samples from it (:mod:`.batches`) and
minimises ``mse(velocity) + ce_weight * ce(answer tokens)``. Flow matching as the pipeline samples:
``x_t = (1 - t) x0 + t eps`` and the velocity target ``eps - x0``, ``t`` logit-normal, shifted towards noise.
The generation path may learn at a multiple of the rate (``gen_lr_scale``), and an exponential moving
average of the weights (``ema_decay``) may be what is exported.

Both stages run matmuls and convolutions under bf16 autocast (``precision``) and the LLM's decoder layers
compiled (``compile``); docs/shapes.md gives what each saves on the project's 2-core machine.

Every ``save_every`` steps the stage state (weights, AdamW moments, weight average, step) goes to ``work_dir`` in
safetensors + JSON (:mod:`.state`), so an interrupted run resumes where it stopped; the sample stream depends
only on ``(seed, step)``, so a resumed run draws the same batches. :func:`run` does both stages and writes the
result in the official layout (:func:`export_checkpoint`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from unicache_core.bagel.config import BagelConfig
from unicache_core.bagel.modeling import AutoEncoder, Bagel
from unicache_core.shapes import world

from .bagel_stage import BAGEL_STATE, UND_WARMUP_STATE, SampleMaker, compile_layers, train_bagel, train_und_warmup
from .checkpoint_files import model_parts, write_parts
from .config import TrainConfig
from .model import VARIANT, ShapesGeometry, build_models, shapes_config, shapes_tokenizer, shapes_tokenizer_files
from .state import WeightAverage, saved_log, saved_step
from .vae_stage import Pool, build_pool, latent_statistics, reconstruction_quality, train_vae, vae_from_run

logger = logging.getLogger(__name__)


def export_checkpoint(model: Bagel, vae: AutoEncoder, bagel_cfg: BagelConfig, out: Path, info: dict) -> Path:
    """Write the official folder layout (+ ``training.json``, the run's record) to ``out``."""
    files, ids, _, bos, eos = shapes_tokenizer_files()
    parts = model_parts(model, vae, bagel_cfg, files, ids, bos=bos, eos=eos, dtype="bf16")  # as BAGEL ships
    write_parts(parts, out)
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return out


def check_und_warmup_resume(work: Path, cfg: TrainConfig) -> None:
    """Raise ``ValueError`` if the states in ``work`` come from a run with another ``und_warmup`` than
    ``cfg``'s (a warm-up may be lengthened only while stage 2 has not begun)."""
    warmup_path, stage2_begun = work / UND_WARMUP_STATE, (work / BAGEL_STATE).is_file()
    if not warmup_path.is_file():
        if stage2_begun and cfg.und_warmup:
            raise ValueError(
                f"{work} holds a stage 2 begun without the understanding warm-up, but this run "
                f"asks for --und-warmup {cfg.und_warmup}; resume with --und-warmup 0 or use a new "
                "--work folder"
            )
        return
    done = saved_step(warmup_path)
    if done > cfg.und_warmup or (stage2_begun and done != cfg.und_warmup):
        raise ValueError(
            f"{work} holds an understanding warm-up of {done} steps, but this run asks for "
            f"--und-warmup {cfg.und_warmup}; resume with --und-warmup {done} or use a new --work "
            "folder"
        )


def run(out: Path, work: Path, cfg: TrainConfig, progress: Callable | None = None) -> dict:
    """The VAE, the understanding warm-up and stage 2 (each resuming from ``work``), then export; returns the
    run record."""
    check_und_warmup_resume(work, cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n", encoding="utf-8")
    files, _, vocab_size, _, _ = shapes_tokenizer_files()
    bagel_cfg = shapes_config(vocab_size, ShapesGeometry(**cfg.model))
    torch.manual_seed(cfg.seed)
    model, vae = build_models(bagel_cfg, cfg.seed, unit_input_init=cfg.unit_input_init)
    # seconds per stage over every session of this run (a resumed run adds to them)
    times_path = work / "times.json"
    times = {"vae_s": 0.0, "pool_s": 0.0, "und_warmup_s": 0.0, "bagel_s": 0.0, "sessions": 0}
    if times_path.is_file():
        times.update(json.loads(times_path.read_text(encoding="utf-8")))
    times["sessions"] += 1

    def add_time(stage: str, start: float) -> None:
        times[stage] = round(times[stage] + time.perf_counter() - start, 3)
        times_path.write_text(json.dumps(times, indent=2) + "\n", encoding="utf-8")

    if cfg.vae_from:
        vae_log = vae_from_run(vae, cfg, Path(cfg.vae_from), times)
    else:
        t = time.perf_counter()
        vae_log = train_vae(vae, cfg, work, progress)
        add_time("vae_s", t)
    for p in vae.parameters():
        p.requires_grad_(False)
    vae_quality = reconstruction_quality(vae, cfg.vae_eval_scenes)
    logger.info("vae reconstructions: %s", vae_quality)
    done = saved_step(work / BAGEL_STATE) >= cfg.last_step
    t = time.perf_counter()
    pairs_for_stats = [world.edit_sample(seed) for seed in range(cfg.latent_stat_pairs)]
    shift, scale = latent_statistics(vae, pairs_for_stats, cfg)
    if not done:  # encoding for stage 2, like the pool (a finished run only re-exports; the check above is no training)
        add_time("pool_s", t)
    bagel_cfg = dataclasses.replace(
        bagel_cfg, ae=dataclasses.replace(bagel_cfg.ae, shift_factor=shift, scale_factor=scale)
    )
    vae.config = bagel_cfg.ae
    vae.shift_factor, vae.scale_factor = shift, scale
    model.config = bagel_cfg
    t = time.perf_counter()
    # a finished (or stopped-early) stage 2 only re-exports: its pool is not encoded again
    pool = Pool([], torch.zeros(0), torch.zeros(0)) if done else build_pool(vae, cfg.pool_size, progress, cfg)
    add_time("pool_s", t)
    maker = SampleMaker(cfg, bagel_cfg, pool, shapes_tokenizer(), vae)

    def stage_clock(stage: str) -> Callable[[], None]:
        # a counter called at every save, so that a session stopped later still counts the stage's time up to
        # its last state
        before, start = times[stage], time.perf_counter()

        def count() -> None:
            times[stage] = round(before + time.perf_counter() - start, 3)
            times_path.write_text(json.dumps(times, indent=2) + "\n", encoding="utf-8")

        return count

    if cfg.compile and not done:
        compile_layers(model)
    if cfg.und_warmup and not (work / BAGEL_STATE).is_file():
        count_warmup_time = stage_clock("und_warmup_s")
        train_und_warmup(model, maker, cfg, work, progress, lambda step, log: count_warmup_time())
        count_warmup_time()
    und_warmup_log = saved_log(work / UND_WARMUP_STATE)
    count_bagel_time = stage_clock("bagel_s")

    def record(bagel_log: list, final: bool) -> dict:
        return {
            "variant": VARIANT,
            "final": final,
            "images_per_request": 1,  # every training request holds one input image (nodes warn above it)
            "config": cfg.to_dict(),
            "latent_shift": shift,
            "latent_scale": scale,
            "vae_reconstruction": vae_quality,
            "seconds": dict(times),
            "threads": torch.get_num_threads(),
            "vae_log": vae_log,
            "und_warmup_log": und_warmup_log,
            "bagel_log": bagel_log,
            "parameters": {
                "bagel": sum(p.numel() for p in model.parameters()),
                "vae": sum(p.numel() for p in vae.parameters()),
            },
        }

    # made after the warm-up: a fresh stage 2 averages from the warm-up's weights
    average = WeightAverage(model, cfg.ema_decay) if cfg.ema_decay else None

    def snapshot(step: int, log: list) -> None:
        count_bagel_time()
        with average.swapped_in() if average is not None else contextlib.nullcontext():
            export_checkpoint(model, vae, bagel_cfg, out, record(log, final=False))

    bagel_log = train_bagel(model, maker, cfg, work, progress, snapshot, average)
    count_bagel_time()
    info = record(bagel_log, final=True)
    with average.swapped_in() if average is not None else contextlib.nullcontext():
        export_checkpoint(model, vae, bagel_cfg, out, info)
    return info
