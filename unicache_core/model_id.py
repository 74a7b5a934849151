"""Model ids: which checkpoint a policy table (or a report) belongs to.

- A single-file checkpoint names its model in its metadata (``variant``): that string is the id.
- A checkpoint folder is identified by its two architecture configs, ``llm_config.json`` and
  ``vit_config.json``: ``bagel-7b-mot`` when their geometry is BAGEL-7B-MoT's (the official
  ByteDance-Seed/BAGEL-7B-MoT release), else ``sha256:`` + the first 16 hex digits of a digest of
  both files' parsed JSON (keys sorted, so formatting does not change the id).

Only JSON is read; nothing here imports the BAGEL engine.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

BAGEL_7B_MOT = "bagel-7b-mot"
#: Geometry of BAGEL-7B-MoT (official llm_config.json / vit_config.json values).
_BAGEL_7B_LLM = {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                 "num_key_value_heads": 4, "vocab_size": 152064}
_BAGEL_7B_VIT = {"hidden_size": 1152}


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path} is missing: a BAGEL checkpoint folder needs llm_config.json and vit_config.json") \
            from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def model_id_from_configs(llm: Mapping[str, Any], vit: Mapping[str, Any]) -> str:
    """The id of a model given its parsed ``llm_config.json`` and ``vit_config.json``."""
    if all(llm.get(k) == v for k, v in _BAGEL_7B_LLM.items()) and all(vit.get(k) == v for k, v in _BAGEL_7B_VIT.items()):
        return BAGEL_7B_MOT
    canonical = json.dumps({"llm": llm, "vit": vit}, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def model_id_of(checkpoint_dir: str | Path) -> str:
    """The id of a checkpoint folder (see the module docstring)."""
    folder = Path(checkpoint_dir)
    return model_id_from_configs(_read(folder / "llm_config.json"), _read(folder / "vit_config.json"))


__all__ = ["BAGEL_7B_MOT", "model_id_from_configs", "model_id_of"]
