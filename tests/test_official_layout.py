"""A folder without BAGEL, or a pack with only its own small models: the user is told which files BAGEL-7B-MoT's
folder holds, with their sizes, and where they go (engine, command line and loader node alike)."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from cli_runs import run_bagel_cli
from comfy_stubs import NodeCall, host_stubs  # noqa: F401  (a fixture)

from unicache_core.bagel import load_bagel
from unicache_core.bagel.checkpoint.official_layout import (
    OFFICIAL_FILES,
    OFFICIAL_REPOSITORY,
    human_size,
    official_files_line,
)
from unicache_core.errors import CheckpointError

SIZES = {f.name: f.size for f in OFFICIAL_FILES}


def test_the_weight_files_sizes_are_the_official_geometrys():
    # ema.safetensors is BAGEL-7B-MoT's tensors in bf16 and ae.safetensors the FLUX VAE's in fp32 (tensor data)
    from unicache_core.bagel.memory.plan import official_config
    from unicache_core.bagel.modeling import AutoEncoder
    from unicache_core.bagel.weights import build_bagel

    config = official_config()
    bagel = build_bagel(config, weight_dtype="bf16", dtype=torch.bfloat16, device="meta").state_dict()
    assert len(bagel) == 1223
    assert SIZES["ema.safetensors"] == sum(t.numel() * 2 for t in bagel.values())
    with torch.device("meta"):
        vae = AutoEncoder(config.ae).state_dict()
    assert len(vae) == 244
    assert SIZES["ae.safetensors"] == sum(t.numel() * 4 for t in vae.values())
    assert human_size(SIZES["ema.safetensors"]) == "29.2 GB" and human_size(SIZES["ae.safetensors"]) == "335 MB"


def test_every_file_the_loader_reads_is_listed(tiny_checkpoint):
    # the tiny checkpoint is written in the official layout: it holds every listed file (and optional extras)
    assert all((tiny_checkpoint / name).is_file() for name in SIZES)
    assert {"llm_config.json", "vit_config.json", "ema.safetensors", "ae.safetensors"} <= set(SIZES)


def _expect_every_file(message: str) -> None:
    for f in OFFICIAL_FILES:
        assert f"{f.name} ({human_size(f.size)})" in message
    assert OFFICIAL_REPOSITORY in message


def test_the_engine_names_what_a_folder_lacks(tmp_path, tiny_checkpoint):
    empty = tmp_path / "photos"
    empty.mkdir()
    (empty / "cat.png").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError) as error:
        load_bagel(empty)
    message = str(error.value)
    assert message.startswith(f"{empty} holds no BAGEL checkpoint;") and "\n" not in message
    _expect_every_file(message)
    partial = tmp_path / "partial"
    shutil.copytree(tiny_checkpoint, partial)
    (partial / "ema.safetensors").unlink()
    # a checkpoint folder that lacks its weights: the file's own message, with the published size
    with pytest.raises(
        CheckpointError, match=r"missing weights file .*ema\.safetensors; download ema\.safetensors \(29\.2 GB\)"
    ):
        load_bagel(partial)
    # a checkpoint folder that lacks several files: all of them in one message, not one per run
    (partial / "vocab.json").unlink()
    (partial / "merges.txt").unlink()
    with pytest.raises(CheckpointError) as error:
        load_bagel(partial)
    lacks = str(error.value).split(";")[0]
    assert lacks == f"{partial} is missing ema.safetensors (29.2 GB), vocab.json (2.78 MB), merges.txt (1.67 MB)"
    # a folder with some of BAGEL's files but not its llm_config.json: what it lacks, each with its size
    configs_only = tmp_path / "configs-only"
    configs_only.mkdir()
    shutil.copy(tiny_checkpoint / "vocab.json", configs_only / "vocab.json")
    with pytest.raises(CheckpointError) as error:
        load_bagel(configs_only)
    lacks = str(error.value).split(";")[0]
    assert "is missing llm_config.json (663 B)" in lacks and "vocab.json" not in lacks


def test_the_command_line_says_it_in_one_line(capsys, tmp_path):
    empty = tmp_path / "downloads"
    empty.mkdir()
    code, out, err = run_bagel_cli(
        capsys, "understand", "--checkpoint", str(empty), "--prompt", "what is this?", "--max-new-tokens", "2"
    )
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --checkpoint: {empty} holds no BAGEL checkpoint")
    _expect_every_file(lines[0])


def test_the_loader_node_explains_where_bagel_goes(host_stubs, tmp_path, caplog):  # noqa: F811
    import nodes
    from nodes import host
    from nodes.model import NO_CHECKPOINT, demo_models_only, resolve_checkpoint

    comfy_bagel = tmp_path / "ComfyUI" / "models" / "bagel"
    with pytest.raises(FileNotFoundError) as error:
        resolve_checkpoint(NO_CHECKPOINT, [comfy_bagel])
    message = str(error.value)
    _expect_every_file(message)
    assert f"{comfy_bagel / 'BAGEL-7B-MoT'}/" in message
    loader = nodes.NODE_CLASS_MAPPINGS["UniCacheBagelLoader"]
    assert official_files_line() in loader.INPUT_TYPES()["required"]["checkpoint"][1]["tooltip"]
    # a host whose bagel folders hold only the pack's own models: loading the bundled one says where BAGEL goes
    assert demo_models_only(["unicache-shapes", "bagel-tiny"]) and not demo_models_only(["unicache-shapes", "b7"])
    folders = [comfy_bagel, host.PACK_BAGEL_DIR]
    comfy_bagel.mkdir(parents=True)
    host_stubs["folder_paths"].get_folder_paths = lambda name: [str(f) for f in folders]
    with caplog.at_level(logging.INFO, logger="nodes.loader_node"):
        NodeCall(loader)("unicache-shapes", "fp32", "cpu")
    told = [r.getMessage() for r in caplog.records if r.name == "nodes.loader_node"]
    assert any("for BAGEL-7B-MoT put" in line and official_files_line() in line for line in told), told
    assert any(f"{comfy_bagel / 'BAGEL-7B-MoT'}/" in line for line in told), told
