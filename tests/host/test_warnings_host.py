"""Inputs that speak, on the real host (issue 52): an empty Text Item in the shipped iterative edit runs and warns
on the Text Item and on both edits (in ``/history``'s UI outputs, which the frontend draws on the nodes, and in the
host's log); the two-image edit warns that the bundled model was trained on one image per request; every workflow
saved by the previous (V1) version of the pack runs on today's V3 nodes; and, in the real frontend, the empty Text
Item's warning is shown on the node (headless chromium)."""

from __future__ import annotations

import json
import shutil

import pytest
from hostlib import BROWSER_DIR, REPO, SCREENSHOTS, describe, load_api_workflow, run_in_browser

pytestmark = pytest.mark.host

OLD = REPO / "tests" / "old_workflows"
#: The iterative edit's Text Item (its text is Edit 1's prompt and part of Edit 2's items) and the two edits.
TEXT_ITEM, EDIT_1, EDIT_2 = "5", "6", "7"


def _warnings(entry: dict, node: str) -> list[str]:
    return entry["outputs"].get(node, {}).get("unicache_warnings", [])


def test_empty_text_item_runs_and_warns(comfy):
    prompt = load_api_workflow("iterative_edit")
    prompt[TEXT_ITEM]["inputs"]["text"] = ""
    entry = comfy.run(prompt)
    assert entry["status"]["status_str"] == "success", describe(entry)
    assert any("this Text Item is empty" in w for w in _warnings(entry, TEXT_ITEM)), entry["outputs"]
    assert any("the prompt is empty" in w for w in _warnings(entry, EDIT_1)), entry["outputs"]
    assert any("items[1] (a text item) is empty" in w for w in _warnings(entry, EDIT_2)), entry["outputs"]
    assert "Text Item: this Text Item is empty" in comfy.log.read_text(encoding="utf-8", errors="replace")


def test_shipped_iterative_edit_warns_only_about_the_models_training(comfy):
    entry = comfy.run(load_api_workflow("iterative_edit"))
    assert entry["status"]["status_str"] == "success", describe(entry)
    assert _warnings(entry, TEXT_ITEM) == [] and _warnings(entry, EDIT_1) == []
    (line,) = _warnings(entry, EDIT_2)
    assert "2 images in one request, but this checkpoint was trained on 1 per request" in line


@pytest.mark.parametrize("name", sorted(p.stem for p in (OLD / "api").glob("*.json")))
def test_workflows_saved_by_the_v1_pack_run(comfy, name):
    entry = comfy.run(json.loads((OLD / "api" / f"{name}.json").read_text()))
    assert entry["status"]["status_str"] == "success", describe(entry)


@pytest.mark.browser
def test_frontend_shows_the_empty_text_items_warning_on_the_node(comfy):
    assert shutil.which("node") and (BROWSER_DIR / "node_modules" / "playwright-core").is_dir(), (
        "node or playwright-core missing: run `make browser-deps`"
    )
    status, _ = comfy.request("POST", "/settings/Comfy.TutorialCompleted", True)
    assert status == 200
    workflow = REPO / "workflows" / "iterative_edit.json"
    shot = SCREENSHOTS / "iterative_edit_empty_text_item.png"
    edits = json.dumps({TEXT_ITEM: {"text": ""}})
    result = run_in_browser(comfy.url, workflow, shot, 900, edits)
    assert result["edited"] == [f"{TEXT_ITEM}.text"] and result["status"] == "success", result
    shown = {str(w["id"]): w for w in result["warnings"]}
    assert "this Text Item is empty" in shown[TEXT_ITEM]["text"] and shown[TEXT_ITEM]["shown"], result["warnings"]
    assert "the prompt is empty" in shown[EDIT_1]["text"], result["warnings"]
    assert shot.is_file() and shot.stat().st_size > 10_000
