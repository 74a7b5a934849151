"""load_bagel's weight storage and placement: weight_dtype, streaming (peak host memory), offload, CLI flags,
and the CFG branches of a denoising step run through the decoder together."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from benchmarks.medium import write_medium_checkpoint
from benchmarks.rss import measure_load_in_subprocess
from unicache_core.bagel.checkpoint.header import read_header
from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.checkpoint.tensor_file import RELEASE_EVERY_BYTES
from unicache_core.bagel.cli.main import main as cli_main
from unicache_core.bagel.modeling import Bagel
from unicache_core.bagel.modeling.operations import is_low_precision, store_weight
from unicache_core.bagel.pipeline import BagelPipeline
from unicache_core.bagel.settings import T2I_DEFAULTS
from unicache_core.bagel.weights import parameter_bytes


@pytest.fixture(scope="module")
def medium_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The benchmark's medium checkpoint (fp32 file, 260 MB: large beside the process's fixed memory)."""
    return write_medium_checkpoint(tmp_path_factory.mktemp("medium"))


@pytest.mark.parametrize("weight_dtype", ["fp8_e4m3fn", "int8"])
def test_loaded_weights_are_the_stored_checkpoint_tensors(tiny_checkpoint: Path, weight_dtype: str):
    """Every low-precision layer holds store_weight of the checkpoint tensor as stored (fp32 here, not rounded to
    the compute dtype first); everything else equals the bf16 load."""
    reference = load_bagel(tiny_checkpoint, dtype=torch.bfloat16)
    as_stored = dict(load_bagel(tiny_checkpoint, dtype=torch.float32).model.named_parameters())
    loaded = load_bagel(tiny_checkpoint, dtype=torch.bfloat16, weight_dtype=weight_dtype)
    assert loaded.weight_dtype == weight_dtype
    reference_tensors = dict(reference.model.named_parameters())
    low = 0
    for name, module in loaded.model.named_modules():
        if is_low_precision(module):
            data, scale = store_weight(as_stored[f"{name}.weight"], module.storage)
            assert torch.equal(module.weight.view(torch.uint8), data.view(torch.uint8)), name
            assert torch.equal(module.weight_scale, scale), name
            low += 1
    assert low >= 49  # every Linear and Embedding of the LLM, ViT, connector and heads but lm_head (16-bit)
    assert loaded.model.language_model.lm_head.weight.dtype == torch.bfloat16
    for name, tensor in loaded.model.named_parameters():
        if name in reference_tensors and tensor.dtype == torch.bfloat16:
            assert torch.equal(tensor, reference_tensors[name]), name
    assert parameter_bytes(loaded.model) < 0.85 * parameter_bytes(reference.model)


def test_streaming_load_peaks_near_the_loaded_model(medium_checkpoint: Path):
    """Peak host memory of a load (fresh process) is the loaded model plus about one tensor, never the file:
    the fp32 file loaded as fp8 peaks under 0.45 of its size (measured: 0.35)."""
    largest = max(entry.nbytes for entry in read_header(medium_checkpoint / "ema.safetensors").tensors.values())
    # the tensor read and its conversion, what was freed since the last release to the system, allocator slack
    slack = 2 * largest + 2 * RELEASE_EVERY_BYTES + (16 << 20)
    fp8 = measure_load_in_subprocess(medium_checkpoint, "fp8_e4m3fn")
    bf16 = measure_load_in_subprocess(medium_checkpoint, "auto")
    assert fp8["param_bytes"] < 0.6 * bf16["param_bytes"]
    for figures in (fp8, bf16):
        assert figures["load_peak_bytes"] < figures["param_bytes"] + slack, figures
    assert fp8["load_peak_bytes"] < 0.45 * fp8["file_bytes"], fp8


def test_offload_layers_gives_the_resident_outputs(tiny_checkpoint: Path):
    """A t2i with CFG (three branches per step) through offloaded layers: the same latents as resident."""
    settings = dataclasses.replace(T2I_DEFAULTS, width=64, height=64, num_timesteps=4)
    resident = BagelPipeline(load_bagel(tiny_checkpoint)).text_to_image("a red cube", settings, seed=3, decode=False)
    loaded = load_bagel(tiny_checkpoint, offload="layers")
    assert loaded.offload is not None and loaded.offload.transfers == 0
    offloaded = BagelPipeline(loaded).text_to_image("a red cube", settings, seed=3, decode=False)
    assert torch.equal(resident.latents, offloaded.latents)
    layers = loaded.config.llm.num_hidden_layers
    assert loaded.offload.transfers >= layers * 3  # prefill blocks and steps; the branches share one copy


def test_cfg_branches_run_through_the_decoder_together(tiny_checkpoint: Path, monkeypatch):
    """Each denoising step sends its CFG branches to forward_llm_branches in one call."""
    calls: list[int] = []
    original = Bagel.forward_llm_branches

    def counting(self, branches, **kwargs):
        calls.append(len(branches))
        return original(self, branches, **kwargs)

    monkeypatch.setattr(Bagel, "forward_llm_branches", counting)
    settings = dataclasses.replace(T2I_DEFAULTS, width=64, height=64, num_timesteps=4, cfg_interval=(0.0, 1.0))
    pipe = BagelPipeline(load_bagel(tiny_checkpoint, weight_dtype="fp8_e4m3fn"))
    pipe.text_to_image("a red cube", settings, seed=3, decode=False)
    assert calls == [3, 3, 3]


def test_cli_weight_dtype_and_offload(tiny_checkpoint: Path, tmp_path: Path, capsys):
    out = tmp_path / "cube.png"
    args = [
        "t2i",
        "--checkpoint",
        str(tiny_checkpoint),
        "--prompt",
        "a red cube",
        "--width",
        "64",
        "--height",
        "64",
        "--steps",
        "3",
        "--quiet",
        "--out",
        str(out),
    ]
    assert cli_main(args + ["--weight-dtype", "int8", "--offload", "layers"]) == 0
    assert out.is_file()
    with pytest.raises(SystemExit) as exc:
        cli_main(args + ["--weight-dtype", "fp4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--weight-dtype" in err[0] and "fp8_e4m3fn" in err[0]


def test_bad_weight_dtype_and_offload_values(tiny_checkpoint: Path):
    with pytest.raises(ValueError, match="`weight_dtype` 'fp4'.*int8"):
        load_bagel(tiny_checkpoint, weight_dtype="fp4")
    with pytest.raises(ValueError, match="`offload` 'disk'.*layers"):
        load_bagel(tiny_checkpoint, offload="disk")
    with pytest.raises(ValueError, match="only one of them"):
        load_bagel(tiny_checkpoint, offload="layers", device_map={"": "cpu"})
