"""Start, stop and inspect a headless ComfyUI host (installed by ``tools/install_comfyhost.sh``).

    python tools/comfyhost.py start [--name NAME] [--port PORT] [--base DIR] [--timeout S] [-- EXTRA ARGS]
    python tools/comfyhost.py status [--name NAME] [--url]
    python tools/comfyhost.py stop [--name NAME]

``start`` runs ComfyUI on CPU, listening on 127.0.0.1 only, on PORT (default: a free port), with the
offline settings of docs/comfyui.md §1.6: ``--cpu --database-url sqlite:///:memory: --disable-api-nodes
--disable-auto-launch --log-stdout`` and ``HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1``. ``--base-directory``
(default ``.comfyhost/base``, which holds the pack link in ``custom_nodes/``) keeps the ComfyUI tree
untouched and gives every run its own models/input/output/user folders. It waits until ``/system_stats``
answers and the pack's loader node is listed in ``/object_info``, then writes
``.comfyhost/run/NAME.json`` (pid, port, url, base, log). ``stop`` ends exactly that PID (SIGTERM, then
SIGKILL after 15 s). The same functions are used by the host tests (``tests/host/conftest.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEST = Path(os.environ.get("COMFYHOST_DIR", REPO / ".comfyhost"))
PACK_NAME = "comfyui-unicache-bagel"
READY_NODE = "UniCacheBagelLoader"


@dataclass
class Host:
    """A started ComfyUI process (what the PID file holds)."""

    pid: int
    port: int
    url: str
    base: str
    log: str
    started_s: float = 0.0  # seconds from spawn to ready

    def alive(self) -> bool:
        return _is_our_process(self.pid, self.port)


def comfy_dir() -> Path:
    return DEST / "ComfyUI"


def host_python() -> Path:
    return DEST / "venv" / "bin" / "python"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_base(base: Path) -> Path:
    """Create BASE/custom_nodes (0.3.75 crashes without it) with the pack linked in, BASE/models/bagel, and
    BASE/input with the shipped workflows' input images (``workflows/assets/*``, where not already there)."""
    base = Path(base).resolve()
    (base / "custom_nodes").mkdir(parents=True, exist_ok=True)
    (base / "models" / "bagel").mkdir(parents=True, exist_ok=True)
    (base / "input").mkdir(parents=True, exist_ok=True)
    for asset in sorted((REPO / "workflows" / "assets").glob("*")):
        if asset.is_file() and not (base / "input" / asset.name).exists():
            shutil.copyfile(asset, base / "input" / asset.name)
    link = base / "custom_nodes" / PACK_NAME
    if not link.exists():
        if link.is_symlink():
            link.unlink()
        link.symlink_to(REPO, target_is_directory=True)
    return base


# Run as `python -c DIE_WITH_PARENT main.py ...`: ask the kernel for SIGTERM when the starting process
# dies (PR_SET_PDEATHSIG = 1, kept across exec), then become ComfyUI; for owners that may vanish
# (Ray workers).
DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys; parent = int(os.environ['COMFYHOST_PARENT']); "
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM) == 0 or sys.exit('prctl failed'); "
    "os.getppid() == parent or sys.exit('the starting process is gone'); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def command(
    port: int, base: Path, extra: list[str] | None = None, cpu: bool = True, die_with_parent: bool = False
) -> list[str]:
    """The ComfyUI command line; ``cpu=False`` lets it use the GPUs that CUDA_VISIBLE_DEVICES shows."""
    python = [str(host_python()), *(["-c", DIE_WITH_PARENT] if die_with_parent else [])]
    return [
        *python, "main.py", *(["--cpu"] if cpu else []), "--listen", "127.0.0.1", "--port", str(port),
        "--base-directory", str(base), "--database-url", "sqlite:///:memory:", "--disable-api-nodes",
        "--disable-auto-launch", "--log-stdout", *(extra or []),
    ]  # fmt: skip


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def log_tail(path: str | Path, n: int = 60) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def start(
    base: Path | None = None,
    port: int | None = None,
    extra: list[str] | None = None,
    timeout: float = 180.0,
    log: Path | None = None,
    ready_node: str | None = READY_NODE,
    env: dict[str, str] | None = None,
    cpu: bool = True,
    die_with_parent: bool = False,
) -> Host:
    """Spawn ComfyUI and wait until it answers; raise RuntimeError (with the log tail) if it does not.

    ``cpu``: pass ``--cpu`` (else ComfyUI uses the GPUs in ``env``'s CUDA_VISIBLE_DEVICES);
    ``die_with_parent``: the host gets SIGTERM when the calling process dies, however it dies."""
    if not (comfy_dir() / "main.py").is_file() or not host_python().is_file():
        raise RuntimeError(f"no ComfyUI host in {DEST}: run tools/install_comfyhost.sh (make host) first")
    base = prepare_base(base or DEST / "base")
    for attempt in range(2):  # a free port can be taken between the probe and the bind: retry once
        use_port = port or free_port()
        log_path = Path(log or base / f"comfyui-{use_port}.log")
        run_env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        run_env.update(env or {}, COMFYHOST_PARENT=str(os.getpid()))
        with open(log_path, "wb") as fh:
            proc = subprocess.Popen(
                command(use_port, base, extra, cpu, die_with_parent), cwd=comfy_dir(), stdout=fh,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=run_env, start_new_session=True,
            )  # fmt: skip
        url = f"http://127.0.0.1:{use_port}"
        t0 = time.monotonic()
        try:
            _wait_ready(proc, url, log_path, timeout, ready_node)
        except RuntimeError:
            if proc.poll() is None:
                _terminate(proc.pid)
            if attempt == 0 and port is None and "address already in use" in log_tail(log_path).lower():
                continue
            raise
        return Host(proc.pid, use_port, url, str(base), str(log_path), round(time.monotonic() - t0, 2))
    raise AssertionError("unreachable")


