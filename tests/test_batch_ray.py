"""tools/batch --ray on a local Ray cluster whose workers attach to fake hosts (tests/fakehost.py): GPU
assignment, Ray's restart and retry of a worker whose host went away, a worker without a host, one-line
reasons, the driver's own local cluster shut down with nothing left behind. No ComfyUI here; the real hosts
are in tests/host/test_batch_ray_hosts.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import ray
from fakehost import Answer, FakeHost
from raylib import local_cluster, ray_temp_dir, wait_until_gone

from tools.batch import cli
from tools.batch.ray_backend import host_device_settings

#: One worker runs this module under pytest-xdist (make test): one Ray cluster at a time on the machine.
pytestmark = pytest.mark.xdist_group("ray")

REPO = Path(__file__).resolve().parents[1]
GRAPH = {
    "1": {"class_type": "UniCacheBagelLoader", "inputs": {"checkpoint": "bagel-tiny"}},
    "3": {"class_type": "UniCacheTextToImage", "inputs": {"model": ["1", 0], "seed": 1, "prompt": "a"}},
    "5": {"class_type": "UniCacheKVReport", "inputs": {"report": ["3", 3]}},
}


@pytest.fixture(scope="module")
def cluster():
    """A one-node Ray cluster (2 CPUs, 2 logical GPUs), shut down at the end and checked for strays."""
    with local_cluster({"num_cpus": 2, "num_gpus": 2}) as c:
        yield c


def ray_batch(cluster, tmp_path, hosts, *extra) -> tuple[int, dict]:
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps(GRAPH))
    out = tmp_path / "out"
    argv = [str(wf), "--ray", "--address", cluster.address, "--out", str(out), "--poll", "0.05", *extra]
    for url in hosts:
        argv += ["--host", url]
    rc = cli.main(argv)
    assert not ray.is_initialized(), "the driver must disconnect from Ray when the batch ends"
    return rc, json.loads((out / "summary.json").read_text())


def test_device_settings_pin_the_host_to_the_workers_gpus():
    assert host_device_settings(["2", "3"]) == ({"CUDA_VISIBLE_DEVICES": "2,3"}, False)
    assert host_device_settings([]) == ({}, True)


def test_workers_get_their_own_gpus_and_share_the_runs(cluster, tmp_path):
    with FakeHost() as a, FakeHost() as b:
        rc, s = ray_batch(cluster, tmp_path, [a.url, b.url], "--gpus-per-worker", "1", "--count", "6")
    assert rc == 0 and s["succeeded"] == 6 and s["backend"] == "ray", s
    workers = s["ray"]["workers"]
    assert sorted(w["gpus"] for w in workers) == [["0"], ["1"]], workers
    assert {w["host"] for w in workers} == {a.url, b.url} and a.prompts + b.prompts == 6
    node = cluster.head_node.node_id
    for run in s["runs"]:
        assert run["node"] == node and run["worker"] in (0, 1) and run["attempts"] == 1, run
        assert run["kv_bytes_saved"] == 600 and len(run["outputs"]) == 3, run
    assert a.prompts and b.prompts, "both workers must take runs"


def test_malformed_answer_is_one_failed_run(cluster, tmp_path):
    first_bad = lambda n: (
        Answer(200, {"no": "id"}) if n == 0 else Answer(200, {"prompt_id": f"p{n}", "number": n, "node_errors": {}})
    )
    with FakeHost(prompt=first_bad) as host:
        rc, s = ray_batch(cluster, tmp_path, [host.url], "--count", "3")
    statuses = [r["status"] for r in s["runs"]]
    assert rc == 1 and statuses == ["failed", "success", "success"], s["runs"]
    assert "no usable prompt_id" in s["runs"][0]["error"] and "\n" not in s["runs"][0]["error"]


def test_worker_whose_host_went_away_is_restarted_and_its_run_retried(cluster, tmp_path):
    """The host hangs up on the first prompt: the worker ends, Ray restarts it and runs the call again."""
    hang_up_first = lambda n: (
        Answer(raw=b"") if n == 0 else Answer(200, {"prompt_id": f"p{n}", "number": n, "node_errors": {}})
    )
    with FakeHost(prompt=hang_up_first) as host:
        rc, s = ray_batch(cluster, tmp_path, [host.url], "--count", "2")
    assert rc == 0 and s["succeeded"] == 2, s
    retried = s["runs"][0]
    assert len(retried["retries"]) == 1 and "went away" in retried["retries"][0], retried
    assert "Ray restarts the worker" in retried["retries"][0] and retried["attempts"] == 1, retried


def test_worker_without_a_host_says_why_and_the_others_do_the_batch(cluster, tmp_path):
    with FakeHost() as gone:
        dead_url = gone.url  # closed again: nothing listens there any more
    with FakeHost() as host:
        rc, s = ray_batch(cluster, tmp_path, [dead_url, host.url], "--count", "3")
    assert rc == 0 and s["succeeded"] == 3, s
    dead = [w for w in s["ray"]["workers"] if w.get("error")]
    assert len(dead) == 1 and f"host {dead_url} does not answer" in dead[0]["error"], s["ray"]["workers"]
    assert {r["host"] for r in s["runs"]} == {host.url}


def test_too_many_gpus_asked_is_one_clear_error(cluster, tmp_path, capsys):
    with FakeHost() as host:
        wf = tmp_path / "wf.json"
        wf.write_text(json.dumps(GRAPH))
        ray_args = ["--ray", "--address", cluster.address, "--host", host.url, "--out", str(tmp_path / "out")]
        rc = cli.main([str(wf), *ray_args, *"--count 1 --gpus-per-worker 3".split()])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "needs 3 GPUs; the cluster has 2" in err[-1], err
    assert not ray.is_initialized()


def test_local_cluster_of_the_driver_is_shut_down_with_nothing_left(tmp_path):
    """--ray without --address: the driver starts its own local cluster and leaves no process behind."""
    wf = tmp_path / "wf.json"
    wf.write_text(json.dumps(GRAPH))
    command = [sys.executable, "-m", "tools.batch", str(wf), "--ray", "--out", str(tmp_path / "out")]
    # ray_temp_dir fails if a process still names `temp` after the run
    with ray_temp_dir("ubl-") as temp, FakeHost() as host:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        command += ["--host", host.url, *"--count 2 --poll 0.05".split()]
        proc = subprocess.run(
            command, cwd=REPO, env=dict(env, RAY_TMPDIR=temp), capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["succeeded"] == 2 and s["ray"]["address"] is None and s["ray"]["startup_s"] > 0


def test_the_pack_never_imports_ray_or_the_batch_client():
    """ComfyUI imports the repo root as the node pack: nothing it loads may import Ray (or tools/)."""
    sources = [REPO / "__init__.py", *(REPO / "nodes").rglob("*.py"), *(REPO / "unicache_core").rglob("*.py")]
    pattern = re.compile(r"^\s*(import ray\b|from ray\b|import tools\b|from tools\b)", re.M)
    offenders = [str(p.relative_to(REPO)) for p in sources if pattern.search(p.read_text(encoding="utf-8"))]
    assert len(sources) > 20 and offenders == [], offenders


@pytest.mark.parametrize("die_with_parent", [True, False])
def test_a_host_started_to_die_with_its_parent_ends_with_it(tmp_path, die_with_parent):
    """A Ray worker can vanish without cleaning up (os._exit, SIGKILL): its host must not outlive it.

    The starter spawns a stand-in for ComfyUI's main.py the way tools/comfyhost.py does, then exits at once;
    the stand-in must end within seconds with DIE_WITH_PARENT, and (the control) keep running without it."""
    stand_in = tmp_path / "main.py"
    stand_in.write_text("import time\ntime.sleep(120)\n")
    prefix = "['-c', comfyhost.DIE_WITH_PARENT]" if die_with_parent else "[]"
    starter = (
        "import os, subprocess, sys, time\nfrom tools import comfyhost\n"
        f"child = subprocess.Popen([sys.executable, *{prefix}, {str(stand_in)!r}], start_new_session=True,\n"
        "    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,\n"
        "    env=dict(os.environ, COMFYHOST_PARENT=str(os.getpid())))\n"
        "print(child.pid, flush=True)\ntime.sleep(1.0)\nos._exit(1)\n"
    )
    proc = subprocess.run([sys.executable, "-c", starter], cwd=REPO, capture_output=True, text=True, timeout=60)
    pid = int(proc.stdout.split()[0])
    # the stand-in dies within a second of its parent with DIE_WITH_PARENT (5 s allowed); the control shows
    # that without it the stand-in is still there 2 s later
    alive = bool(wait_until_gone(str(stand_in), seconds=5 if die_with_parent else 2))
    if alive:
        os.kill(pid, signal.SIGKILL)  # the stand-in this test started
    assert alive is not die_with_parent, f"stand-in alive={alive} with die_with_parent={die_with_parent}"
