"""The memory plan phase by phase (issue 54): full KV holds each image's rows once, UniCache stores them compressed
as the context fills, and ComfyUI's lowvram placement of what is left
(unicache_core/bagel/memory/comfy_placement.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from unicache_core.bagel.memory.accounting import kv_bytes_per_token, request_tokens
from unicache_core.bagel.memory.comfy_placement import (
    MINIMUM_INFERENCE_MEMORY,
    NUM_STREAMS,
    comfy_modules,
    comfy_placement,
    lowvram_budget,
    memory_required,
)
from unicache_core.bagel.memory.plan import PlanSettings, official_config, plan_without_suggestion
from unicache_core.bagel.memory.plan_kv import bound_method, kv_per_image, kv_phases
from unicache_core.compression.family import FULL_BITS, Segment
from unicache_core.kv.quant import quantize_keys, quantize_values
from unicache_core.kv.token_types import TokenType

GB = 10**9
CONFIG = official_config()
FOUR = ((1024, 1024),) * 4


def _plan(method: str, images=FOUR, task: str = "edit", **kw):
    settings = PlanSettings(
        task=task, width=1024, height=1024, images=images, kv_method=method, weight_dtype="fp8_e4m3fn", **kw
    )
    return plan_without_suggestion(CONFIG, settings, 24 * GB)


@pytest.fixture
def evict_kinds_written():
    """UniCache as FILL_DESIGN D2 has it (its ``memory`` objective): the rows it evicts later also stored as written,
    at the target's bytes (at least the floor bits)."""
    from unicache_core.compression.methods.unicache import UniCache

    return UniCache(objective="memory")


def _written_ratio(method, task: str, kind: TokenType, rows: int) -> float:
    """Stored bytes over uncompressed bytes of ``rows`` rows of ``kind`` as ``method`` writes them (its own
    :meth:`~unicache_core.compression.method.Method.written_store`)."""
    llm = CONFIG.llm
    full = 2 * rows * llm.num_key_value_heads * llm.head_dim * 2
    segment = Segment(rows, rows, FULL_BITS, full, True, llm.num_key_value_heads, llm.head_dim, 2)
    choice = bound_method(method, task, CONFIG).written_store(task, kind, segment)
    return 1.0 if choice is None else segment.choice_bytes(choice) / full


def test_full_kv_holds_each_image_once_and_unicache_its_written_rows():
    """4 x 1024² edit, fp8, 24 GB: full KV holds each image's rows once; UniCache the image rows as it stores them
    while the context fills (its own written store), the rest whole."""
    full, ours = _plan("full"), _plan("unicache")
    per_token = kv_bytes_per_token(CONFIG, torch.bfloat16)
    images = 4 * (4096 + 2 + 4900 + 2) * per_token
    prompt = (64 + 2) * per_token
    tokens = request_tokens(CONFIG, "edit", 1024, 1024, images=FOUR)
    filled = [p for p in kv_phases(CONFIG, torch.bfloat16, tokens, "full") if p.name == "denoise:first"][0]
    assert filled.kv == images + 2 * prompt  # gen's prompt and cfg_img's; cfg_text shares gen's images
    assert full.breakdown["kv_full"] == 2 * images + 2 * prompt  # the official code copies the images per branch
    assert images <= full.breakdown["kv_held"] <= filled.kv  # the peak phase: the last ViT block or step 1
    vae, vit = (
        _written_ratio("unicache", "edit", t, n)
        for t, n in ((TokenType.SOURCE_VAE, 4096), (TokenType.SOURCE_VIT, 4900))
    )
    assert vae == pytest.approx(0.2, abs=0.01)  # an edit's VAE rows: quantized as written (the paper table)
    held = sum(
        image["held_bytes"] for image in kv_per_image(CONFIG, torch.bfloat16, tokens, FOUR, kv_method="unicache")
    )
    assert held == pytest.approx(4 * ((4096 * vae + 4900 * vit) * per_token + 4 * per_token), rel=1e-3)
    assert ours.breakdown["kv_held"] < full.breakdown["kv_held"] and ours.peak_bytes <= full.peak_bytes
    assert full.peak_bytes == max(size for _, size in full.phases)


def test_the_done_when_plan_with_evicted_rows_written_at_the_floor(evict_kinds_written):
    """Issue 54's figure when the ViT rows UniCache evicts are also stored as written, at 2 bits: at most a third of
    full KV's bytes at the peak."""
    full, ours = _plan("full"), _plan(evict_kinds_written)
    assert ours.breakdown["kv_held"] <= full.breakdown["kv_held"] / 3


