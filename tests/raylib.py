"""Helpers for the Ray tests: a local Ray cluster in its own temp folder, and a check that none of its
processes (nor the ComfyUI hosts its workers started there) outlive it."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


def processes_mentioning(text: str) -> list[str]:
    """``pid: command line`` of every live process whose command line contains ``text``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in line:
            found.append(f"{cmdline.parent.name}: {line[:200]}")
    return found


def wait_until_gone(text: str, seconds: float = 20.0) -> list[str]:
    """The processes still mentioning ``text`` after waiting up to ``seconds`` for them to end."""
    deadline = time.monotonic() + seconds
    while (left := processes_mentioning(text)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@contextlib.contextmanager
def ray_temp_dir(prefix: str) -> Iterator[str]:
    """A short temp folder (Ray's socket paths must stay under 107 characters) as RAY_TMPDIR while open;
    on exit, fails if any process still names it, then removes it."""
    temp = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp
    try:
        yield temp
    finally:
        if saved is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved
        left = wait_until_gone(temp)
        shutil.rmtree(temp, ignore_errors=True)
        assert left == [], f"processes left behind in {temp}: {left}"


@contextlib.contextmanager
def local_cluster(head: dict, *nodes: dict) -> Iterator:
    """A Ray cluster on this machine: a head node with ``head`` settings (num_cpus, num_gpus, ...) and one
    more node per ``nodes`` entry (``env_vars`` give that node's workers their own environment); shut down and
    checked for stray processes on exit."""
    from ray.cluster_utils import Cluster

    with ray_temp_dir("ubr-") as temp:
        cluster = Cluster(initialize_head=True, head_node_args={"include_dashboard": False, **head})
        try:
            for node in nodes:
                cluster.add_node(**node)
            cluster.temp = temp
            yield cluster
        finally:
            cluster.shutdown()
