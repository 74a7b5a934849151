"""Train the bundled shapes model: the VAE first, then the MoT LLM, ViT and connector on all three tasks.

Stage 1 (VAE): reconstruction (L1 + MSE) of 64 px crops, then of whole 128 px world images, with a
small KL term; the latent's shift and scale are then measured on the data so that the LLM sees
unit-variance latents (``ae_config.json``'s ``shift_factor``/``scale_factor``, as BAGEL's FLUX VAE uses them).

Stage 2 (BAGEL): a pool of edit pairs from the training seeds is encoded once with the frozen VAE;
every step draws text-to-image, edit and understanding samples from it (docs: batches.py) and
minimises ``mse(velocity) + ce_weight * ce(answer tokens)``. Flow matching as the pipeline samples:
``x_t = (1 - t) x0 + t eps`` and the velocity target ``eps - x0``, ``t`` logit-normal, shifted towards noise.
The generation path may learn at a multiple of the rate (``gen_lr_scale``), and an exponential moving
average of the weights (``ema_decay``) may be what is exported.

Both stages run matmuls and convolutions under bf16 autocast (``precision``) and the LLM's decoder layers
compiled (``compile``); docs/shapes.md gives what each saves on the project's 2-core machine.

Every ``save_every`` steps the stage state (weights, AdamW moments, weight average, step) goes to ``work_dir`` in
safetensors + JSON, so an interrupted run resumes where it stopped; the sample stream depends only on
``(seed, step)``, so a resumed run draws the same batches. The result is written in the official
layout by :func:`export_checkpoint`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor
from torch.nn import functional as F

from unicache_core.kv.cache import AttentionCall
from unicache_core.shapes import world
from unicache_core.bagel.config import BagelConfig
from unicache_core.bagel.modeling import AutoEncoder, Bagel
from unicache_core.bagel.modeling.bagel import patchify
from unicache_core.bagel.sampling import pack_latent
from .tiny import model_parts, write_parts
from unicache_core.bagel.transforms import ImageTransforms
from .attention import MaskedAttention
from .batches import Block, Sample, pack
from .model import VARIANT, build_models, shapes_config, shapes_tokenizer, shapes_tokenizer_files

logger = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    """Every knob of a training run (the defaults are the shipped run)."""

    seed: int = 0
    model: dict = field(default_factory=dict)  # keyword overrides of shapes_config
    vae_steps: int = 1200
    vae_batch: int = 16  # crops per step of the first ``vae_crop_steps`` steps
    vae_crop: int = 64
    vae_crop_steps: int = 900  # then whole 128 px images (the mid-block attention must see the full grid)
    vae_full_batch: int = 8
    vae_fg_weight: float = 3.0  # extra loss weight of object pixels (a scene is mostly background)
    vae_lr: float = 2e-3
    vae_kl: float = 1e-6
    pool_size: int = 4000
    # a finished run's checkpoint folder whose VAE stands in for stage 1 (its config must match this one's VAE
    # stage; its recorded VAE seconds and log carry over); "" = train the VAE
    vae_from: str = ""
    # start image input modules at N(0, 1/fan_in): False, True / "all", "und" (ViT + connector) or a list of
    # names (model.unit_init_modules)
    unit_input_init: bool | str | list = "und"
    timestep_shift: float = 2.0  # t = s u / (1 + (s - 1) u), u = sigmoid(N(0, 1)): more weight on noisy steps
    steps: int = 3200  # the length the learning-rate schedule is laid out for
    stop_at: int = 0  # stop (and export) at this step; 0 = ``steps``
    batch: dict = field(default_factory=lambda: {"t2i": 16, "edit": 12, "und": 16})
    # understanding: questions asked about each image, as turns of one sequence (each of another kind); an
    # image costs 64 ViT tokens and a question ~14 text tokens, so several questions per image are cheap
    und_questions: int = 2
    # question kinds held back until step ``und_late_from``: with "background" (answered from the mean colour
    # of all patches, learnt in ~50 steps) in the mix from the start, the object kinds stayed at their answer
    # prior in und-only runs (docs/shapes.md, "Understanding")
    und_late_kinds: list = field(default_factory=lambda: ["background", "exists"])
    und_late_from: int = 800
    lr: float = 1.5e-3
    # learning rate of the generation path (is_generation_parameter) over ``lr``: in 800-step pilots a higher rate
    # everywhere (3e-3) learnt the velocity and the caption faster but held understanding back
    gen_lr_scale: float = 2.0
    warmup: int = 100
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    ce_weight: float = 0.5
    drop_text: float = 0.1
    drop_image: float = 0.1
    grad_clip: float = 1.0
    save_every: int = 500
    threads: int = 0  # 0: torch's default
    # "bf16": matmuls and convolutions under bfloat16 autocast (weights, optimiser and losses stay fp32); on the
    # 2-core AMD EPYC a 128-px VAE step is 2.9x faster and a [5300, 128] x [128, 384] matmul 6x; "fp32": none
    precision: str = "bf16"
    # compile the LLM's decoder layers (torch.compile, dynamic shapes; ~30 s once): the forward pass halves
    compile: bool = True
    # exponential moving average of the BAGEL weights, exported as ema.safetensors (0 = export the raw weights);
    # the decay ramps up as (1 + step) / (10 + step) until it reaches this value
    ema_decay: float = 0.999

    @property
    def last_step(self) -> int:
        """The step stage 2 ends at (``stop_at`` when set, else ``steps``)."""
        return min(self.steps, self.stop_at) if self.stop_at else self.steps

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


PRECISIONS: tuple[str, ...] = ("bf16", "fp32")


def autocast(cfg: TrainConfig, device: torch.device | str = "cpu"):
    """The autocast context of ``cfg.precision`` (bf16: matmuls and convolutions in bfloat16)."""
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {cfg.precision!r}")
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")


def _lr(step: int, total: int, base: float, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


# ------------------------------------------------------------------------------------ state files


def _atomic_save(tensors: dict[str, Tensor], path: Path, meta: dict) -> None:
    tmp = path.with_suffix(".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp),
              metadata={"state": json.dumps(meta)})
    os.replace(tmp, path)


def save_state(path: Path, module: torch.nn.Module, opt: torch.optim.Optimizer, step: int, log: list,
               average: "WeightAverage | None" = None) -> None:
    """Weights and AdamW moments (keyed by parameter name), the weight average if any, the step and loss log."""
    tensors = {f"param.{k}": v for k, v in module.state_dict().items()}
    if average is not None:
        tensors.update({f"ema.{k}": v for k, v in average.shadow.items()})
    names = {id(p): n for n, p in module.named_parameters()}
    steps = {}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if not st:
                continue
            name = names[id(p)]
            tensors[f"exp_avg.{name}"] = st["exp_avg"]
            tensors[f"exp_avg_sq.{name}"] = st["exp_avg_sq"]
            steps[name] = float(st["step"])
    _atomic_save(tensors, path, {"step": step, "adam_steps": steps, "log": log})


def _saved_step(path: Path) -> int:
    """The step of a saved state (0 when there is none)."""
    from safetensors import safe_open

    if not path.is_file():
        return 0
    with safe_open(str(path), "pt") as f:
        return int(json.loads(f.metadata()["state"])["step"])


def load_state(path: Path, module: torch.nn.Module, opt: torch.optim.Optimizer,
               average: "WeightAverage | None" = None) -> tuple[int, list]:
    from safetensors import safe_open

    tensors = load_file(str(path))
    saved = {k[4:]: v for k, v in tensors.items() if k.startswith("ema.")}
    if average is None and saved:
        raise ValueError(f"{path} holds a weight average but this run has none (ema_decay 0); resume with the "
                         "run's own settings")
    if average is not None:
        if set(saved) != set(average.shadow):
            raise ValueError(f"{path} holds no weight average of this model (ema_decay was 0 when it was saved, or "
                             "the model differs); resume with the run's own settings")
        for name, value in saved.items():
            average.shadow[name].copy_(value)
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["state"])
    module.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("param.")})
    params = dict(module.named_parameters())
    for name, step in meta["adam_steps"].items():
        opt.state[params[name]] = {"step": torch.tensor(step), "exp_avg": tensors[f"exp_avg.{name}"],
                                   "exp_avg_sq": tensors[f"exp_avg_sq.{name}"]}
    return int(meta["step"]), list(meta["log"])


class WeightAverage:
    """Exponential moving average of a module's trainable parameters (fp32 copies, keyed by name).

    After each optimiser step ``update(step)`` moves every average towards its parameter by ``1 - d`` with
    ``d = min(decay, (1 + step) / (10 + step))``, so early steps, far from the end point, fade fast.
    """

    def __init__(self, module: torch.nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self.shadow = {n: p.detach().clone().float() for n, p in self.params.items()}

    @torch.no_grad()
    def update(self, step: int) -> None:
        d = min(self.decay, (1 + step) / (10 + step))
        names = list(self.params)
        torch._foreach_lerp_([self.shadow[n] for n in names], [self.params[n].detach().float() for n in names], 1.0 - d)

    @contextlib.contextmanager
    def swapped_in(self):
        """Within the block the module's parameters hold the averages; the trained values come back after."""
        saved = {n: p.detach().clone() for n, p in self.params.items()}
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.shadow[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(saved[n])


# ------------------------------------------------------------------------------------------ VAE


def _to_unit(image) -> Tensor:
    return torch.from_numpy(world.image_array(image).copy()).permute(2, 0, 1).float() / 127.5 - 1.0


def train_vae(vae: AutoEncoder, cfg: TrainConfig, work: Path, progress: Callable | None = None) -> list:
    """Stage 1; returns the loss log ``[[step, loss, l1], ...]``."""
    path = work / "vae_state.safetensors"
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, weight_decay=0.0)
    step, log = (load_state(path, vae, opt) if path.exists() else (0, []))
    vae.train()
    t0 = time.perf_counter()
    while step < cfg.vae_steps:
        rng = random.Random(cfg.seed * 7919 + step)
        crop = cfg.vae_crop if step < cfg.vae_crop_steps else world.CANVAS
        crops, weights = [], []
        for _ in range(cfg.vae_batch if step < cfg.vae_crop_steps else cfg.vae_full_batch):
            scene = world.random_scene(rng, min_objects=0)
            x = _to_unit(scene.render())
            top, left = rng.randrange(0, world.CANVAS - crop + 1, 8), rng.randrange(0, world.CANVAS - crop + 1, 8)
            x = x[:, top:top + crop, left:left + crop]
            bg = torch.tensor(world.BACKGROUNDS[scene.background]).float()[:, None, None] / 127.5 - 1.0
            weights.append(1.0 + cfg.vae_fg_weight * ((x - bg).abs().amax(0, keepdim=True) > 0.02).float())
            crops.append(x)
        x, w = torch.stack(crops), torch.stack(weights)
        for g in opt.param_groups:
            g["lr"] = _lr(step, cfg.vae_steps, cfg.vae_lr, 50, cfg.min_lr_ratio)
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
            logger.info("vae step %d/%d loss %.4f l1 %.4f (%.1fs)", step, cfg.vae_steps, *log[-1][1:],
                        time.perf_counter() - t0)
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
        x = _to_unit(scene.render())[None]
        rec = vae.decoder(vae.encode_moments(x)[0])[0].clamp(-1, 1)
        out = ((rec + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
        values.append(psnr(out, world.image_array(scene.render())))
        agree += scenes_match(analyse(out), scene)
    return {"psnr_db": round(sum(values) / count, 2), "analyser_agreement": agree / count, "scenes": count}


@contextlib.contextmanager
def _channels_last(module: torch.nn.Module):
    """Within the block ``module``'s weights are channels-last: encoding 128 px images under bf16 autocast is ~30%
    faster than in the default layout (26 against 37 ms an image on 2 cores); the layout is restored after, so the
    weights save as they are."""
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
            x = torch.stack([_to_unit(s.render()) for e in pairs[i:i + 64] for s in (e.source, e.target)])
            means.append(_encode(vae, x, cfg)[0])
    m = torch.cat(means)
    return float(m.mean()), float(1.0 / m.std())


# ------------------------------------------------------------------------------------------ pool


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
            x = torch.stack([_to_unit(s.render()) for e in pairs[i:i + 64] for s in (e.source, e.target)])
            mean, logvar = _encode(vae, x, cfg or TrainConfig(precision="fp32"))
            means.append(mean.view(-1, 2, *mean.shape[1:]))
            stds.append(torch.exp(0.5 * logvar.clamp(-30, 20)).view(-1, 2, *mean.shape[1:]))
            if progress is not None:
                progress("pool", min(size, i + 64), size)
    return Pool(pairs, torch.cat(means), torch.cat(stds))


# ------------------------------------------------------------------------------------------ BAGEL


#: Question kinds that every scene can answer (so an understanding sample always gets a question).
ALWAYS_ASKABLE: tuple[str, ...] = ("count", "exists", "background")


def check_und_late_kinds(kinds: list[str]) -> None:
    """Raise ``ValueError`` unless ``kinds`` are question kinds and leave an always-askable kind in play."""
    unknown = [k for k in kinds if k not in world.QUESTION_KINDS]
    if unknown:
        raise ValueError(f"unknown question kind(s) {unknown} to hold back; use some of {list(world.QUESTION_KINDS)}")
    if all(k in kinds for k in ALWAYS_ASKABLE):
        raise ValueError(f"holding back {kinds} leaves no kind every scene can answer; keep one of "
                         f"{list(ALWAYS_ASKABLE)} from the start")


class SampleMaker:
    """Draws the training samples of one step from the pool."""

    def __init__(self, cfg: TrainConfig, bagel_cfg: BagelConfig, pool: Pool, tokenizer, vae: AutoEncoder):
        check_und_late_kinds(list(cfg.und_late_kinds))
        self.cfg, self.bagel_cfg, self.pool, self.tok = cfg, bagel_cfg, pool, tokenizer
        self.transforms = ImageTransforms.from_config(bagel_cfg)
        self.scale, self.shift = vae.scale_factor, vae.shift_factor
        self.patch = bagel_cfg.latent_patch_size
        self.grid = (world.CANVAS // bagel_cfg.latent_downsample,) * 2

    def text(self, text: str, loss: bool = False) -> Block:
        return Block("text", ids=[self.tok.bos_token_id, *self.tok.encode(text), self.tok.eos_token_id], loss=loss)

    def vit(self, scene: world.Scene) -> Block:
        return Block("vit", pixels=self.transforms.vit(self.transforms.prepare(scene.render())))

    def latent(self, p: int, side: int, gen: torch.Generator) -> Tensor:
        z = self.pool.mean[p, side] + self.pool.std[p, side] * torch.randn(self.pool.mean.shape[2:], generator=gen)
        return pack_latent(self.scale * (z - self.shift), self.patch)

    def noisy(self, x0: Tensor, gen: torch.Generator) -> Block:
        u = float(torch.sigmoid(torch.randn((), generator=gen)))
        s = self.cfg.timestep_shift
        t = s * u / (1 + (s - 1) * u)
        eps = torch.randn(x0.shape, generator=gen)
        return Block("noisy", latent=(1 - t) * x0 + t * eps, grid=self.grid, timestep=t, target=eps - x0)

    def draw(self, step: int) -> dict[str, list[Sample]]:
        rng = random.Random(self.cfg.seed * 1_000_003 + step)
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
        size = len(self.pool.pairs)
        out: dict[str, list[Sample]] = {"t2i": [], "edit": [], "und": []}
        for _ in range(self.cfg.batch.get("t2i", 0)):
            p, side = rng.randrange(size), rng.randrange(2)
            edit = self.pool.pairs[p]
            scene = edit.source if side == 0 else edit.target
            blocks = [] if rng.random() < self.cfg.drop_text else [self.text(scene.caption())]
            out["t2i"].append(Sample("t2i", blocks + [self.noisy(self.latent(p, side, gen), gen)]))
        for _ in range(self.cfg.batch.get("edit", 0)):
            p = rng.randrange(size)
            edit = self.pool.pairs[p]
            r = rng.random()
            image_blocks = [Block("vae", latent=self.latent(p, 0, gen), grid=self.grid), self.vit(edit.source)]
            text_blocks = [self.text(edit.instruction)]
            if r < self.cfg.drop_text:
                blocks = image_blocks  # the cfg_text context
            elif r < self.cfg.drop_text + self.cfg.drop_image:
                blocks = text_blocks  # the cfg_img context
            else:
                blocks = image_blocks + text_blocks
            out["edit"].append(Sample("edit", blocks + [self.noisy(self.latent(p, 1, gen), gen)]))
        kinds = self.und_kinds(step)
        for _ in range(self.cfg.batch.get("und", 0)):
            p, side = rng.randrange(size), rng.randrange(2)
            edit = self.pool.pairs[p]
            scene = edit.source if side == 0 else edit.target
            blocks = [self.vit(scene)]
            for q in self.questions(scene, kinds, rng):
                blocks += [self.text(q.question), self.text(q.answer, loss=True)]
            out["und"].append(Sample("und", blocks))
        return out

    def und_kinds(self, step: int) -> tuple[str, ...]:
        """The question kinds trained at ``step`` (``und_late_kinds`` join at ``und_late_from``)."""
        if step >= self.cfg.und_late_from:
            return world.QUESTION_KINDS
        return tuple(k for k in world.QUESTION_KINDS if k not in self.cfg.und_late_kinds)

    def questions(self, scene: world.Scene, kinds: tuple[str, ...], rng: random.Random) -> list[world.Question]:
        """``und_questions`` questions about ``scene``, each of another kind (fewer if fewer are askable)."""
        if self.cfg.und_questions == 1:
            q = None
            while q is None:
                q = world.ask(scene, rng.choice(kinds), rng)
            return [q]
        order = list(kinds)
        rng.shuffle(order)
        asked = (world.ask(scene, kind, rng) for kind in order)
        return [q for q in asked if q is not None][: self.cfg.und_questions]


#: Parameters only the generation path uses: the gen expert of every layer and the latent input/output modules.
GENERATION_MODULES: tuple[str, ...] = ("vae2llm.", "llm2vae.", "time_embedder.", "latent_pos_embed.")


def is_generation_parameter(name: str) -> bool:
    """True for a parameter of the generation path (``*_moe_gen`` weights, latent in/out, timestep embedder)."""
    return "_moe_gen" in name or name.startswith(GENERATION_MODULES)


def bagel_loss(model: Bagel, batch, cfg: TrainConfig) -> tuple[Tensor, float, float]:
    """``(loss, mse, ce)`` of one packed batch (one forward through the whole MoT stack).

    Under bf16 autocast the pieces of the input embeddings are cast to fp32, so the residual stream stays fp32;
    the losses are taken in fp32.
    """
    device = model.device
    hidden = model.hidden_size
    embeds = torch.zeros(batch.positions.shape[0], hidden, device=device)
    text_slots = torch.nonzero(batch.text_slots).squeeze(1)
    embeds = embeds.index_copy(0, text_slots, model.language_model.model.embed_tokens(batch.text_ids[text_slots]))
    if batch.vit_pixels:
        p = model.config.vit.patch_size
        patches, pos, seqlens = [], [], []
        for img in batch.vit_pixels:
            rows, cols = img.shape[1] // p, img.shape[2] // p
            patches.append(patchify(img, p))
            pos.append(model.vit_position_ids(rows, cols))
            seqlens.append(rows * cols)
        pos_ids = torch.cat(pos)
        feats = model.vit_model(torch.cat(patches), pos_ids, seqlens)
        vit = model.connector(feats) + model.vit_pos_embed(pos_ids)
        embeds = embeds.index_copy(0, batch.vit_slots, vit.to(embeds.dtype))
    if batch.latent_slots.numel():
        lat = (model.vae2llm(batch.latents) + model.time_embedder(batch.latent_t)
               + model.latent_pos_embed(batch.latent_pos))
        embeds = embeds.index_copy(0, batch.latent_slots, lat.to(embeds.dtype))
    attention = MaskedAttention(model.num_layers, batch.groups)
    call = AttentionCall(token_types=batch.token_types, rope_positions=batch.positions, causal=False, update=False,
                         phase="prefill")
    out = model.language_model.model(embeds, batch.positions, attention, call, batch.gen_mask)
    mse = ce = torch.zeros((), device=device)
    if batch.mse_slots.numel():
        mse = F.mse_loss(model.llm2vae(out[batch.mse_slots]).float(), batch.mse_targets)
    if batch.ce_slots.numel():
        ce = F.cross_entropy(model.lm_logits(out[batch.ce_slots]).float(), batch.ce_targets)
    return mse + cfg.ce_weight * ce, float(mse.detach()), float(ce.detach())


def train_bagel(model: Bagel, maker: SampleMaker, cfg: TrainConfig, work: Path,
                progress: Callable | None = None, snapshot: Callable[[int, list], None] | None = None,
                average: WeightAverage | None = None) -> list:
    """Stage 2; returns the loss log ``[[step, loss, mse, ce], ...]`` (means over logging windows).

    ``snapshot(step, log)`` runs after each saved state (the run exports a usable checkpoint there);
    ``average`` (a :class:`WeightAverage` of ``model``) is updated after every step and saved with the state.
    """
    path = work / "bagel_state.safetensors"
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    groups = []
    for gen in (False, True):
        for decays in (True, False):
            chosen = [p for n, p in named if is_generation_parameter(n) == gen and (p.dim() >= 2) == decays]
            if chosen:
                groups.append({"params": chosen, "weight_decay": cfg.weight_decay if decays else 0.0,
                               "lr_scale": cfg.gen_lr_scale if gen else 1.0})
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.98))
    step, log = (load_state(path, model, opt, average) if path.exists() else (0, []))
    tok = maker.tok
    model.train()
    if cfg.compile and step < cfg.last_step:
        for layer in model.language_model.model.layers:  # in place: parameter names stay as they are
            layer.compile(dynamic=True)
    window: list[tuple[float, float, float]] = []
    t0 = time.perf_counter()
    last = cfg.last_step

    # the batch is drawn on this thread between steps: drawing the next one on a helper thread during the step
    # (torch releases the GIL) made steps slower on 2 cores, 0.74 s against 0.60 s, as the helper takes a core
    # from torch's two OpenMP threads
    while step < last:
        batch = pack(maker.draw(step), start_id=tok.start_of_image, end_id=tok.end_of_image,
                     vit_patch=model.config.vit.patch_size, max_latent_size=model.config.max_latent_size)
        for g in opt.param_groups:
            g["lr"] = _lr(step, cfg.steps, cfg.lr, cfg.warmup, cfg.min_lr_ratio) * g["lr_scale"]
        with autocast(cfg, model.device):
            loss, mse, ce = bagel_loss(model, batch, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        if average is not None:
            average.update(step)
        step += 1
        window.append((float(loss.detach()), mse, ce))
        if step % 25 == 0 or step == last:
            m = [round(sum(w[i] for w in window) / len(window), 5) for i in range(3)]
            log.append([step, *m])
            window.clear()
            logger.info("bagel step %d/%d loss %.4f mse %.4f ce %.4f (%.1fs)", step, last, *m,
                        time.perf_counter() - t0)
        if progress is not None:
            progress("bagel", step, last)
        if step % cfg.save_every == 0 or step == last:
            save_state(path, model, opt, step, log, average)
            if snapshot is not None and step < last:
                model.eval()
                snapshot(step, log)
                model.train()
    model.eval()
    return log


# ------------------------------------------------------------------------------------------ run


def export_checkpoint(model: Bagel, vae: AutoEncoder, bagel_cfg: BagelConfig, out: Path, info: dict) -> Path:
    """Write the official folder layout (+ ``training.json``, the run's record) to ``out``."""
    files, ids, _, bos, eos = shapes_tokenizer_files()
    parts = model_parts(model, vae, bagel_cfg, files, ids, bos=bos, eos=eos, dtype="bf16")  # as BAGEL ships
    write_parts(parts, out)
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return out


#: TrainConfig fields that decide stage 1 (a VAE taken from another run must have been trained with these).
VAE_STAGE_FIELDS = ("seed", "precision", "vae_steps", "vae_batch", "vae_crop", "vae_crop_steps", "vae_full_batch", "vae_fg_weight",
                    "vae_lr", "vae_kl", "grad_clip")


def _vae_from(vae: AutoEncoder, cfg: TrainConfig, folder: Path, times: dict) -> list:
    """Stage 1 taken from a finished run's checkpoint ``folder``: loads its ``ae.safetensors`` after checking
    that its ``training.json`` has the same VAE stage; its VAE seconds go into ``times``. Returns its VAE log."""
    record_path = folder / "training.json"
    if not record_path.is_file() or not (folder / "ae.safetensors").is_file():
        raise ValueError(f"--vae-from {folder}: needs ae.safetensors and training.json of a finished training run")
    record = json.loads(record_path.read_text(encoding="utf-8"))
    theirs = record.get("config", {})
    diffs = [f"{k}: {theirs.get(k)!r} there, {getattr(cfg, k)!r} here" for k in VAE_STAGE_FIELDS
             if theirs.get(k) != getattr(cfg, k)]
    ae_keys = json.loads(json.dumps({k: v for k, v in cfg.model.items() if k.startswith("ae_")}))  # tuples → lists
    if {k: v for k, v in theirs.get("model", {}).items() if k.startswith("ae_")} != ae_keys:
        diffs.append("VAE geometry (model ae_* overrides)")
    if diffs:
        raise ValueError(f"--vae-from {folder}: its VAE stage differs from this run's: {'; '.join(diffs)}")
    vae.load_state_dict(load_file(str(folder / "ae.safetensors")))
    if not times.get("vae_from"):
        times["vae_s"] = round(times["vae_s"] + float(record["seconds"]["vae_s"]), 1)
        times["vae_from"] = str(folder)
    return list(record.get("vae_log", []))


def run(out: Path, work: Path, cfg: TrainConfig, progress: Callable | None = None) -> dict:
    """Both stages (resuming from ``work``), then export; returns the run record."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n", encoding="utf-8")
    files, _, vocab_size, _, _ = shapes_tokenizer_files()
    bagel_cfg = shapes_config(vocab_size, **cfg.model)
    torch.manual_seed(cfg.seed)
    model, vae = build_models(bagel_cfg, cfg.seed, unit_input_init=cfg.unit_input_init)
    # seconds per stage over every session of this run (a resumed run adds to them)
    times_path = work / "times.json"
    times = {"vae_s": 0.0, "pool_s": 0.0, "bagel_s": 0.0, "sessions": 0}
    if times_path.is_file():
        times.update(json.loads(times_path.read_text(encoding="utf-8")))
    times["sessions"] += 1

    def add_time(stage: str, start: float) -> None:
        times[stage] = round(times[stage] + time.perf_counter() - start, 1)
        times_path.write_text(json.dumps(times, indent=2) + "\n", encoding="utf-8")

    if cfg.vae_from:
        vae_log = _vae_from(vae, cfg, Path(cfg.vae_from), times)
    else:
        t = time.perf_counter()
        vae_log = train_vae(vae, cfg, work, progress)
        add_time("vae_s", t)
    for p in vae.parameters():
        p.requires_grad_(False)
    vae_quality = reconstruction_quality(vae)
    logger.info("vae reconstructions: %s", vae_quality)
    done = _saved_step(work / "bagel_state.safetensors") >= cfg.last_step
    t = time.perf_counter()
    pairs_for_stats = [world.edit_sample(seed) for seed in range(256)]
    shift, scale = latent_statistics(vae, pairs_for_stats, cfg)
    if not done:  # encoding for stage 2, like the pool (a finished run only re-exports; the check above is no training)
        add_time("pool_s", t)
    bagel_cfg = dataclasses.replace(bagel_cfg, ae=dataclasses.replace(bagel_cfg.ae, shift_factor=shift, scale_factor=scale))
    vae.config = bagel_cfg.ae
    vae.shift_factor, vae.scale_factor = shift, scale
    model.config = bagel_cfg
    t = time.perf_counter()
    # a finished (or stopped-early) stage 2 only re-exports: its pool is not encoded again
    pool = Pool([], torch.zeros(0), torch.zeros(0)) if done else build_pool(vae, cfg.pool_size, progress, cfg)
    add_time("pool_s", t)
    maker = SampleMaker(cfg, bagel_cfg, pool, shapes_tokenizer(), vae)
    t = time.perf_counter()
    bagel_before = times["bagel_s"]

    def count_bagel_time() -> None:
        # at every save, so that a session stopped later still counts the stage-2 time up to its last state
        times["bagel_s"] = round(bagel_before + time.perf_counter() - t, 1)
        times_path.write_text(json.dumps(times, indent=2) + "\n", encoding="utf-8")

    def record(bagel_log: list, final: bool) -> dict:
        return {
            "variant": VARIANT,
            "final": final,
            "config": cfg.to_dict(),
            "latent_shift": shift, "latent_scale": scale,
            "vae_reconstruction": vae_quality,
            "seconds": dict(times),
            "threads": torch.get_num_threads(),
            "vae_log": vae_log,
            "bagel_log": bagel_log,
            "parameters": {"bagel": sum(p.numel() for p in model.parameters()),
                           "vae": sum(p.numel() for p in vae.parameters())},
        }

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
