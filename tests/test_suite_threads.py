"""The unit suite's process settings (tests/conftest.py): torch on one thread, in the test and its children."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def test_a_unit_test_and_the_processes_it_starts_use_one_torch_thread():
    assert torch.get_num_threads() == 1
    assert os.environ["OMP_NUM_THREADS"] == "1"
    child = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert child.stdout.strip() == "1"


@pytest.mark.xdist_group("suite_settings")
def test_an_xdist_group_stays_on_one_worker(request):
    """Under ``make test`` (``--dist loadgroup``) a test marked ``xdist_group`` carries its group in its node id,
    which is how xdist keeps the group's tests (and their module fixtures: one Ray cluster, one import probe) on
    one worker. pytest 9.2.0 moved node ids where xdist 3.8.0 no longer writes them and the groups were silently
    split; pyproject.toml pins a pytest that keeps them."""
    if getattr(request.config.option, "loadgroup", False):  # set in xdist workers of a --dist loadgroup run
        assert request.node.nodeid.endswith("@suite_settings"), request.node.nodeid
