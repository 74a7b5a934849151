"""Command-line helpers shared by the project's tools: one-line errors, non-empty path arguments."""

from __future__ import annotations

import argparse
from pathlib import Path


class OneLineParser(argparse.ArgumentParser):
    """argparse with the one-line error format of every tool here (``error: ...``, exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"error: {' '.join(message.split())} (see {self.prog} --help)\n")


def path_arg(value: str) -> Path:
    """A path argument; the empty string is refused (``Path('')`` would silently mean the current folder)."""
    if not value:
        raise argparse.ArgumentTypeError("empty path ''")
    return Path(value)


__all__ = ["OneLineParser", "path_arg"]
