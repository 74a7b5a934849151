"""Single-file BAGEL checkpoints: the converted ``.safetensors`` that ComfyUI-BAGEL's native loader reads.

Format (as github neverbiasu/ComfyUI-BAGEL reads it):

* the tensors of the official ``ema.safetensors`` with their names unchanged, all under the eight roots
  :data:`MODULE_ROOTS`; all of one dtype; **no VAE and no tokenizer** inside;
* the configs in the safetensors ``__metadata__["comfyui_bagel"]``, a JSON string (:mod:`.metadata`:
  format, version, variant, dtype, special-token ids and ``model_configs``, which holds
  ``llm_config.json`` and ``vit_config.json`` and may hold this engine's optional ``ae_config.json`` /
  ``transform_config.json``; other fields are ignored);
* or, without that key, a sidecar ``<file>.comfyui-bagel.json``: ``{"format": "comfyui_bagel_sidecar",
  "checkpoint_size": <bytes of the file>, "metadata": <the same JSON, object or string>}``; its
  ``checkpoint_size`` must equal the file's size (a sidecar of another file is refused);
* a file with neither is accepted only as BAGEL-7B-MoT, and only when every tensor name and shape is
  that model's (the real-size tree is built on the meta device to know them); anything else is one
  :class:`~unicache_core.errors.CheckpointError`.

Only the header (:func:`~.header.read_header`) and the sidecar are parsed by :func:`inspect_single_file`: no
tensor data is read,
and the configs are checked against the header before anything is built. Variants other than
:data:`KNOWN_VARIANTS`, other format versions, quantized files and other latent formats are refused.

The tokenizer of a single file comes from a folder (``vocab.json``, ``merges.txt``,
``tokenizer_config.json``, e.g. ComfyUI's ``comfy/text_encoders/qwen25_tokenizer``);
:func:`check_tokenizer` makes sure BAGEL's special tokens are in its files at the ids the checkpoint's
embeddings were trained with (:data:`BAGEL_SPECIAL_TOKEN_IDS` for BAGEL-7B-MoT).

:func:`convert_folder` writes the single-file form of an official-layout folder;
``python -m unicache_core.bagel.checkpoint.single_file FOLDER OUT.safetensors`` does the same from a shell.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...cli import OneLineParser
from ...errors import CheckpointError, UniCacheError
from ..config import (
    AE_CONFIG_FILE,
    LLM_CONFIG_FILE,
    TRANSFORM_CONFIG_FILE,
    VIT_CONFIG_FILE,
    BagelConfig,
    bagel_config_from_dicts,
    load_bagel_config,
)
from ..modeling import Bagel
from ..tokenizer import BAGEL_SPECIAL_TOKENS, BagelTokenizer
from .config_check import check_model_config
from .folder import EMA_FILE, check_folder_model_config
from .header import PICKLE_SUFFIXES, SafetensorsHeader, read_header
from .metadata import (
    BAGEL_SPECIAL_TOKEN_IDS,
    DTYPE_NAMES,
    FORMAT_NAME,
    FORMAT_VERSION,
    KNOWN_VARIANTS,
    METADATA_KEY,
    NATIVE_VARIANT,
    SIDECAR_FORMAT,
    TINY_VARIANT,
    build_metadata,
    config_dict,
    expected_special_ids,
    parse_json_text,
    read_sidecar,
    sidecar_path,
    validate_metadata,
)
from .model_id import BAGEL_7B_MOT, SIDECAR_SUFFIX, model_id_from_variant, model_id_of

logger = logging.getLogger(__name__)

#: The eight module roots of the official ``ema.safetensors`` names.
MODULE_ROOTS = (
    "language_model",
    "vit_model",
    "connector",
    "vae2llm",
    "llm2vae",
    "latent_pos_embed",
    "vit_pos_embed",
    "time_embedder",
)
_TORCH_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
#: The architecture fields of BAGEL-7B-MoT's ``llm_config.json`` / ``vit_config.json`` (the ones read).
OFFICIAL_LLM_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "vocab_size": 152064,
}
OFFICIAL_VIT_CONFIG = {
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "image_size": 980,
    "intermediate_size": 4304,
    "layer_norm_eps": 1e-06,
    "model_type": "siglip_vision_model",
    "num_attention_heads": 16,
    "num_channels": 3,
    "num_hidden_layers": 27,
    "patch_size": 14,
}
_MAX_LISTED = 8
_CONFIG_FILES = (LLM_CONFIG_FILE, VIT_CONFIG_FILE, AE_CONFIG_FILE, TRANSFORM_CONFIG_FILE)


@dataclass(frozen=True)
class SingleFileInfo:
    """What the header (and sidecar) of a single-file checkpoint says; no tensor data was read.

    Attributes:
        path, size: the file and its size in bytes.
        source: where the configs came from: ``"metadata"`` (embedded), ``"sidecar"`` or ``"layout"``
            (no metadata: recognised as BAGEL-7B-MoT by its tensor names and shapes).
        variant, model_id: the metadata ``variant`` and its model id
        (:func:`~unicache_core.bagel.checkpoint.model_id.model_id_from_variant`). metadata: the ``comfyui_bagel`` JSON
        (built from the official configs for ``"layout"``). config: the parsed configs (checked against the header).
        dtype: the stored dtype (``bf16``/``fp16``/``fp32``). special_token_ids: ``{token: id}`` the tokenizer must give
        BAGEL's four special tokens. header: the file's safetensors header (tensor names, dtypes and shapes).
    """

    path: Path
    size: int
    source: str
    variant: str
    model_id: str
    metadata: dict[str, Any]
    config: BagelConfig
    dtype: str
    special_token_ids: dict[str, int]
    header: SafetensorsHeader = field(repr=False)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape, from the header."""
        return self.header.shapes


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    more = f" … and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return f"{shown}{more}"


