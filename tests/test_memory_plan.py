"""The memory plan: its JSON, the official geometry without files, the suggestion, the CLI, the CPU runtime's own
terms (and GPU plans without them), and the plan's weight and KV figures against what a run on the bundled model
holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.cli.main import main as cli_main
from unicache_core.bagel.memory.plan import (
    CPU_MATMUL_KERNEL_BYTES,
    CUDA_VAE_DECODE_PER_PIXEL,
    GLIBC_MMAP_THRESHOLD_MAX,
    NOT_IN_PEAK,
    PlanSettings,
    cpu_runtime_parts,
    matmul_shapes,
    official_config,
    plan_config,
    plan_memory,
    request_tokens,
    tensor_peak_bytes,
)
from unicache_core.bagel.pipeline import BagelPipeline
from unicache_core.bagel.settings import BUNDLED_CHECKPOINT_DIR, T2I_DEFAULTS
from unicache_core.bagel.weights import parameter_bytes

GB = 10**9


def _plan(**changes):
    settings = PlanSettings(**{"task": "edit", "width": 1024, "height": 1024, "kv_method": "unicache", **changes})
    return plan_memory(official_config(), settings, 24 * GB)


def test_official_plan_weights_per_dtype_and_offload():
    bf16, fp8, int8 = _plan(), _plan(weight_dtype="fp8_e4m3fn"), _plan(weight_dtype="int8")
    assert 29.0 * GB < bf16.breakdown["weights_device_bfloat16"] < 29.5 * GB  # 14.6B parameters, two experts
    assert fp8.breakdown["weights_device_float8_e4m3fn"] == int8.breakdown["weights_device_int8"]
    head = 152_064 * 3_584 * 2  # lm_head stays bf16 under an 8-bit weight dtype
    eight_bit = fp8.breakdown["weights_device_float8_e4m3fn"]
    assert 0.49 < (eight_bit + head / 2) / bf16.breakdown["weights_device_bfloat16"] < 0.51
    assert head < fp8.breakdown["weights_device_bfloat16"] < head * 1.1  # the head, norms and biases
    eight_bit_total = sum(v for k, v in fp8.breakdown.items() if k.startswith("weights_device"))
    assert 0.5 < eight_bit_total / bf16.breakdown["weights_device_bfloat16"] < 0.54
    offloaded = _plan(weight_dtype="fp8_e4m3fn", offload="layers")
    assert offloaded.breakdown["weights_host"] > 0.8 * fp8.breakdown["weights_device_float8_e4m3fn"]
    assert offloaded.peak_bytes + offloaded.breakdown["weights_host"] == fp8.peak_bytes
    assert bf16.breakdown["kv_compressed"] < bf16.breakdown["kv_full"]
    assert not bf16.fits and bf16.suggestion.startswith("use --weight-dtype")
    assert offloaded.fits and offloaded.suggestion is None


def test_plan_json_schema(tmp_path: Path, capsys):
    out = tmp_path / "plan.json"
    assert (
        cli_main(
            [
                "plan",
                "--checkpoint",
                "bagel-7b-mot",
                "--task",
                "edit",
                "--device-memory",
                "8GB",
                "--weight-dtype",
                "int8",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert set(data) == {
        "peak_bytes",
        "breakdown",
        "device_bytes",
        "fits",
        "suggestion",
        "vae_decode",
        "peak_phase",
        "phases",
        "settings",
    }
    assert data["device_bytes"] == 8 * GB and data["fits"] is False and isinstance(data["suggestion"], str)
    assert data["peak_bytes"] == sum(v for k, v in data["breakdown"].items() if k not in NOT_IN_PEAK)
    parts = data["breakdown"]
    assert parts["working"] == data["peak_bytes"] - sum(
        v for k, v in parts.items() if k not in NOT_IN_PEAK and k != "working"
    )
    assert parts["working"] >= parts["vae_working"] + parts["cuda_vae_workspace"]
    assert data["peak_bytes"] == max(data["phases"].values()) == data["phases"][data["peak_phase"]]
    # the edit's calls: the source's VAE and ViT blocks into gen, the prompt into gen, then into cfg_img
    assert list(data["phases"]) == ["vae:encode", "prefill:item0", "prefill:item1", "prefill:item2"] + [
        "prefill:item3",
        "denoise:first",
        "denoise:compress",
        "denoise",
        "vae:decode",
    ]
    assert data["settings"]["weight_dtype"] == "int8"
    assert "does not fit" in capsys.readouterr().out


def test_cli_refuses_a_run_that_cannot_fit(tiny_checkpoint: Path, tmp_path: Path, monkeypatch, capsys):
    monkeypatch.setattr("unicache_core.bagel.memory.plan.device_memory_bytes", lambda device: 1000)
    code = cli_main(
        [
            "t2i",
            "--checkpoint",
            str(tiny_checkpoint),
            "--prompt",
            "a cube",
            "--width",
            "64",
            "--height",
            "64",
            "--quiet",
            "--out",
            str(tmp_path / "x.png"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "planned" in err[0] and "--width/--height" in err[0]
    assert not (tmp_path / "x.png").exists()


def test_bad_device_memory_is_one_line(capsys):
    assert cli_main(["plan", "--checkpoint", "bagel-7b-mot", "--task", "t2i", "--device-memory", "12XB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "12XB" in err[0]


@pytest.mark.parametrize("weight_dtype", ["auto", "int8"])
@pytest.mark.parametrize("task", ["und", "t2i", "edit"])
def test_plan_matches_the_tensors_a_run_holds(tiny_checkpoint: Path, task: str, weight_dtype: str):
    """Weights and VAE exactly the loaded tensors' bytes; the full KV within 10% of what the branches hold."""
    loaded = load_bagel(tiny_checkpoint, weight_dtype=weight_dtype)
    pipe = BagelPipeline(loaded)
    prompt = "make the square red and the background dark"
    image = Image.new("RGB", (96, 64), (200, 30, 30))
    if task == "und":
        result = pipe.understand(prompt, image)
        held, size = result.info["cache_bytes"], image.size
    elif task == "t2i":
        settings = T2I_DEFAULTS.__class__(**{**T2I_DEFAULTS.__dict__, "width": 64, "height": 96, "num_timesteps": 3})
        result = pipe.text_to_image(prompt, settings, decode=False)
        held, size = sum(result.info["cache_bytes"].values()), (64, 96)
    else:
        result = pipe.edit(prompt, image)
        held, size = sum(result.info["cache_bytes"].values()), image.size
    settings = PlanSettings(task=task, width=size[0], height=size[1], weight_dtype=weight_dtype)
    plan = plan_memory(
        plan_config(tiny_checkpoint), settings, 24 * GB, prompt_tokens=len(loaded.tokenizer.encode(prompt))
    )
    weights = sum(v for k, v in plan.breakdown.items() if k.startswith("weights_"))
    assert weights == parameter_bytes(loaded.model)
    assert plan.breakdown["vae"] == parameter_bytes(loaded.vae)
    assert abs(plan.breakdown["kv_full"] - held) <= 0.1 * held, (plan.breakdown["kv_full"], held)


