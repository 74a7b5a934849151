"""The real ComfyUI frontend in headless Debian chromium (playwright-core from npm, tests/host/browser/).

Loads a shipped UI workflow through ``app.loadGraphData``, queues it, waits for the prompt and for the
pack's KV chart (web/unicache.js), saves a screenshot to ``out/screenshots/`` and checks that no node type
is missing (no missing-nodes dialog). Needs ``make browser-deps`` (apt chromium, ``npm ci``); if chromium or
node_modules are absent the test fails and says so (it is never skipped).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hostlib import BROWSER_DIR, REPO, SCREENSHOTS, WORKFLOWS_UI, run_in_browser

pytestmark = [pytest.mark.host, pytest.mark.browser]

CHROMIUM = "/usr/bin/chromium"
UI_WORKFLOW = "text_to_image"


def test_frontend_runs_shipped_ui_workflow(comfy):
    assert shutil.which("node"), "node is not installed"
    assert (BROWSER_DIR / "node_modules" / "playwright-core").is_dir(), (
        "playwright-core missing: run `make browser-deps` (npm ci in tests/host/browser)"
    )
    assert Path(CHROMIUM).exists() or shutil.which("chromium"), (
        "Debian chromium missing: run `make browser-deps` (apt-get install -y chromium)"
    )
    workflow = WORKFLOWS_UI / f"{UI_WORKFLOW}.json"
    assert workflow.is_file(), f"shipped UI workflow {workflow.relative_to(REPO)} is missing"
    # Skip the first-run Templates dialog (docs/comfyui.md Appendix B).
    status, _ = comfy.request("POST", "/settings/Comfy.TutorialCompleted", True)
    assert status == 200
    shot = SCREENSHOTS / f"{UI_WORKFLOW}.png"
    result = run_in_browser(comfy.url, workflow, shot, 600)
    print(json.dumps({k: v for k, v in result.items() if k != "console_errors"}, indent=1))
    assert result["missing"] == [], f"node types unknown to the frontend: {result['missing']}"
    assert not any("missing" in d.lower() for d in result["dialogs"]), result["dialogs"]
    assert sorted(result["graph_nodes"]) == sorted(n["type"] for n in json.loads(workflow.read_text())["nodes"]), (
        "the workflow did not load whole"
    )
    assert result["status"] == "success", result
    reports = result["report_nodes"]
    assert reports, "no UniCacheKVReport node in the graph"
    assert all(r["has_chart_data"] or r["chart_canvases"] for r in reports) or result["chart_elements"], (
        f"the KV report node shows no chart after execution (web/unicache.js): {reports}"
    )
    assert shot.is_file() and shot.stat().st_size > 10_000
