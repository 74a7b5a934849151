"""Host tests: a real ComfyUI 0.3.75 server (installed by tools/install_comfyhost.sh) with the pack loaded.

Every test here carries the ``host`` marker (the browser test also ``browser``); ``make test`` deselects
them, ``make test-host`` / ``.ci/run`` run them. Nothing is skipped silently: if the host cannot be
installed or started, or the bundled checkpoint cannot be written, the tests fail with the log tail.

One shared server for the modules that use the ``comfy`` fixture (modules that need a host started with other
options start their own), started with ``--base-directory`` in a throw-away folder that holds, before the
start (ComfyUI lists model combos from what is on disk): the pack link, a corrupt copy of the tiny
checkpoint (``models/bagel/corrupt-tiny``, for the run-time error test) and the input images that the
shipped workflows name. The bundled default checkpoint is the pack's ``models/bagel/bagel-tiny``
(written with ``python -m training.tiny`` if missing).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hostlib import REPO, WORKFLOWS_API, WORKFLOWS_UI, Comfy, comfyhost  # noqa: E402

BUNDLED = REPO / "models" / "bagel" / "bagel-tiny"
CORRUPT = "corrupt-tiny"


# ------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session", autouse=True)
def passive_openmp_waits():
    """Every host, Ray node and tool these tests start waits for work asleep (``OMP_WAIT_POLICY=PASSIVE``).

    The batch tests run two or three hosts of 2 torch threads each on this 2-core machine; OpenMP's default
    spin-waiting then lets each host's idle threads take the cores the other host's busy ones need (the two
    Ray host tests took 174 s with spinning and 86 s without). The policy changes how threads wait, never
    how work is split, so results stay bit for bit those of a host alone."""
    patch = pytest.MonkeyPatch()
    patch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    yield
    patch.undo()


@pytest.fixture(scope="session")
def host_install() -> Path:
    """Install (or reuse) the host; a failure fails the tests, it never skips them."""
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", str(REPO / "tools" / "install_comfyhost.sh")], cwd=REPO, capture_output=True, text=True, timeout=3600
    )
    if proc.returncode != 0:
        pytest.fail(
            f"tools/install_comfyhost.sh failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}",
            pytrace=False,
        )
    print(f"\nhost install: {time.monotonic() - t0:.1f} s ({proc.stdout.strip().splitlines()[-1]})")
    return comfyhost.DEST


@pytest.fixture(scope="session")
def bundled_checkpoint() -> Path:
    """The pack's bundled default checkpoint ``models/bagel/bagel-tiny`` (written if missing)."""
    if not (BUNDLED / "ema.safetensors").is_file() and not BUNDLED.with_suffix(".safetensors").is_file():
        subprocess.run([sys.executable, "-m", "training.tiny", str(BUNDLED)], cwd=REPO, check=True)
    return BUNDLED


def _input_images(base: Path) -> None:
    """Put the images that the shipped workflows' LoadImage nodes name into BASE/input.

    A file of that name shipped in the repo (workflows/assets/, workflows/, tests/) is copied; else a small
    deterministic RGB test image is drawn so the graph validates.
    """
    from PIL import Image

    names = set()
    for wf in sorted(WORKFLOWS_API.glob("*.json")):
        try:
            prompt = json.loads(wf.read_text())
        except ValueError:
            continue
        for node in prompt.values():
            if isinstance(node, dict) and node.get("class_type") == "LoadImage":
                names.add(str(node["inputs"].get("image", "")))
    (base / "input").mkdir(exist_ok=True)
    for name in sorted(n for n in names if n):
        dst = base / "input" / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shipped = [p for d in (WORKFLOWS_UI / "assets", WORKFLOWS_UI, REPO / "tests") if (p := d / name).is_file()]
        if shipped:
            shutil.copyfile(shipped[0], dst)
        else:
            w, h = 96, 64
            img = Image.new("RGB", (w, h))
            img.putdata([(x * 255 // w, y * 255 // h, (x + y) % 256) for y in range(h) for x in range(w)])
            img.save(dst)


def _corrupt_checkpoint(base: Path, bundled: Path) -> None:
    """BASE/models/bagel/corrupt-tiny: the tiny checkpoint with its ema.safetensors cut to half."""
    dst = base / "models" / "bagel" / CORRUPT
    if bundled.is_dir():
        shutil.copytree(bundled, dst, dirs_exist_ok=True)
        ema = dst / "ema.safetensors"
        data = ema.read_bytes()
        ema.write_bytes(data[: len(data) // 2])


@pytest.fixture(scope="session")
def comfy(host_install, bundled_checkpoint, tmp_path_factory) -> Comfy:
    """One server for the whole host session (each start costs 10-20 s of a 2-core machine); the tests that share
    it never depend on what an earlier one left cached. It stops when the session ends; the host tests run in
    their own pytest process, after the unit suite, so it never idles beside it."""
    base = comfyhost.prepare_base(tmp_path_factory.mktemp("comfybase"))
    _corrupt_checkpoint(base, bundled_checkpoint)
    _input_images(base)
    try:
        host = comfyhost.start(base, timeout=240)  # also waits for the pack's loader in /object_info
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
    print(f"\nhost start: {host.started_s} s to ready ({host.url})")
    client = Comfy(host.url, base, Path(host.log))
    yield client
    comfyhost.stop(host)
    print(f"\nhost log: {host.log}\n{comfyhost.log_tail(host.log, 15)}")
