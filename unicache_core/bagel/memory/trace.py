"""Bytes of the tensors alive while code runs, and their peak: the tensor accounting of a run or a dry run.

:class:`TensorMemoryTracker` is a :class:`~torch.utils._python_dispatch.TorchDispatchMode`: every tensor an
operator returns while it is active is counted by its storage (views and in-place results share one) until
the last Python tensor on that storage is freed. It works on any device, ``meta`` included, so a plan can run a
module on meta tensors and read the peak its activations would reach without allocating them
(:func:`meta_trace`). What it does not see: tensors created before it was entered (the weights) and the
scratch space fused kernels allocate and free inside one operator (the CPU flash attention's blocks). An operator
that returns a view of an earlier tensor counts that tensor's storage while the view lives, unless the tensor is
given as ``existing`` (the weights a run reads through views: a Linear's ``weight.t()``, an fp8 weight's bits).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorMemoryTracker(TorchDispatchMode):
    """Live and peak bytes of the storages created while active (``with TensorMemoryTracker() as t: ...``).

    Attributes:
        live_bytes: bytes of the tracked storages alive now.
        peak_bytes: the most ``live_bytes`` reached since entry or the last :meth:`reset_peak`.
        phase_peaks: ``{name: peak}`` of the spans opened with :meth:`phase`.
        storage_sizes: the distinct byte sizes of the storages tracked.
    """

    def __init__(self, existing: Iterable[torch.Tensor] = ()) -> None:
        """``existing``: tensors made before (a model's parameters and buffers) whose storages are never counted,
        even when an operator returns a view of them (``weight.t()``, ``weight.view(torch.int8)``)."""
        super().__init__()
        self._existing = {(t.untyped_storage()._cdata, t.untyped_storage().data_ptr()) for t in existing}
        self._storage_bytes: dict[int, int] = {}
        self._tensor_counts: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.phase_peaks: dict[str, int] = {}
        self.storage_sizes: set[int] = set()

    def _forget(self, key: int) -> None:
        remaining = self._tensor_counts[key] - 1
        if remaining:
            self._tensor_counts[key] = remaining
            return
        del self._tensor_counts[key]
        self.live_bytes -= self._storage_bytes.pop(key)

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata  # the storage's own address: shared by every view of it, on any device
        if self._existing and (key, storage.data_ptr()) in self._existing:
            return
        if key not in self._storage_bytes:
            self._storage_bytes[key] = storage.nbytes()
            self.storage_sizes.add(storage.nbytes())
            self._tensor_counts[key] = 0
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._tensor_counts[key] += 1
        weakref.finalize(tensor, self._forget, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for value in tree_flatten(result)[0]:
            if isinstance(value, torch.Tensor):
                self._track(value)
        return result

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        self.peak_bytes = self.live_bytes

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record in ``phase_peaks[name]`` the peak reached inside this span (the overall peak is kept)."""
        overall = self.peak_bytes
        self.peak_bytes = self.live_bytes
        try:
            yield
        finally:
            self.phase_peaks[name] = max(self.phase_peaks.get(name, 0), self.peak_bytes)
            self.peak_bytes = max(overall, self.peak_bytes)


class ConvolutionShapes(TorchDispatchMode):
    """The distinct convolutions run while active (``shapes``: ``(input shape, weight shape, stride, padding)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution.default:
            image, weight, _, stride, padding = args[:5]
            self.shapes.add((tuple(image.shape), tuple(weight.shape), tuple(stride), tuple(padding)))
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class MetaTrace:
    """What one run did (:func:`meta_trace`): the peak bytes of the tensors it created (its result included),
    their distinct storage sizes and its distinct convolutions (:class:`ConvolutionShapes`)."""

    peak_bytes: int
    storage_sizes: frozenset
    convolutions: frozenset


def meta_trace(run: Callable[[], object]) -> MetaTrace:
    """Run ``run`` once (e.g. on meta tensors) under a :class:`TensorMemoryTracker` and a
    :class:`ConvolutionShapes` recorder."""
    with torch.inference_mode(), TensorMemoryTracker() as tracker, ConvolutionShapes() as convolutions:
        result = run()
        del result
    return MetaTrace(tracker.peak_bytes, frozenset(tracker.storage_sizes), frozenset(convolutions.shapes))


__all__ = ["ConvolutionShapes", "MetaTrace", "TensorMemoryTracker", "meta_trace"]
