"""The settings of a BAGEL request: one validated object per task family, with the official defaults and bounds.

* :class:`GenerationSettings`: text-to-image and edit (denoising, guidance, think mode, T2I output size);
* :class:`UnderstandingSettings`: answer decoding.

Both check every value when they are made (``ValueError`` naming the field, the bound and the value), so
the CLI, the ComfyUI nodes and the Python API build the same object and get the same messages. The
official defaults (docs/bagel.md §5; ByteDance-Seed/Bagel ``app.py``, ``inferencer.py``) are the presets
of :func:`preset`: text-to-image and edit differ in image guidance, guidance interval and renorm type.
The output size limit depends on the checkpoint (:func:`check_output_size`).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from ..kv.token_types import TASKS, Task
from ..validation import check_bool, check_float, check_int, is_integer
from .numerics import check_finite
from .sampling import RENORM_TYPES, timestep_schedule

#: The bundled default checkpoint (a small BAGEL trained on the shapes world, docs/shapes.md), shipped in the
#: repository's ``models/bagel/``; the CLI's default ``--checkpoint`` and the loader node's default choice.
BUNDLED_CHECKPOINT = "unicache-shapes"
BUNDLED_CHECKPOINT_DIR = Path(__file__).resolve().parents[2] / "models" / "bagel" / BUNDLED_CHECKPOINT

#: Largest accepted ``cfg_text_scale`` / ``cfg_img_scale``. The official defaults are 4.0 and 1.5 (T2I) or
#: 2.0 (edit), and the official demo's sliders stop at 8 and 4. Far larger scales only amplify the branch
#: differences until they overflow.
MAX_CFG_SCALE = 100.0
#: Accepted ``timestep_shift`` range, inclusive (official default 3.0). Below about 1e-7 the fp32 schedule
#: divides by zero. Far outside ``[0.01, 100]``, almost all steps land at one end of the schedule.
TIMESTEP_SHIFT_RANGE = (0.01, 100.0)
#: Accepted sampling ``temperature`` / ``think_temperature`` range when sampling (official default 0.3).
#: Use greedy decoding (``do_sample=False``) rather than a temperature near 0.
TEMPERATURE_RANGE = (1e-3, 100.0)
#: Largest accepted ``num_timesteps`` (official default 50). Each step costs one forward per CFG branch.
MAX_NUM_TIMESTEPS = 1000
#: Highest accepted ``taylorseer_order``: the official default (``max_order`` 6 in ``cache_init`` of
#: ``modeling/cache_utils/taylorseer.py``). Each order keeps one more ``[tokens, hidden]`` tensor per branch and
#: divides one more difference of model-dtype features by the step distance.
MAX_TAYLORSEER_ORDER = 6


# ------------------------------------------------------------------------------------------ value checks


def check_prompt(prompt: object) -> str:
    """``prompt`` when it is a str of valid Unicode text (no lone surrogates), else a ValueError."""
    if not isinstance(prompt, str):
        raise ValueError(f"`prompt` must be a str, got {type(prompt).__name__}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # lone surrogates, e.g. undecodable bytes of a command-line argument
        raise ValueError(
            f"`prompt` is not valid Unicode text: {prompt[exc.start : exc.end]!r} at index {exc.start} is a lone "
            f"surrogate (an undecodable byte, e.g. from non-UTF-8 input); pass UTF-8 text"
        ) from None
    return prompt


def _check_temperature(name: str, value: object) -> float:
    return check_float(name, value, TEMPERATURE_RANGE[0], maximum=TEMPERATURE_RANGE[1])


def check_output_size(config, width: object, height: object) -> tuple[int, int]:
    """``width``/``height`` of a T2I request: positive multiples of the latent patch (16 px for BAGEL), within
    ``latent_downsample * max_latent_size`` (1024 px for BAGEL); ``config`` is a :class:`BagelConfig`."""
    step = config.latent_downsample
    limit = step * config.max_latent_size
    sides = []
    for name, value in (("width", width), ("height", height)):
        # is_integer admits exactly the numbers.Integral kinds (bools excluded), which int() converts exactly
        number = int(cast(numbers.Integral, value)) if is_integer(value) else None
        if number is None or number <= 0 or number % step or number > limit:
            raise ValueError(f"`{name}` must be a positive multiple of {step} and <= {limit}, got {value!r}")
        sides.append(number)
    return sides[0], sides[1]


def source_latent_size(
    config,
    rows: int,
    cols: int,
    *,
    name: str = "source_latent",
    fix: str = "encode a smaller image, or leave it None to encode the image here",
) -> tuple[int, int]:
    """Output ``(width, height)`` in pixels of an edit whose source latent is ``[1, C, rows, cols]``.

    Each latent cell is ``ae.downsample`` px (8 for BAGEL) and BAGEL packs ``latent_patch_size``² cells
    (2x2) into one token, so ``rows`` and ``cols`` must be positive multiples of ``latent_patch_size`` and at
    most ``latent_patch_size * max_latent_size`` (the latent position table: 128 cells, 1024 px). Otherwise a
    ValueError naming ``name``, its size and what to do (``fix`` for a latent that is too large).
    """
    patch, cell = config.latent_patch_size, config.ae.downsample
    limit = patch * config.max_latent_size
    for side, value in (("height", rows), ("width", cols)):
        if not is_integer(value) or value < patch or value % patch:
            raise ValueError(
                f"`{name}` is {rows}x{cols} latent cells (rows x columns); BAGEL packs {patch}x{patch} cells into "
                f"a token, so its {side} must be a positive multiple of {patch} ({patch * cell} px): crop it to "
                f"{max(patch, rows - rows % patch)}x{max(patch, cols - cols % patch)} or encode an image whose sides "
                f"are multiples of {patch * cell} px"
            )
        if value > limit:
            raise ValueError(
                f"`{name}` is {rows}x{cols} latent cells ({cols * cell}x{rows * cell} px); BAGEL's latent position "
                f"table holds at most {limit} cells ({limit * cell} px) per side: {fix}"
            )
    return cols * cell, rows * cell


# ------------------------------------------------------------------------------------------ settings


@dataclass(frozen=True, kw_only=True)
class GenerationSettings:
    """Denoising, guidance and think-mode settings of a text-to-image or edit request (docs/bagel.md §5.3-§5.5).

    Checked when made (and by ``replace``); the defaults are the official text-to-image ones
    (``preset("edit")`` for the edit ones).

    Attributes:
        num_timesteps: points of the shifted schedule; ``num_timesteps - 1`` Euler steps are run.
        timestep_shift: ``s`` in ``t' = s t / (1 + (s - 1) t)``.
        cfg_text_scale: text guidance (the ``cfg_text`` branch is computed only when > 1).
        cfg_img_scale: image guidance (the ``cfg_img`` branch; computed only when the text scale is > 1 too).
        cfg_interval: guidance is active for the steps with ``lo < t <= hi``.
        cfg_renorm_min, cfg_renorm_type: norm clamp after guidance: ``global`` | ``channel`` | ``text_channel``.
        think: decode a plan first and generate from it.
        think_max_new_tokens, think_do_sample, think_temperature: how the reasoning is decoded (checked with ``think``).
        width, height: text-to-image output size in pixels (checked against the checkpoint by
            :func:`check_output_size`); an edit's output follows its source image and ignores them.
        prompt_special_tokens: parse control-token strings in the prompt as the official code does
            (``<|im_end|>`` becomes the control token); off: the prompt is plain text.
        taylorseer: the official ``enable_taylorseer`` (:mod:`.taylorseer`, docs/bagel.md §5.6): each CFG branch
            runs its decoder on its first ``taylorseer_first_steps`` forwards, then on every
            ``taylorseer_interval``-th, and forecasts its decoder output on the others with a Taylor expansion of
            order up to ``taylorseer_order`` (official 3 / 5 / 6).
    """

    num_timesteps: int = 50
    timestep_shift: float = 3.0
    cfg_text_scale: float = 4.0
    cfg_img_scale: float = 1.5
    cfg_interval: tuple[float, float] = (0.4, 1.0)
    cfg_renorm_min: float = 0.0
    cfg_renorm_type: str = "global"
    think: bool = False
    think_max_new_tokens: int = 1024
    think_do_sample: bool = False
    think_temperature: float = 0.3
    width: int = 1024
    height: int = 1024
    prompt_special_tokens: bool = False
    taylorseer: bool = False
    taylorseer_interval: int = 3
    taylorseer_first_steps: int = 5
    taylorseer_order: int = 6

    def __post_init__(self) -> None:
        steps = check_int("num_timesteps", self.num_timesteps, 2, MAX_NUM_TIMESTEPS)
        lo_shift, hi_shift = TIMESTEP_SHIFT_RANGE
        shift = check_float("timestep_shift", self.timestep_shift, lo_shift, maximum=hi_shift)
        text_scale = check_float("cfg_text_scale", self.cfg_text_scale, 0.0, maximum=MAX_CFG_SCALE)
        img_scale = check_float("cfg_img_scale", self.cfg_img_scale, 0.0, maximum=MAX_CFG_SCALE)
        interval = self.cfg_interval
        if not isinstance(interval, Sequence) or isinstance(interval, str) or len(interval) != 2:
            raise ValueError(f"`cfg_interval` must be a pair (lo, hi) with 0 <= lo <= hi <= 1, got {interval!r}")
        lo = check_float("cfg_interval[0]", interval[0], 0.0, maximum=1.0)
        hi = check_float("cfg_interval[1]", interval[1], 0.0, maximum=1.0)
        if lo > hi:
            raise ValueError(f"`cfg_interval` must satisfy lo <= hi, got {tuple(interval)!r}")
        renorm_min = check_float("cfg_renorm_min", self.cfg_renorm_min, 0.0, maximum=1.0)
        if self.cfg_renorm_type not in RENORM_TYPES:
            raise ValueError(f"`cfg_renorm_type` must be one of {RENORM_TYPES}, got {self.cfg_renorm_type!r}")
        timesteps, dts = timestep_schedule(self.num_timesteps, shift)
        check_finite(
            torch.cat([timesteps, dts]),
            f"the flow schedule of timestep_shift={shift:g}",
            "choose a timestep_shift nearer 1 (official default 3.0)",
        )
        normalised = {
            "num_timesteps": steps,
            "timestep_shift": shift,
            "cfg_text_scale": text_scale,
            "cfg_img_scale": img_scale,
            "cfg_interval": (lo, hi),
            "cfg_renorm_min": renorm_min,
        }
        check_bool("prompt_special_tokens", self.prompt_special_tokens)
        check_bool("taylorseer", self.taylorseer)
        normalised["taylorseer_interval"] = check_int(
            "taylorseer_interval", self.taylorseer_interval, 1, MAX_NUM_TIMESTEPS
        )
        normalised["taylorseer_first_steps"] = check_int(
            "taylorseer_first_steps", self.taylorseer_first_steps, 1, MAX_NUM_TIMESTEPS
        )
        normalised["taylorseer_order"] = check_int("taylorseer_order", self.taylorseer_order, 0, MAX_TAYLORSEER_ORDER)
        if check_bool("think", self.think):
            normalised["think_max_new_tokens"] = check_int("think_max_new_tokens", self.think_max_new_tokens, 1)
            if check_bool("think_do_sample", self.think_do_sample):
                normalised["think_temperature"] = _check_temperature("think_temperature", self.think_temperature)
        for name, value in normalised.items():
            object.__setattr__(self, name, value)

    @property
    def num_steps(self) -> int:
        """Euler steps run (``num_timesteps - 1``)."""
        return self.num_timesteps - 1

    def replace(self, **changes) -> GenerationSettings:
        """A copy with ``changes`` applied (checked again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class UnderstandingSettings:
    """Decoding settings of an understanding request (``app.py image_understanding``), checked when made.

    Attributes:
        max_new_tokens: most answer tokens decoded.
        do_sample: sample tokens (else greedy); ``temperature`` is checked only when sampling.
        temperature: sampling temperature, within :data:`TEMPERATURE_RANGE`.
        think: the think-mode system prompt first (the answer then holds the reasoning).
        prompt_special_tokens: parse control-token strings in the prompt as the official code does; off: plain text.
    """

    max_new_tokens: int = 512
    do_sample: bool = False
    temperature: float = 0.3
    think: bool = False
    prompt_special_tokens: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_new_tokens", check_int("max_new_tokens", self.max_new_tokens, 1))
        check_bool("prompt_special_tokens", self.prompt_special_tokens)
        if check_bool("do_sample", self.do_sample):
            object.__setattr__(self, "temperature", _check_temperature("temperature", self.temperature))
        check_bool("think", self.think)

    def replace(self, **changes) -> UnderstandingSettings:
        """A copy with ``changes`` applied (checked again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


#: ``app.py text_to_image``: cfg_img_scale is not passed there, so the interleave default 1.5 applies.
T2I_DEFAULTS = GenerationSettings()
#: ``app.py edit_image`` and the notebook: image scale 2.0, guidance on the whole schedule, text_channel renorm.
EDIT_DEFAULTS = GenerationSettings(cfg_img_scale=2.0, cfg_interval=(0.0, 1.0), cfg_renorm_type="text_channel")
UNDERSTANDING_DEFAULTS = UnderstandingSettings()

_PRESETS: dict[Task, GenerationSettings | UnderstandingSettings] = {
    "understanding": UNDERSTANDING_DEFAULTS,
    "t2i": T2I_DEFAULTS,
    "edit": EDIT_DEFAULTS,
}


def preset(task: Task, **changes) -> GenerationSettings | UnderstandingSettings:
    """The official settings of ``task`` (one of :data:`~unicache_core.kv.token_types.TASKS`) with ``changes``."""
    if task not in TASKS:
        raise ValueError(f"`task` must be one of {TASKS}, got {task!r}")
    return _PRESETS[task].replace(**changes) if changes else _PRESETS[task]


__all__ = [
    "BUNDLED_CHECKPOINT",
    "BUNDLED_CHECKPOINT_DIR",
    "EDIT_DEFAULTS",
    "GenerationSettings",
    "MAX_CFG_SCALE",
    "MAX_NUM_TIMESTEPS",
    "MAX_TAYLORSEER_ORDER",
    "T2I_DEFAULTS",
    "TEMPERATURE_RANGE",
    "TIMESTEP_SHIFT_RANGE",
    "UNDERSTANDING_DEFAULTS",
    "UnderstandingSettings",
    "check_bool",
    "check_float",
    "check_int",
    "check_output_size",
    "check_prompt",
    "preset",
    "source_latent_size",
]
