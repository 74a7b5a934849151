"""Helpers for the host tests: an HTTP client for one ComfyUI server and API graphs built from a live
``/object_info`` (widget defaults filled in)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import comfyhost  # noqa: E402  (tools/comfyhost.py)

WORKFLOWS_API = REPO / "workflows" / "api"
WORKFLOWS_UI = REPO / "workflows"
#: docs/nodepack-contract.md: shipped workflows (both formats) for t2i, edit, understand and an A/B edit.
CONTRACT_TASK_NODES = ("UniCacheTextToImage", "UniCacheImageEdit", "UniCacheUnderstand")
PROMPT_TIMEOUT = float(os.environ.get("COMFYHOST_PROMPT_TIMEOUT", "900"))


# --------------------------------------------------------------------------------------------- client


class Comfy:
    """A small HTTP client for one ComfyUI server (stdlib only)."""

    def __init__(self, url: str, base: Path, log: Path):
        self.url, self.base, self.log = url, Path(base), Path(log)
        self.client_id = uuid.uuid4().hex

    def request(self, method: str, path: str, body=None, timeout: float = 60.0) -> tuple[int, object]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw, status = r.read(), r.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw

    def get(self, path: str, timeout: float = 60.0):
        status, body = self.request("GET", path, timeout=timeout)
        assert status == 200, f"GET {path}: HTTP {status}: {body!r:.500}"
        return body

    def get_bytes(self, path: str) -> tuple[int, bytes, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=60) as r:
                return r.status, r.read(), r.headers.get("Content-Type", "")
        except urllib.error.HTTPError as e:
            return e.code, e.read(), ""

    def object_info(self) -> dict:
        return self.get("/object_info")

    def queue(self, prompt: dict, **extra) -> tuple[int, dict]:
        """POST /prompt; returns (HTTP status, body)."""
        return self.request("POST", "/prompt", {"prompt": prompt, "client_id": self.client_id, **extra})

    def submit(self, prompt: dict) -> str:
        status, body = self.queue(prompt)
        assert status == 200, f"/prompt refused the graph: HTTP {status}: {json.dumps(body)[:3000]}"
        assert not body.get("node_errors"), body
        return body["prompt_id"]

    def wait(self, prompt_id: str, timeout: float = PROMPT_TIMEOUT) -> dict:
        """Poll /history/<id> until the prompt is done; return its history entry."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hist = self.get(f"/history/{prompt_id}")
            if prompt_id in hist and hist[prompt_id].get("status", {}).get("completed") is not None:
                entry = hist[prompt_id]
                if entry["status"].get("status_str") in ("success", "error"):
                    return entry
            time.sleep(0.2)
        raise AssertionError(
            f"prompt {prompt_id} not finished after {timeout} s; log tail:\n" + comfyhost.log_tail(self.log)
        )

    def run(self, prompt: dict, timeout: float = PROMPT_TIMEOUT) -> dict:
        return self.wait(self.submit(prompt), timeout)

    def view(self, image: dict) -> bytes:
        q = urllib.parse.urlencode(
            {
                "filename": image["filename"],
                "subfolder": image.get("subfolder", ""),
                "type": image.get("type", "output"),
            }
        )
        status, data, _ = self.get_bytes("/view?" + q)
        assert status == 200, f"/view {image}: HTTP {status}"
        return data


#: The browser test's playwright script (tests/host/browser/run_workflow.mjs) and where its screenshots go.
BROWSER_DIR = REPO / "tests" / "host" / "browser"
SCREENSHOTS = REPO / "out" / "screenshots"


def run_in_browser(url: str, workflow: Path, shot: Path, seconds: int, edits: str | None = None) -> dict:
    """Load ``workflow`` (UI format) in the frontend at ``url`` in headless Chromium, apply ``edits`` (JSON of
    ``{node id: {widget: value}}``), queue it, wait up to ``seconds`` for it, screenshot into ``shot``; the script's
    JSON result (loaded nodes, missing types, dialogs, status, warnings shown). A failing script fails the test."""
    command = ["node", "run_workflow.mjs", url, str(workflow), str(shot), str(seconds)] + ([edits] if edits else [])
    proc = subprocess.run(command, cwd=BROWSER_DIR, capture_output=True, text=True, timeout=seconds + 300)
    assert proc.returncode == 0, f"browser script failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def messages(entry: dict, kind: str) -> list[dict]:
    """The payloads of history status messages of one kind (execution_error, execution_cached, ...)."""
    return [m[1] for m in entry.get("status", {}).get("messages", []) if m[0] == kind]


def describe(entry: dict) -> str:
    err = messages(entry, "execution_error")
    if err:
        e = err[0]
        return (
            f"{e.get('node_type')} (node {e.get('node_id')}): {e.get('exception_type')}: "
            f"{e.get('exception_message')}\n{''.join(e.get('traceback', []))[-3000:]}"
        )
    return json.dumps(entry.get("status"))[:2000]


