"""The tensors a config implies, counted without building (:mod:`unicache_core.bagel.weight_layout`), against the
model that is built today: the same names and shapes, and the same bytes per stored dtype for every weight dtype,
compute dtype and offload mode, on the tiny, the bundled and BAGEL-7B-MoT's geometry."""

from __future__ import annotations

import pytest
import torch

from unicache_core.bagel.config import load_bagel_config
from unicache_core.bagel.memory.plan import _weights, official_config
from unicache_core.bagel.modeling import AutoEncoder
from unicache_core.bagel.modeling.operations import is_low_precision
from unicache_core.bagel.settings import BUNDLED_CHECKPOINT_DIR
from unicache_core.bagel.weight_layout import bagel_layout, vae_layout
from unicache_core.bagel.weights import WEIGHT_DTYPES, build_bagel, checkpoint_shapes

COMPUTE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _geometry(name: str, tiny_checkpoint):
    if name == "tiny":
        return load_bagel_config(tiny_checkpoint)
    if name == "bundled":
        return load_bagel_config(BUNDLED_CHECKPOINT_DIR)
    return official_config()


def built_weight_parts(config, weight_dtype: str, dtype: torch.dtype, offload: str) -> dict[str, int]:
    """The plan's weight parts as they were counted before the layout: on a model built on the meta device."""
    model = build_bagel(config, weight_dtype=weight_dtype, dtype=dtype, device="meta")
    layers = list(model.language_model.model.layers)
    on_host = (
        {id(t) for layer in layers[2:] for t in list(layer.parameters()) + list(layer.buffers())}
        if offload == "layers"
        else set()
    )
    parts: dict[str, int] = {}
    host = 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        size = tensor.numel() * tensor.element_size()
        if id(tensor) in on_host:
            host += size
        else:
            key = f"weights_device_{str(tensor.dtype).removeprefix('torch.')}"
            parts[key] = parts.get(key, 0) + size
    parts["weights_host"] = host
    with torch.device("meta"):
        vae = AutoEncoder(config.ae)
    parts["vae"] = sum(t.numel() * t.element_size() for t in vae.parameters())
    element = dtype.itemsize

    def upcast_of(module) -> int:
        return sum(m.weight.numel() * element for m in module.modules() if is_low_precision(m))

    parts["upcast"] = max(upcast_of(layers[0]) if layers else 0, upcast_of(model.language_model.lm_head))
    return parts


@pytest.mark.parametrize("geometry", ["tiny", "bundled", "bagel-7b-mot"])
def test_layout_names_and_shapes_are_those_of_the_built_model(geometry, tiny_checkpoint):
    config = _geometry(geometry, tiny_checkpoint)
    built = build_bagel(config, device="meta")
    assert bagel_layout(config).checkpoint_shapes() == {k: tuple(v) for k, v in checkpoint_shapes(built).items()}
    with torch.device("meta"):
        vae = AutoEncoder(config.ae)
    assert {s.name: s.shape for s in vae_layout(config.ae)} == {k: tuple(v) for k, v in checkpoint_shapes(vae).items()}


@pytest.mark.parametrize("geometry", ["tiny", "bundled", "bagel-7b-mot"])
@pytest.mark.parametrize("weight_dtype", list(WEIGHT_DTYPES))
def test_planned_weight_bytes_equal_the_built_model(geometry, weight_dtype, tiny_checkpoint):
    """Equal bytes per stored dtype, host bytes, VAE and upcast: every weight dtype, compute dtype, offload mode."""
    config = _geometry(geometry, tiny_checkpoint)
    compute = ["bf16", "fp16", "fp32"] if geometry != "bagel-7b-mot" else ["bf16", "fp32"]
    for name in compute:
        for offload in ("none", "layers"):
            counted, element = _weights(config, weight_dtype, COMPUTE[name], offload)
            assert counted == built_weight_parts(config, weight_dtype, COMPUTE[name], offload), (name, offload)
            assert element == COMPUTE[name].itemsize


def test_layout_costs_the_same_at_ten_million_layers(tiny_checkpoint):
    """A plan of a config claiming 10^7 decoder and ViT layers counts (they scale exactly) without building them."""
    import dataclasses

    config = load_bagel_config(tiny_checkpoint)
    huge = dataclasses.replace(
        config,
        llm=dataclasses.replace(config.llm, num_hidden_layers=10**7),
        vit=dataclasses.replace(config.vit, num_hidden_layers=10**7),
    )
    one = dataclasses.replace(
        config,
        llm=dataclasses.replace(config.llm, num_hidden_layers=1),
        vit=dataclasses.replace(config.vit, num_hidden_layers=1),
    )
    zero = dataclasses.replace(
        config,
        llm=dataclasses.replace(config.llm, num_hidden_layers=0),
        vit=dataclasses.replace(config.vit, num_hidden_layers=0),
    )
    parts = {c: _weights(c, "int8", torch.bfloat16, "none")[0] for c in (huge, one, zero)}
    for key in parts[one]:
        if key.startswith("weights_device_"):
            per_layers = parts[one][key] - parts[zero].get(key, 0)
            assert parts[huge][key] == parts[zero].get(key, 0) + 10**7 * per_layers
    layers = bagel_layout(huge)
    assert (layers.llm_count, layers.vit_count) == (10**7, 10**7)