@pytest.mark.parametrize("task", ["und", "t2i", "edit"])
def test_plan_peak_matches_the_tensor_accounting_of_a_run(task: str):
    """The CPU plan's tensor peak within 10% of parameter bytes + the peak of the tensors alive during a CPU run."""
    from benchmarks.memory_plan_check import BUNDLED, TOLERANCE, tensor_accounting

    measured, planned, _ = tensor_accounting(BUNDLED, task, 128)
    assert abs(planned / measured - 1) <= TOLERANCE, (task, planned, measured)


def test_official_plan_attention_holds_no_whole_score_matrix():
    """A 1024x1024 edit's attention term is the flash kernels' fp32 outputs, far below one layer's fp32 scores."""
    plan = _plan(weight_dtype="fp8_e4m3fn")
    config = official_config()
    scores = 4098 * 13000 * config.llm.num_attention_heads * 4
    assert plan.breakdown["attention"] < scores / 20
    assert plan.fits  # fp8 weights, resident: fits 24 GB now that the phases are not added up


def test_cuda_and_cpu_plans_share_their_tensor_peak():
    """A GPU plan (the default) adds CUDA's own terms and no CPU term, the CPU plan the reverse; both keep the
    same tensor peak, and each runtime term is what separates its peak from it."""
    fp8 = "fp8_e4m3fn"  # fits 24 GB: the whole VAE decode on both devices
    cuda, default = _plan(device="cuda", weight_dtype=fp8), _plan(weight_dtype=fp8)
    assert not any(name.startswith("cpu_") for name in cuda.breakdown) and cuda == default
    assert cuda.peak_bytes == sum(v for k, v in cuda.breakdown.items() if k not in NOT_IN_PEAK)
    cpu = _plan(device="cpu", weight_dtype=fp8)
    cuda_terms, cpu_terms = (
        {"cuda_runtime", "cuda_vae_workspace"},
        {"cpu_kernel_cache", "cpu_freed_heap", "cpu_vae_heap"},
    )
    assert set(cpu.breakdown) - cpu_terms == set(cuda.breakdown) - cuda_terms
    assert cuda_terms <= set(cuda.breakdown) and not cuda_terms & set(cpu.breakdown)
    assert tensor_peak_bytes(cpu) == tensor_peak_bytes(cuda) < cuda.peak_bytes
    tensors_working = cuda.breakdown["working"] - cuda.breakdown["cuda_vae_workspace"]  # the VAE phase is the larger
    assert cuda.peak_bytes == tensor_peak_bytes(cuda) + cuda.breakdown["cuda_runtime"] + (
        cuda.breakdown["working"] - tensors_working
    )
    assert cpu.peak_bytes == tensor_peak_bytes(cpu) + cpu.breakdown["cpu_kernel_cache"] + (
        cpu.breakdown["working"] - tensors_working
    )


