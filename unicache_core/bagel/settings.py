"""The official generation defaults, in one place (docs/bagel.md §5; ByteDance-Seed/Bagel ``app.py``, ``inferencer.py``).

The pipeline's keyword defaults, the CLI's flag defaults and the ComfyUI nodes' widget defaults all
read these presets; :func:`preset` returns the one of a task.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

#: The bundled default checkpoint (a small BAGEL trained on the shapes world, docs/shapes.md), shipped in the
#: repository's ``models/bagel/``; the CLI's default ``--checkpoint`` and the loader node's default choice.
BUNDLED_CHECKPOINT = "unicache-shapes"
BUNDLED_CHECKPOINT_DIR = Path(__file__).resolve().parents[2] / "models" / "bagel" / BUNDLED_CHECKPOINT


@dataclass(frozen=True)
class GenerationSettings:
    """Denoising and think-mode settings of a text-to-image or edit request."""

    num_timesteps: int = 50
    timestep_shift: float = 3.0
    cfg_text_scale: float = 4.0
    cfg_img_scale: float = 1.5
    cfg_interval: tuple[float, float] = (0.4, 1.0)
    cfg_renorm_min: float = 0.0
    cfg_renorm_type: str = "global"
    think_max_new_tokens: int = 1024
    think_do_sample: bool = False
    think_temperature: float = 0.3
    width: int = 1024
    height: int = 1024

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class UnderstandingSettings:
    """Decoding settings of an understanding request (``app.py image_understanding``)."""

    max_new_tokens: int = 512
    do_sample: bool = False
    temperature: float = 0.3

    def to_dict(self) -> dict:
        return asdict(self)


#: ``app.py text_to_image``: cfg_img_scale is not passed there, so the interleave default 1.5 applies.
T2I_DEFAULTS = GenerationSettings()
#: ``app.py edit_image`` and the notebook: image scale 2.0, guidance on the whole schedule, text_channel renorm.
EDIT_DEFAULTS = GenerationSettings(cfg_img_scale=2.0, cfg_interval=(0.0, 1.0), cfg_renorm_type="text_channel")
UNDERSTANDING_DEFAULTS = UnderstandingSettings()

_PRESETS = {"t2i": T2I_DEFAULTS, "edit": EDIT_DEFAULTS, "understanding": UNDERSTANDING_DEFAULTS}


def preset(task: str) -> GenerationSettings | UnderstandingSettings:
    """The official defaults of ``task`` (``t2i``, ``edit`` or ``understanding``)."""
    if task not in _PRESETS:
        raise ValueError(f"`task` must be one of {tuple(_PRESETS)}, got {task!r}")
    return _PRESETS[task]


__all__ = ["BUNDLED_CHECKPOINT", "BUNDLED_CHECKPOINT_DIR", "EDIT_DEFAULTS", "GenerationSettings", "T2I_DEFAULTS", "UNDERSTANDING_DEFAULTS", "UnderstandingSettings",
           "preset"]
