"""``make thumbnails`` end to end on the real host: every shipped API workflow run as ``make demo`` runs it (the batch
runner, one run, seed 42), then ``python -m tools.thumbnails`` over that output makes one strip per workflow with
the panels of the README's committed thumbnails (same count and sizes; the pixels are the host's) and the template
browser's card beside each UI workflow; the host serves those cards where ComfyUI's frontend looks for them."""

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
    images, templates = tmp_path / "images", tmp_path / "templates"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.thumbnails", "--demo", str(demo), "--out", str(images)]
        + ["--templates", str(templates)],
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
        with Image.open(templates / f"{workflow.stem}.jpg") as card:
            assert card.format == "JPEG" and card.size == (320, 320), workflow.stem
        assert (REPO / "workflows" / f"{workflow.stem}.jpg").is_file(), (
            f"workflows/{workflow.stem}.jpg: run make thumbnails"
        )


def test_template_browser_finds_every_workflow_with_its_picture(comfy):
    """Frontend 1.32 lists a pack's example workflows from ``/api/workflow_templates`` and shows each with
    ``/api/workflow_templates/<pack>/<name>.jpg``."""
    status, listing = comfy.request("GET", "/api/workflow_templates")
    assert status == 200
    (pack,) = [p for p, names in listing.items() if "iterative_edit" in names]
    assert sorted(listing[pack]) == sorted(w.stem for w in WORKFLOWS)
    for workflow in WORKFLOWS:
        status, body, kind = comfy.get_bytes(f"/api/workflow_templates/{pack}/{workflow.stem}.jpg")
        assert status == 200 and kind == "image/jpeg", (workflow.stem, status, kind)
        assert body == (REPO / "workflows" / f"{workflow.stem}.jpg").read_bytes()