def test_cuda_terms_of_a_1024_px_edit():
    """BAGEL-7B-MoT, a 1024 px edit in fp8 without offload, on CUDA: the VAE decode is the larger phase, the full KV is
    not added beside it (the pipeline frees the caches first), and the plan is the H200 run's peak
    (benchmarks/gpu_real_size.py: 20.21 GB measured) within 1%."""
    plan = _plan(weight_dtype="fp8_e4m3fn")
    parts = plan.breakdown
    assert parts["cuda_vae_workspace"] == CUDA_VAE_DECODE_PER_PIXEL * 1024 * 1024
    assert parts["working"] == parts["vae_working"] + parts["cuda_vae_workspace"]
    assert parts["working"] > parts["kv_full"] + parts["upcast"] + parts["attention"] + parts["mlp"]
    assert abs(plan.peak_bytes / 20.206e9 - 1) < 0.01, plan.peak_bytes


def test_cpu_terms_of_a_known_request():
    """BAGEL-7B-MoT, a 1024x1024 understanding: the kernels of its linear shapes and the heap its forward keeps; the
    bundled model's 128 px text-to-image: its VAE heap, two of its largest activations under glibc's mmap threshold."""
    config = official_config()
    tokens = request_tokens(config, "understanding", 1024, 1024, prompt_tokens=64, answer_tokens=16)
    assert tokens.vit == 4900 and tokens.decoded == 16  # 70 x 70 patches of 14 px (the ViT's 980 px resize)
    # row counts 66 (prompt), 4902 (ViT block), 1 (answer); 5 decoder shapes each (q with a bias, o without, both
    # 3584 x 3584; k/v; gate/up; down); 6 ViT/connector shapes at 4900 rows; lm_head at 1 row
    assert len(matmul_shapes(config, tokens)) == 3 * 5 + 6 + 1
    parts = cpu_runtime_parts(config, torch.bfloat16, tokens)
    assert parts["kernel_cache"] == 22 * CPU_MATMUL_KERNEL_BYTES and parts["vae_heap"] == 0  # no VAE here
    # 4902 rows: fp32 attention outputs 4902*3584*4 = 70 MB and the 18944-wide MLP tensors 186 MB are mapped
    # apart (>= 32 MiB); the 4 + 1 hidden-size tensors of 4902*3584*2 = 35.1 MB are too
    assert parts["freed_heap"] == 0
    small = request_tokens(config, "understanding", 448, 448, prompt_tokens=64, answer_tokens=16)
    rows = small.largest_block()
    hidden = rows * 3584 * 2
    assert hidden < GLIBC_MMAP_THRESHOLD_MAX
    assert cpu_runtime_parts(config, torch.bfloat16, small)["freed_heap"] == sum(
        size * count
        for size, count in ((rows * 28 * 128 * 4, 2), (rows * 18944 * 2, 3), (hidden, 5))
        if size < GLIBC_MMAP_THRESHOLD_MAX
    )
    assert cpu_runtime_parts(config, torch.float32, tokens)["kernel_cache"] == 0  # fp32 products: MKL, no cache
    bundled = plan_config(BUNDLED_CHECKPOINT_DIR)
    t2i = request_tokens(bundled, "t2i", 128, 128)
    # the bundled VAE decodes 128 px through 64-channel fp32 maps; the largest, 64 x 128 x 128 x 4 = 4 MiB, is heap
    assert cpu_runtime_parts(bundled, torch.bfloat16, t2i)["vae_heap"] == 2 * 64 * 128 * 128 * 4


def test_plan_takes_the_runs_kv_flags_and_prices_the_configured_method(tmp_path: Path):
    """``plan`` takes ``--kv-target``, ``--policy``, ``--rho`` and ``--rho-floor`` as a run does, and plans the method
    they configure (issue #61): a 4 x 1024² question at kv_target 0.9 holds 2.9x the default UniCache's KV at its
    peak (image rows written at 8 bits instead of 2), and the JSON names every setting."""
    table = Path(__file__).resolve().parents[1] / "unicache_core" / "compression" / "tables" / "bagel-7b-mot.json"
    held = {}
    for name, flags in {
        "default": [],
        "0.9": ["--kv-target", "0.9"],
        "rho": ["--rho", "0.5", "--rho-floor", "0.3", "--policy", str(table)],
    }.items():
        out = tmp_path / f"{name}.json"
        sizes = ",".join(["1024x1024"] * 4)
        argv = ["plan", "--checkpoint", "bagel-7b-mot", "--task", "und", "--image-sizes", sizes, "--kv-method"]
        assert cli_main([*argv, "unicache", *flags, "--json", str(out), "-q"]) == 0
        data = json.loads(out.read_text())
        held[name] = data["breakdown"]["kv_held"]
        settings = data["settings"]["kv_settings"]
        assert data["settings"]["kv_method"] == settings["method"] == "unicache"
    assert settings["rho"] == 0.5 and settings["rho_floor"] == 0.3 and settings["policy"] == str(table)
    assert held["0.9"] >= 2.8 * held["default"] and held["rho"] > 1.5 * held["default"]  # rho0 0.5: 4-bit rows
