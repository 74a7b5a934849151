"""Files the commands read and write for a user (issues 45.5, 46.1, 46.3): an input is read only when it is a regular
file of bounded size (a FIFO never blocks, /dev/zero never fills memory), and an output never replaces a checkpoint's
file, an input, a weights file or a device node, and is written whole or not at all."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from cli_runs import exit_status, run_bagel_cli

from unicache_commands.input_files import read_regular_file, read_text_file
from unicache_commands.output_files import check_output_file, save_text, write_atomically
from unicache_core.bagel.calibration import cli as calibrate_cli
from unicache_core.bagel.calibration.inputs import read_prompts as calibration_prompts
from unicache_core.bagel.calibration.tables import check_out
from unicache_core.compression.policy_table import PolicyTable, PolicyTableError

REPO = Path(__file__).resolve().parents[1]
GRAPH = {
    "1": {"class_type": "UniCacheBagelLoader", "inputs": {"checkpoint": "bagel-tiny"}},
    "3": {"class_type": "UniCacheTextToImage", "inputs": {"model": ["1", 0], "seed": 1, "prompt": "a"}},
}


def finishes(call, seconds: float = 30.0):
    """``call()``'s result, run in a thread: a read that blocks (a FIFO opened for reading) fails the test instead of
    hanging the suite."""
    box: dict = {}

    def target():
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test below
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the call blocked"
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ------------------------------------------------------------------------------------------------ inputs


def test_inputs_must_be_regular_files(fifo, tmp_path):
    with pytest.raises(ValueError, match=r"--x .*pipe is a FIFO \(named pipe\), not a regular file; pass"):
        finishes(lambda: read_regular_file(fifo, label=f"--x {fifo}", max_bytes=100))
    with pytest.raises(ValueError, match=r"--x /dev/zero is a character device, not a regular file"):
        finishes(lambda: read_regular_file("/dev/zero", label="--x /dev/zero", max_bytes=100))
    with pytest.raises(IsADirectoryError, match="is a directory"):
        read_regular_file(tmp_path, label=f"--x {tmp_path}", max_bytes=100)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_regular_file(tmp_path / "none", label="--x none", max_bytes=100)
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    with pytest.raises(FileNotFoundError, match="a broken symlink to"):
        read_regular_file(tmp_path / "link", label="--x link", max_bytes=100)


def test_inputs_are_bounded_and_utf8(tmp_path):
    big = tmp_path / "big.txt"
    big.write_bytes(b"x" * 101)
    with pytest.raises(ValueError, match=r"--x big is 101 bytes, more than the 100 accepted"):
        read_regular_file(big, label="--x big", max_bytes=100)
    text = tmp_path / "bom.txt"
    text.write_bytes("\ufeffa cat\n".encode())
    assert read_text_file(text, label="--x", max_bytes=100) == "a cat\n"
    text.write_bytes(b"caf\xe9")
    with pytest.raises(ValueError, match=r"is not valid UTF-8 \(byte 0xe9 at offset 3\)"):
        read_text_file(text, label="--x", max_bytes=100)


def test_prompt_file_fifo_and_device_are_one_line(tiny_checkpoint, fifo, tmp_path, capsys):
    for path in (fifo, Path("/dev/zero")):
        code, _, err = finishes(
            lambda p=path: run_bagel_cli(
                capsys,
                "t2i",
                "--checkpoint",
                str(tiny_checkpoint),
                "--prompt-file",
                str(p),
                "--out",
                str(tmp_path / "o.png"),
                "-q",
            )
        )
        assert code == 2 and f"--prompt-file: {path} is a " in one_line(err)


def test_policy_fifo_is_refused_without_blocking(tiny_checkpoint, fifo, tmp_path, capsys):
    code, _, err = finishes(
        lambda: run_bagel_cli(
            capsys,
            "t2i",
            "--checkpoint",
            str(tiny_checkpoint),
            "--prompt",
            "x",
            "--kv-method",
            "unicache",
            "--policy",
            str(fifo),
            "--out",
            str(tmp_path / "o.png"),
            "-q",
        )
    )
    assert code == 2 and "is a FIFO (named pipe), not a regular file" in one_line(err)
    with pytest.raises(PolicyTableError, match="character device"):
        PolicyTable.load("/dev/zero")


def test_calibration_prompts_fifo(fifo):
    with pytest.raises(ValueError, match=r"--prompts: .*pipe is a FIFO"):
        finishes(lambda: calibration_prompts(fifo))


@pytest.mark.parametrize("which", ["workflow", "--seeds", "--prompts"])
@pytest.mark.parametrize("special", ["fifo", "/dev/zero"])
def test_batch_inputs_fifo_and_device_are_one_line(tmp_path, fifo, capsys, which, special):
    from tools.batch import cli

    path = str(fifo) if special == "fifo" else special
    workflow = tmp_path / "wf.json"
    workflow.write_text(json.dumps(GRAPH))
    argv = [path if which == "workflow" else str(workflow), "--host", "http://127.0.0.1:9", "--count", "1"]
    argv += ["--out", str(tmp_path / "out")] + ([which, path] if which != "workflow" else [])
    capsys.readouterr()
    assert finishes(lambda: cli.main(argv)) == 2
    err = one_line(capsys.readouterr().err)
    assert err.startswith(f"tools.batch: {which} {path} is a ") and "not a regular file" in err


def test_batch_prompts_drop_the_bom(tmp_path):
    from tools.batch.work import read_prompts

    path = tmp_path / "p.txt"
    path.write_bytes("\ufeffa red cube\n# note\nblue\n".encode())
    assert read_prompts(path) == ["a red cube", "blue"]


def test_batch_count_of_a_billion_is_refused_at_once(tmp_path, capsys):
    from tools.batch import cli

    workflow = tmp_path / "wf.json"
    workflow.write_text(json.dumps(GRAPH))
    argv = [str(workflow), "--host", "http://127.0.0.1:9", "--count", "1000000000", "--out", str(tmp_path / "o")]
    assert exit_status(cli.main, argv) == 2
    err = one_line(capsys.readouterr().err)
    assert "--count must be within 1..100000 (the summary keeps a record of every run), got 1000000000" in err


def test_ray_address_nothing_answers_is_one_line(tmp_path, capsys):
    pytest.importorskip("ray")
    from tools.batch import cli

    workflow = tmp_path / "wf.json"
    workflow.write_text(json.dumps(GRAPH))
    argv = [str(workflow), "--ray", "--address", "127.0.0.1:1", "--count", "1", "--out", str(tmp_path / "o")]
    assert finishes(lambda: cli.main(argv)) == 2
    err = one_line(capsys.readouterr().err)
    assert err.startswith("tools.batch: --address 127.0.0.1:1: no Ray cluster answers there (Connection refused)")


def test_ray_init_is_bounded_by_ray_timeout(tmp_path):
    """A local Ray start that takes longer than --ray-timeout ends the process with one line (status 2)."""
    pytest.importorskip("ray")
    workflow = tmp_path / "wf.json"
    workflow.write_text(json.dumps(GRAPH))
    argv = [str(workflow), "--ray", "--ray-timeout", "0.2", "--count", "1", "--out", str(tmp_path / "o")]
    ray_tmp = tempfile.mkdtemp(prefix="uc-ray-", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    env = dict(os.environ, PYTHONPATH=str(REPO), RAY_TMPDIR=ray_tmp)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tools.batch", *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 2, done.stderr
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith("tools.batch: --ray (a local cluster): Ray did not start or connect within 0.2 s (--ray-timeout)")
    )


#: A stand-in of Ray whose ``init`` holds the interpreter's lock (a C loop, as Ray's core worker waiting for a raylet
#: that died of a memory limit does), so no watchdog thread of the process can run.
FAKE_RAY = {
    "ray/__init__.py": "__version__ = '0'\n\ndef init(*args, **kwargs):\n    sum(range(10**15))\n",
    "ray/util/__init__.py": "",
    "ray/util/queue.py": "class Queue:\n    pass\n",
}


def test_ray_init_holding_the_interpreter_is_still_bounded_by_ray_timeout(tmp_path):
    """A ``ray.init`` blocked inside Ray's C++ code while holding the GIL: the watchdog thread never ran and the batch
    hung past 150 s (also with --ray-timeout 10); the supervising parent of ``python -m tools.batch`` ends it with one
    line, exit 2, and nothing of it left running."""
    for name, text in FAKE_RAY.items():
        (tmp_path / "fake" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fake" / name).write_text(text)
    workflow = tmp_path / "wf.json"
    workflow.write_text(json.dumps(GRAPH))
    argv = [str(workflow), "--ray", "--ray-timeout", "1", "--count", "1", "--out", str(tmp_path / "o")]
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'fake'}{os.pathsep}{REPO}")
    done = subprocess.run(
        [sys.executable, "-m", "tools.batch", *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert one_line(done.stderr).startswith(
        "tools.batch: --ray (a local cluster): Ray did not start or connect within 1 s (--ray-timeout)"
    )
    assert not [line for line in Path("/proc").glob("[0-9]*/cmdline") if str(workflow).encode() in _cmdline(line)]


def _cmdline(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def test_more_gpus_than_this_machine_has_are_refused_before_ray_starts(tmp_path, capsys, monkeypatch):
    """``--gpus-per-worker 1`` on a machine without a GPU: a local cluster is never started for a request it cannot
    hold (a start under a memory limit hung past 150 s); one line naming the flag and what to do."""
    ray = pytest.importorskip("ray")
    from tools.batch import cli, ray_backend

    def no_start(*args, **kwargs):
        raise AssertionError("ray.init ran for a request this machine cannot hold")

    monkeypatch.setattr(ray, "init", no_start)
    monkeypatch.setattr(ray_backend, "_local_gpus", lambda: 0.0)
    workflow = tmp_path / "wf.json"
    workflow.write_text(json.dumps(GRAPH))
    argv = [str(workflow), "--ray", "--gpus-per-worker", "1", "--count", "1", "--out", str(tmp_path / "o")]
    assert finishes(lambda: cli.main(argv)) == 2
    assert one_line(capsys.readouterr().err).startswith(
        "tools.batch: --gpus-per-worker 1: this machine (a local cluster) has 0 GPUs, fewer than one worker needs; "
        "give --gpus-per-worker 0 (hosts on the CPU)"
    )
    assert isinstance(ray_backend.LOCAL_OBJECT_STORE_BYTES, int) and ray_backend.LOCAL_OBJECT_STORE_BYTES <= 1 << 30


def test_a_local_ray_start_reserves_a_bounded_object_store(tmp_path, monkeypatch):
    """Ray's default object store (30% of the machine's memory, reserved at start) made a local start die under
    ``ulimit -v 8000000``; the batch asks for a small one (it moves only run records and outputs)."""
    ray = pytest.importorskip("ray")
    from tools.batch import ray_backend

    asked: dict = {}

    def init(**kwargs):
        asked.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(ValueError, match="cannot start or reach Ray: stop here"):
        ray_backend._connect(ray_backend.RayOptions(gpus_per_worker=0.0))
    assert asked["object_store_memory"] == ray_backend.LOCAL_OBJECT_STORE_BYTES == 512 << 20


# ------------------------------------------------------------------------------------------------ outputs


def test_plan_json_never_replaces_a_checkpoint_file(tiny_checkpoint_copy, capsys):
    target = tiny_checkpoint_copy / "llm_config.json"
    before = target.read_bytes()
    for checkpoint in (str(tiny_checkpoint_copy), "bagel-7b-mot"):  # the folder given, or recognised by its files
        code, out, err = run_bagel_cli(
            capsys,
            "plan",
            "--checkpoint",
            checkpoint,
            "--task",
            "t2i",
            "--width",
            "128",
            "--height",
            "128",
            "--json",
            str(target),
        )
        assert code == 2 and out == ""
        assert f"--json: {target} is a file of the checkpoint" in one_line(err)
    assert target.read_bytes() == before


@pytest.mark.parametrize("name", ["llm_config.json", "vocab.json"])
def test_calibrate_out_never_replaces_a_checkpoint_file(tiny_checkpoint_copy, tmp_path, capsys, name):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cube\n")
    target = tiny_checkpoint_copy / name
    before = target.read_bytes()
    argv = ["--checkpoint", str(tiny_checkpoint_copy), "--task", "t2i", "--prompts", str(prompts), "--out", str(target)]
    assert exit_status(calibrate_cli.main, argv) == 2
    assert f"--out: {target} is a file of the checkpoint" in one_line(capsys.readouterr().err)
    assert target.read_bytes() == before


def test_calibrate_out_may_be_the_checkpoints_policy_table_but_not_the_prompts(tiny_checkpoint_copy, tmp_path):
    check_out(tiny_checkpoint_copy / "unicache_policy.json", False, "", checkpoint=tiny_checkpoint_copy)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cube\n")
    with pytest.raises(ValueError, match=r"--out: .*p.txt is the same file as --prompts"):
        check_out(prompts, False, "", checkpoint=tiny_checkpoint_copy, prompts=prompts)


def test_outputs_never_replace_weights_devices_or_fifos(tiny_checkpoint_copy, tmp_path, fifo):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"--json: .*model.safetensors is a weights file"):
        check_output_file("--json", weights, "plan JSON")
    for node, kind in (("/dev/null", "character device"), (str(fifo), "FIFO")):
        with pytest.raises(ValueError, match=rf"--json: {node} exists and is not a regular file \(a {kind}"):
            finishes(lambda n=node: check_output_file("--json", n, "plan JSON"))
    with pytest.raises(ValueError, match="is no longer a regular file; nothing was written"):
        write_atomically("--json", fifo, lambda tmp: tmp.write_text("{}"))
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_batch_summary_on_a_device_node_is_refused(tmp_path, capsys):
    from tools.batch import cli

    workflow = tmp_path / "wf.json"
    workflow.write_text(json.dumps(GRAPH))
    for summary, message in (
        ("/dev/null", "--summary: /dev/null exists and is not a regular file (a character device)"),
        (str(workflow), f"--summary: {workflow} is the same file as the workflow"),
    ):
        argv = [str(workflow), "--host", "http://127.0.0.1:9", "--count", "1", "--out", str(tmp_path / "o")]
        assert cli.main([*argv, "--summary", summary]) == 2
        assert message in one_line(capsys.readouterr().err)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and json.loads(workflow.read_text()) == GRAPH


def test_plan_json_write_error_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("unicache_commands.output_files.os.replace", full)
    target = tmp_path / "plan.json"
    code, _, err = run_bagel_cli(
        capsys,
        "plan",
        "--checkpoint",
        "bagel-7b-mot",
        "--task",
        "t2i",
        "--device-memory",
        "80GB",
        "--json",
        str(target),
    )
    assert code == 2
    assert one_line(err).startswith(f"error: --json: cannot write {target} (No space left on device); free space")
    assert list(tmp_path.iterdir()) == []  # no empty file, no temporary file


def test_atomic_write_keeps_the_replaced_files_permissions(tmp_path):
    target = tmp_path / "r.json"
    target.write_text("old")
    target.chmod(0o640)
    save_text("new", target, "--report")
    assert target.read_text() == "new" and stat.S_IMODE(target.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