def _wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float, ready_node: str | None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"ComfyUI exited with {proc.returncode}; log {log}:\n{log_tail(log)}")
        try:
            http_get(url + "/system_stats", timeout=2)
            break
        except (OSError, urllib.error.URLError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"ComfyUI not ready after {timeout:.0f} s; log {log}:\n{log_tail(log)}") from None
            time.sleep(0.25)
    if ready_node:
        try:
            info = json.loads(http_get(f"{url}/object_info/{ready_node}", timeout=30))
        except (OSError, ValueError) as e:
            raise RuntimeError(f"/object_info/{ready_node} failed: {e}; log {log}:\n{log_tail(log)}") from e
        if ready_node not in info:
            raise RuntimeError(
                f"ComfyUI runs but does not list {ready_node}: the pack did not import; log {log}:\n" + log_tail(log)
            )


def _is_our_process(pid: int, port: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"main.py" in cmdline and str(port).encode() in cmdline


def _terminate(pid: int, grace: float = 15.0) -> None:
    """SIGTERM this PID, SIGKILL it if it is still there after ``grace`` seconds; reap it if it is our child."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:  # not our child: poll for its disappearance
            if not Path(f"/proc/{pid}").exists():
                return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def stop(host: Host, grace: float = 15.0) -> None:
    if host.alive():
        _terminate(host.pid, grace)


def pid_file(name: str) -> Path:
    return DEST / "run" / f"{name}.json"


def read_pid_file(name: str) -> Host | None:
    try:
        return Host(**json.loads(pid_file(name).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["start", "stop", "status"])
    ap.add_argument("--name", default="default", help="instance name (PID file .comfyhost/run/NAME.json)")
    ap.add_argument("--port", type=int, default=None, help="port (default: a free one)")
    ap.add_argument("--base", type=Path, default=None, help="--base-directory (default .comfyhost/base)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for readiness")
    ap.add_argument("--url", action="store_true", help="status: print only the URL")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []  # after --: more ComfyUI arguments
    a = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    current = read_pid_file(a.name)
    if a.action == "status":
        if current and current.alive():
            print(current.url if a.url else json.dumps(asdict(current)))
            return 0
        print(f"comfyhost {a.name}: not running")
        return 3
    if a.action == "stop":
        if current and current.alive():
            stop(current)
            print(f"comfyhost {a.name}: stopped pid {current.pid}")
        else:
            print(f"comfyhost {a.name}: not running")
        pid_file(a.name).unlink(missing_ok=True)
        return 0
    if current and current.alive():
        print(f"comfyhost {a.name}: already running at {current.url} (pid {current.pid})")
        return 0
    try:
        host = start(a.base, a.port, extra, a.timeout)
    except RuntimeError as e:
        print(f"comfyhost: {e}", file=sys.stderr)
        return 1
    pid_file(a.name).parent.mkdir(parents=True, exist_ok=True)
    pid_file(a.name).write_text(json.dumps(asdict(host)))
    print(f"comfyhost {a.name}: ready at {host.url} (pid {host.pid}, {host.started_s} s, log {host.log})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
