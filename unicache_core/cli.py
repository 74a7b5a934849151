"""Command-line helpers of the library's commands: one-line errors, non-empty path arguments, and single-value
flags that refuse to be given twice. They live in :mod:`unicache_commands.flags` (standard library only, shared with
the batch runner, which runs without the library); this module keeps the library's name for them."""

from __future__ import annotations

from unicache_commands.flags import OneLineParser, SingleValueAction, path_arg, refuse_repeated_flags

__all__ = ["OneLineParser", "SingleValueAction", "path_arg", "refuse_repeated_flags"]
