"""Model ids: which checkpoint a policy table (or a report) belongs to.

- A single-file checkpoint names its model in its metadata (``variant``): that string, lower-cased,
  is the id (:func:`model_id_from_variant`; ``BAGEL-7B-MoT`` gives ``bagel-7b-mot``, the same id as the
  official folder, so both forms share policy tables). A file without metadata or sidecar is only ever
  accepted as BAGEL-7B-MoT (the loader checks its whole layout), so its id is ``bagel-7b-mot``.
- A checkpoint folder is identified by its two architecture configs, ``llm_config.json`` and
  ``vit_config.json``: ``bagel-7b-mot`` when their geometry is BAGEL-7B-MoT's (the official
  ByteDance-Seed/BAGEL-7B-MoT release), else ``sha256:`` + the first 16 hex digits of a digest of
  both files' parsed JSON (keys sorted, so formatting does not change the id).

Only JSON is read (for a single file: its safetensors header, through :func:`~.header.read_header`,
and sidecar); nothing here imports the BAGEL engine.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...errors import CheckpointError
from .header import read_header

BAGEL_7B_MOT = "bagel-7b-mot"
#: Geometry of BAGEL-7B-MoT (official llm_config.json / vit_config.json values).
_BAGEL_7B_LLM = {
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
}
_BAGEL_7B_VIT = {"hidden_size": 1152}


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(
            f"{path} is missing: a BAGEL checkpoint folder needs llm_config.json and vit_config.json"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def model_id_from_configs(llm: Mapping[str, Any], vit: Mapping[str, Any]) -> str:
    """The id of a model given its parsed ``llm_config.json`` and ``vit_config.json``."""
    if all(llm.get(k) == v for k, v in _BAGEL_7B_LLM.items()) and all(
        vit.get(k) == v for k, v in _BAGEL_7B_VIT.items()
    ):
        return BAGEL_7B_MOT
    canonical = json.dumps({"llm": llm, "vit": vit}, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def model_id_from_variant(variant: object) -> str:
    """The id of a single-file checkpoint whose metadata names ``variant`` (lower-cased, stripped)."""
    if not isinstance(variant, str) or not variant.strip():
        raise ValueError(f"a checkpoint variant must be a non-empty string, got {variant!r}")
    return variant.strip().lower()


SIDECAR_SUFFIX = ".comfyui-bagel.json"


def _metadata_variant(raw: object) -> str | None:
    data = json.loads(raw) if isinstance(raw, str) else raw
    if isinstance(data, dict) and isinstance(data.get("variant"), str) and data["variant"].strip():
        return data["variant"]
    return None


def _single_file_variant(path: Path) -> str | None:
    """The ``variant`` of a single-file checkpoint's metadata or sidecar (``None`` when it has neither)."""
    try:
        raw = read_header(path).metadata.get("comfyui_bagel")
    except CheckpointError as exc:
        raise ValueError(str(exc)) from None
    try:
        if raw is not None:
            return _metadata_variant(raw)
        sidecar = Path(str(path) + SIDECAR_SUFFIX)
        if sidecar.is_file():
            return _metadata_variant(_read(sidecar).get("metadata"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"the comfyui_bagel metadata of {path} is not JSON ({exc})") from None
    return None


def model_id_of(checkpoint: str | Path) -> str:
    """The id of a checkpoint folder or single ``.safetensors`` file (see the module docstring).

    A single file without metadata or sidecar gets ``bagel-7b-mot`` (the only layout the loader accepts
    for it; this function does not check the layout).
    """
    path = Path(checkpoint)
    if path.is_file():
        variant = _single_file_variant(path)
        return BAGEL_7B_MOT if variant is None else model_id_from_variant(variant)
    return model_id_from_configs(_read(path / "llm_config.json"), _read(path / "vit_config.json"))


__all__ = ["BAGEL_7B_MOT", "model_id_from_configs", "model_id_from_variant", "model_id_of"]
