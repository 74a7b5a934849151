"""The unit suite's process settings (tests/conftest.py): torch on one thread, in the test and its children."""

from __future__ import annotations

import os
import subprocess
import sys

import torch


def test_a_unit_test_and_the_processes_it_starts_use_one_torch_thread():
    assert torch.get_num_threads() == 1
    assert os.environ["OMP_NUM_THREADS"] == "1"
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, check=True, timeout=120)
    assert child.stdout.strip() == "1"
