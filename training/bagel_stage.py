"""Stage 2: BAGEL (the MoT LLM, ViT and connector) on text-to-image, edit and understanding samples drawn
from the pool of encoded edit pairs (:class:`SampleMaker`), one masked forward per step (:func:`bagel_loss`);
and the understanding warm-up that may precede it (:func:`train_und_warmup`: one-object scenes, position
questions only, the understanding path alone at a low rate)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor
from torch.nn import functional as F

from unicache_core.bagel.config import BagelConfig
from unicache_core.bagel.modeling import AutoEncoder, Bagel
from unicache_core.bagel.modeling.bagel import patchify
from unicache_core.bagel.sampling import pack_latent
from unicache_core.bagel.transforms import ImageTransforms
from unicache_core.kv.cache import AttentionCall
from unicache_core.shapes import world

from .attention import MaskedAttention
from .batches import Block, Sample, pack
from .config import TrainConfig, autocast, check_und_late_kinds, check_und_warmup_kinds, learning_rate
from .state import WeightAverage, load_state, save_state
from .vae_stage import Pool

logger = logging.getLogger(__name__)


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
            out["und"].append(self.und_sample(scene, self.questions(scene, kinds, rng)))
        return out

    def und_sample(self, scene: world.Scene, questions: list[world.Question]) -> Sample:
        """An understanding sample: the scene's ViT image, then each question and its answer (the loss), as
        turns."""
        blocks = [self.vit(scene)]
        for q in questions:
            blocks += [self.text(q.question), self.text(q.answer, loss=True)]
        return Sample("und", blocks)

    def und_warmup_questions(self, step: int) -> list[tuple[world.Scene, world.Question]]:
        """The ``und_warmup_batch`` questions of warm-up step ``step``: one-object training scenes (not from
        the pool), sample ``i`` asked a question of kind ``und_warmup_kinds[i % len(und_warmup_kinds)]``."""
        first = (self.cfg.seed * 1_000_003 + step) * self.cfg.und_warmup_batch
        kinds = self.cfg.und_warmup_kinds
        return [
            world.understanding_sample((first + i) % world.TRAIN_SEEDS.stop, kinds[i % len(kinds)], max_objects=1)
            for i in range(self.cfg.und_warmup_batch)
        ]

    def und_warmup_draw(self, step: int) -> dict[str, list[Sample]]:
        """The samples of warm-up step ``step`` (:meth:`und_warmup_questions`, one question per image)."""
        und = [self.und_sample(scene, [q]) for scene, q in self.und_warmup_questions(step)]
        return {"t2i": [], "edit": [], "und": und}

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
        lat = (
            model.vae2llm(batch.latents)
            + model.time_embedder(batch.latent_t)
            + model.latent_pos_embed(batch.latent_pos)
        )
        embeds = embeds.index_copy(0, batch.latent_slots, lat.to(embeds.dtype))
    attention = MaskedAttention(model.num_layers, batch.groups)
    call = AttentionCall(
        token_types=batch.token_types, rope_positions=batch.positions, causal=False, update=False, phase="prefill"
    )
    out = model.language_model.model(embeds, batch.positions, attention, call, batch.gen_mask)
    mse = ce = torch.zeros((), device=device)
    if batch.mse_slots.numel():
        mse = F.mse_loss(model.llm2vae(out[batch.mse_slots]).float(), batch.mse_targets)
    if batch.ce_slots.numel():
        ce = F.cross_entropy(model.lm_logits(out[batch.ce_slots]).float(), batch.ce_targets)
    return mse + cfg.ce_weight * ce, float(mse.detach()), float(ce.detach())


#: The state files of the understanding warm-up and of stage 2 in a run's work folder.
UND_WARMUP_STATE = "und_warmup_state.safetensors"
BAGEL_STATE = "bagel_state.safetensors"


def trainable_parameters(model: Bagel, generation: bool = True) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of every trained parameter, in the model's order (``generation=False``: without
    the generation path)."""
    return [
        (n, p)
        for n, p in model.named_parameters()
        if p.requires_grad and (generation or not is_generation_parameter(n))
    ]


def adamw(named: list[tuple[str, torch.nn.Parameter]], cfg: TrainConfig) -> torch.optim.AdamW:
    """A fresh AdamW over ``named``: weight decay on matrices only, each group's ``lr_scale`` the rate
    multiplier (``gen_lr_scale`` for the generation path, 1 elsewhere)."""
    groups = []
    for gen in (False, True):
        for decays in (True, False):
            chosen = [p for n, p in named if is_generation_parameter(n) == gen and (p.dim() >= 2) == decays]
            if chosen:
                groups.append(
                    {
                        "params": chosen,
                        "weight_decay": cfg.weight_decay if decays else 0.0,
                        "lr_scale": cfg.gen_lr_scale if gen else 1.0,
                    }
                )
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.98))


def compile_layers(model: Bagel) -> None:
    """Compile the LLM's decoder layers in place (dynamic shapes; parameter names stay as they are)."""
    for layer in model.language_model.model.layers:
        layer.compile(dynamic=True)


