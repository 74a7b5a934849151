"""Exceptions raised by :mod:`unicache_core`.

Every error names the offending value and says what to do about it.
"""

from __future__ import annotations


class UniCacheError(Exception):
    """Base class of every error raised on purpose by this library."""


class CheckpointError(UniCacheError):
    """A checkpoint folder is missing files, has corrupt files or does not match its config."""


class CancelledError(UniCacheError):
    """A long-running call (denoising, decoding) was cancelled between steps by the caller."""


class NumericalError(UniCacheError):
    """A tensor that must be finite holds NaN or infinite values (weights, noise, logits, velocities, pixels).

    Raised where the non-finite values first appear, instead of letting them become an image or a text;
    the message names the tensor (or the step and branch) and says what to change (dtype, scale, file).
    """


class NonFiniteKVError(NumericalError, ValueError):
    """Keys or values handed to the KV cache hold NaN or infinite values (the model overflowed before the cache:
    fp16's range is ±65504). ``count``: how many. The engine re-raises it as a :class:`NumericalError` naming the
    step; it is a ``ValueError`` too, as the KV core's other refusals of bad input are."""

    def __init__(self, message: str, count: int = 0):
        super().__init__(message)
        self.count = count
