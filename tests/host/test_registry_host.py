"""ComfyUI 0.3.75 reads a custom node's pyproject.toml with its own copy of the registry's parser
(``comfy_config.config_parser``, kept in step with comfy-cli's): run in the host's Python on the pack, it finds
every field the registry needs (the unit suite checks the rules themselves: tests/test_registry_metadata.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hostlib import REPO, comfyhost  # noqa: E402

pytestmark = pytest.mark.host

PARSE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from comfy_config import config_parser
config = config_parser.extract_node_configuration(sys.argv[2])
print(json.dumps({"project": config.project.model_dump(), "comfy": config.tool_comfy.model_dump()}))
"""


def test_comfyuis_parser_reads_every_registry_field(host_install):
    proc = subprocess.run(
        [str(comfyhost.host_python()), "-c", PARSE, str(comfyhost.comfy_dir()), str(REPO)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    project, comfy = parsed["project"], parsed["comfy"]
    assert project["name"] == "comfyui-unicache-bagel" and project["version"]
    assert project["license"]["text"] == "Apache-2.0"
    assert project["urls"]["repository"] == ""  # none published yet (pyproject.toml says why)
    assert project["supported_os"] == ["OS Independent"]
    assert project["supported_accelerators"] == []  # a CPU runs it too
    assert project["supported_comfyui_version"] == ">=0.3.75"
    assert comfy["publisher_id"] == "unicache" and comfy["display_name"] == "UniCache for BAGEL"
    assert comfy["icon"] == ""
