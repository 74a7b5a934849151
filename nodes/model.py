"""The ``BAGEL_MODEL`` object, checkpoint discovery and the model cache (no ComfyUI imports).

A ``BAGEL_MODEL`` is a :class:`BagelModel`: the :class:`~unicache_core.bagel.checkpoint.loader.LoadedBagel`, the ComfyUI
``ModelPatcher`` that carries its modules (built by :mod:`nodes.host`), the checkpoint name and the file
identity ``(path, size, mtime)``. Loaded models are cached by ``(path, size, mtime, dtype, device)``, so
queued prompts reuse them and never re-read the weights; one entry is kept (choosing another checkpoint
frees the previous one once ComfyUI drops it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from unicache_core.bagel import LoadedBagel, load_bagel
from unicache_core.bagel.checkpoint.header import read_header
from unicache_core.bagel.checkpoint.official_layout import OFFICIAL_REPOSITORY, official_files_line
from unicache_core.bagel.settings import BUNDLED_CHECKPOINT
from unicache_core.errors import CheckpointError

logger = logging.getLogger(__name__)

#: Shown in the checkpoint combo when no checkpoint is found (an empty combo breaks ComfyUI's validation).
NO_CHECKPOINT = "no BAGEL checkpoint found (see tooltip)"
#: A folder holding this file is an official-layout checkpoint.
CONFIG_MARKER = "llm_config.json"
#: How deep below a ``bagel`` folder checkpoints are looked for (``bagel/<name>`` or ``bagel/<org>/<name>``).
MAX_DEPTH = 2
#: Loaded models kept for reuse.
CACHE_SIZE = 1
#: The pack's own small models in its ``models/bagel`` (the trained default and the tiny test checkpoint).
PACK_MODELS = (BUNDLED_CHECKPOINT, "bagel-tiny")


class BagelModules(torch.nn.Module):
    """BAGEL and its VAE in one module, so ComfyUI's ModelPatcher moves both.

    ``device`` is where the model computes, set by ModelPatcher when it loads the model. It is also BAGEL's
    ``execution_device``: after a partial (lowvram) load some layers stay on the offload device and bring their
    weights per call, so BAGEL's inputs go to ``device``, not to where its first parameter happens to be.
    """

    def __init__(self, loaded: LoadedBagel):
        super().__init__()
        self.bagel = loaded.model
        if loaded.vae is not None:
            self.vae = loaded.vae
        self.device = loaded.device
        self.dtype = loaded.dtype

    @property
    def device(self) -> torch.device:
        # BAGEL's device is its execution_device, which __init__ sets (the final norm's device were it unset).
        return self.bagel.device

    @device.setter
    def device(self, value) -> None:
        self.bagel.execution_device = torch.device(value)


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer of ``module``."""
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


@dataclass(eq=False)
class BagelModel:
    """What the loader node outputs (``BAGEL_MODEL``); shared by reference, never mutated by task nodes."""

    loaded: LoadedBagel
    patcher: Any
    name: str
    identity: tuple  # (path, size, mtime_ns)
    dtype: str
    device: str
    weight_dtype: str = "default"  # the loader's choice (core UNETLoader's names)

    @property
    def checkpoint_dir(self) -> str:
        return str(self.loaded.checkpoint_dir)

    def runtime(self) -> LoadedBagel:
        """The loaded model as placed now (after ComfyUI moved the modules): a view with the right ``device``."""
        device = getattr(self.patcher.model, "device", None) if self.patcher is not None else None
        if device is None:
            device = next(self.loaded.model.parameters()).device
        device = torch.device(device)
        if device == self.loaded.device:
            return self.loaded
        return dataclasses.replace(self.loaded, device=device)


# --------------------------------------------------------------------------------- checkpoint discovery


_HEADER_CACHE: dict[tuple, bool] = {}


def is_bagel_file(path: str | Path) -> bool:
    """Whether a ``.safetensors`` file is a single-file BAGEL checkpoint (``comfyui_bagel`` metadata, or BAGEL's
    ``language_model.`` tensors), read from its header only; a VAE or other model in the folder is not listed."""
    path = Path(path)
    try:
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns)
        if key in _HEADER_CACHE:
            return _HEADER_CACHE[key]
        header = read_header(path, check_data_size=False)
    except (OSError, CheckpointError):
        return False
    found = "comfyui_bagel" in header.metadata or any(k.startswith("language_model.") for k in header.tensors)
    _HEADER_CACHE[key] = found
    return found


