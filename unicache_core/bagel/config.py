"""BAGEL configuration: LLM, ViT and VAE hyper-parameters and image transform sizes of a checkpoint folder.

The official loader (``app.py`` / ``inferencer.py`` of github ByteDance-Seed/Bagel) reads
``llm_config.json`` (Qwen2) and ``vit_config.json`` (SigLIP) and then overrides a few fields at load
time: the LLM always gets QK-norm, untied output embeddings and Mixture-of-Transformers layers; the ViT
drops its last layer and uses learned absolute positions. The VAE config is hard-coded to the FLUX
autoencoder; an optional ``ae_config.json`` may override it (used by the tiny test checkpoint, never
present in the real one).

The image transform sizes (``transform_config.json``) are :mod:`.transform_config`'s; this module
checks them against the model (:func:`check_transform_config`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .latents import FLUX_SCALE_FACTOR, FLUX_SHIFT_FACTOR
from .transform_config import (
    FIX_TRANSFORM,
    OFFICIAL_MAX_PIXELS,
    TRANSFORM_CONFIG_FILE,
    ResizeConfig,
    TransformConfig,
    parse_transform_config,
)

LLM_CONFIG_FILE = "llm_config.json"
VIT_CONFIG_FILE = "vit_config.json"
AE_CONFIG_FILE = "ae_config.json"


@dataclass(frozen=True)
class LLMConfig:
    """Qwen2 decoder hyper-parameters (after BAGEL's load-time overrides).

    ``qk_norm`` and ``tie_word_embeddings`` are forced to ``True`` / ``False`` by the official loader
    whatever the file says.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    qk_norm: bool = True
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        """Per-head width ``d = hidden_size / num_attention_heads``."""
        return self.hidden_size // self.num_attention_heads

    @property
    def num_kv_groups(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads


@dataclass(frozen=True)
class ViTConfig:
    """SigLIP NaViT hyper-parameters; ``num_hidden_layers`` is the number of layers AS BUILT
    (the file value minus one: BAGEL drops the last SigLIP layer)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_hidden_layers: int
    image_size: int
    patch_size: int
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    num_channels: int = 3

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_patches_per_side(self) -> int:
        """Side of the learned position table (``image_size // patch_size``, 70 for BAGEL)."""
        return self.image_size // self.patch_size

    @property
    def num_positions(self) -> int:
        """Rows of the learned position table (4900 for BAGEL)."""
        return self.num_patches_per_side**2


@dataclass(frozen=True)
class AEConfig:
    """FLUX autoencoder parameters; the defaults are the real BAGEL VAE (hard-coded by ``load_ae``)."""

    resolution: int = 256
    in_channels: int = 3
    downsample: int = 8
    ch: int = 128
    out_ch: int = 3
    ch_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    z_channels: int = 16
    scale_factor: float = FLUX_SCALE_FACTOR
    shift_factor: float = FLUX_SHIFT_FACTOR


@dataclass(frozen=True)
class BagelConfig:
    """The whole model: LLM + ViT + VAE, image transform sizes and BAGEL's own constants (constructed in
    code officially)."""

    llm: LLMConfig
    vit: ViTConfig
    ae: AEConfig = field(default_factory=AEConfig)
    transforms: TransformConfig = field(default_factory=TransformConfig)
    vit_max_num_patch_per_side: int = 70
    latent_patch_size: int = 2
    max_latent_size: int = 64
    connector_act: str = "gelu_pytorch_tanh"

    @property
    def latent_downsample(self) -> int:
        """Image pixels per latent-token side (``ae.downsample * latent_patch_size`` = 16)."""
        return self.ae.downsample * self.latent_patch_size

    @property
    def latent_channel(self) -> int:
        """VAE latent channels (16)."""
        return self.ae.z_channels

    @property
    def patch_latent_dim(self) -> int:
        """Width of one packed latent token (``latent_patch_size**2 * z_channels`` = 64)."""
        return self.latent_patch_size**2 * self.ae.z_channels


# --------------------------------------------------------------------------------------------------
# Parsing


#: Largest accepted config JSON file (the real ones are about 1 KB); larger files are refused unread.
MAX_CONFIG_BYTES = 1 << 20
#: Largest accepted ``max_position_embeddings`` (Qwen2.5 uses 32768 to 131072; 1M-context variants exist).
MAX_POSITION_EMBEDDINGS = 1 << 24
#: Most VAE levels (``len(ch_mult)``) and blocks per level (FLUX's VAE: 4 of 2): the VAE is built and traced block by
#: block, also by a memory plan made before ``ae.safetensors`` is downloaded (nothing to check the config against).
MAX_VAE_LEVELS, MAX_VAE_BLOCKS = 8, 32


def _read_json(path: Path) -> dict[str, Any]:
    if path.exists() and not path.is_file():  # a folder, FIFO or device: never opened (a FIFO would block)
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise CheckpointError(f"config file {path} is {kind}; it must be a JSON file (re-download it)")
    if not path.is_file():
        raise CheckpointError(
            f"missing config file {path}; a BAGEL checkpoint folder must contain {path.name} "
            f"(download the full ByteDance-Seed/BAGEL-7B-MoT repository into {path.parent})"
        )
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise CheckpointError(
                f"config file {path} is {size} bytes, more than the {MAX_CONFIG_BYTES} a config can need; "
                f"re-download it"
            )
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad UTF-8/JSON, a 5000-digit integer
        raise CheckpointError(
            f"cannot parse config file {path}: {type(exc).__name__}: {exc}; re-download it (it must be a JSON object)"
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(
            f"config file {path} holds a JSON {type(data).__name__}, expected an object; re-download it"
        )
    return data


def _get(data: dict[str, Any], key: str, kind: type, path: Path, default: Any = ...) -> Any:
    if key not in data or data[key] is None:
        if default is ...:
            raise CheckpointError(f"config file {path} lacks the required field {key!r}")
        return default
    value = data[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise CheckpointError(f"config file {path}: field {key!r} = {value!r} must be of type {kind.__name__}")
    if kind is float and isinstance(value, float) and not math.isfinite(value):  # a float: checked just above
        raise CheckpointError(f"config file {path}: field {key!r} = {value!r} must be a finite number")
    return value


def _positive(path: Path, **values: int | float) -> None:
    for name, value in values.items():
        if value <= 0 or (name.endswith("_eps") and value >= 1):  # an epsilon of 1 or more drowns the variance
            bound = " and < 1 (BAGEL's is 1e-06)" if name.endswith("_eps") else ""
            raise CheckpointError(f"config file {path}: field {name!r} = {value} must be > 0{bound}")


def parse_llm_config(data: dict[str, Any], path: Path) -> LLMConfig:
    """Build an :class:`LLMConfig` from a parsed ``llm_config.json`` (applies the official overrides)."""
    cfg = LLMConfig(
        hidden_size=_get(data, "hidden_size", int, path),
        intermediate_size=_get(data, "intermediate_size", int, path),
        num_hidden_layers=_get(data, "num_hidden_layers", int, path),
        num_attention_heads=_get(data, "num_attention_heads", int, path),
        num_key_value_heads=_get(data, "num_key_value_heads", int, path, data.get("num_attention_heads")),
        vocab_size=_get(data, "vocab_size", int, path),
        rope_theta=_get(data, "rope_theta", float, path, 10000.0),
        rms_norm_eps=_get(data, "rms_norm_eps", float, path, 1e-6),
        max_position_embeddings=_get(data, "max_position_embeddings", int, path, 32768),
        qk_norm=True,  # official override
        tie_word_embeddings=False,  # official override
    )
    _positive(
        path,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
    )
    if cfg.hidden_size % cfg.num_attention_heads or cfg.head_dim % 2:
        raise CheckpointError(
            f"config file {path}: hidden_size {cfg.hidden_size} must be a multiple of num_attention_heads "
            f"{cfg.num_attention_heads} with an even head dim"
        )
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise CheckpointError(
            f"config file {path}: num_attention_heads {cfg.num_attention_heads} must be a multiple of "
            f"num_key_value_heads {cfg.num_key_value_heads}"
        )
    if cfg.max_position_embeddings > MAX_POSITION_EMBEDDINGS:
        raise CheckpointError(
            f"config file {path}: field 'max_position_embeddings' = {cfg.max_position_embeddings} must be <= "
            f"{MAX_POSITION_EMBEDDINGS}"
        )
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"config file {path}: hidden_act {act!r} is not supported (only 'silu')")
    scaling = data.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
        if kind != "default":
            raise CheckpointError(
                f"config file {path}: rope_scaling {scaling!r} is not supported (BAGEL uses default RoPE)"
            )
    return cfg


def parse_vit_config(data: dict[str, Any], path: Path) -> ViTConfig:
    """Build a :class:`ViTConfig` from a parsed ``vit_config.json`` (drops the last layer, no RoPE)."""
    file_layers = _get(data, "num_hidden_layers", int, path, 12)
    if file_layers < 2:
        raise CheckpointError(
            f"config file {path}: num_hidden_layers = {file_layers}; BAGEL drops the last ViT layer, so it must be >= 2"
        )
    cfg = ViTConfig(
        hidden_size=_get(data, "hidden_size", int, path, 768),
        intermediate_size=_get(data, "intermediate_size", int, path, 3072),
        num_attention_heads=_get(data, "num_attention_heads", int, path, 12),
        num_hidden_layers=file_layers - 1,  # official override
        image_size=_get(data, "image_size", int, path, 224),
        patch_size=_get(data, "patch_size", int, path, 16),
        layer_norm_eps=_get(data, "layer_norm_eps", float, path, 1e-6),
        hidden_act=_get(data, "hidden_act", str, path, "gelu_pytorch_tanh"),
        num_channels=_get(data, "num_channels", int, path, 3),
    )
    _positive(
        path,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        image_size=cfg.image_size,
        patch_size=cfg.patch_size,
        layer_norm_eps=cfg.layer_norm_eps,
        num_channels=cfg.num_channels,
    )
    if cfg.hidden_size % cfg.num_attention_heads:
        raise CheckpointError(
            f"config file {path}: hidden_size {cfg.hidden_size} must be a multiple of num_attention_heads "
            f"{cfg.num_attention_heads}"
        )
    if cfg.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
        raise CheckpointError(
            f"config file {path}: hidden_act {cfg.hidden_act!r} is not supported (allowed: 'gelu_pytorch_tanh', 'gelu')"
        )
    return cfg


def parse_ae_config(data: dict[str, Any] | None, path: Path) -> AEConfig:
    """Build an :class:`AEConfig`: the real BAGEL VAE defaults, overridden by ``data`` when given."""
    if data is None:
        return AEConfig()
    known = {f.name: f for f in fields(AEConfig)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise CheckpointError(f"config file {path}: unknown fields {unknown}; allowed: {sorted(known)}")
    values: dict[str, Any] = {}
    for name, value in data.items():
        if name == "ch_mult":
            if (
                not isinstance(value, list)
                or not 0 < len(value) <= MAX_VAE_LEVELS
                or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
            ):
                raise CheckpointError(
                    f"config file {path}: ch_mult = {value!r} must be a list of 1 to {MAX_VAE_LEVELS} ints > 0"
                )
            values[name] = tuple(value)
        elif name in ("scale_factor", "shift_factor"):
            values[name] = _get(data, name, float, path)
            if name == "scale_factor":  # the decoder divides by it
                _positive(path, scale_factor=values[name])
        else:
            values[name] = _get(data, name, int, path)
            _positive(path, **{name: values[name]})
            if name == "num_res_blocks" and values[name] > MAX_VAE_BLOCKS:
                raise CheckpointError(f"config file {path}: field {name!r} = {value} must be <= {MAX_VAE_BLOCKS}")
    cfg = AEConfig(**values)
    if cfg.downsample != 2 ** (len(cfg.ch_mult) - 1):
        raise CheckpointError(
            f"config file {path}: downsample {cfg.downsample} must equal 2**(len(ch_mult)-1) = "
            f"{2 ** (len(cfg.ch_mult) - 1)}"
        )
    bad = [cfg.ch * m for m in cfg.ch_mult if (cfg.ch * m) % 32]
    if bad:
        raise CheckpointError(
            f"config file {path}: every ch*ch_mult must be a multiple of 32 (GroupNorm groups); got {bad}"
        )
    return cfg


def check_transform_config(cfg: BagelConfig, path: Path, *, present: bool | None = None) -> None:
    """Check ``cfg.transforms`` against the model; errors name ``path`` (the ``transform_config.json``).

    ``present``: whether the transform config was given (default: whether ``path`` is a file; a
    single-file checkpoint passes it, its configs live in the safetensors metadata).

    * ``vae.stride`` is a multiple of ``latent_downsample`` (one latent token per 16x16 pixels
      officially) and the largest VAE image fits the latent position table (``max_latent_size`` tokens
      per side);
    * ``vit.stride`` equals the ViT ``patch_size`` and the largest ViT image fits the position tables
      (ids ``row * vit_max_num_patch_per_side + col`` index both BAGEL's and SigLIP's tables).
    """
    tf = cfg.transforms
    present = path.is_file() if present is None else present
    where = f"config file {path}" + ("" if present else " (absent, so the official values are used)")
    fix = (
        FIX_TRANSFORM.format(path=path.name)
        if present
        else f"write {path.name} with sizes that suit this model (docs/engine.md: 'Image transform sizes')"
    )
    ld = cfg.latent_downsample
    if tf.vae.stride % ld:
        raise CheckpointError(
            f"{where}: field 'vae.stride' = {tf.vae.stride} must be a multiple of {ld} (ae downsample "
            f"{cfg.ae.downsample} x latent_patch_size {cfg.latent_patch_size}: one latent token per "
            f"{ld}x{ld} pixels); {fix}"
        )
    vae_tokens = tf.vae.max_side // ld
    if vae_tokens > cfg.max_latent_size:
        raise CheckpointError(
            f"{where}: field 'vae.max_size' = {tf.vae.max_size} allows {tf.vae.max_side}-pixel sides = "
            f"{vae_tokens} latent tokens, more than max_latent_size {cfg.max_latent_size}; use "
            f"vae.max_size <= {cfg.max_latent_size * ld}; {fix}"
        )
    p = cfg.vit.patch_size
    if tf.vit.stride != p:
        raise CheckpointError(
            f"{where}: field 'vit.stride' = {tf.vit.stride} must equal the ViT patch_size {p} of "
            f"{VIT_CONFIG_FILE}; {fix}"
        )
    per_side = cfg.vit_max_num_patch_per_side
    # ids row * per_side + col (row, col < n) must index SigLIP's table of vit.num_positions rows too
    allowed = min(per_side, (cfg.vit.num_positions - 1) // (per_side + 1) + 1)
    vit_patches = tf.vit.max_side // p
    if vit_patches > allowed:
        raise CheckpointError(
            f"{where}: field 'vit.max_size' = {tf.vit.max_size} allows {vit_patches} patches per side, more "
            f"than the position tables hold ({allowed}: vit_max_num_patch_per_side {per_side}, "
            f"{cfg.vit.num_positions} SigLIP positions from {VIT_CONFIG_FILE}); use vit.max_size <= "
            f"{allowed * p}; {fix}"
        )


def load_bagel_config(checkpoint_dir: str | Path) -> BagelConfig:
    """Read a checkpoint folder's configs and apply BAGEL's load-time overrides.

    Args:
        checkpoint_dir: folder with ``llm_config.json``, ``vit_config.json`` (and optionally
            ``ae_config.json`` and ``transform_config.json``).

    Raises:
        CheckpointError: a file is missing, is not valid JSON, or holds unusable values.
    """
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise CheckpointError(
            f"checkpoint folder {root} does not exist or is not a directory; pass the folder holding "
            f"{LLM_CONFIG_FILE}, {VIT_CONFIG_FILE}, ema.safetensors and ae.safetensors"
        )
    llm_path, vit_path, ae_path = root / LLM_CONFIG_FILE, root / VIT_CONFIG_FILE, root / AE_CONFIG_FILE
    llm = parse_llm_config(_read_json(llm_path), llm_path)
    vit = parse_vit_config(_read_json(vit_path), vit_path)
    ae = parse_ae_config(_read_json(ae_path) if ae_path.exists() else None, ae_path)
    tf_path = root / TRANSFORM_CONFIG_FILE
    transforms = parse_transform_config(_read_json(tf_path) if tf_path.exists() else None, tf_path)
    cfg = BagelConfig(llm=llm, vit=vit, ae=ae, transforms=transforms)
    if cfg.llm.hidden_size % 4:
        raise CheckpointError(
            f"config file {llm_path}: hidden_size {cfg.llm.hidden_size} must be a multiple of 4 "
            f"(2-D sin-cos position tables)"
        )
    check_transform_config(cfg, tf_path)
    return cfg


def bagel_config_from_dicts(
    llm: dict[str, Any] | None,
    vit: dict[str, Any] | None,
    ae: dict[str, Any] | None = None,
    transforms: dict[str, Any] | None = None,
    *,
    source: str | Path,
) -> BagelConfig:
    """:func:`load_bagel_config` for configs that are not files (a single-file checkpoint's metadata).

    ``llm``/``vit``/``ae``/``transforms`` are the parsed ``llm_config.json``, ``vit_config.json`` and the
    optional ``ae_config.json`` / ``transform_config.json``; errors name ``{source}:{file name}``.

    Raises:
        CheckpointError: a config is not a JSON object or holds unusable values.
    """

    def where(name: str) -> Path:
        return Path(f"{source}:{name}")

    parsed: dict[str, dict[str, Any]] = {}  # every required config; the optional ones when given
    for name, data, required in (
        (LLM_CONFIG_FILE, llm, True),
        (VIT_CONFIG_FILE, vit, True),
        (AE_CONFIG_FILE, ae, False),
        (TRANSFORM_CONFIG_FILE, transforms, False),
    ):
        if data is None and not required:
            continue
        if not isinstance(data, dict):
            raise CheckpointError(
                f"config {where(name)} is {'missing' if data is None else 'a JSON ' + type(data).__name__}; it "
                f"must be a JSON object (the checkpoint's {name})"
            )
        parsed[name] = data
    cfg = BagelConfig(
        llm=parse_llm_config(parsed[LLM_CONFIG_FILE], where(LLM_CONFIG_FILE)),
        vit=parse_vit_config(parsed[VIT_CONFIG_FILE], where(VIT_CONFIG_FILE)),
        ae=parse_ae_config(parsed.get(AE_CONFIG_FILE), where(AE_CONFIG_FILE)),
        transforms=parse_transform_config(parsed.get(TRANSFORM_CONFIG_FILE), where(TRANSFORM_CONFIG_FILE)),
    )
    if cfg.llm.hidden_size % 4:
        raise CheckpointError(
            f"config {where(LLM_CONFIG_FILE)}: hidden_size {cfg.llm.hidden_size} must be a multiple of 4 "
            f"(2-D sin-cos position tables)"
        )
    check_transform_config(cfg, where(TRANSFORM_CONFIG_FILE), present=transforms is not None)
    return cfg


__all__ = [
    "OFFICIAL_MAX_PIXELS",
    "TRANSFORM_CONFIG_FILE",
    "AEConfig",
    "BagelConfig",
    "LLMConfig",
    "ResizeConfig",
    "TransformConfig",
    "ViTConfig",
    "bagel_config_from_dicts",
    "check_transform_config",
    "load_bagel_config",
    "parse_ae_config",
    "parse_llm_config",
    "parse_transform_config",
    "parse_vit_config",
]
