"""The ``comfyui_bagel`` metadata of a single-file checkpoint: the format's names, validation and sidecar.

The metadata is a JSON object stored in the safetensors ``__metadata__["comfyui_bagel"]`` (or in a
sidecar ``<file>.comfyui-bagel.json``, see :mod:`.single_file` for the whole format)::

    {"format": "comfyui_bagel", "format_version": 1, "variant": "BAGEL-7B-MoT", "dtype": "bf16",
     "quantization": "none", "latent_format": "flux",
     "special_token_ids": {"<|im_start|>": 151644, ...},
     "model_configs": {"llm_config.json": {...}, "vit_config.json": {...}}, ...}

:func:`validate_metadata` refuses what this engine cannot run (another format or version, an unknown
variant, quantization, another latent format, variant options); :func:`build_metadata` writes it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...errors import CheckpointError
from ..config import LLM_CONFIG_FILE, VIT_CONFIG_FILE
from ..tokenizer import BAGEL_SPECIAL_TOKENS
from .model_id import SIDECAR_SUFFIX

FORMAT_NAME = "comfyui_bagel"
FORMAT_VERSION = 1
#: Key of the safetensors ``__metadata__`` entry holding the JSON.
METADATA_KEY = "comfyui_bagel"
SIDECAR_FORMAT = "comfyui_bagel_sidecar"
#: The official model (ComfyUI-BAGEL's native variant).
NATIVE_VARIANT = "BAGEL-7B-MoT"
#: The random test checkpoints of :mod:`training.tiny` (configs always from the metadata).
TINY_VARIANT = "UniCache-tiny-random"
KNOWN_VARIANTS = (NATIVE_VARIANT, TINY_VARIANT)
#: The ids BAGEL-7B-MoT's embeddings give its special tokens (Qwen2.5's added tokens).
BAGEL_SPECIAL_TOKEN_IDS = {
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
}
#: Metadata dtype names → safetensors header dtype strings.
DTYPE_NAMES = {"bf16": "BF16", "fp16": "F16", "fp32": "F32"}
#: Largest accepted metadata JSON / sidecar (real ones are a few KB).
MAX_METADATA_BYTES = 16 << 20


def sidecar_path(path: str | Path) -> Path:
    """``<file>.comfyui-bagel.json``."""
    return Path(str(path) + SIDECAR_SUFFIX)


def parse_json_text(text: str, where: str) -> Any:
    """``text`` parsed as JSON; ``where`` names it in the error (too long, or not JSON)."""
    if len(text) > MAX_METADATA_BYTES:
        raise CheckpointError(f"{where} is {len(text)} characters, more than metadata can need; re-convert the file")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(
            f"{where} is not valid JSON ({exc}); re-convert the file or rewrite its sidecar"
        ) from None


def read_sidecar(path: Path, sidecar: Path, size: int) -> Any:
    """The metadata a sidecar holds for the ``size``-byte file ``path`` (refused when written for another)."""
    where = f"sidecar {sidecar}"
    if not sidecar.is_file():
        raise CheckpointError(f"{where} is not a regular file; remove it or replace it with a sidecar JSON file")
    if sidecar.stat().st_size > MAX_METADATA_BYTES:
        raise CheckpointError(f"{where} is {sidecar.stat().st_size} bytes, more than a sidecar can need; rewrite it")
    try:
        text = sidecar.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"cannot read {where}: {exc}; rewrite it") from None
    data = parse_json_text(text, where)
    if not isinstance(data, dict) or data.get("format") != SIDECAR_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise CheckpointError(
            f"{where} has format {found!r}, expected {SIDECAR_FORMAT!r}; it is not a ComfyUI-BAGEL "
            f"sidecar (remove or rewrite it)"
        )
    expected = data.get("checkpoint_size")
    if isinstance(expected, bool) or not isinstance(expected, int) or expected != size:
        raise CheckpointError(
            f"{where} was written for a file of {expected!r} bytes, but {path.name} has {size} bytes: the sidecar "
            f"belongs to another (or an incomplete) checkpoint file; re-download the file or rewrite its sidecar"
        )
    meta = data.get("metadata")
    if isinstance(meta, str):
        meta = parse_json_text(meta, f"{where}: field 'metadata'")
    return meta


def validate_metadata(meta: Any, where: str) -> dict[str, Any]:
    """Refuse what this engine cannot run: another format/version, an unknown variant, quantization, …"""
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where} must be a JSON object, got {type(meta).__name__}; re-convert the file")
    if meta.get("format") != FORMAT_NAME:
        raise CheckpointError(
            f"{where} has format {meta.get('format')!r}, expected {FORMAT_NAME!r}; re-convert the file"
        )
    version = meta.get("format_version")
    if isinstance(version, bool) or version != FORMAT_VERSION:
        raise CheckpointError(
            f"{where} has format_version {version!r}; this loader reads format_version {FORMAT_VERSION} only "
            f"(convert the checkpoint with a matching converter, or update the node pack)"
        )
    variant = meta.get("variant")
    if variant not in KNOWN_VARIANTS:
        raise CheckpointError(
            f"{where} names the variant {variant!r}, which this engine has no support for (known: "
            f"{', '.join(KNOWN_VARIANTS)}); a variant needs its own adapter — use a {NATIVE_VARIANT} checkpoint"
        )
    dtype = meta.get("dtype", "bf16")
    if dtype not in DTYPE_NAMES:
        raise CheckpointError(f"{where}: dtype {dtype!r} is not supported (allowed: {sorted(DTYPE_NAMES)})")
    quant = meta.get("quantization")
    if quant not in (None, "", "none"):
        raise CheckpointError(
            f"{where}: quantization {quant!r} is not supported (only unquantized bf16/fp16/fp32 "
            f"files); use the unquantized checkpoint"
        )
    latent = meta.get("latent_format")
    if latent not in (None, "flux"):
        raise CheckpointError(f"{where}: latent_format {latent!r} is not supported (BAGEL uses the FLUX VAE: 'flux')")
    for key in ("model_options", "additional_special_tokens"):
        if meta.get(key):
            raise CheckpointError(
                f"{where}: field {key!r} = {meta[key]!r} needs a variant adapter this engine does "
                f"not have; use a plain {NATIVE_VARIANT} checkpoint"
            )
    configs = meta.get("model_configs")
    if not isinstance(configs, dict):
        raise CheckpointError(
            f"{where} lacks 'model_configs' (the checkpoint's {LLM_CONFIG_FILE} and "
            f"{VIT_CONFIG_FILE}); re-convert the file"
        )
    ids = meta.get("special_token_ids", {}) or {}
    if not isinstance(ids, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in ids.items()
    ):
        raise CheckpointError(f"{where}: special_token_ids must map token strings to integer ids, got {ids!r}")
    return meta


def config_dict(configs: Mapping[str, Any], name: str, where: str) -> dict[str, Any] | None:
    """``model_configs[name]`` as a dict (parsed when a writer stored it as a JSON string), or ``None``."""
    value = configs.get(name)
    if isinstance(value, str):  # some writers store each config as a JSON string
        value = parse_json_text(value, f"{where}: model_configs[{name!r}]")
    return value


def expected_special_ids(meta: dict[str, Any], variant: str, where: str) -> dict[str, int]:
    """The ids a tokenizer must give BAGEL's special tokens: BAGEL-7B-MoT's own, else the metadata's."""
    given = {k: v for k, v in (meta.get("special_token_ids") or {}).items() if k in BAGEL_SPECIAL_TOKENS}
    if variant == NATIVE_VARIANT:
        wrong = {k: v for k, v in given.items() if BAGEL_SPECIAL_TOKEN_IDS[k] != v}
        if wrong:
            raise CheckpointError(
                f"{where}: special_token_ids {wrong} disagree with {NATIVE_VARIANT}'s "
                f"{BAGEL_SPECIAL_TOKEN_IDS}; the metadata is wrong, re-convert the file"
            )
        return dict(BAGEL_SPECIAL_TOKEN_IDS)
    missing = [k for k in BAGEL_SPECIAL_TOKENS if k not in given]
    if missing:
        raise CheckpointError(
            f"{where}: special_token_ids lacks {missing}; a {variant} file must name the ids of "
            f"{list(BAGEL_SPECIAL_TOKENS)}"
        )
    return {k: given[k] for k in BAGEL_SPECIAL_TOKENS}


def build_metadata(
    variant: str,
    dtype: str,
    model_configs: Mapping[str, Mapping[str, Any]],
    special_token_ids: Mapping[str, int],
    **extra: Any,
) -> dict[str, Any]:
    """The ``comfyui_bagel`` metadata object (``extra`` fields are added, e.g. ``converter``)."""
    meta = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "architecture": "Bagel",
        "variant": variant,
        "dtype": dtype,
        "quantization": "none",
        "latent_format": "flux",
        "special_token_ids": dict(special_token_ids),
        "model_configs": {k: dict(v) for k, v in model_configs.items()},
    }
    meta.update(extra)
    return validate_metadata(meta, "the metadata to write")


__all__ = [
    "BAGEL_SPECIAL_TOKEN_IDS",
    "DTYPE_NAMES",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "KNOWN_VARIANTS",
    "MAX_METADATA_BYTES",
    "METADATA_KEY",
    "NATIVE_VARIANT",
    "SIDECAR_FORMAT",
    "TINY_VARIANT",
    "build_metadata",
    "config_dict",
    "expected_special_ids",
    "parse_json_text",
    "read_sidecar",
    "sidecar_path",
    "validate_metadata",
]