def load_api_workflow(name: str) -> dict:
    path = WORKFLOWS_API / f"{name}.json"
    assert path.is_file(), f"shipped API workflow {path.relative_to(REPO)} is missing (docs/nodepack-contract.md)"
    return json.loads(path.read_text())


def find_nodes(prompt: dict, class_type: str) -> list[str]:
    return [nid for nid, node in prompt.items() if node.get("class_type") == class_type]


def retarget_checkpoint(prompt: dict, name: str) -> dict:
    """A copy of ``prompt`` whose loader nodes use checkpoint ``name``."""
    prompt = json.loads(json.dumps(prompt))
    for nid in find_nodes(prompt, "UniCacheBagelLoader"):
        prompt[nid]["inputs"]["checkpoint"] = name
    return prompt


def set_inputs(prompt: dict, class_type: str, **values) -> dict:
    prompt = json.loads(json.dumps(prompt))
    nids = find_nodes(prompt, class_type)
    assert nids, f"no {class_type} node in the workflow"
    for nid in nids:
        prompt[nid]["inputs"].update(values)
    return prompt


# ------------------------------------------------------------------------------------------- graphs

WIDGETS = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


def spec_options(spec) -> tuple[object, dict]:
    kind = spec[0]
    opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    return kind, opts


def combo_options(spec) -> list | None:
    kind, opts = spec_options(spec)
    if isinstance(kind, list):
        return kind
    if kind == "COMBO":
        return list(opts.get("options", []))
    return None


def widget_default(spec):
    kind, opts = spec_options(spec)
    choices = combo_options(spec)
    if choices is not None:
        return opts.get("default", choices[0] if choices else None)
    if "default" in opts:
        return opts["default"]
    return {"INT": opts.get("min", 0), "FLOAT": opts.get("min", 0.0), "STRING": "", "BOOLEAN": False}[kind]


def node(info: dict, class_type: str, links: dict | None = None, **values) -> dict:
    """One API node: every required widget at its default, then ``values``, then ``links`` (sockets)."""
    assert class_type in info, f"{class_type} is not listed by /object_info (did the pack import?)"
    inputs = {}
    for name, spec in info[class_type]["input"].get("required", {}).items():
        kind = spec[0]
        if isinstance(kind, list) or kind in WIDGETS:
            inputs[name] = widget_default(spec)
    inputs.update(values)
    inputs.update(links or {})
    return {"class_type": class_type, "inputs": inputs}


def checkpoint_choice(info: dict, want: str) -> str:
    """The loader combo entry naming checkpoint ``want`` (folder or single file)."""
    choices = combo_options(info["UniCacheBagelLoader"]["input"]["required"]["checkpoint"]) or []
    for c in choices:
        stem = c.rsplit("/", 1)[-1]
        if stem in (want, want + ".safetensors"):
            return c
    raise AssertionError(f"checkpoint {want!r} is not offered by UniCacheBagelLoader (offered: {choices})")


def understand_graph(
    info: dict, checkpoint: str, prompt: str = "Describe the picture.", kv: dict | None = None, **understand
) -> dict:
    """Loader -> KVConfig -> Understand -> KVReport (no image: a text-only question)."""
    understand.setdefault("max_new_tokens", 8)
    return {
        "1": node(info, "UniCacheBagelLoader", checkpoint=checkpoint_choice(info, checkpoint)),
        "2": node(info, "UniCacheKVConfig", **(kv or {})),
        "3": node(info, "UniCacheUnderstand", {"model": ["1", 0], "kv": ["2", 0]}, prompt=prompt, **understand),
        "4": node(info, "UniCacheKVReport", {"report": ["3", 1]}),
    }


def t2i_graph(info: dict, checkpoint: str, prompt: str = "a red square", **t2i) -> dict:
    """Loader -> KVConfig -> TextToImage -> SaveImage, plus KVReport on its report."""
    return {
        "1": node(info, "UniCacheBagelLoader", checkpoint=checkpoint_choice(info, checkpoint)),
        "2": node(info, "UniCacheKVConfig"),
        "3": node(info, "UniCacheTextToImage", {"model": ["1", 0], "kv": ["2", 0]}, prompt=prompt, **t2i),
        "4": node(info, "SaveImage", {"images": ["3", 0]}, filename_prefix="unicache_host_test"),
        "5": node(info, "UniCacheKVReport", {"report": ["3", 3]}),
    }


def small_size(info: dict, class_type: str) -> dict:
    """The smallest allowed width/height of a generation node (fast on CPU)."""
    req = info[class_type]["input"]["required"]
    out = {}
    for k in ("width", "height"):
        if k in req:
            out[k] = spec_options(req[k])[1].get("min", 256)
    return out
