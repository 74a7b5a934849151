"""What a request holds at each of its phases: :class:`PhaseMeter` on :attr:`RunHooks.phase
<unicache_core.bagel.request.RunHooks.phase>` (the bytes allocated when a phase begins and the most reached inside
it) and :func:`live_tensors` (the largest tensors Python still references, to trace a gap to what holds it)."""

from __future__ import annotations

import gc
from collections import Counter

import torch

from unicache_core.bagel.memory.trace import TensorMemoryTracker

#: How many of the largest live tensors a row lists at the decode's start.
LISTED_TENSORS = 8


class PhaseMeter:
    """Bytes allocated at the start of each request phase and the most reached inside it.

    On CUDA: the caching allocator's counters (``base`` ignored). On the CPU: ``base`` (the loaded parameters)
    plus what ``tracker`` (active around the request) sees alive.
    """

    def __init__(self, device: torch.device, tracker: TensorMemoryTracker | None = None, base: int = 0):
        self.device, self.tracker, self.base = device, tracker, base
        self.entry: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.current_phase: str | None = None
        self.decode_entry_tensors: list[dict] = []

    def _allocated(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return self.base + self.tracker.live_bytes

    def _max(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return self.base + self.tracker.peak_bytes

    def _reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.tracker.reset_peak()

    def __call__(self, name: str) -> None:
        """``RunHooks.phase``: close the running phase, open ``name``."""
        self.close()
        if name == "decode":
            self.decode_entry_tensors = live_tensors(self.device)
        self.entry[name] = self._allocated()
        self._reset()
        self.current_phase = name

    def close(self) -> None:
        if self.current_phase is not None:
            self.peak[self.current_phase] = self._max()
            self.current_phase = None

    @property
    def overall_peak(self) -> int:
        return max(self.peak.values())


def live_tensors(device: torch.device, top: int = LISTED_TENSORS) -> list[dict]:
    """The ``top`` largest (shape, dtype) groups of tensors on ``device`` that Python objects still reference."""
    sizes: Counter = Counter()
    counts: Counter = Counter()
    for obj in gc.get_objects():
        try:
            # plain tensors only (not parameters, nor the fake and symbolic ones torch.compile leaves behind), and
            # type() rather than isinstance: that asks deprecated module proxies for __class__, which warns
            if type(obj) is not torch.Tensor or obj.device.type != device.type:
                continue
            key = (tuple(obj.shape), str(obj.dtype).removeprefix("torch."))
            sizes[key] += obj.untyped_storage().nbytes()
            counts[key] += 1
        except (RuntimeError, ReferenceError, TypeError):  # no storage (meta, sparse), a dead proxy, a symbolic size
            continue
    return [{"shape": list(k[0]), "dtype": k[1], "count": counts[k], "bytes": b} for k, b in sizes.most_common(top)]


__all__ = ["LISTED_TENSORS", "PhaseMeter", "live_tensors"]
