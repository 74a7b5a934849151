"""tools/batch --ray with real ComfyUI hosts on a local two-node Ray cluster (CPU only, this machine).

The head node takes two workers of 2 CPUs each (``--cpus-per-worker 2``: Ray sets each host's
OMP_NUM_THREADS to 2, the thread count of the plain host on this 2-core machine, so CPU results can match bit
for bit), each starting its own host with the pack; the second node has no ComfyUI installed (its workers see
COMFYHOST_DIR pointing at an empty folder), so the third worker cannot start a host and must say why. The
shipped edit workflow must give the same images as the plain single-host path at the same seeds; a host
killed mid-batch must cost no run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hostlib import REPO, WORKFLOWS_API, Comfy
from PIL import Image

sys.path.insert(0, str(REPO / "tests"))
from raylib import local_cluster, processes_mentioning  # noqa: E402  (tests/raylib.py)

pytestmark = pytest.mark.host
HOST_LINE = re.compile(r"worker (\d+) \(node (\w+)\): ComfyUI host (http://[\d.:]+) \(pid (\d+)")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    no_comfyui = tmp_path_factory.mktemp("no-comfyui")
    with local_cluster({"num_cpus": 4}, {"num_cpus": 2, "env_vars": {"COMFYHOST_DIR": str(no_comfyui)}}) as c:
        c.no_comfyui = no_comfyui
        yield c


class Batch:
    """``python -m tools.batch ...`` in a subprocess, its output collected line by line while it runs."""

    def __init__(self, *args: str):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tools.batch", *args],
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait(self, timeout: float = 900) -> tuple[int, str]:
        try:
            rc = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self._reader.join(10)
        return rc, "\n".join(self.lines)

    def hosts(self, count: int, timeout: float = 300) -> list[tuple[int, str, int]]:
        """(worker, url, pid) of the first ``count`` workers that report a ready host."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [m for line in list(self.lines) if (m := HOST_LINE.search(line))]
            if len(found) >= count:
                return [(int(m[1]), m[3], int(m[4])) for m in found[:count]]
            assert self.proc.poll() is None, "\n".join(self.lines)
            time.sleep(0.2)
        raise AssertionError("workers not ready:\n" + "\n".join(self.lines))


def edit_pixels(run_dir: Path) -> np.ndarray:
    (png,) = sorted(run_dir.glob("node5_0_*.png"))  # the SaveImage node of workflows/api/image_edit.json
    return np.asarray(Image.open(png))


def ray_args(cluster) -> list[str]:
    """Three workers of 2 CPUs on the cluster: two on the head node, one on the node without ComfyUI."""
    return ["--ray", "--address", cluster.address, *"--workers 3 --cpus-per-worker 2".split()]


def check_workers(summary: dict, cluster) -> set[int]:
    """Two workers with a host on the head node, the third reporting why it has none; the good ones' ids."""
    workers = summary["ray"]["workers"]
    assert len(workers) == 3, workers
    broken = [w for w in workers if w.get("error")]
    assert len(broken) == 1 and f"no ComfyUI host in {cluster.no_comfyui}" in broken[0]["error"], workers
    good = [w for w in workers if not w.get("error")]
    assert all(w["node"] == cluster.head_node.node_id and w["host"] for w in good), workers
    return {w["worker"] for w in good}


def test_shipped_edit_on_two_ray_workers_matches_the_single_host_path(comfy, cluster, tmp_path):
    wf, common = str(WORKFLOWS_API / "image_edit.json"), "--count 6 --seed-start 100 --poll 0.2".split()
    t0 = time.monotonic()
    rc, log = Batch(wf, *ray_args(cluster), "--out", str(tmp_path / "ray"), *common).wait()
    ray_s = time.monotonic() - t0
    assert rc == 0, log
    assert "cannot start its host: no ComfyUI host in" in log and "the batch goes on without it" in log, log
    t0 = time.monotonic()
    rc, log_single = Batch(wf, "--host", comfy.url, "--depth", "1", "--out", str(tmp_path / "one"), *common).wait()
    single_s = time.monotonic() - t0
    assert rc == 0, log_single
    ray_summary = json.loads((tmp_path / "ray" / "summary.json").read_text())
    one_summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    good = check_workers(ray_summary, cluster)
    assert {r["worker"] for r in ray_summary["runs"]} == good, "both workers with a host must take runs"
    for ray_run, one_run in zip(ray_summary["runs"], one_summary["runs"]):
        assert ray_run["seed"] == one_run["seed"] and ray_run["status"] == "success" and ray_run["attempts"] == 1
        assert ray_run["node"] == cluster.head_node.node_id and ray_run["kv_bytes_saved"] == one_run["kv_bytes_saved"]
        index = f"{ray_run['index']:04d}"
        assert np.array_equal(edit_pixels(tmp_path / "ray" / index), edit_pixels(tmp_path / "one" / index)), index
    assert [p for p in processes_mentioning(cluster.temp + "/") if "main.py" in p] == [], "a host outlived the batch"
    print(
        f"\n6 edits: Ray (2 workers, hosts started) {ray_s:.1f} s, one host {single_s:.1f} s; "
        f"Ray connect {ray_summary['ray']['startup_s']} s, host ready "
        f"{[w['ready_s'] for w in ray_summary['ray']['workers'] if not w.get('error')]} s"
    )


def test_host_killed_mid_batch_costs_no_run(cluster, tmp_path):
    """SIGKILL one worker's host while it runs a prompt: Ray restarts that worker and retries the run."""
    graph = json.loads((WORKFLOWS_API / "image_edit.json").read_text())
    graph["4"]["inputs"]["steps"] = 80  # long enough to be caught running (24 steps take about 2 s alone)
    wf = tmp_path / "edit_long.json"
    wf.write_text(json.dumps(graph))
    options = "--count 4 --seed-start 7 --poll 0.2".split()
    batch = Batch(str(wf), *ray_args(cluster), "--out", str(tmp_path / "out"), *options)
    try:
        worker, url, pid = batch.hosts(2)[0]
        victim = Comfy(url, tmp_path, tmp_path / "no.log")
        deadline = time.monotonic() + 300
        while not victim.get("/queue")["queue_running"]:
            assert time.monotonic() < deadline and batch.proc.poll() is None, "\n".join(batch.lines)
            time.sleep(0.1)
        time.sleep(1.0)
        os.kill(pid, signal.SIGKILL)  # the host our batch's worker started, by its PID
    finally:
        rc, log = batch.wait()
    assert rc == 0, log
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["succeeded"] == 4, json.dumps(s["runs"], indent=1)
    retried = [r for r in s["runs"] if r["retries"]]
    assert len(retried) == 1, json.dumps(s["runs"], indent=1)
    run = retried[0]
    assert run["worker"] == worker and run["attempts"] == 2 and run["hosts_tried"][0] == url, run
    assert run["host"] != url and f"host {url} went away" in run["retries"][0], run
    assert "Ray restarts the worker and retries the run" in log, log
    check_workers(s, cluster)
    assert [p for p in processes_mentioning(cluster.temp + "/") if "main.py" in p] == [], "a host outlived the batch"
