"""The settings of a training run (:class:`TrainConfig`) and the pieces both stages share: precision and
the learning-rate schedule."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from unicache_core.shapes import world


@dataclass
class TrainConfig:
    """Every knob of a training run (the defaults are the shipped run)."""

    seed: int = 0
    model: dict = field(default_factory=dict)  # overrides of model.ShapesGeometry's fields, by name
    vae_steps: int = 1200
    vae_batch: int = 16  # crops per step of the first ``vae_crop_steps`` steps
    vae_crop: int = 64
    vae_crop_steps: int = 900  # then whole 128 px images (the mid-block attention must see the full grid)
    vae_full_batch: int = 8
    vae_fg_weight: float = 3.0  # extra loss weight of object pixels (a scene is mostly background)
    vae_lr: float = 2e-3
    vae_kl: float = 1e-6
    pool_size: int = 4000
    # held-out scenes whose VAE reconstructions are scored after stage 1 (the record's "vae_reconstruction")
    vae_eval_scenes: int = 64
    # edit pairs (training seeds 0..n-1, source and target images) whose posterior means set the latent
    # shift and scale
    latent_stat_pairs: int = 256
    # a finished run's checkpoint folder whose VAE stands in for stage 1 (its config must match this one's VAE
    # stage; its recorded VAE seconds and log carry over); "" = train the VAE
    vae_from: str = ""
    # start image input modules at N(0, 1/fan_in): False, True / "all", "und" (ViT + connector) or a list of
    # names (model.unit_init_modules)
    unit_input_init: bool | str | list = "und"
    timestep_shift: float = 2.0  # t = s u / (1 + (s - 1) u), u = sigmoid(N(0, 1)): more weight on noisy steps
    # the bundled model: the schedule laid out for the steps the hour holds on this machine, run to its end
    # (2800 steps at 0.6-0.65 s after the warm-up: 52.5 min in all); 0.73 s a step would make it 57 min
    steps: int = 2800  # the length the learning-rate schedule is laid out for
    stop_at: int = 0  # stop (and export) at this step; 0 = ``steps``
    batch: dict = field(default_factory=lambda: {"t2i": 16, "edit": 12, "und": 16})
    # understanding: questions asked about each image, as turns of one sequence (each of another kind); a
    # question adds a few text tokens to the image's ViT tokens
    und_questions: int = 2
    # question kinds held back until step ``und_late_from`` (why: docs/shapes.md, "Understanding: what held it
    # at the prior")
    und_late_kinds: list = field(default_factory=lambda: ["background", "exists"])
    und_late_from: int = 800
    # the understanding warm-up that runs before stage 2 (0 = none): ``und_warmup`` steps of understanding
    # only, ``und_warmup_batch`` one-object scenes a step, each asked where its object is; the understanding
    # path alone trains, at peak rate ``und_warmup_lr`` (linear over ``warmup`` steps, then a cosine to
    # ``min_lr_ratio`` at ``und_warmup``); stage 2 then starts from these weights with a fresh optimiser. The
    # defaults are the pilot that taught the model where things are (docs/shapes.md, "The understanding
    # warm-up")
    und_warmup: int = 600
    und_warmup_lr: float = 2e-4
    und_warmup_batch: int = 16
    # the question kinds of the warm-up, taken in turn by the samples of a step
    und_warmup_kinds: list = field(default_factory=lambda: ["position"])
    lr: float = 1.5e-3
    # learning rate of the generation path (bagel_stage.is_generation_parameter) over ``lr`` (the pilots that
    # chose it: docs/shapes.md, "The recipe")
    gen_lr_scale: float = 2.0
    warmup: int = 100
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.01
    ce_weight: float = 0.5
    drop_text: float = 0.1
    drop_image: float = 0.1
    grad_clip: float = 1.0
    save_every: int = 200
    threads: int = 0  # 0: torch's default
    # "bf16": matmuls and convolutions under bfloat16 autocast (weights, optimiser and losses stay fp32); "fp32":
    # no autocast (what each saves: docs/shapes.md, "Training on two cores")
    precision: str = "bf16"
    # compile the LLM's decoder layers (torch.compile, dynamic shapes; compiled once per run)
    compile: bool = True
    # exponential moving average of the BAGEL weights, exported as ema.safetensors (0 = export the raw weights);
    # the decay ramps up as (1 + step) / (10 + step) until it reaches this value
    ema_decay: float = 0.999

    @property
    def last_step(self) -> int:
        """The step stage 2 ends at (``stop_at`` when set, else ``steps``)."""
        return min(self.steps, self.stop_at) if self.stop_at else self.steps

    def to_dict(self) -> dict:
        """Every field, as ``training.json`` records it."""
        return dataclasses.asdict(self)


PRECISIONS: tuple[str, ...] = ("bf16", "fp32")


def autocast(cfg: TrainConfig, device: torch.device | str = "cpu"):
    """The autocast context of ``cfg.precision`` (bf16: matmuls and convolutions in bfloat16)."""
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {cfg.precision!r}")
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")


def learning_rate(step: int, total: int, base: float, warmup: int, min_ratio: float) -> float:
    """The rate at ``step``: linear warm-up over ``warmup`` steps to ``base``, then a cosine down to
    ``min_ratio * base`` at ``total``."""
    if step < warmup:
        return base * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


#: TrainConfig fields that decide stage 1 (a VAE taken from another run must have been trained with these).
VAE_STAGE_FIELDS = (
    "seed",
    "precision",
    "vae_steps",
    "vae_batch",
    "vae_crop",
    "vae_crop_steps",
    "vae_full_batch",
    "vae_fg_weight",
    "vae_lr",
    "vae_kl",
    "grad_clip",
)


#: Question kinds that every scene can answer (so an understanding sample always gets a question).
ALWAYS_ASKABLE: tuple[str, ...] = ("count", "exists", "background")


def _unknown_kinds(kinds: list[str]) -> list[str]:
    return [k for k in kinds if k not in world.QUESTION_KINDS]


def check_und_warmup_kinds(kinds: list[str]) -> None:
    """Raise ``ValueError`` unless ``kinds`` is a non-empty list of question kinds (the warm-up asks them in
    turn)."""
    if not kinds or _unknown_kinds(kinds):
        raise ValueError(
            f"the warm-up's question kinds must be one or more of {list(world.QUESTION_KINDS)}, got {kinds}"
        )


def check_und_late_kinds(kinds: list[str]) -> None:
    """Raise ``ValueError`` unless ``kinds`` are question kinds and leave an always-askable kind in play."""
    unknown = _unknown_kinds(kinds)
    if unknown:
        raise ValueError(f"unknown question kind(s) {unknown} to hold back; use some of {list(world.QUESTION_KINDS)}")
    if all(k in kinds for k in ALWAYS_ASKABLE):
        raise ValueError(
            f"holding back {kinds} leaves no kind every scene can answer; keep one of "
            f"{list(ALWAYS_ASKABLE)} from the start"
        )