def test_phases_fill_item_by_item_and_unicache_holds_less_at_each():
    tokens = request_tokens(CONFIG, "edit", 1024, 1024, images=FOUR)
    full = kv_phases(CONFIG, torch.bfloat16, tokens, "full")
    ours = kv_phases(CONFIG, torch.bfloat16, tokens, "unicache")
    names = [f"prefill:item{j}" for j in range(10)] + ["denoise:first", "denoise:compress", "denoise"]
    assert [p.name for p in full] == [p.name for p in ours] == names
    assert [p.kv for p in full] == sorted(p.kv for p in full)
    for a, b in zip(full, ours):
        assert b.kv < a.kv
        assert b.transient >= a.transient  # it also holds the new block's rows of one layer before storing them
    per_layer = kv_bytes_per_token(CONFIG, torch.bfloat16) // CONFIG.llm.num_hidden_layers
    first = full[len(names) - 3]
    assert first.transient == (4 * (4096 + 2 + 4900 + 2) + 66) * per_layer  # gen's one layer, concatenated
    assert ours[len(names) - 3].scoring > 0 and first.scoring == 0
    assert ours[-1].bound and not full[-1].bound  # what UniCache's first compression keeps: at most what it held


def test_the_evicted_types_wait_at_the_target_bytes_at_least_the_floor(evict_kinds_written):
    """The ViT rows UniCache evicts later are held at the target's bytes meanwhile, like the VAE rows it quantizes
    (docs/compression.md §13), never under the floor: 2 bits in groups of 128, whose ratio is the bytes a real
    quantized store of such rows holds (keys per channel, values per token)."""
    rows = 4900
    keys = torch.randn(CONFIG.llm.num_key_value_heads, rows, CONFIG.llm.head_dim, dtype=torch.bfloat16)
    held = quantize_keys(keys, 2, 128).nbytes() + quantize_values(keys, 2, 128).nbytes()
    floor = held / (2 * keys.numel() * 2)
    vit = _written_ratio(evict_kinds_written, "edit", TokenType.SOURCE_VIT, rows)
    assert floor < 0.2 and vit == pytest.approx(0.2, abs=0.01) and vit >= floor
    assert _written_ratio(evict_kinds_written, "edit", TokenType.SOURCE_VAE, rows) == pytest.approx(0.2, abs=0.01)
    for method in ("full", "h2o", "snapkv", "kivi"):
        assert _written_ratio(method, "edit", TokenType.SOURCE_VIT, rows) == 1.0  # kept whole until compressed
    rho1 = bound_method(method_from_name_("unicache", rho=1.0), "edit", CONFIG)
    llm = CONFIG.llm
    segment = Segment(
        rows,
        rows,
        FULL_BITS,
        2 * rows * llm.num_key_value_heads * llm.head_dim * 2,
        True,
        llm.num_key_value_heads,
        llm.head_dim,
        2,
    )
    assert rho1.written_store("edit", TokenType.SOURCE_VIT, segment) is None  # a full target keeps every row


def method_from_name_(name, **settings):
    from unicache_core.compression import method_from_name

    return method_from_name(name, **settings)


def test_comfy_modules_are_the_plans_weights():
    """ComfyUI's module list (fp8: Linear/Embedding in fp8, the head bf16, the VAE fp32) adds up to the plan's
    weights and VAE."""
    plan = _plan("full")
    weights = sum(v for k, v in plan.breakdown.items() if k.startswith("weights_device_")) + plan.breakdown["vae"]
    modules = comfy_modules(CONFIG, "fp8_e4m3fn", torch.bfloat16)
    # the plan's fp8 linears keep a per-row fp32 scale ComfyUI's plain cast does not; its biases are bf16
    assert sum(m.size for m in modules) == pytest.approx(weights, rel=0.01)
    names = {m.name for m in modules}
    assert "bagel.language_model.model.layers.27.mlp_moe_gen.down_proj" in names and "vae.decoder.conv_out" in names


