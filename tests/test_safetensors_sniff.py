"""A valid safetensors file is never mistaken for a pickle, whatever its header length's low byte.

A safetensors file opens with its header length (little-endian u64, padded to a multiple of 8). When that
length is 0x80 modulo 256 the first byte is 0x80, the same byte a raw pickle stream opens with; about 1 in
32 valid files (the official ``ema.safetensors`` or ``ae.safetensors`` among them, by chance) has it.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_runs import run_bagel_cli
from PIL import Image
from safetensors.torch import load_file, save_file

from training.tiny import write_tiny_single_file
from unicache_core.bagel.checkpoint.header import read_header
from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.checkpoint.single_file import inspect_single_file
from unicache_core.errors import CheckpointError


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


def test_cli_runs_on_a_0x80_header_checkpoint(tiny_checkpoint_copy, tmp_path, capsys):
    resave_with_low_byte(tiny_checkpoint_copy / "ema.safetensors")
    image = tmp_path / "src.png"
    Image.fromarray(np.full((32, 32, 3), 200, dtype=np.uint8)).save(image)
    code, _, err = run_bagel_cli(
        capsys,
        "understand",
        "--checkpoint",
        str(tiny_checkpoint_copy),
        "--image",
        str(image),
        "--prompt",
        "what is this?",
        "--max-new-tokens",
        "2",
        "--dtype",
        "fp32",
        "--quiet",
    )
    assert code == 0, err


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


# ------------------------------------------------------------------------------------ the one header reader


def _raw_safetensors(path: Path, header: dict, data: bytes) -> Path:
    """A file written byte by byte: header length, the JSON ``header`` and ``data``."""
    text = json.dumps(header).encode("utf-8")
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return path


def test_header_reader_gives_what_safetensors_reads(tiny_checkpoint):
    from safetensors import safe_open

    path = tiny_checkpoint / "ema.safetensors"
    header = read_header(path)
    with safe_open(str(path), framework="pt") as fh:
        names = list(fh.keys())
        assert header.shapes == {name: tuple(fh.get_slice(name).get_shape()) for name in names}
        assert header.metadata == (fh.metadata() or {})
    assert set(header.tensors) == set(names) and set(header.dtypes.values()) == {"F32"}


@pytest.mark.parametrize(
    "header, data, match",
    [
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]},
            },
            b"\0" * 16,
            "not contiguous at byte 12",
        ),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, r"do not hold a F32 \[3\] tensor"),
        ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "'a' has a malformed header entry"),
        ({"__metadata__": {"k": 1}}, b"", "__metadata__ must map strings to strings"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "describes .* bytes but the file"),
    ],
)
def test_header_reader_refuses_inconsistent_headers(tmp_path, header, data, match):
    path = _raw_safetensors(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(CheckpointError, match=f"bad.safetensors: .*{match}.*re-download or re-convert"):
        read_header(path)


def test_header_longer_than_the_limit_is_refused_unread(tmp_path, monkeypatch):
    from unicache_core.bagel.checkpoint import header as header_module

    path = _raw_safetensors(
        tmp_path / "big.safetensors", {"a": {"dtype": "U8", "shape": [64], "data_offsets": [0, 64]}}, b"\0" * 64
    )
    assert read_header(path).shapes == {"a": (64,)}
    monkeypatch.setattr(header_module, "MAX_HEADER_BYTES", 16)
    with pytest.raises(CheckpointError, match="header length .* does not fit"):
        read_header(path)


def test_listing_reads_the_same_header(tiny_checkpoint, tmp_path):
    from nodes.model import is_bagel_file

    data = (tiny_checkpoint / "ema.safetensors").read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="describes .* bytes but the file has"):
        read_header(cut)
    assert is_bagel_file(cut)  # listed: loading it then says the file is truncated
    assert is_bagel_file(tiny_checkpoint / "ema.safetensors")
    assert not is_bagel_file(tiny_checkpoint / "ae.safetensors")  # a VAE
    pickled = tmp_path / "pickled.safetensors"
    pickled.write_bytes(pickle.dumps({"language_model.x": 1}, protocol=4))
    assert not is_bagel_file(pickled)
    with pytest.raises(CheckpointError, match="is a pickle/torch.save file"):
        read_header(pickled)
