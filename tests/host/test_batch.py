"""tools/batch.py against two real ComfyUI hosts on this machine (two ports): spreading and retry."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hostlib import REPO, Comfy, comfyhost, small_size, t2i_graph

pytestmark = pytest.mark.host


def _start(tmp_path_factory, name: str) -> comfyhost.Host:
    base = comfyhost.prepare_base(tmp_path_factory.mktemp(name))
    try:
        return comfyhost.start(base, timeout=240)
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="module")
def two_hosts(comfy, tmp_path_factory):
    """Two more hosts (the session host stays untouched); stopped at the end of the module."""
    hosts = [_start(tmp_path_factory, f"batchhost{i}") for i in range(2)]
    yield hosts
    for h in hosts:
        comfyhost.stop(h)


@pytest.fixture(scope="module")
def workflow_file(comfy, tmp_path_factory) -> Path:
    info = comfy.object_info()
    graph = t2i_graph(info, "bagel-tiny", steps=12, **small_size(info, "UniCacheTextToImage"))
    path = tmp_path_factory.mktemp("batchwf") / "t2i_small.json"
    path.write_text(json.dumps(graph))
    return path


def _batch(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tools.batch", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def test_four_prompts_on_two_hosts(two_hosts, workflow_file, tmp_path):
    out, summary = tmp_path / "out", tmp_path / "summary.json"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# one prompt a line\na red square\na blue circle\n")
    args = [
        str(workflow_file),
        "--count",
        "4",
        "--seed-start",
        "100",
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--summary",
        str(summary),
        "--depth",
        "1",
    ]
    for h in two_hosts:
        args += ["--host", h.url]
    proc = _batch(args)
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, log
    s = json.loads(summary.read_text())
    assert s["succeeded"] == 4, json.dumps(s, indent=1)
    assert {r["host"] for r in s["runs"]} == {h.url for h in two_hosts}, "both hosts must be used"
    assert [r["seed"] for r in s["runs"]] == [100, 101, 102, 103]
    assert [r["prompt_text"] for r in s["runs"]] == ["a red square", "a blue circle"] * 2
    for r in s["runs"]:
        assert r["status"] == "success" and r["seconds"] > 0
        assert r["kv_bytes_saved"] is not None, f"no KV bytes from the report node: {r}"
        pngs = [p for p in r["outputs"] if p.endswith(".png")]
        assert pngs and all(Path(p).stat().st_size > 0 for p in pngs), r["outputs"]
    print(log.strip().splitlines()[-1])


def test_host_killed_mid_run_is_retried(two_hosts, workflow_file, tmp_path_factory, tmp_path):
    """Kill one host while its run executes: that run (and its queue) finish on the other host."""
    survivor = two_hosts[0]
    victim = _start(tmp_path_factory, "victim")
    info = Comfy(survivor.url, Path(survivor.base), Path(survivor.log)).object_info()
    graph = t2i_graph(info, "bagel-tiny", steps=60, **small_size(info, "UniCacheTextToImage"))
    wf = tmp_path / "t2i_long.json"
    wf.write_text(json.dumps(graph))
    out, summary = tmp_path / "out", tmp_path / "summary.json"
    proc = _batch(
        [
            str(wf),
            "--count",
            "4",
            "--seed-start",
            "5",
            "--out",
            str(out),
            "--summary",
            str(summary),
            "--host",
            victim.url,
            "--host",
            survivor.url,
            "--depth",
            "2",
        ]
    )
    try:
        deadline = time.monotonic() + 300
        victim_client = Comfy(victim.url, Path(victim.base), Path(victim.log))
        while time.monotonic() < deadline:  # wait until the victim executes one of our runs
            if victim_client.get("/queue")["queue_running"]:
                break
            assert proc.poll() is None, proc.communicate()[0]
            time.sleep(0.1)
        else:
            raise AssertionError("the victim host never ran a prompt")
        time.sleep(0.5)
        os.kill(victim.pid, signal.SIGKILL)  # our own host process, by PID
        log, _ = proc.communicate(timeout=900)
    finally:
        comfyhost.stop(victim)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, log
    s = json.loads(summary.read_text())
    assert s["succeeded"] == 4, json.dumps(s, indent=1)
    retried = [r for r in s["runs"] if r["hosts_tried"][0] == victim.url]
    assert retried, f"no run was on the victim: {json.dumps(s, indent=1)}"
    for r in retried:
        assert r["host"] == survivor.url and r["attempts"] >= 2, r
    assert "went away" in log, log
