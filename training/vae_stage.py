"""Stage 1: the VAE (reconstruction of world images), its latent statistics, and the pool of encoded edit
pairs stage 2 draws from; or stage 1 taken from a finished run (:func:`vae_from_run`)."""

from __future__ import annotations

import contextlib
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from unicache_core.bagel.modeling import AutoEncoder
from unicache_core.shapes import world

from .config import VAE_STAGE_FIELDS, TrainConfig, autocast, learning_rate
from .state import load_state, save_state

logger = logging.getLogger(__name__)


def to_unit(image) -> Tensor:
    """A world image (PIL) as ``[3, H, W]`` floats in [-1, 1]."""
    return torch.from_numpy(world.image_array(image).copy()).permute(2, 0, 1).float() / 127.5 - 1.0


def train_vae(vae: AutoEncoder, cfg: TrainConfig, work: Path, progress: Callable | None = None) -> list:
    """Stage 1; returns the loss log ``[[step, loss, l1], ...]``."""
    path = work / "vae_state.safetensors"
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, weight_decay=0.0)
    step, log = load_state(path, vae, opt) if path.exists() else (0, [])
    vae.train()
    t0 = time.perf_counter()
    while step < cfg.vae_steps:
        rng = random.Random(cfg.seed * 7919 + step)
        crop = cfg.vae_crop if step < cfg.vae_crop_steps else world.CANVAS
        crops, weights = [], []
        for _ in range(cfg.vae_batch if step < cfg.vae_crop_steps else cfg.vae_full_batch):
            scene = world.random_scene(rng, min_objects=0)
            x = to_unit(scene.render())
            top, left = rng.randrange(0, world.CANVAS - crop + 1, 8), rng.randrange(0, world.CANVAS - crop + 1, 8)
            x = x[:, top : top + crop, left : left + crop]
            bg = torch.tensor(world.BACKGROUNDS[scene.background]).float()[:, None, None] / 127.5 - 1.0
            weights.append(1.0 + cfg.vae_fg_weight * ((x - bg).abs().amax(0, keepdim=True) > 0.02).float())
            crops.append(x)
        x, w = torch.stack(crops), torch.stack(weights)
        for g in opt.param_groups:
            g["lr"] = learning_rate(step, cfg.vae_steps, cfg.vae_lr, 50, cfg.min_lr_ratio)
        with autocast(cfg):
            mean, logvar = vae.encode_moments(x)
            mean, logvar = mean.float(), logvar.float().clamp(-30, 20)
            z = mean + torch.exp(0.5 * logvar) * torch.randn_like(mean)
            rec = vae.decoder(z)
        d = rec.float() - x
        l1 = d.abs().mean()
        kl = 0.5 * (mean.pow(2) + logvar.exp() - 1 - logvar).mean()
        loss = ((d.abs() + d.pow(2)) * w).mean() / w.mean() + cfg.vae_kl * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        if step % 25 == 0 or step == cfg.vae_steps:
            log.append([step, round(float(loss.detach()), 5), round(float(l1.detach()), 5)])
            logger.info(
                "vae step %d/%d loss %.4f l1 %.4f (%.1fs)", step, cfg.vae_steps, *log[-1][1:], time.perf_counter() - t0
            )
        if progress is not None:
            progress("vae", step, cfg.vae_steps)
        if step % cfg.save_every == 0 or step == cfg.vae_steps:
            save_state(path, vae, opt, step, log)
    vae.eval()
    return log


