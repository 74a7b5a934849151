"""``make thumbnails`` end to end on the real host: every shipped API workflow run as ``make demo`` runs it (the batch
runner, one run, seed 42), then ``python -m tools.thumbnails`` over that output makes one strip per workflow with
the panels of the README's committed thumbnails (same count and sizes; the pixels are the host's)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hostlib import REPO
from PIL import Image

pytestmark = pytest.mark.host

WORKFLOWS = sorted((REPO / "workflows" / "api").glob("*.json"))


def test_demo_outputs_make_the_readmes_thumbnails(comfy, tmp_path):
    demo = tmp_path / "demo"
    for workflow in WORKFLOWS:
        out = demo / workflow.stem
        proc = subprocess.run(
            [sys.executable, "-m", "tools.batch", str(workflow), "--host", comfy.url, "--count", "1"]
            + ["--seed-start", "42", "--out", str(out), "--summary", str(out / "summary.json")],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
    images = tmp_path / "images"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.thumbnails", "--demo", str(demo), "--out", str(images)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for workflow in WORKFLOWS:
        made = images / f"demo_{workflow.stem}.png"
        with Image.open(made) as image, Image.open(REPO / "docs" / "images" / made.name) as committed:
            assert image.size == committed.size, made.name
