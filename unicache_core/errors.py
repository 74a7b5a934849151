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
