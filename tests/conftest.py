"""Shared fixtures: a tiny random BAGEL checkpoint in the official folder layout, and one torch thread per
unit-test process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from training.tiny import write_tiny_checkpoint

from comfy_stubs import install_v3_stub  # isort: skip  (tests/ is on sys.path: rootdir conftest)

install_v3_stub()  # the nodes derive from ComfyUI's V3 base: a stand-in when no ComfyUI is importable


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Unit tests run torch's CPU kernels on one thread, from their fixtures' setup to their teardown, and so
    do the processes they start (``OMP_NUM_THREADS=1``: the CLI, fresh interpreters).

    ``make test`` runs one pytest process per core, so more threads per process only oversubscribe the
    cores: on this 2-core machine two threads per worker cost several times the CPU of one (the threads
    spin waiting on each other) for the same results. Host and browser tests keep torch's default thread
    count: they compare what their ComfyUI servers compute bit for bit across thread-count-matched runs.
    """
    if item.get_closest_marker("host") or item.get_closest_marker("browser"):
        return (yield)
    saved_threads, saved_env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        return (yield)
    finally:
        torch.set_num_threads(saved_threads)
        if saved_env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved_env


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``heavy`` run first, the others in their usual order.

    pytest-xdist hands tests (or ``xdist_group``s) to its workers in collection order; a minute-long test
    collected last would run on one worker while the other sits idle (longest first evens the load out).
    """
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


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
