"""The official checkpoint folder: configs, tokenizer and the two weight files' headers, checked together.

An official-layout folder (ByteDance-Seed/BAGEL-7B-MoT) holds ``llm_config.json``, ``vit_config.json``,
``ema.safetensors`` (BAGEL), ``ae.safetensors`` (the FLUX VAE) and the tokenizer files; the optional
``ae_config.json`` / ``transform_config.json`` override the built-in VAE and image transform sizes.
:func:`inspect_folder` reads everything but the tensor data and checks that it belongs together.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...errors import CheckpointError
from ..config import AE_CONFIG_FILE, LLM_CONFIG_FILE, VIT_CONFIG_FILE, BagelConfig, load_bagel_config
from ..tokenizer import BagelTokenizer, check_bagel_tokens
from ..weight_layout import bagel_layout, vae_layout
from .config_check import check_model_config, check_names_and_shapes, check_vae_config
from .header import SafetensorsHeader, read_header
from .model_id import model_id_of
from .official_layout import is_checkpoint_folder, missing_official_files, not_a_checkpoint_message

#: The BAGEL weights of a checkpoint folder.
EMA_FILE = "ema.safetensors"
#: The VAE weights of a checkpoint folder.
AE_FILE = "ae.safetensors"


@dataclass(frozen=True)
class FolderCheckpoint:
    """What a checkpoint folder holds, checked; no tensor data was read.

    Attributes:
        root: the folder.
        config: its parsed configs (checked against both headers).
        tokenizer: its tokenizer (no more ids than the model's embedding rows).
        ema, ae: the headers of ``ema.safetensors`` and ``ae.safetensors``.
        model_id: the id policy tables and reports use (``""`` when the configs give none).
    """

    root: Path
    config: BagelConfig
    tokenizer: BagelTokenizer
    ema: SafetensorsHeader
    ae: SafetensorsHeader
    model_id: str


def _vae_config_source(root: Path) -> str:
    """Where a folder's VAE config comes from: its ``ae_config.json``, or the built-in FLUX config."""
    return f"{root / AE_CONFIG_FILE}" if (root / AE_CONFIG_FILE).is_file() else "the built-in FLUX VAE config"


def check_folder_model_config(config: BagelConfig, root: Path, ema: SafetensorsHeader) -> None:
    """:func:`~.config_check.check_model_config` with the messages naming the folder's config files."""
    check_model_config(config, ema, llm_source=str(root / LLM_CONFIG_FILE), vit_source=str(root / VIT_CONFIG_FILE))


def check_folder_weights(root: str | Path, config: BagelConfig, *, missing_ok: bool = False) -> None:
    """The folder's configs against its weight files' headers, before anything is built: layer and block counts,
    the main widths (naming the config file and key), then every tensor name and shape (:mod:`..weight_layout`).

    ``missing_ok``: a weights file that is absent is skipped (a memory plan before the download).

    Raises:
        CheckpointError: a corrupt or pickle weights file, or one the configs do not describe.
    """
    root = Path(root)

    def header(path: Path) -> SafetensorsHeader | None:
        return None if missing_ok and not path.exists() and not path.is_symlink() else read_header(path)

    ema, ae = header(root / EMA_FILE), header(root / AE_FILE)
    # counts and main widths first (their messages name the config key), then every name and shape
    if ema is not None:
        check_folder_model_config(config, root, ema)
    if ae is not None:
        check_vae_config(config.ae, ae, source=_vae_config_source(root))
    if ema is not None:
        check_names_and_shapes(ema, bagel_layout(config).checkpoint_shapes())
    if ae is not None:
        check_names_and_shapes(ae, {spec.name: spec.shape for spec in vae_layout(config.ae)})


def check_official_files(root: str | Path) -> None:
    """A folder that is no BAGEL checkpoint (no ``llm_config.json``), or a checkpoint folder that lacks two or more
    files of the official layout: a CheckpointError naming every file it lacks, each with its size, and where to get
    them, in one message (nothing is read). A checkpoint folder that lacks one file is named by that file's own
    check."""
    if not is_checkpoint_folder(root) or len(missing_official_files(root)) > 1:
        raise CheckpointError(not_a_checkpoint_message(root))


def inspect_folder(root: str | Path) -> FolderCheckpoint:
    """Read and check an official-layout checkpoint folder: configs, tokenizer, headers (no tensor data).

    Raises:
        CheckpointError: a folder with no BAGEL in it (every file it lacks named with its size,
            :mod:`.official_layout`), a missing or corrupt file, a pickle instead of safetensors, a tokenizer
            with more ids than the model, a config that does not describe the weight files.
    """
    root = Path(root)
    check_official_files(root)
    config = load_bagel_config(root)
    tokenizer = BagelTokenizer.from_dir(root)
    check_bagel_tokens(tokenizer, root)
    if tokenizer.vocab_size > config.llm.vocab_size:
        raise CheckpointError(
            f"the tokenizer in {root} has {tokenizer.vocab_size} ids but llm_config.json says vocab_size="
            f"{config.llm.vocab_size}; the tokenizer files do not belong to this model"
        )
    # headers only: the config must describe these files before anything is built from it
    ema, ae = read_header(root / EMA_FILE), read_header(root / AE_FILE)
    check_folder_model_config(config, root, ema)
    check_vae_config(config.ae, ae, source=_vae_config_source(root))
    try:
        model_id = model_id_of(root)
    except (ValueError, TypeError):
        model_id = ""
    return FolderCheckpoint(root=root, config=config, tokenizer=tokenizer, ema=ema, ae=ae, model_id=model_id)


__all__ = [
    "AE_FILE",
    "EMA_FILE",
    "FolderCheckpoint",
    "check_folder_model_config",
    "check_folder_weights",
    "check_official_files",
    "inspect_folder",
]