def optimise(
    model: Bagel,
    opt: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    path: Path,
    draw: Callable[[int], dict[str, list[Sample]]],
    rate: Callable[[int], float],
    last: int,
    cfg: TrainConfig,
    tokenizer,
    *,
    stage: str,
    progress: Callable | None = None,
    snapshot: Callable[[int, list], None] | None = None,
    average: WeightAverage | None = None,
) -> list:
    """Optimise ``model`` on the batches ``draw(step)`` (packed with ``tokenizer``'s image markers) up to step
    ``last``; returns the loss log ``[[step, loss, mse, ce], ...]`` (means over 25-step windows).

    Each group of ``opt`` runs at ``rate(step)`` times its ``lr_scale``; the gradient norm of ``params`` is
    clipped to ``cfg.grad_clip``. The state (weights, ``opt``'s moments, ``average``) resumes from ``path`` and
    is saved there every ``cfg.save_every`` steps and at ``last``; ``snapshot(step, log)`` runs after each save
    before ``last``; ``average`` is updated after every step; ``progress(stage, step, last)`` after every step.
    """
    step, log = load_state(path, model, opt, average) if path.exists() else (0, [])
    model.train()
    window: list[tuple[float, float, float]] = []
    t0 = time.perf_counter()

    # the batch is drawn on this thread between steps (a helper thread drawing the next one during the step
    # takes a core from torch's threads on a small machine: docs/shapes.md)
    while step < last:
        batch = pack(
            draw(step),
            start_id=tokenizer.start_of_image,
            end_id=tokenizer.end_of_image,
            vit_patch=model.config.vit.patch_size,
            max_latent_size=model.config.max_latent_size,
        )
        for g in opt.param_groups:
            g["lr"] = rate(step) * g["lr_scale"]
        with autocast(cfg, model.device):
            loss, mse, ce = bagel_loss(model, batch, cfg)
        model.zero_grad(set_to_none=True)
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
            logger.info(
                "%s step %d/%d loss %.4f mse %.4f ce %.4f (%.1fs)", stage, step, last, *m, time.perf_counter() - t0
            )
        if progress is not None:
            progress(stage, step, last)
        if step % cfg.save_every == 0 or step == last:
            save_state(path, model, opt, step, log, average)
            if snapshot is not None and step < last:
                model.eval()
                snapshot(step, log)
                model.train()
    model.eval()
    return log


def train_und_warmup(
    model: Bagel,
    maker: SampleMaker,
    cfg: TrainConfig,
    work: Path,
    progress: Callable | None = None,
    snapshot: Callable[[int, list], None] | None = None,
) -> list:
    """The understanding warm-up (``cfg.und_warmup`` steps of :meth:`SampleMaker.und_warmup_draw`); returns
    its loss log (``mse`` is 0).

    Only the understanding path trains (the generation path gets no gradient from these samples and keeps its
    initial values), with its own AdamW, at ``learning_rate(step, und_warmup, und_warmup_lr, warmup,
    min_lr_ratio)``; its state is ``work/und_warmup_state.safetensors``. ``snapshot(step, log)`` runs after
    each save before the end.
    """
    check_und_warmup_kinds(cfg.und_warmup_kinds)
    if cfg.und_warmup_batch < 1:
        raise ValueError(
            f"und_warmup_batch must be >= 1 for a warm-up of {cfg.und_warmup} steps, got {cfg.und_warmup_batch}"
        )
    named = trainable_parameters(model, generation=False)

    def rate(step: int) -> float:
        return learning_rate(step, cfg.und_warmup, cfg.und_warmup_lr, cfg.warmup, cfg.min_lr_ratio)

    return optimise(
        model,
        adamw(named, cfg),
        [p for _, p in named],
        work / UND_WARMUP_STATE,
        maker.und_warmup_draw,
        rate,
        cfg.und_warmup,
        cfg,
        maker.tok,
        stage="und_warmup",
        progress=progress,
        snapshot=snapshot,
    )


def train_bagel(
    model: Bagel,
    maker: SampleMaker,
    cfg: TrainConfig,
    work: Path,
    progress: Callable | None = None,
    snapshot: Callable[[int, list], None] | None = None,
    average: WeightAverage | None = None,
) -> list:
    """Stage 2 (``cfg.last_step`` steps of :meth:`SampleMaker.draw`, a fresh AdamW at ``learning_rate(step,
    steps, lr, warmup, min_lr_ratio)``, the generation path at ``gen_lr_scale`` times that); returns the loss
    log ``[[step, loss, mse, ce], ...]`` (means over logging windows).

    ``snapshot(step, log)`` runs after each saved state (the run exports a usable checkpoint there);
    ``average`` (a :class:`WeightAverage` of ``model``) is updated after every step and saved with the state.
    """
    named = trainable_parameters(model)

    def rate(step: int) -> float:
        return learning_rate(step, cfg.steps, cfg.lr, cfg.warmup, cfg.min_lr_ratio)

    return optimise(
        model,
        adamw(named, cfg),
        [p for _, p in named],
        work / BAGEL_STATE,
        maker.draw,
        rate,
        cfg.last_step,
        cfg,
        maker.tok,
        stage="bagel",
        progress=progress,
        snapshot=snapshot,
        average=average,
    )
