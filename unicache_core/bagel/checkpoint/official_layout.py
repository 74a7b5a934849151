"""The files of the official BAGEL-7B-MoT checkpoint folder that the engine reads, with their sizes, and the one
message that tells a user which of them a folder lacks and where to get them.

The names are those the official inference reads (../shared/docs/bagel.md §1). The sizes are the published
repository's (``ByteDance-Seed/BAGEL-7B-MoT``): ``ema.safetensors`` is its 1223 tensors in bf16 (29,214,520,256
bytes of data, counted on the model built here on the meta device), ``ae.safetensors`` the FLUX VAE's 244 tensors
in fp32 (335,278,732 bytes); the JSON and tokenizer sizes are the files' as published. ``tokenizer.json``,
``config.json`` and ``generation_config.json`` are in the repository too, and never read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: Where BAGEL-7B-MoT's files are published.
OFFICIAL_REPOSITORY = "ByteDance-Seed/BAGEL-7B-MoT"
#: The file that makes a folder a BAGEL checkpoint folder (the loader node lists folders holding it).
MARKER_FILE = "llm_config.json"


@dataclass(frozen=True)
class OfficialFile:
    """One file of the official folder: its name, its published size in bytes and what it holds."""

    name: str
    size: int
    holds: str


#: Every file the engine reads from an official folder, in the order a download lists them.
OFFICIAL_FILES = (
    OfficialFile("llm_config.json", 663, "the language model's configuration"),
    OfficialFile("vit_config.json", 205, "the SigLIP ViT's configuration"),
    OfficialFile("ema.safetensors", 29_214_520_256, "BAGEL's weights (bf16)"),
    OfficialFile("ae.safetensors", 335_278_732, "the FLUX VAE's weights (fp32)"),
    OfficialFile("vocab.json", 2_780_000, "the Qwen2 tokenizer's vocabulary"),
    OfficialFile("merges.txt", 1_670_000, "the tokenizer's merges"),
    OfficialFile("tokenizer_config.json", 7_310, "the tokenizer's special tokens"),
)


def official_size(name: str) -> int | None:
    """The published size of the official file ``name`` (``None`` for a name not in :data:`OFFICIAL_FILES`)."""
    return next((f.size for f in OFFICIAL_FILES if f.name == name), None)


def human_size(size: int) -> str:
    """``29214520256`` → ``"29.2 GB"`` (decimal units, three significant digits; bytes below 1 kB)."""
    if size < 1000:
        return f"{size} B"
    for unit, scale in (("kB", 1e3), ("MB", 1e6), ("GB", 1e9)):
        if size < scale * 1000 or unit == "GB":
            value = size / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    raise AssertionError("unreachable")


def official_files_line() -> str:
    """The files and their sizes in one line: ``llm_config.json (663 B), ..., tokenizer_config.json (7.31 kB)``."""
    return ", ".join(f"{f.name} ({human_size(f.size)})" for f in OFFICIAL_FILES)


def missing_official_files(folder: str | Path) -> list[OfficialFile]:
    """The official files ``folder`` does not hold (all of them when it is not a folder). A name that is there
    but is not a readable file (a folder, a FIFO, a dangling link) is not missing: the file's own check names it."""
    folder = Path(folder)
    return [f for f in OFFICIAL_FILES if not os.path.lexists(folder / f.name)]


def is_checkpoint_folder(folder: str | Path) -> bool:
    """Does ``folder`` look like a BAGEL checkpoint folder (it holds :data:`MARKER_FILE`)? A folder that does is
    checked file by file later, each missing or broken file named on its own (weights, tokenizer, pickles)."""
    return os.path.lexists(Path(folder) / MARKER_FILE)


def not_a_checkpoint_message(folder: str | Path, where: str = "") -> str:
    """One line for a folder that is not a (complete) BAGEL checkpoint: what it lacks, every file BAGEL-7B-MoT's
    folder holds with its size, and where to put them (``where``, e.g. ComfyUI's model folder; else ``folder``)."""
    folder = Path(folder)
    missing = missing_official_files(folder)
    lacks = (
        "holds no BAGEL checkpoint"
        if len(missing) == len(OFFICIAL_FILES)
        else "is missing " + ", ".join(f"{f.name} ({human_size(f.size)})" for f in missing)
    )
    return (
        f"{folder} {lacks}; a BAGEL-7B-MoT folder holds {official_files_line()} from {OFFICIAL_REPOSITORY}: "
        f"download them into {where or folder}"
    )


__all__ = [
    "OFFICIAL_FILES",
    "OFFICIAL_REPOSITORY",
    "MARKER_FILE",
    "OfficialFile",
    "human_size",
    "is_checkpoint_folder",
    "missing_official_files",
    "not_a_checkpoint_message",
    "official_files_line",
    "official_size",
]
