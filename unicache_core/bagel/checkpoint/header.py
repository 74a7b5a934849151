"""The safetensors header reader every checkpoint form uses: tensor names, dtypes and shapes, and metadata.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON (one entry per
tensor: ``{"dtype", "shape", "data_offsets"}``, plus an optional ``__metadata__`` map of strings), then
the tensor data. :func:`read_header` reads and validates the header only (a 29 GB checkpoint is opened
for its first bytes, nothing is mapped), as the safetensors library does: known dtypes, non-negative
shapes, data offsets that hold exactly their tensor, contiguous from byte 0 to the end of the file.

Pickle files are never read: a file whose first bytes are not a safetensors prefix (a length that
fits the file, then ``{``) but are a pickle's own signature (a ``torch.save`` zip archive, or the
PROTO opcode ``0x80`` with protocol 2..5) is refused with its own message. The prefix is tested
first: a valid header length may well start with the byte ``0x80``.

Nothing here imports torch; this module reads bytes and JSON only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ...errors import CheckpointError
from .official_layout import human_size, official_size

#: Suffixes of pickle-based weight files (``torch.save``): never opened.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
#: Largest header accepted (the safetensors library's own limit; BAGEL-7B-MoT's is about 150 KB).
MAX_HEADER_BYTES = 100_000_000
#: Bytes per element of the dtypes a header may name.
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
#: First bytes of a ``torch.save`` zip archive.
_ZIP_MAGIC = b"PK\x03\x04"
#: Protocols a raw pickle stream announces after its ``0x80`` PROTO opcode.
_PICKLE_PROTOCOLS = range(2, 6)
#: Bytes read before the format is told apart: the header length and the JSON's first character.
_PREFIX_BYTES = 9


class TensorEntry(NamedTuple):
    """One tensor of a header: its safetensors dtype name (``"BF16"``, ``"F32"``, ...), its shape and where its
    data starts in the file (``data_start``, bytes from the file's first byte; ``numel * itemsize`` bytes)."""

    dtype: str
    shape: tuple[int, ...]
    data_start: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data in the file."""
        count = 1
        for d in self.shape:
            count *= d
        return count * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class SafetensorsHeader:
    """The validated header of one safetensors file.

    Attributes:
        path: the file.
        tensors: tensor name -> :class:`TensorEntry`, in the header's order.
        metadata: the ``__metadata__`` map (empty when the file has none).
    """

    path: Path
    tensors: dict[str, TensorEntry] = field(repr=False)
    metadata: dict[str, str] = field(repr=False)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape."""
        return {name: entry.shape for name, entry in self.tensors.items()}

    @property
    def dtypes(self) -> dict[str, str]:
        """Tensor name -> safetensors dtype name."""
        return {name: entry.dtype for name, entry in self.tensors.items()}


def _looks_like_safetensors(head: bytes, size: int) -> bool:
    """Whether ``head`` (the first 9 bytes of a ``size``-byte file) opens a safetensors file.

    A safetensors file starts with its header length as a little-endian u64 and then the JSON header's
    ``{``. The length's low byte may be anything (``0x80`` included, the first byte of a pickle stream),
    so the format is told by the whole prefix, not by its first byte.
    """
    if len(head) < _PREFIX_BYTES:
        return False
    header_len = int.from_bytes(head[:8], "little")
    return 2 <= header_len <= size - 8 and head[8:9] == b"{"


def _is_pickle(head: bytes) -> bool:
    """A ``torch.save`` zip archive or a raw pickle stream (PROTO opcode ``0x80`` and protocol 2..5)."""
    return head.startswith(_ZIP_MAGIC) or (len(head) >= 2 and head[0] == 0x80 and head[1] in _PICKLE_PROTOCOLS)


def _check_is_weights_file(path: Path) -> None:
    """Refuse a ``path`` that is missing, a folder, a FIFO or device (never opened: it could block)."""
    if path.exists() and not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise CheckpointError(
            f"weights file {path} is {kind}; replace it with {path.name} of ByteDance-Seed/BAGEL-7B-MoT"
        )
    if not path.is_file():
        pickles = sorted(p.name for p in path.parent.glob("*") if p.suffix.lower() in PICKLE_SUFFIXES)
        found = (
            f"; the folder has pickle-based weights ({', '.join(pickles)}), which are not read because "
            f"unpickling can run arbitrary code: this loader needs safetensors, so download {path.name} or "
            f"convert those weights to safetensors"
            if pickles
            else ""
        )
        size = official_size(path.name)
        published = f" ({human_size(size)})" if size else ""
        raise CheckpointError(
            f"missing weights file {path}; download {path.name}{published} of ByteDance-Seed/BAGEL-7B-MoT into "
            f"{path.parent}{found}"
        )


def _parse_entries(header: dict, bad, data_base: int) -> tuple[dict[str, TensorEntry], list[tuple[int, int]]]:
    """Every tensor entry of a parsed header, checked; and the ``(begin, end)`` byte span of each (relative to the
    data, which starts at byte ``data_base`` of the file)."""
    tensors, spans = {}, []
    for name, entry in header.items():
        ok = isinstance(entry, dict) and entry.get("dtype") in DTYPE_BYTES and isinstance(entry.get("shape"), list)
        ok = ok and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry["shape"])
        offsets = entry.get("data_offsets") if ok else None
        if not (
            ok
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise bad(f"tensor {name!r} has a malformed header entry")
        count = 1
        for d in entry["shape"]:
            count *= d
        if offsets[1] - offsets[0] != count * DTYPE_BYTES[entry["dtype"]] or offsets[0] < 0:
            raise bad(f"tensor {name!r}: data_offsets {offsets} do not hold a {entry['dtype']} {entry['shape']} tensor")
        tensors[name] = TensorEntry(entry["dtype"], tuple(entry["shape"]), data_base + offsets[0])
        spans.append((offsets[0], offsets[1]))
    return tensors, spans


def read_header(path: str | Path, *, check_data_size: bool = True) -> SafetensorsHeader:
    """Read and validate the header of the safetensors file ``path``; no tensor data is read.

    Args:
        path: the ``.safetensors`` file.
        check_data_size: also require the file to hold exactly the data the header describes (a
            truncated download fails here). ``False`` checks the header alone (when listing files, a
            truncated file is still shown, and loading it then says what is wrong).

    Raises:
        CheckpointError: the file is missing, not a regular file, a pickle, or not a valid safetensors
            file (each message names the file and says what to do).
    """
    path = Path(path)
    _check_is_weights_file(path)

    def bad(detail: str) -> CheckpointError:
        return CheckpointError(
            f"cannot read {path}: {detail}. The file is corrupt or truncated (or not a safetensors "
            f"file); re-download or re-convert it"
        )

    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(_PREFIX_BYTES)
        if not _looks_like_safetensors(head, size) and _is_pickle(head):
            raise CheckpointError(
                f"{path} is a pickle/torch.save file, not safetensors; it is not read because unpickling can run "
                f"arbitrary code. Download the real {path.name} or convert the weights to safetensors"
            )
        if len(head) < 8:
            raise bad(f"only {len(head)} bytes")
        n = int.from_bytes(head[:8], "little")
        if not 2 <= n <= min(MAX_HEADER_BYTES, size - 8):
            raise bad(f"header length {n} does not fit a file of {size} bytes")
        raw = head[8:] + fh.read(n - len(head[8:]))
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise bad(f"the header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise bad("__metadata__ must map strings to strings")
    tensors, spans = _parse_entries(header, bad, 8 + n)
    end = 0
    for lo, hi in sorted(spans):
        if lo != end:
            raise bad(f"tensor data is not contiguous at byte {lo} (expected {end})")
        end = hi
    if check_data_size and 8 + n + end != size:
        raise bad(f"the header describes {8 + n + end} bytes but the file has {size}")
    return SafetensorsHeader(path=path, tensors=tensors, metadata=meta)


__all__ = ["MAX_HEADER_BYTES", "PICKLE_SUFFIXES", "SafetensorsHeader", "TensorEntry", "read_header"]