@torch.no_grad()
def reconstruction_quality(vae: AutoEncoder, count: int = 64) -> dict:
    """PSNR of VAE reconstructions (posterior mean) of held-out scenes, and how often the analyser still
    reads the scene off the reconstruction (an upper bound for every generated image)."""
    from unicache_core.shapes import analyse, psnr, scenes_match

    rng = random.Random(world.EVAL_SEEDS.start)
    values, agree = [], 0
    for _ in range(count):
        scene = world.random_scene(rng, min_objects=0)
        x = to_unit(scene.render())[None]
        rec = vae.decoder(vae.encode_moments(x)[0])[0].clamp(-1, 1)
        out = ((rec + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
        values.append(psnr(out, world.image_array(scene.render())))
        agree += scenes_match(analyse(out), scene)
    return {"psnr_db": round(sum(values) / count, 2), "analyser_agreement": agree / count, "scenes": count}


@contextlib.contextmanager
def _channels_last(module: torch.nn.Module):
    """Within the block ``module``'s weights are channels-last (faster convolutions when encoding under bf16
    autocast, docs/shapes.md); the layout is restored after, so the weights save as they are."""
    module.to(memory_format=torch.channels_last)
    try:
        yield
    finally:
        module.to(memory_format=torch.contiguous_format)


def _encode(vae: AutoEncoder, x: Tensor, cfg: TrainConfig) -> tuple[Tensor, Tensor]:
    """``(mean, logvar)`` fp32 posteriors of ``x [B, 3, H, W]`` under ``cfg.precision`` (channels-last input)."""
    with autocast(cfg):
        mean, logvar = vae.encode_moments(x.contiguous(memory_format=torch.channels_last))
    return mean.float().contiguous(), logvar.float().contiguous()


@torch.no_grad()
def latent_statistics(vae: AutoEncoder, pairs: list[world.Edit], cfg: TrainConfig) -> tuple[float, float]:
    """``(shift, scale)``: the mean of the posterior means and one over their std, over the pool."""
    means = []
    with _channels_last(vae):
        for i in range(0, min(len(pairs), 512), 64):
            x = torch.stack([to_unit(s.render()) for e in pairs[i : i + 64] for s in (e.source, e.target)])
            means.append(_encode(vae, x, cfg)[0])
    m = torch.cat(means)
    return float(m.mean()), float(1.0 / m.std())


@dataclass
class Pool:
    """Edit pairs from the training seeds with their VAE posteriors (``[P, 2, 16, 16, 16]`` mean/std)."""

    pairs: list[world.Edit]
    mean: Tensor
    std: Tensor


@torch.no_grad()
def build_pool(vae: AutoEncoder, size: int, progress: Callable | None = None, cfg: TrainConfig | None = None) -> Pool:
    """Edit pairs of training seeds ``0..size-1`` with their posteriors (encoded under ``cfg.precision``; fp32
    when no config is given)."""
    pairs = [world.edit_sample(seed) for seed in range(size)]
    means, stds = [], []
    with _channels_last(vae):
        for i in range(0, size, 64):
            x = torch.stack([to_unit(s.render()) for e in pairs[i : i + 64] for s in (e.source, e.target)])
            mean, logvar = _encode(vae, x, cfg or TrainConfig(precision="fp32"))
            means.append(mean.view(-1, 2, *mean.shape[1:]))
            stds.append(torch.exp(0.5 * logvar.clamp(-30, 20)).view(-1, 2, *mean.shape[1:]))
            if progress is not None:
                progress("pool", min(size, i + 64), size)
    return Pool(pairs, torch.cat(means), torch.cat(stds))


def vae_from_run(vae: AutoEncoder, cfg: TrainConfig, folder: Path, times: dict) -> list:
    """Stage 1 taken from a finished run's checkpoint ``folder``: loads its ``ae.safetensors`` after checking
    that its ``training.json`` has the same VAE stage; its VAE seconds go into ``times``. Returns its VAE log."""
    record_path = folder / "training.json"
    if not record_path.is_file() or not (folder / "ae.safetensors").is_file():
        raise ValueError(f"--vae-from {folder}: needs ae.safetensors and training.json of a finished training run")
    record = json.loads(record_path.read_text(encoding="utf-8"))
    theirs = record.get("config", {})
    diffs = [
        f"{k}: {theirs.get(k)!r} there, {getattr(cfg, k)!r} here"
        for k in VAE_STAGE_FIELDS
        if theirs.get(k) != getattr(cfg, k)
    ]
    ae_keys = json.loads(json.dumps({k: v for k, v in cfg.model.items() if k.startswith("ae_")}))  # tuples → lists
    if {k: v for k, v in theirs.get("model", {}).items() if k.startswith("ae_")} != ae_keys:
        diffs.append("VAE geometry (model ae_* overrides)")
    if diffs:
        raise ValueError(f"--vae-from {folder}: its VAE stage differs from this run's: {'; '.join(diffs)}")
    vae.load_state_dict(load_file(str(folder / "ae.safetensors")))
    if not times.get("vae_from"):
        times["vae_s"] = round(times["vae_s"] + float(record["seconds"]["vae_s"]), 3)
        times["vae_from"] = str(folder)
    return list(record.get("vae_log", []))
