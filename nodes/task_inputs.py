"""The inputs and outputs the task nodes declare (:mod:`.task_nodes`), each once as a typed V3 input: the
generation widgets with the official defaults and their bounds, the prompt, the seed, and the optional KV, VAE,
TaylorSeer and item inputs; and how the generation widgets become the engine's settings (:func:`settings_of`)."""

from __future__ import annotations

from unicache_core.bagel import RENORM_TYPES
from unicache_core.bagel.seeding import MAX_SEED
from unicache_core.bagel.settings import (
    MAX_CFG_SCALE,
    MAX_NUM_TIMESTEPS,
    T2I_DEFAULTS,
    TIMESTEP_SHIFT_RANGE,
)

from .base import ITEMS, KV, MODEL, REPORT
from .host import io

OUTPUT_TOOLTIPS = (
    "The generated image(s), [batch, height, width, 3] in [0, 1].",
    "The final latent in ComfyUI's FLUX convention (decode with core VAEDecode and the FLUX ae.safetensors).",
    "The reasoning decoded in think mode (empty when think is off).",
    "The KV-cache report of the run (connect to UniCache KV Report).",
)


def generation_outputs() -> list:
    """IMAGE, LATENT, the think-mode reasoning and the KV report (output ids differ from the input names, as V3 wants;
    the names shown are the display names)."""
    image, latent, thinking, report = OUTPUT_TOOLTIPS
    return [
        io.Image.Output("image_out", display_name="image", tooltip=image),
        io.Latent.Output("latent_out", display_name="latent", tooltip=latent),
        io.String.Output("thinking", display_name="thinking", tooltip=thinking),
        REPORT.Output("kv_report", display_name="kv_report", tooltip=report),
    ]


# ------------------------------------------------------------------------------------------- inputs


def model_input():
    return MODEL.Input("model", tooltip="From UniCache BAGEL Loader.")


def seed_input():
    return io.Int.Input(
        "seed",
        default=0,
        min=0,
        max=MAX_SEED,
        step=1,
        control_after_generate=True,
        tooltip="Seed of all random draws (noise, sampled text); any value in [0, 2^64-1]. Seeds below 2^32 "
        "reproduce the official BAGEL stream.",
    )


def think_input(tip: str):
    return io.Boolean.Input("think", default=False, label_on="think", label_off="direct", tooltip=tip)


#: Each generation widget and the engine setting it sets (:func:`~unicache_core.bagel.settings.preset`).
SETTING_OF = {
    "steps": "num_timesteps",
    "cfg_text_scale": "cfg_text_scale",
    "cfg_img_scale": "cfg_img_scale",
    "timestep_shift": "timestep_shift",
    "cfg_renorm_min": "cfg_renorm_min",
    "cfg_renorm_type": "cfg_renorm_type",
    "think": "think",
}


def generation_inputs(defaults) -> list:
    """The generation widgets, in the order saved workflows hold their values (``steps`` ... ``think``)."""
    lo, hi = TIMESTEP_SHIFT_RANGE

    def scale(name: str, default: float, tip: str):
        return io.Float.Input(name, default=default, min=0.0, max=MAX_CFG_SCALE, step=0.1, round=0.01, tooltip=tip)

    def unit(name: str, default: float, tip: str):
        return io.Float.Input(name, default=default, min=0.0, max=1.0, step=0.01, tooltip=tip)

    return [
        io.Int.Input(
            "steps",
            default=defaults.num_timesteps,
            min=2,
            max=MAX_NUM_TIMESTEPS,
            step=1,
            tooltip="Points of the timestep schedule (BAGEL's num_timesteps; steps-1 Euler updates are run). "
            f"Official: {defaults.num_timesteps}.",
        ),
        seed_input(),
        scale("cfg_text_scale", defaults.cfg_text_scale, "Text guidance; <= 1 turns it (and image guidance) off."),
        scale("cfg_img_scale", defaults.cfg_img_scale, "Image guidance; <= 1 turns it off."),
        unit(
            "cfg_interval_lo",
            defaults.cfg_interval[0],
            "Guidance runs for the steps with lo < t <= hi (t goes from 1 to 0).",
        ),
        unit("cfg_interval_hi", defaults.cfg_interval[1], "Upper end of the guidance interval (>= lo)."),
        io.Float.Input(
            "timestep_shift",
            default=defaults.timestep_shift,
            min=lo,
            max=hi,
            step=0.1,
            round=0.01,
            tooltip=f"Shift s of the schedule t' = s t / (1 + (s-1) t). Official: {defaults.timestep_shift}.",
        ),
        unit(
            "cfg_renorm_min", defaults.cfg_renorm_min, "Lower clamp of the norm ratio after guidance (1 = no renorm)."
        ),
        io.Combo.Input(
            "cfg_renorm_type",
            options=list(RENORM_TYPES),
            default=defaults.cfg_renorm_type,
            tooltip="How the guided velocity is renormalised.",
        ),
        think_input("Reason first (think mode) and generate from the reasoning, which is the `thinking` output."),
    ]


def settings_of(inputs: dict) -> dict:
    """The generation widgets' values as the engine's settings (``cfg_interval`` from its two ends)."""
    lo, hi = inputs["cfg_interval_lo"], inputs["cfg_interval_hi"]
    if lo > hi:
        raise ValueError(f"cfg_interval_lo ({lo}) must not exceed cfg_interval_hi ({hi})")
    out = {setting: inputs[widget] for widget, setting in SETTING_OF.items()}
    return {**out, "cfg_interval": (lo, hi), "taylorseer": bool(inputs.get("taylorseer") or False)}


def prompt_input(default: str, tip: str):
    return io.String.Input("prompt", multiline=True, default=default, tooltip=tip)


def kv_input():
    return KV.Input("kv", optional=True, tooltip="KV-cache compression (UniCache KV Config). None = full cache.")


def taylorseer_input():  # optional: a workflow saved before it existed still runs, without TaylorSeer
    return io.Boolean.Input(
        "taylorseer",
        optional=True,
        default=False,
        tooltip=f"TaylorSeer (official): after {T2I_DEFAULTS.taylorseer_first_steps} steps the model runs on 1 step in "
        f"{T2I_DEFAULTS.taylorseer_interval}, the others are forecast.",
    )


def vae_input():
    return io.Vae.Input(
        "vae",
        optional=True,
        tooltip="Optional FLUX VAE (core VAELoader, ae.safetensors) instead of the checkpoint's own; needed for "
        "single-file checkpoints without a VAE.",
    )


def items_input():
    return ITEMS.Input(
        "items",
        optional=True,
        tooltip="Texts and images that come first, in order (UniCache BAGEL Image Item / Text Item chain); this "
        "node's own image and prompt follow them.",
    )
