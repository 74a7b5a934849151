"""The pack's pyproject.toml satisfies what the Comfy Registry requires to publish it, as comfy-cli's
``comfy node validate`` / ``comfy node publish`` read it (comfy-cli 1.17: ``registry/config_parser.py``,
``command/custom_nodes/command.py::validate_node_for_publishing``) and as docs.comfy.org/registry/specifications
states the fields; the LICENSE file is the license pyproject names. (ComfyUI's own copy of the parser reads the
same file in tests/host/test_registry_host.py.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import tomllib
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PROJECT = CONFIG["project"]
COMFY = CONFIG["tool"]["comfy"]
#: The registry's node id rules: under 100 characters of letters, digits, ``-``, ``_`` and ``.``, starting with a
#: letter, never two special characters in a row.
NODE_ID = re.compile(r"^[A-Za-z](?:[A-Za-z0-9]|[-_.](?=[A-Za-z0-9]))*$")
#: comfy-cli's ``validate_version`` pattern for ``requires-comfyui`` (each comma-separated part).
VERSION_SPEC = re.compile(r"^(?:(==|>=|<=|!=|~=|>|<|<>|=)\s*)?(\d+\.\d+\.\d+(?:-[a-zA-Z0-9]+)?)?$")
#: The classifiers comfy-cli accepts (others void the whole list with a warning).
OS_PREFIXES = ("Microsoft", "POSIX", "MacOS", "OS Independent")
ACCELERATORS = {
    "GPU :: NVIDIA CUDA",
    "GPU :: AMD ROCm",
    "GPU :: Intel Arc",
    "NPU :: Huawei Ascend",
    "GPU :: Apple Metal",
}
#: The addresses the project does not publish (a Repository or Icon URL there was a broken link in the Manager).
UNPUBLISHED = ("github.com/unicache/", "raw.githubusercontent.com/unicache/")
ICON = ROOT / "docs" / "images" / "icon.png"


def test_project_fields_the_registry_requires():
    assert len(PROJECT["name"]) < 100 and NODE_ID.match(PROJECT["name"]), PROJECT["name"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", PROJECT["version"]), "the registry needs a X.Y.Z version"
    assert PROJECT["description"].strip()
    urls = PROJECT.get("urls", {})
    if "Repository" in urls:  # optional for the registry: only once the repository is public
        assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", urls["Repository"]), urls["Repository"]
    for url in [*urls.values(), COMFY.get("Icon", "")]:
        assert not any(part in url for part in UNPUBLISHED), f"{url}: an address this project does not publish"
        assert not url or url.startswith("https://"), url


def test_tool_comfy_is_complete():
    assert re.fullmatch(r"[a-z0-9][a-z0-9-]*", COMFY["PublisherId"]), COMFY["PublisherId"]
    assert COMFY["DisplayName"].strip()
    assert isinstance(COMFY.get("includes", []), list)
    for part in COMFY["requires-comfyui"].split(","):
        assert VERSION_SPEC.match(part.strip()), COMFY["requires-comfyui"]
    classifiers = PROJECT.get("classifiers", [])
    for c in classifiers:
        if c.startswith("Operating System :: "):
            assert c.removeprefix("Operating System :: ").startswith(OS_PREFIXES), c
        if c.startswith("Environment ::"):
            assert c.removeprefix("Environment :: ") in ACCELERATORS, c


def test_the_icon_is_in_the_repository_square_and_small():
    if "Icon" in COMFY:  # a raw URL of the committed icon, on the Repository's main branch
        raw = PROJECT["urls"]["Repository"].replace("https://github.com/", "https://raw.githubusercontent.com/")
        assert COMFY["Icon"] == f"{raw}/main/docs/images/icon.png", COMFY["Icon"]
    with Image.open(ICON) as image:
        assert image.width == image.height <= 400, image.size


def test_accelerators_claim_nothing_the_pack_does_not_need():
    """The pack runs on a CPU too, and the registry's accelerator classifiers name GPUs only: none is listed."""
    assert not [c for c in PROJECT.get("classifiers", []) if c.startswith("Environment ::")]


def test_the_icon_command_draws_the_committed_icon(tmp_path):
    out = tmp_path / "icon.png"
    from tools import icon

    assert icon.main(["--out", str(out)]) == 0
    committed = ROOT / "docs" / "images" / "icon.png"
    with Image.open(out) as made, Image.open(committed) as shipped:
        assert made.size == shipped.size and made.tobytes() == shipped.tobytes()


def test_the_license_file_is_the_license_pyproject_names():
    assert PROJECT["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text


def test_the_validate_commands_security_check_is_clean():
    # `comfy node validate` runs ruff's S102 (exec), S307 (eval) and E702 (two statements on a line) over the
    # pack and warns today that they will become errors: the pack has none (ruff is pinned in the test extra)
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", ".", "--no-cache", "-q", "--select", "S102,S307,E702"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
