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
