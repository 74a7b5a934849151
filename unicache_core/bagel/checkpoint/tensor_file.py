"""Read one tensor at a time from a safetensors file with plain file reads (no memory map).

The safetensors library maps the whole file: every page a tensor was read from stays in the process's
resident memory until the file is closed, so loading a 29 GB checkpoint tensor by tensor through it still
shows the file's size in the resident set, on top of the model being filled. Here each tensor's bytes are
read (``readinto``) straight into a fresh tensor at the offsets :func:`~.header.read_header` validated, so
the process holds the model plus the tensor being converted, and the file's pages stay in the kernel's
page cache, which the system may drop.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch
from torch import Tensor

from ...errors import CheckpointError
from .header import SafetensorsHeader

#: Bytes read between two returns of freed host memory to the system (:func:`release_freed_host_memory`).
RELEASE_EVERY_BYTES = 16 << 20

#: safetensors dtype names → torch dtypes (the floating ones a checkpoint of BAGEL may hold, and the rest so
#: a wrong tensor is named by its dtype).
TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or ``None`` on another C library."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_host_memory() -> None:
    """Give the memory freed since the last call back to the system (glibc's ``malloc_trim``; a no-op elsewhere).

    Converting tensor after tensor frees buffers of every size, in the heaps of whichever threads the
    conversion kernels ran on; glibc keeps such freed memory resident, and the load's peak varies from run to run
    without this (docs/engine.md, "Measurements behind the engine's choices").
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class TensorFile:
    """An open safetensors file whose tensors are read on request (``with TensorFile(header) as f: f.read(name)``).

    Raises:
        CheckpointError: the file cannot be opened, or holds fewer bytes than its header promises.
    """

    def __init__(self, header: SafetensorsHeader):
        if sys.byteorder != "little":
            raise CheckpointError("safetensors data is little-endian; this loader needs a little-endian machine")
        self.header = header
        self._since_release = 0
        try:
            self._handle = open(header.path, "rb")
        except OSError as exc:
            raise CheckpointError(f"cannot open {header.path}: {exc.strerror or exc}") from None

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._handle.close()

    def read(self, name: str) -> Tensor:
        """Tensor ``name`` (its stored dtype and shape) on the CPU, in memory of its own."""
        entry = self.header.tensors[name]
        raw = torch.empty(entry.nbytes, dtype=torch.uint8)
        self._handle.seek(entry.data_start)
        got = self._handle.readinto(raw.numpy().data) if entry.nbytes else 0  # .data: the array's memoryview
        if got != entry.nbytes:
            raise CheckpointError(
                f"cannot read {self.header.path}: tensor {name!r} needs {entry.nbytes} bytes at byte "
                f"{entry.data_start}, the file gave {got}. The file is corrupt or truncated; re-download it"
            )
        self._since_release += entry.nbytes
        if self._since_release >= RELEASE_EVERY_BYTES:  # the previous tensors' conversions are freed by now
            release_freed_host_memory()
            self._since_release = 0
        return raw.view(TORCH_DTYPES[entry.dtype]).reshape(entry.shape)


__all__ = ["TORCH_DTYPES", "TensorFile"]