def test_comfy_placement_follows_load_models_gpu():
    modules = comfy_modules(CONFIG, "fp8_e4m3fn", torch.bfloat16)
    model = sum(m.size for m in modules)
    whole = comfy_placement(CONFIG, "fp8_e4m3fn", torch.bfloat16, model + 3 * GB, 1 * GB)
    assert whole.whole and whole.loaded == model and whole.streamed_per_step == 0
    # lowvram_model_memory: what is free less max(minimum_inference_memory, memory_required + the reserve)
    assert lowvram_budget(16 * GB, 0) == 16 * GB - MINIMUM_INFERENCE_MEMORY
    assert lowvram_budget(16 * GB, 3 * GB) == 16 * GB - 3 * GB - 400 * 2**20
    assert lowvram_budget(GB, 3 * GB) == 0
    part = comfy_placement(CONFIG, "fp8_e4m3fn", torch.bfloat16, 12 * GB, 3 * GB)
    assert part.loaded + part.offloaded == model and 0 < part.offloaded < model
    largest = max(m.size for m in modules)
    assert part.budget - largest * (NUM_STREAMS + 2) <= part.loaded < part.budget  # filled up to the reserve
    # a denoising step streams each left-behind decoder module once per CFG branch (3), the rest once or never
    assert part.offloaded <= part.streamed_per_step <= 3 * part.offloaded
    more = comfy_placement(CONFIG, "fp8_e4m3fn", torch.bfloat16, 12 * GB, 4 * GB)
    assert more.offloaded > part.offloaded and more.streamed_per_step > part.streamed_per_step
    nothing = comfy_placement(CONFIG, "fp8_e4m3fn", torch.bfloat16, 2 * GB, 3 * GB)
    assert nothing.loaded == 0 and nothing.offloaded == model


@pytest.mark.parametrize("task,side", [("edit", 1024), ("understanding", 980)])
def test_memory_required_is_the_peak_above_the_weights_and_unicache_asks_less(task, side):
    images = ((side, side),) * 8
    tokens = request_tokens(CONFIG, task, side, side, images=images)
    full = memory_required(CONFIG, torch.bfloat16, tokens, "full")
    ours = memory_required(CONFIG, torch.bfloat16, tokens, "unicache")
    # an edit's VAE rows are stored quantized as written; a question's ViT rows only once evicted rows are written too
    assert ours < full if task == "edit" else ours <= full
    plan = _plan("full", images=images, task="edit" if task == "edit" else "und")
    layer_upcast = plan.breakdown["upcast"]
    # ComfyUI casts one Linear per call, not a decoder layer at once, and the decode may fall back to tiles
    assert full <= plan.above_weights and full >= plan.breakdown["kv_held"] + 0.1 * layer_upcast
    assert (
        dataclasses.replace(plan).above_weights
        == plan.peak_bytes
        - sum(v for k, v in plan.breakdown.items() if k.startswith("weights_device_"))
        - plan.breakdown["vae"]
    )


def test_comfy_modules_are_the_modules_comfyui_walks():
    """The module list, counted from the geometry, is the one ComfyUI's ``ModelPatcher._load_list`` walks on the
    pack's model: every module with parameters of its own (none in a child), its state_dict's bytes; built here on
    the meta device from a namespace that stores fp8 as a plain cast, as ComfyUI's operations do."""
    from unicache_core.bagel.memory.plan import plan_config
    from unicache_core.bagel.modeling.autoencoder import AutoEncoder
    from unicache_core.bagel.modeling.operations import TorchOperations
    from unicache_core.bagel.settings import BUNDLED_CHECKPOINT_DIR
    from unicache_core.bagel.weights import build_bagel

    config = plan_config(BUNDLED_CHECKPOINT_DIR)
    root = torch.nn.Module()
    root.bagel = build_bagel(
        config, weight_dtype="fp8_e4m3fn", dtype=torch.bfloat16, device="meta", operations=TorchOperations
    )
    root.vae = AutoEncoder(config.ae, operations=TorchOperations, dtype=torch.float32, device="meta")
    walked = {}
    for name, module in root.named_modules():
        own = list(module.parameters(recurse=False))
        if own and len(own) == len(list(module.parameters())):
            walked[name] = sum(t.nelement() * t.element_size() for t in module.state_dict().values())
    planned = {m.name: m.size for m in comfy_modules(config, "fp8_e4m3fn", torch.bfloat16)}
    assert planned == walked and len(walked) > 200


def test_a_question_asks_less_when_the_evicted_rows_are_written_at_the_floor(evict_kinds_written):
    tokens = request_tokens(CONFIG, "understanding", 980, 980, images=((980, 980),) * 8)
    assert memory_required(CONFIG, torch.bfloat16, tokens, "unicache") < memory_required(
        CONFIG, torch.bfloat16, tokens, "full"
    )
