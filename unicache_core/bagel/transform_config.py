"""Image transform sizes: the resize rules for the VAE and the ViT, and the optional ``transform_config.json``.

The official code hard-codes them (``app.py`` of ByteDance-Seed/Bagel: ``ImageTransform(1024, 512, 16)``
for the VAE, ``ImageTransform(980, 224, 14)`` for the ViT, ``max_pixels=14*14*9*1024`` from
``data/transforms.py``). An optional ``transform_config.json`` in a checkpoint overrides them (only
written for small checkpoints, so a tiny model need not run at 512-1024 px)::

    {"vae": {"max_size": 1024, "min_size": 512, "stride": 16, "max_pixels": 1806336},
     "vit": {"max_size": 980, "min_size": 224, "stride": 14, "max_pixels": 1806336}}

Every field is optional (official value when absent or ``null``). :func:`parse_transform_config` checks
the file's own rules; the checks against the model are
:func:`~unicache_core.bagel.config.check_transform_config`'s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

TRANSFORM_CONFIG_FILE = "transform_config.json"

#: Pixel budget of the official transforms (``max_pixels=14*14*9*1024`` in ``data/transforms.py``).
OFFICIAL_MAX_PIXELS = 14 * 14 * 9 * 1024


@dataclass(frozen=True)
class ResizeConfig:
    """One ``MaxLongEdgeMinShortEdgeResize`` rule (``data/transforms.py`` of ByteDance-Seed/Bagel).

    Both output sides are multiples of ``stride``; the long edge is at most about ``max_size`` (snapped
    to the stride), the short edge at least ``min_size`` unless that breaks the long-edge limit, and the
    area at most ``max_pixels``. See :func:`~unicache_core.bagel.transforms.resize_size`.
    """

    max_size: int
    min_size: int
    stride: int
    max_pixels: int = OFFICIAL_MAX_PIXELS

    @property
    def max_side(self) -> int:
        """Largest side in pixels the rule can output (``max_size`` snapped to the stride, >= ``stride``)."""
        return max(self.stride, int(round(self.max_size / self.stride) * self.stride))


@dataclass(frozen=True)
class TransformConfig:
    """Image transform sizes; the defaults are the official ones (``app.py`` of ByteDance-Seed/Bagel).

    ``vae`` is also the rule every input image is resized with before the ViT and VAE transforms, so it
    sets the output size of an edit.
    """

    vae: ResizeConfig = ResizeConfig(1024, 512, 16)
    vit: ResizeConfig = ResizeConfig(980, 224, 14)


#: How a message about a transform field ends (``path``: the file name).
FIX_TRANSFORM = "fix it in {path}, or remove the field to use the official value"


def parse_transform_config(data: dict[str, Any] | None, path: Path) -> TransformConfig:
    """Build a :class:`TransformConfig`: the official sizes, overridden by ``data`` when given.

    Only the file's own rules are checked here (known keys, ints > 0, ``max_size >= min_size``); the
    checks against the model (strides, position tables) are :func:`check_transform_config`'s.
    """
    default = TransformConfig()
    if data is None:
        return default
    known = [f.name for f in fields(TransformConfig)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise CheckpointError(f"config file {path}: unknown fields {unknown}; allowed: {known}. Remove or rename them")
    rules: dict[str, ResizeConfig] = {}
    for name in known:
        base: ResizeConfig = getattr(default, name)
        section = data.get(name)
        if section is None:
            rules[name] = base
            continue
        if not isinstance(section, dict):
            raise CheckpointError(
                f"config file {path}: field {name!r} = {section!r} must be an object such as "
                f"{json.dumps(vars(base))}; " + FIX_TRANSFORM.format(path=path.name)
            )
        allowed = [f.name for f in fields(ResizeConfig)]
        unknown = sorted(f"{name}.{key}" for key in set(section) - set(allowed))
        if unknown:
            raise CheckpointError(
                f"config file {path}: unknown fields {unknown}; allowed: {[f'{name}.{k}' for k in allowed]}. "
                f"Remove or rename them"
            )
        values: dict[str, int] = {}
        for key in allowed:
            value = section.get(key)
            if value is None:
                values[key] = getattr(base, key)
            elif isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CheckpointError(
                    f"config file {path}: field '{name}.{key}' = {value!r} must be an int > 0 (official "
                    f"value {getattr(base, key)}); " + FIX_TRANSFORM.format(path=path.name)
                )
            else:
                values[key] = value
        rule = ResizeConfig(**values)
        if rule.max_size < rule.min_size:
            raise CheckpointError(
                f"config file {path}: field '{name}.max_size' = {rule.max_size} must be >= "
                f"'{name}.min_size' = {rule.min_size} (an absent field takes the official value); set both "
                f"in {path.name}"
            )
        rules[name] = rule
    return TransformConfig(**rules)


__all__ = [
    "FIX_TRANSFORM",
    "OFFICIAL_MAX_PIXELS",
    "TRANSFORM_CONFIG_FILE",
    "ResizeConfig",
    "TransformConfig",
    "parse_transform_config",
]
