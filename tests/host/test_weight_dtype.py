"""The loader's ``weight_dtype`` (core UNETLoader's choices) in the real host (ComfyUI 0.3.75, CPU).

- The node's patcher (tests/host/node_patcher_check.py, in the host's Python): BAGEL built from ComfyUI's
  operations, ``model_size()`` following the weight dtype, and ComfyUI's lowvram partial load (a third of the
  model's size) leaving modules with ``comfy_cast_weights`` and giving the same images as the full load.
- Through the server: every shipped API workflow runs with ``weight_dtype`` fp8_e4m3fn and its images stay close
  to the default's; a workflow saved before the widget existed still runs, as ``default``.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hostlib import REPO, WORKFLOWS_API, combo_options, comfyhost, describe, find_nodes  # noqa: E402

pytestmark = pytest.mark.host

BUNDLED = "unicache-shapes"
WORKFLOW_NAMES = sorted(p.stem for p in WORKFLOWS_API.glob("*.json"))
#: The shipped workflows run 25 denoising steps; the comparison runs both weight dtypes at this many instead,
#: to bound the test's time on 2 CPU cores (both sides use the same settings and seed).
STEPS = 6
#: Mean absolute pixel difference (0-255) of the fp8_e4m3fn run against the default run of each shipped
#: workflow's images at STEPS steps on the bundled model, measured on this machine (ComfyUI's manual_cast with
#: unscaled fp8 weights; the workflows' `auto` dtype computes in fp32 on the CPU host): text_to_image 0.75,
#: image_edit 1.86, ab_edit_full_vs_unicache 0.94 (full) and 1.86 (unicache); the understanding answer is the
#: same. Bound: about 2x the largest.
FP8_MEAN_ABS_BOUND = 4.0


# ------------------------------------------------------------------------------------- node's patcher


@pytest.fixture(scope="module")
def patcher_report(host_install) -> dict:
    proc = subprocess.run(
        [
            str(comfyhost.host_python()),
            str(Path(__file__).with_name("node_patcher_check.py")),
            str(comfyhost.comfy_dir()),
            str(REPO),
            BUNDLED,
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=REPO,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"node_patcher_check.py failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}",
            pytrace=False,
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_node_builds_from_comfy_operations(patcher_report: dict):
    default, fp8 = patcher_report["default"], patcher_report["fp8_e4m3fn"]
    assert default["operations"] == "disable_weight_init" and default["up_proj_dtype"] == "torch.bfloat16"
    assert fp8["operations"] == "manual_cast" and fp8["up_proj_dtype"] == "torch.float8_e4m3fn"  # no fp8 matmul on CPU
    assert default["vae_conv_dtype"] == fp8["vae_conv_dtype"] == "torch.float32"
    assert default["castable_modules"] == fp8["castable_modules"] > 0


def test_model_size_follows_the_weight_dtype(patcher_report: dict):
    default, fp8 = patcher_report["default"], patcher_report["fp8_e4m3fn"]
    # BAGEL's own layers take one byte per weight instead of two (the fp32 VAE and BAGEL's bf16 RMSNorms and
    # sin-cos tables stay): the patcher's size drops by exactly that
    saved = default["castable_bytes"] - fp8["castable_bytes"]
    assert saved > 0 and default["model_size"] - fp8["model_size"] == saved
    # on BAGEL-7B-MoT's geometry (built on the meta device) that is about half: 29.5 GB -> 15.6 GB measured (lm_head
    # stays bf16: 1.09 GB)
    real = patcher_report["real_geometry_model_size"]
    assert real["default"] > 29e9 and real["fp8_e4m3fn"] < 0.6 * real["default"], real


@pytest.mark.parametrize("weight_dtype", ["default", "fp8_e4m3fn"])
def test_partial_load_leaves_modules_casting_and_gives_the_same_images(patcher_report: dict, weight_dtype: str):
    entry = patcher_report[weight_dtype]
    partial = entry["partial"]
    assert partial["lowvram"] and partial["budget"] < entry["model_size"]
    assert 0 < partial["left_with_comfy_cast_weights"] < entry["castable_modules"]
    assert 0 < partial["loaded_bytes"] <= partial["budget"]
    assert all(v["equal"] for v in partial["vs_full_load"].values()), partial["vs_full_load"]


# ------------------------------------------------------------------------------------------- server


def _images(comfy, entry: dict) -> dict[str, np.ndarray]:
    from PIL import Image

    found = {}
    for node_id, output in sorted(entry["outputs"].items()):
        for i, image in enumerate(output.get("images", [])):
            if image.get("type") == "output":
                with Image.open(io.BytesIO(comfy.view(image))) as im:
                    found[f"{node_id}/{i}"] = np.asarray(im.convert("RGB"), dtype=np.float64)
    return found


def _answers(prompt: dict, entry: dict) -> dict[str, list]:
    """The answers of the prompt's understanding nodes."""
    return {node_id: entry["outputs"][node_id]["text"] for node_id in find_nodes(prompt, "UniCacheUnderstand")}


def _workflow(name: str, weight_dtype: str | None) -> dict:
    prompt = json.loads((WORKFLOWS_API / f"{name}.json").read_text())
    for node in prompt.values():
        if "steps" in node["inputs"]:
            node["inputs"]["steps"] = STEPS
    for node_id in find_nodes(prompt, "UniCacheBagelLoader"):
        if weight_dtype is None:
            del prompt[node_id]["inputs"]["weight_dtype"]  # as saved before the widget existed
        else:
            prompt[node_id]["inputs"]["weight_dtype"] = weight_dtype
    return prompt


def _run(comfy, prompt: dict) -> dict:
    entry = comfy.run(prompt)
    assert entry["status"]["status_str"] == "success", describe(entry)
    return entry


def test_loader_offers_unet_loaders_weight_dtypes(comfy):
    info = comfy.object_info()
    ours = info["UniCacheBagelLoader"]["input"]["optional"]["weight_dtype"]
    core = info["UNETLoader"]["input"]["required"]["weight_dtype"]
    assert combo_options(ours) == combo_options(core) == ["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"]


@pytest.mark.parametrize("name", WORKFLOW_NAMES)
def test_fp8_runs_each_shipped_workflow_close_to_default(comfy, name: str):
    prompt = _workflow(name, "default")
    default = _run(comfy, prompt)
    fp8 = _run(comfy, _workflow(name, "fp8_e4m3fn"))
    want, got = _images(comfy, default), _images(comfy, fp8)
    assert set(got) == set(want)
    differences = {key: float(np.abs(got[key] - want[key]).mean()) for key in want}
    print(f"\n{name}: fp8_e4m3fn vs default, mean |difference| per image: {differences}")
    assert all(got[key].shape == want[key].shape for key in want)
    assert all(d <= FP8_MEAN_ABS_BOUND for d in differences.values()), differences
    if want:
        assert max(differences.values()) > 0  # the weights really were stored in fp8
    assert want or _answers(prompt, default)  # every shipped workflow outputs images or an answer
    # the understanding workflow's answer (bundled model, greedy decoding) is the same
    assert _answers(prompt, fp8) == _answers(prompt, default)


def test_workflow_saved_without_weight_dtype_runs_as_default(comfy):
    old = _run(comfy, _workflow("text_to_image", None))
    default = _run(comfy, _workflow("text_to_image", "default"))
    want, got = _images(comfy, default), _images(comfy, old)
    assert want and set(got) == set(want)
    assert all(np.array_equal(got[key], want[key]) for key in want)
