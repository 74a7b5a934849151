"""Layer offload outside ComfyUI (on the CPU: every visit is a real copy, so the mechanism is the GPU's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.config import load_bagel_config
from unicache_core.bagel.modeling import Bagel
from unicache_core.bagel.modeling.qwen2_mot import BranchInput
from unicache_core.bagel.offload import apply_layer_offload
from unicache_core.kv.cache import AttentionCall, FullKVCache
from unicache_core.kv.token_types import TokenType, type_tensor


def _run(model: Bagel) -> list[torch.Tensor]:
    """A text prefill, a latent block over it (not cached), a decode step, and the ViT path."""
    cache = FullKVCache(model.num_layers)
    ids = torch.arange(3, 20)
    pos = torch.arange(17)
    call = AttentionCall(
        token_types=type_tensor(TokenType.INSTRUCTION, 17), rope_positions=pos, causal=True, update=True
    )
    text = model.forward_llm(model.embed_text(ids), pos, cache, call)
    lat = model.embed_latents(
        torch.randn(4, 64, generator=torch.Generator().manual_seed(1)), model.latent_position_ids(2, 2), 0.5
    )
    block = torch.cat([model.embed_text(torch.tensor([1])), lat, model.embed_text(torch.tensor([2]))])
    bpos = torch.full((6,), 17)
    lcall = AttentionCall(
        token_types=type_tensor(TokenType.CURRENT_LATENT, 6), rope_positions=bpos, causal=False, update=False
    )
    hidden = model.forward_llm(block, bpos, cache, lcall, torch.tensor([False, True, True, True, True, False]))
    dpos = torch.tensor([17])
    dcall = AttentionCall(
        token_types=type_tensor(TokenType.DECODED_TEXT, 1), rope_positions=dpos, causal=True, update=True
    )
    step = model.forward_llm(model.embed_text(torch.tensor([7])), dpos, cache, dcall)
    image = torch.rand(3, 28, 28, generator=torch.Generator().manual_seed(2)) * 2 - 1
    return [model.lm_logits(text), model.latent_velocity(hidden[1:-1]), model.lm_logits(step), model.embed_vit(image)]


def test_offloaded_layers_give_identical_outputs(tiny_checkpoint: Path):
    resident = load_bagel(tiny_checkpoint, dtype=torch.bfloat16).model
    model = load_bagel(tiny_checkpoint, dtype=torch.bfloat16).model
    offload = apply_layer_offload(model, "cpu")
    layers = model.language_model.model.layers
    host = {i: layers[i].mlp.up_proj.weight.data_ptr() for i in range(len(layers))}
    seen = []  # during each layer's forward: is its weight the host copy?
    for i, layer in enumerate(layers):
        layer.mlp.register_forward_pre_hook(
            lambda mod, args, i=i: seen.append((i, mod.up_proj.weight.data_ptr() == host[i]))
        )
    want, got = _run(resident), _run(model)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert seen and all(not on_host for _, on_host in seen)  # every layer ran on a fresh device copy
    # between runs only the last layer and the prefetched first are on the device; the others are on the host
    assert offload.current == len(layers) - 1 and offload.device_layers() == min(2, len(layers))
    assert offload.transfers == 3 * len(layers) + 1  # each layer once per pass, plus the next pass's first
    assert model.execution_device == torch.device("cpu")
    offload.remove()
    assert offload.device_layers() == 0 and all(
        layers[i].mlp.up_proj.weight.data_ptr() == host[i] for i in range(len(layers))
    )
    assert all(getattr(layer, "_hf_hook", None) is None for layer in layers)
    for a, b in zip(want, _run(model)):
        assert torch.equal(a, b)


def test_branches_copy_each_layer_once(tiny_checkpoint: Path):
    """Three branches run layer by layer copy each layer once; run one after another, once per branch."""
    model = load_bagel(tiny_checkpoint, dtype=torch.bfloat16).model
    offload = apply_layer_offload(model, "cpu", prefetch=False)
    h = model.hidden_size
    x = torch.randn(6, h, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    pos = torch.zeros(6, dtype=torch.long)

    def block():
        call = AttentionCall(
            token_types=type_tensor(TokenType.CURRENT_LATENT, 6), rope_positions=pos, causal=False, update=False
        )
        return BranchInput(x, pos, FullKVCache(model.num_layers), call, torch.ones(6, dtype=torch.bool))

    together = model.forward_llm_branches([block(), block(), block()])
    assert offload.transfers == model.num_layers
    offload.release()
    before = offload.transfers
    apart = [model.forward_llm(b.embeds, b.positions, b.cache, b.call, b.gen_mask) for b in (block(), block(), block())]
    assert offload.transfers - before == 3 * model.num_layers
    for a, b in zip(together, apart):
        assert torch.equal(a, b)


def test_offload_refusals(tiny_checkpoint: Path):
    model = load_bagel(tiny_checkpoint, dtype=torch.bfloat16).model
    apply_layer_offload(model, "cpu")
    with pytest.raises(ValueError, match="already carry accelerate hooks"):
        apply_layer_offload(model, "cpu")
    with torch.device("meta"):
        empty = Bagel(load_bagel_config(tiny_checkpoint))
    with pytest.raises(ValueError, match="needs a loaded model; .* on the meta device"):
        apply_layer_offload(empty, "cpu")
