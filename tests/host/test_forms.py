"""Both checkpoint forms in the real host, with ComfyUI's own tokenizer and core VAE nodes.

A generated checkpoint with the full 152,064-row vocabulary (ComfyUI's bundled Qwen2.5 tokenizer, BAGEL's
special ids) and a full-width FLUX VAE (ch 128, ch_mult 1-2-4-4; core ``VAELoader`` builds exactly that) is
written twice from the same weights: as an official folder and as ComfyUI-BAGEL's single ``.safetensors``
(configs in its metadata, no VAE inside). Then, in one server:

- T2I from the folder (its own VAE) and from the single file (core ``VAELoader`` on the same
  ``ae.safetensors``) give the same image;
- our ``LATENT`` through core ``VAEDecode`` matches our own ``IMAGE`` within 1/255.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hostlib import REPO, Comfy, combo_options, comfyhost, describe, node

pytestmark = pytest.mark.host

FOLDER = "forms-folder"
SINGLE = "forms-single"
VAE_FILE = "unicache-forms-ae.safetensors"
SIZE = dict(width=64, height=64)


def _tiny(out: Path, *extra: str) -> None:
    tok = comfyhost.comfy_dir() / "comfy" / "text_encoders" / "qwen25_tokenizer"
    assert (tok / "vocab.json").is_file(), f"the host ships no Qwen2.5 tokenizer at {tok}"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "training.tiny",
            str(out),
            "--full-vocab",
            "--full-vae",
            "--tokenizer-dir",
            str(tok),
            *extra,
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
    )


@pytest.fixture(scope="module")
def forms(host_install, bundled_checkpoint, tmp_path_factory):
    base = comfyhost.prepare_base(tmp_path_factory.mktemp("formsbase"))
    bagel = base / "models" / "bagel"
    _tiny(bagel / FOLDER)
    _tiny(bagel / SINGLE, "--single-file")
    mismatch = bagel / "forms-mismatch"  # configs that do not belong to the weights
    shutil.copytree(REPO / "models" / "bagel" / "bagel-tiny", mismatch)
    cfg = json.loads((mismatch / "llm_config.json").read_text())
    cfg["num_hidden_layers"] = 7
    (mismatch / "llm_config.json").write_text(json.dumps(cfg))
    (base / "models" / "vae").mkdir(parents=True, exist_ok=True)
    # the single file carries no VAE: it comes through core VAELoader, as in a ComfyUI-BAGEL graph
    shutil.move(str(bagel / SINGLE / "ae.safetensors"), base / "models" / "vae" / VAE_FILE)
    host = comfyhost.start(base, timeout=240)
    client = Comfy(host.url, base, Path(host.log))
    yield client, client.object_info()
    comfyhost.stop(host)


def _image(comfy: Comfy, entry: dict, node_id: str) -> np.ndarray:
    from PIL import Image

    img = entry["outputs"][node_id]["images"][0]
    with Image.open(io.BytesIO(comfy.view(img))) as im:
        return np.asarray(im.convert("RGB"), dtype=np.int16)


def _vae_loader(info: dict) -> dict:
    spec = info["VAELoader"]["input"]["required"]["vae_name"]
    assert VAE_FILE in (combo_options(spec) or []), combo_options(spec)
    return node(info, "VAELoader", vae_name=VAE_FILE)


def _t2i(info: dict, checkpoint: str, vae: bool) -> dict:
    offered = combo_options(info["UniCacheBagelLoader"]["input"]["required"]["checkpoint"]) or []
    name = checkpoint if checkpoint == FOLDER else f"{SINGLE}/bagel-tiny.safetensors"
    assert name in offered, f"{name!r} is not offered by the loader: {offered}"
    graph = {"1": node(info, "UniCacheBagelLoader", checkpoint=name, dtype="fp32")}
    links = {"model": ["1", 0]}
    if vae:
        graph["9"] = _vae_loader(info)
        links["vae"] = ["9", 0]
    graph["3"] = node(
        info, "UniCacheTextToImage", links, prompt="a red square on a blue floor", steps=3, seed=7, **SIZE
    )
    graph["4"] = node(info, "SaveImage", {"images": ["3", 0]}, filename_prefix=f"forms_{checkpoint}")
    return graph


def test_folder_and_single_file_give_the_same_image(forms):
    comfy, info = forms
    a = comfy.run(_t2i(info, FOLDER, vae=False))
    assert a["status"]["status_str"] == "success", describe(a)
    b = comfy.run(_t2i(info, SINGLE, vae=True))
    assert b["status"]["status_str"] == "success", describe(b)
    x, y = _image(comfy, a, "4"), _image(comfy, b, "4")
    assert x.shape == y.shape == (64, 64, 3)
    assert x.std() > 1.0, "a flat image: nothing was generated"
    # same weights, same tokenizer ids, same noise; only the VAE implementation differs (ours vs core)
    assert int(np.abs(x - y).max()) <= 1, f"max pixel difference {int(np.abs(x - y).max())}"


def test_our_latent_through_core_vae_decode_matches_our_image(forms):
    comfy, info = forms
    graph = _t2i(info, FOLDER, vae=False)
    graph["9"] = _vae_loader(info)
    graph["5"] = node(info, "VAEDecode", {"samples": ["3", 1], "vae": ["9", 0]})
    graph["6"] = node(info, "SaveImage", {"images": ["5", 0]}, filename_prefix="forms_vaedecode")
    entry = comfy.run(graph)
    assert entry["status"]["status_str"] == "success", describe(entry)
    ours, core = _image(comfy, entry, "4"), _image(comfy, entry, "6")
    assert ours.shape == core.shape
    assert int(np.abs(ours - core).max()) <= 1, f"max pixel difference {int(np.abs(ours - core).max())}"


def test_mismatching_checkpoint_is_an_execution_error_and_the_host_goes_on(forms):
    comfy, info = forms
    graph = {
        "1": node(info, "UniCacheBagelLoader", checkpoint="forms-mismatch"),
        "3": node(info, "UniCacheUnderstand", {"model": ["1", 0]}, prompt="Hello?", max_new_tokens=2),
    }
    entry = comfy.run(graph)
    assert entry["status"]["status_str"] == "error"
    err = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"][0]
    assert err["node_type"] == "UniCacheBagelLoader" and "num_hidden_layers" in err["exception_message"], err
    graph["1"]["inputs"]["checkpoint"] = "bagel-tiny"
    again = comfy.run(graph)
    assert again["status"]["status_str"] == "success", describe(again)


def test_edit_takes_a_vae_encode_latent_of_any_size(forms):
    """A 4:3 photo-like source through core LoadImage -> VAEEncode (the FLUX VAE): the edit follows the latent's
    size. 400x300 px: VAEEncode crops to 400x296 (37x50 cells of 8 px), the edit drops the odd last row and makes
    400x288 (BAGEL's own resize of the image on this checkpoint would be 128x96)."""
    from PIL import Image

    comfy, info = forms
    name = "forms_source_4x3.png"
    (comfy.base / "input").mkdir(exist_ok=True)
    source = Image.new("RGB", (400, 300))
    source.putdata([(x * 255 // 400, y * 255 // 300, (3 * x + 5 * y) % 256) for y in range(300) for x in range(400)])
    source.save(comfy.base / "input" / name)
    graph = {
        "1": node(info, "UniCacheBagelLoader", checkpoint=FOLDER, dtype="fp32"),
        "2": node(info, "LoadImage", image=name),
        "9": _vae_loader(info),
        "5": node(info, "VAEEncode", {"pixels": ["2", 0], "vae": ["9", 0]}),
        "3": node(
            info,
            "UniCacheImageEdit",
            {"model": ["1", 0], "image": ["2", 0], "latent": ["5", 0]},
            prompt="make it blue",
            steps=2,
            seed=7,
        ),
        "4": node(info, "SaveImage", {"images": ["3", 0]}, filename_prefix="forms_edit_4x3"),
    }
    entry = comfy.run(graph)
    assert entry["status"]["status_str"] == "success", describe(entry)
    edited = _image(comfy, entry, "4")
    assert edited.shape == (288, 400, 3)
    assert edited.std() > 1.0, "a flat image: nothing was generated"
