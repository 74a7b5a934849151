"""A valid safetensors file is never mistaken for a pickle, whatever its header length's low byte.

A safetensors file opens with its header length (little-endian u64, padded to a multiple of 8). When that
length is 0x80 modulo 256 the first byte is 0x80, the same byte a raw pickle stream opens with; about 1 in
32 valid files (the official ``ema.safetensors`` or ``ae.safetensors`` among them, by chance) has it.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.checkpoint.single_file import inspect_single_file
from training.tiny import write_tiny_single_file
from unicache_core.errors import CheckpointError

ROOT = Path(__file__).resolve().parents[1]


def resave_with_low_byte(path: Path, low_byte: int = 0x80) -> None:
    """Rewrite ``path`` (same tensors and metadata) padded so its header length is ``low_byte`` mod 256."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        metadata = dict(fh.metadata() or {})
    tensors = load_file(str(path))
    for pad in range(0, 512):
        save_file(tensors, str(path), metadata={**metadata, "padding": "x" * pad})
        with open(path, "rb") as fh:
            if fh.read(1)[0] == low_byte:
                return
    raise AssertionError("no padding gave the wanted header length")


def _first_byte(path: Path) -> int:
    with open(path, "rb") as fh:
        return fh.read(1)[0]


def test_folder_with_0x80_header_lengths_loads_like_the_original(tiny_checkpoint, tiny_checkpoint_copy):
    for name in ("ema.safetensors", "ae.safetensors"):
        resave_with_low_byte(tiny_checkpoint_copy / name)
        assert _first_byte(tiny_checkpoint_copy / name) == 0x80
    original = load_bagel(tiny_checkpoint, dtype="fp32")
    padded = load_bagel(tiny_checkpoint_copy, dtype="fp32")
    for (name, a), (_, b) in zip(original.model.state_dict().items(), padded.model.state_dict().items()):
        assert torch.equal(a, b), name


def test_cli_runs_on_a_0x80_header_checkpoint(tiny_checkpoint_copy, tmp_path):
    resave_with_low_byte(tiny_checkpoint_copy / "ema.safetensors")
    image = tmp_path / "src.png"
    Image.fromarray(np.full((32, 32, 3), 200, dtype=np.uint8)).save(image)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "unicache_core.bagel", "understand", "--checkpoint", str(tiny_checkpoint_copy),
         "--image", str(image), "--prompt", "what is this?", "--max-new-tokens", "2", "--dtype", "fp32", "--quiet"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def test_single_file_with_a_0x80_header_length_loads(tmp_path):
    single = write_tiny_single_file(tmp_path / "single", seed=0)
    resave_with_low_byte(single)
    assert _first_byte(single) == 0x80
    info = inspect_single_file(single)
    assert info.source == "metadata" and info.metadata  # the comfyui_bagel metadata survived the rewrite
    loaded = load_bagel(single, dtype="fp32", tokenizer_dir=single.parent / "tokenizer")
    assert loaded.form == "single_file"


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_raw_pickle_named_safetensors_is_refused_unread(tiny_checkpoint_copy, monkeypatch, protocol):
    (tiny_checkpoint_copy / "ema.safetensors").write_bytes(pickle.dumps({"w": [0.0] * 64}, protocol=protocol))

    def boom(*args, **kwargs):
        raise AssertionError("a pickle loader was called")

    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(torch, "load", boom)
    with pytest.raises(CheckpointError, match=r"ema\.safetensors is a pickle/torch\.save file.*not read"):
        load_bagel(tiny_checkpoint_copy)