def list_checkpoints(folders: Sequence[Path], *, include_files: bool = True) -> list[str]:
    """Checkpoint names in ``folders`` (relative paths with ``/``): official folders (holding
    ``llm_config.json``) and single ``.safetensors`` files (``include_files``). First folder wins a name clash."""
    names: list[str] = []
    seen: set[str] = set()

    def visit(root: Path, sub: Path, depth: int) -> None:
        here = root / sub
        try:
            entries = sorted(os.scandir(here), key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            rel = (sub / entry.name).as_posix()
            if entry.is_dir():
                if (Path(entry.path) / CONFIG_MARKER).is_file():
                    if rel not in seen:
                        seen.add(rel)
                        names.append(rel)
                elif depth < MAX_DEPTH:
                    visit(root, sub / entry.name, depth + 1)
            elif (
                include_files and entry.name.endswith(".safetensors") and entry.is_file() and is_bagel_file(entry.path)
            ):
                if rel not in seen:
                    seen.add(rel)
                    names.append(rel)

    for folder in folders:
        visit(Path(folder), Path(), 1)
    return names


def resolve_checkpoint(name: str, folders: Sequence[Path]) -> Path:
    """The path of checkpoint ``name`` in ``folders``, or a FileNotFoundError saying where to put one."""
    where = ", ".join(str(f) for f in folders) or "(no bagel folder registered)"
    if name == NO_CHECKPOINT or not name:
        raise FileNotFoundError(
            f"no BAGEL checkpoint was found in the bagel model folders ({where}); put an official BAGEL-7B-MoT "
            f"folder there ({where_to_put(folders)}: {official_files_line()}, from {OFFICIAL_REPOSITORY}) or a "
            "single-file .safetensors checkpoint, then press R in ComfyUI to refresh the list"
        )
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise ValueError(f"checkpoint {name!r} must be a name listed in the bagel folders, not a path")
    for folder in folders:
        candidate = Path(folder) / name
        if candidate.exists():
            return candidate
    raise FileNotFoundError(
        f"checkpoint {name!r} is not in the bagel model folders ({where}); it may have been "
        "moved or deleted: press R in ComfyUI to refresh the list and choose again"
    )


def where_to_put(folders: Sequence[Path]) -> str:
    """Where a user puts BAGEL-7B-MoT: a folder of its own in the first ``bagel`` model folder (ComfyUI's)."""
    first = Path(folders[0]) if folders else Path("ComfyUI/models/bagel")
    return f"{first / 'BAGEL-7B-MoT'}/"


def demo_models_only(names: Sequence[str]) -> bool:
    """Do the ``bagel`` folders hold nothing but the pack's own small models (no BAGEL-7B-MoT yet)?"""
    return all(name in PACK_MODELS for name in names)


def file_identity(path: Path) -> tuple:
    """``(path, size, mtime_ns)`` of a checkpoint file, or of a folder's files (total size, newest mtime)."""
    path = Path(path).resolve()
    if path.is_file():
        st = path.stat()
        return (str(path), st.st_size, st.st_mtime_ns)
    files = [p for p in path.iterdir() if p.is_file()]
    stats = [p.stat() for p in files]
    return (str(path), sum(s.st_size for s in stats), max((s.st_mtime_ns for s in stats), default=0))


# ------------------------------------------------------------------------------------------ model cache

_CACHE: OrderedDict[tuple, BagelModel] = OrderedDict()


def cached_model(key: tuple) -> BagelModel | None:
    model = _CACHE.get(key)
    if model is not None:
        _CACHE.move_to_end(key)
    return model


def remember_model(key: tuple, model: BagelModel) -> None:
    _CACHE[key] = model
    _CACHE.move_to_end(key)
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)


def clear_cache() -> None:
    _CACHE.clear()


def load_checkpoint(
    path: Path, *, dtype: str, device: torch.device, tokenizer_dir: Callable[[], Path], weight_dtype: Any = "auto"
) -> LoadedBagel:
    """:func:`~unicache_core.bagel.load_bagel` on a folder or a single ``.safetensors`` file (whose tokenizer is
    ``tokenizer_dir()``); ``weight_dtype``: the host's layers and storage (:func:`nodes.host.host_operations`)."""
    options = dict(dtype=dtype, device=device, weight_dtype=weight_dtype)
    if path.is_file():
        return load_bagel(path, tokenizer_dir=tokenizer_dir(), **options)
    return load_bagel(path, **options)


__all__ = [
    "BagelModel",
    "BagelModules",
    "CACHE_SIZE",
    "NO_CHECKPOINT",
    "PACK_MODELS",
    "cached_model",
    "clear_cache",
    "demo_models_only",
    "file_identity",
    "is_bagel_file",
    "list_checkpoints",
    "load_checkpoint",
    "module_bytes",
    "remember_model",
    "resolve_checkpoint",
    "where_to_put",
]
