"""Scratch tensors reused across attention calls (the dequantization buffers and the workspaces of packed rows).

A CPU tensor of megabytes that is allocated and freed at every call is mapped afresh by the C allocator each time,
and writing it first costs a page fault per 4 KiB page: on a 2.5 MB workspace that was twice the time of the
dequantization it held. :func:`scratch` hands out a view of a buffer kept per (purpose, dtype, device) and thread,
grown when a call needs more, so those pages are touched once. Only CPU tensors are kept (CUDA's caching allocator
already reuses its blocks), and none larger than :data:`MAX_SCRATCH_BYTES`.

A scratch tensor is valid until the next :func:`scratch` call of the same purpose in the same thread: it is for
temporaries that never outlive the function that asked for them (each caller names its own purpose).
"""

from __future__ import annotations

import math
import threading

import torch
from torch import Tensor

#: Largest buffer kept per purpose (a larger request is allocated for the call alone).
MAX_SCRATCH_BYTES = 64 << 20

_local = threading.local()


def scratch(purpose: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A contiguous tensor of ``shape`` and ``dtype`` on ``device`` with undefined contents, reused by the next call
    that names the same ``purpose`` (module docstring)."""
    device = torch.device(device)
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if device.type != "cpu" or nbytes > MAX_SCRATCH_BYTES:
        return torch.empty(shape, dtype=dtype, device=device)
    buffers: dict[tuple[str, torch.dtype], Tensor] = getattr(_local, "buffers", None) or {}
    _local.buffers = buffers
    key = (purpose, dtype)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        # A normal tensor, even when asked for under torch.inference_mode: an inference tensor could not be written
        # by a later call made outside inference mode; a normal one can be written in and out of it.
        with torch.inference_mode(False):
            buffer = torch.empty(max(numel, 1), dtype=dtype)
        buffers[key] = buffer
    return buffer[:numel].view(shape)


def release() -> None:
    """Free this thread's scratch buffers (they are made again when next needed)."""
    _local.buffers = {}


__all__ = ["MAX_SCRATCH_BYTES", "release", "scratch"]