@functools.lru_cache(maxsize=1)
def official_layout() -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape of BAGEL-7B-MoT's ``ema.safetensors`` (built on the meta device, ~1 s)."""
    cfg = bagel_config_from_dicts(OFFICIAL_LLM_CONFIG, OFFICIAL_VIT_CONFIG, source="<BAGEL-7B-MoT>")
    with torch.device("meta"):
        model = Bagel(cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _check_layout(path: Path, shapes: Mapping[str, tuple[int, ...]]) -> None:
    official = official_layout()
    missing = sorted(set(official) - set(shapes))
    unexpected = sorted(set(shapes) - set(official))
    reshaped = sorted(n for n in set(official) & set(shapes) if tuple(shapes[n]) != official[n])
    if not (missing or unexpected or reshaped):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} of its tensors missing ({_listing(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected ({_listing(unexpected)})")
    if reshaped:
        shown = [f"{n} {tuple(shapes[n])} instead of {official[n]}" for n in reshaped]
        parts.append(f"{len(reshaped)} with other shapes ({_listing(shown)})")
    raise CheckpointError(
        f"{path} has no {METADATA_KEY!r} safetensors metadata and no sidecar {sidecar_path(path).name}, so it can "
        f"only be read as {NATIVE_VARIANT}, but its tensors do not match that layout: {'; '.join(parts)}. Add the "
        f"metadata or a sidecar naming its variant and configs (convert the checkpoint folder with "
        f"`python -m unicache_core.bagel.checkpoint.single_file`), or use the official checkpoint"
    )


def check_single_file_name(path: Path) -> None:
    """Refuse a file that is not ``*.safetensors`` (a pickle suffix gets its own reason)."""
    if path.suffix.lower() != ".safetensors":
        why = (
            " (a pickle file, which is never read: unpickling can run arbitrary code)"
            if path.suffix.lower() in PICKLE_SUFFIXES
            else ""
        )
        raise CheckpointError(
            f"checkpoint {path} is a file, not a directory, and not a .safetensors file{why}: pass a BAGEL "
            f"checkpoint folder or a single converted .safetensors file"
        )


def inspect_single_file(path: str | Path) -> SingleFileInfo:
    """Read and validate a single-file checkpoint's header (and sidecar); no tensor data is read.

    Raises:
        CheckpointError: not a safetensors file, refused metadata (format, version, variant, dtype,
            quantization), a sidecar of another file, configs that do not describe the tensors, or no
            metadata and not BAGEL-7B-MoT's layout.
    """
    path = Path(path)
    check_single_file_name(path)
    header = read_header(path)
    shapes, dtypes, header_meta = header.shapes, header.dtypes, header.metadata
    size = path.stat().st_size
    sidecar = sidecar_path(path)
    if METADATA_KEY in header_meta:
        source, where = "metadata", f"the {METADATA_KEY!r} metadata of {path}"
        if sidecar.exists():
            logger.info("%s: using the embedded metadata, not the sidecar %s", path, sidecar.name)
        raw = parse_json_text(header_meta[METADATA_KEY], where)
    elif sidecar.exists():
        source, where = "sidecar", f"sidecar {sidecar}"
        raw = read_sidecar(path, sidecar, size)
    else:
        source, where = "layout", f"{path} (no metadata)"
        raw = None

    stored = sorted(set(dtypes.values()))
    if raw is None:
        _check_layout(path, shapes)
        names = {v: k for k, v in DTYPE_NAMES.items()}
        if len(stored) != 1 or stored[0] not in names:
            raise CheckpointError(
                f"{path}: tensors are stored as {stored}; a single-file checkpoint holds one "
                f"float dtype of {sorted(names)}"
            )
        meta: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "variant": NATIVE_VARIANT,
            "dtype": names[stored[0]],
            "quantization": "none",
            "latent_format": "flux",
            "special_token_ids": dict(BAGEL_SPECIAL_TOKEN_IDS),
            "model_configs": {LLM_CONFIG_FILE: dict(OFFICIAL_LLM_CONFIG), VIT_CONFIG_FILE: dict(OFFICIAL_VIT_CONFIG)},
        }
    else:
        meta = validate_metadata(raw, where)
        want = DTYPE_NAMES[meta.get("dtype", "bf16")]
        if stored != [want]:
            raise CheckpointError(
                f"{where} says dtype {meta.get('dtype', 'bf16')!r} ({want}), but the tensors are "
                f"stored as {stored}; the metadata does not belong to this file (re-convert it)"
            )
    outside = sorted(n for n in shapes if n.split(".", 1)[0] not in MODULE_ROOTS)
    if outside:
        raise CheckpointError(
            f"{path} holds {len(outside)} tensors outside BAGEL's module roots {list(MODULE_ROOTS)} "
            f"({_listing(outside)}); a single-file checkpoint holds only the official ema.safetensors tensors (no VAE, "
            f"no tokenizer)"
        )
    configs = meta["model_configs"]
    source_name = f"{path.name}[{source}]"
    config = bagel_config_from_dicts(*(config_dict(configs, n, where) for n in _CONFIG_FILES), source=source_name)
    check_model_config(
        config, header, llm_source=f"{source_name}:{LLM_CONFIG_FILE}", vit_source=f"{source_name}:{VIT_CONFIG_FILE}"
    )
    variant = meta["variant"]
    return SingleFileInfo(
        path=path,
        size=size,
        source=source,
        variant=variant,
        model_id=model_id_from_variant(variant),
        metadata=meta,
        config=config,
        dtype=meta.get("dtype", "bf16"),
        special_token_ids=expected_special_ids(meta, variant, where),
        header=header,
    )


def check_tokenizer(tokenizer: BagelTokenizer, info: SingleFileInfo, tokenizer_dir: str | Path) -> None:
    """Refuse a tokenizer whose special tokens are missing or sit at ids other than the checkpoint's.

    BAGEL's tokenizer code adds a missing special token at a fresh id, whose embedding row was never
    trained; with another tokenizer's ids the prompts would be framed by the wrong embeddings.
    """
    problems = []
    for name, expected in info.special_token_ids.items():
        if name in tokenizer.added_special_tokens:
            problems.append(f"{name} is missing (expected id {expected})")
            continue
        got = tokenizer.token_to_id(name)
        if got != expected:
            problems.append(f"{name} has id {got}, the checkpoint expects {expected}")
    if tokenizer.vocab_size > info.config.llm.vocab_size:
        problems.append(
            f"it has {tokenizer.vocab_size} ids, more than the model's {info.config.llm.vocab_size} embedding rows"
        )
    if problems:
        hint = (
            " (for BAGEL-7B-MoT use the Qwen2.5 tokenizer, e.g. ComfyUI's comfy/text_encoders/qwen25_tokenizer)"
            if info.variant == NATIVE_VARIANT
            else ""
        )
        raise CheckpointError(
            f"the tokenizer in {tokenizer_dir} does not belong to {info.path.name}: {'; '.join(problems)}; pass the "
            f"tokenizer folder of this checkpoint{hint}"
        )


# ------------------------------------------------------------------------------------------ writing


def write_single_file(
    tensors: Mapping[str, torch.Tensor],
    out_path: str | Path,
    metadata: Mapping[str, Any],
    *,
    sidecar: bool = False,
) -> Path:
    """Write ``tensors`` as one safetensors file with ``metadata`` embedded (or in a sidecar).

    Tensors must all have the dtype the metadata names. With ``sidecar=True`` the file carries no
    ``comfyui_bagel`` entry and ``<file>.comfyui-bagel.json`` is written next to it. A stale sidecar of
    an earlier file at the same path is removed when the metadata is embedded.
    """
    from safetensors.torch import save_file

    out = Path(out_path)
    want = {v: k for k, v in _TORCH_DTYPE_NAMES.items()}[metadata["dtype"]]
    wrong = sorted(n for n, t in tensors.items() if t.dtype != want)
    if wrong:
        raise ValueError(f"tensors {_listing(wrong)} are not {metadata['dtype']} as the metadata says")
    text = json.dumps(dict(metadata), sort_keys=True)
    header = {"format": "pt"} if sidecar else {"format": "pt", METADATA_KEY: text}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(out), metadata=header)
    side = sidecar_path(out)
    if sidecar:
        side.write_text(
            json.dumps(
                {
                    "format": SIDECAR_FORMAT,
                    "format_version": 1,
                    "checkpoint_size": out.stat().st_size,
                    "metadata": dict(metadata),
                },
                indent=2,
                sort_keys=True,
            )
            + "\n",
            encoding="utf-8",
        )
    elif side.exists():
        side.unlink()
    return out


def convert_folder(
    checkpoint_dir: str | Path,
    out_path: str | Path,
    *,
    variant: str | None = None,
    dtype: str | None = None,
    sidecar: bool = False,
) -> Path:
    """Write the single-file form of an official-layout checkpoint folder (its ``ema.safetensors``).

    The configs are copied verbatim (``llm_config.json``, ``vit_config.json`` and, when present,
    ``ae_config.json`` / ``transform_config.json``), the special-token ids come from the folder's
    tokenizer, ``variant`` defaults to BAGEL-7B-MoT for the official geometry (else it must be given),
    ``dtype`` (``bf16``/``fp16``/``fp32``) to the stored one. All tensors are held in memory while
    writing (about 29 GB for BAGEL-7B-MoT in bf16).
    """
    from safetensors.torch import load_file

    root = Path(checkpoint_dir)
    config = load_bagel_config(root)
    check_folder_model_config(config, root, read_header(root / EMA_FILE))
    if variant is None:
        if model_id_of(root) != BAGEL_7B_MOT:
            raise ValueError(f"{root} is not BAGEL-7B-MoT; pass `variant` (known: {', '.join(KNOWN_VARIANTS)})")
        variant = NATIVE_VARIANT
    configs = {}
    for name in _CONFIG_FILES:
        if (root / name).is_file():
            configs[name] = json.loads((root / name).read_text(encoding="utf-8"))
    tokenizer = BagelTokenizer.from_dir(root)
    found = {name: tokenizer.token_to_id(name) for name in BAGEL_SPECIAL_TOKENS}
    ids = {name: token_id for name, token_id in found.items() if token_id is not None}
    if len(ids) != len(found):  # BagelTokenizer adds each of BAGEL's tokens its files lack, so never
        missing = [name for name in found if name not in ids]
        raise ValueError(f"the tokenizer of {root} has no id for {missing}; re-download its tokenizer files")
    tensors = load_file(str(root / EMA_FILE))
    if dtype is None:
        kinds = {t.dtype for t in tensors.values()}
        if len(kinds) != 1 or next(iter(kinds)) not in _TORCH_DTYPE_NAMES:
            raise ValueError(f"{root / EMA_FILE} mixes dtypes {sorted(map(str, kinds))}; pass `dtype`")
        dtype = _TORCH_DTYPE_NAMES[next(iter(kinds))]
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"`dtype` must be one of {sorted(DTYPE_NAMES)}, got {dtype!r}")
    cast = {v: k for k, v in _TORCH_DTYPE_NAMES.items()}[dtype]
    tensors = {k: v.to(cast) for k, v in tensors.items()}
    meta = build_metadata(variant, dtype, configs, ids, converter="unicache_core.bagel.checkpoint.single_file")
    return write_single_file(tensors, out_path, meta, sidecar=sidecar)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(
        prog="python -m unicache_core.bagel.checkpoint.single_file",
        description="Convert a BAGEL checkpoint folder (official layout) into the "
        "single-file form ComfyUI-BAGEL reads (no VAE, no tokenizer).",
    )
    parser.add_argument("checkpoint_dir")
    parser.add_argument("out", help="the .safetensors file to write")
    parser.add_argument("--variant", default=None, help=f"metadata variant (known: {', '.join(KNOWN_VARIANTS)})")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPE_NAMES), help="stored dtype (default: as stored)")
    parser.add_argument("--sidecar", action="store_true", help="write the metadata to <out>.comfyui-bagel.json")
    args = parser.parse_args(argv)
    try:
        out = convert_folder(
            args.checkpoint_dir, args.out, variant=args.variant, dtype=args.dtype, sidecar=args.sidecar
        )
    except (UniCacheError, ValueError, OSError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    sys.stdout.write(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)\n")
    return 0


__all__ = [
    "BAGEL_SPECIAL_TOKEN_IDS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "KNOWN_VARIANTS",
    "METADATA_KEY",
    "MODULE_ROOTS",
    "NATIVE_VARIANT",
    "SIDECAR_FORMAT",
    "SIDECAR_SUFFIX",
    "SingleFileInfo",
    "TINY_VARIANT",
    "build_metadata",
    "check_single_file_name",
    "check_tokenizer",
    "convert_folder",
    "inspect_single_file",
    "official_layout",
    "sidecar_path",
    "write_single_file",
]


if __name__ == "__main__":
    raise SystemExit(main())
