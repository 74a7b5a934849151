"""Shared fixtures: a tiny random BAGEL checkpoint in the official folder layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.tiny import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of a tiny BAGEL checkpoint folder (written once per test session, seed 0).

    Treat it as read-only; tests that corrupt files must copy it first (see ``tiny_checkpoint_copy``).
    """
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_bagel"), seed=0)


@pytest.fixture
def tiny_checkpoint_copy(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    """A private, writable copy of the tiny checkpoint for tests that modify or delete files."""
    import shutil

    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, dst)
    return dst
