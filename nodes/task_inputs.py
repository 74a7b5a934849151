"""The inputs and outputs the task nodes declare (:mod:`.task_nodes`): the generation widgets with the official
defaults and their bounds, the prompt, the seed, and the optional KV, VAE and TaylorSeer inputs."""

from __future__ import annotations

from unicache_core.bagel import RENORM_TYPES
from unicache_core.bagel.seeding import MAX_SEED
from unicache_core.bagel.settings import (
    MAX_CFG_SCALE,
    MAX_NUM_TIMESTEPS,
    TIMESTEP_SHIFT_RANGE,
)

OUTPUTS = ("IMAGE", "LATENT", "STRING", "UNICACHE_KV_REPORT")
OUTPUT_NAMES = ("image", "latent", "thinking", "kv_report")
OUTPUT_TOOLTIPS = (
    "The generated image(s), [batch, height, width, 3] in [0, 1].",
    "The final latent in ComfyUI's FLUX convention (decode with core VAEDecode and the FLUX ae.safetensors).",
    "The plan decoded in think mode (empty when think is off).",
    "The KV-cache report of the run (connect to UniCache KV Report).",
)


# ------------------------------------------------------------------------------------------- inputs


def seed_input():
    return (
        "INT",
        {
            "default": 0,
            "min": 0,
            "max": MAX_SEED,
            "step": 1,
            "control_after_generate": True,
            "tooltip": "Seed of all random draws (noise, sampled text); any value in [0, 2^64-1]. Seeds "
            "below 2^32 reproduce the official BAGEL stream.",
        },
    )


def generation_inputs(defaults) -> dict:
    lo, hi = TIMESTEP_SHIFT_RANGE
    return {
        "steps": (
            "INT",
            {
                "default": defaults.num_timesteps,
                "min": 2,
                "max": MAX_NUM_TIMESTEPS,
                "step": 1,
                "tooltip": "Points of the timestep schedule (BAGEL's num_timesteps; steps-1 Euler updates "
                "are run). Official: 50.",
            },
        ),
        "seed": seed_input(),
        "cfg_text_scale": (
            "FLOAT",
            {
                "default": defaults.cfg_text_scale,
                "min": 0.0,
                "max": MAX_CFG_SCALE,
                "step": 0.1,
                "round": 0.01,
                "tooltip": "Text guidance; <= 1 turns it (and image guidance) off.",
            },
        ),
        "cfg_img_scale": (
            "FLOAT",
            {
                "default": defaults.cfg_img_scale,
                "min": 0.0,
                "max": MAX_CFG_SCALE,
                "step": 0.1,
                "round": 0.01,
                "tooltip": "Image guidance; <= 1 turns it off.",
            },
        ),
        "cfg_interval_lo": (
            "FLOAT",
            {
                "default": defaults.cfg_interval[0],
                "min": 0.0,
                "max": 1.0,
                "step": 0.01,
                "tooltip": "Guidance runs for the steps with lo < t <= hi (t goes from 1 to 0).",
            },
        ),
        "cfg_interval_hi": (
            "FLOAT",
            {
                "default": defaults.cfg_interval[1],
                "min": 0.0,
                "max": 1.0,
                "step": 0.01,
                "tooltip": "Upper end of the guidance interval (>= lo).",
            },
        ),
        "timestep_shift": (
            "FLOAT",
            {
                "default": defaults.timestep_shift,
                "min": lo,
                "max": hi,
                "step": 0.1,
                "round": 0.01,
                "tooltip": "Shift s of the schedule t' = s t / (1 + (s-1) t). Official: 3.0.",
            },
        ),
        "cfg_renorm_min": (
            "FLOAT",
            {
                "default": defaults.cfg_renorm_min,
                "min": 0.0,
                "max": 1.0,
                "step": 0.01,
                "tooltip": "Lower clamp of the norm ratio after guidance (1 = no renorm).",
            },
        ),
        "cfg_renorm_type": (
            list(RENORM_TYPES),
            {"default": defaults.cfg_renorm_type, "tooltip": "How the guided velocity is renormalised."},
        ),
        "think": (
            "BOOLEAN",
            {
                "default": False,
                "label_on": "think",
                "label_off": "direct",
                "tooltip": "Decode a plan first (think mode) and generate from it; the plan is the `thinking` output.",
            },
        ),
    }


def prompt_input(default: str, tip: str):
    return ("STRING", {"multiline": True, "default": default, "tooltip": tip})


KV_INPUT = ("UNICACHE_KV", {"tooltip": "KV-cache compression (UniCache KV Config). None = full cache."})
TAYLORSEER_INPUT = (  # optional: a workflow saved before it existed still runs, without TaylorSeer
    "BOOLEAN",
    {
        "default": False,
        "tooltip": "TaylorSeer (official): after 5 steps the model runs on 1 step in 3, the others are forecast.",
    },
)
VAE_INPUT = (
    "VAE",
    {
        "tooltip": "Optional FLUX VAE (core VAELoader, ae.safetensors) instead of the checkpoint's own; "
        "needed for single-file checkpoints without a VAE."
    },
)


# ------------------------------------------------------------------------------------------- running
