"""Weight dtypes outside ComfyUI: storage, per-call upcast, shared upcasts across CFG branches, bytes held."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.config import load_bagel_config
from unicache_core.bagel.modeling import Bagel
from unicache_core.bagel.modeling.operations import (
    LowPrecisionLinear,
    is_low_precision,
    low_precision_operations,
    shared_upcasts,
    store_weight,
    upcast_weight,
)
from unicache_core.bagel.modeling.qwen2_mot import BranchInput
from unicache_core.bagel.weights import (
    WEIGHT_DTYPES,
    HostOperations,
    assign_checkpoint_tensor,
    build_bagel,
    checkpoint_shapes,
    head_storage_dtype,
    parameter_bytes,
    parameter_bytes_by_dtype,
    parse_weight_dtype,
    weight_operations,
)
from unicache_core.kv.cache import AttentionCall, FullKVCache
from unicache_core.kv.token_types import TokenType, type_tensor

#: Relative (Frobenius) error of the tiny checkpoint's outputs against the bf16 build, measured on this
#: machine (the largest of logits | hidden | velocity | ViT tokens): fp16 0 (bf16 values of this size fit
#: fp16 exactly), int8 0.014, fp8_e4m3fn 0.047, fp8_e5m2 0.096 (N(0, 0.02) weights; e5m2 keeps 2 mantissa
#: bits); always the logits. Bounds are about 2x those.
RELATIVE_BOUNDS = {
    "auto": 0.0,
    "bf16": 0.0,
    "fp32": 0.0,
    "fp16": 1e-3,
    "int8": 0.03,
    "fp8_e4m3fn": 0.1,
    "fp8_e5m2": 0.2,
}


def load_into(model: Bagel, checkpoint: Path, dtype: torch.dtype = torch.bfloat16) -> Bagel:
    """Stream the tiny checkpoint's tensors into ``model`` one by one (as a loader would)."""
    with safe_open(str(checkpoint / "ema.safetensors"), framework="pt") as fh:
        assert set(fh.keys()) == set(checkpoint_shapes(model))
        for name in fh.keys():
            assign_checkpoint_tensor(model, name, fh.get_tensor(name).to(dtype))
    model.reset_buffers("cpu")
    return model


def outputs(model: Bagel) -> dict[str, torch.Tensor]:
    """Logits of a causal text block, a mixed und/gen block's hidden states and velocity, ViT tokens."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.arange(3, 40)
    pos = torch.arange(len(ids))
    call = AttentionCall(
        token_types=type_tensor(TokenType.INSTRUCTION, len(ids)), rope_positions=pos, causal=True, update=True
    )
    cache = FullKVCache(model.num_layers)
    text = model.forward_llm(model.embed_text(ids), pos, cache, call)
    x = torch.randn(6, 64, generator=gen)
    lat = model.embed_latents(x, model.latent_position_ids(2, 3), 0.4)
    embeds = torch.cat([model.embed_text(torch.tensor([5])), lat, model.embed_text(torch.tensor([6]))])
    lpos = torch.full((8,), len(ids))
    mask = torch.tensor([False] + [True] * 6 + [False])
    lcall = AttentionCall(
        token_types=type_tensor(TokenType.CURRENT_LATENT, 8), rope_positions=lpos, causal=False, update=False
    )
    hidden = model.forward_llm(embeds, lpos, cache, lcall, gen_mask=mask)
    image = torch.rand(3, 28, 42, generator=gen) * 2 - 1
    return {
        "logits": model.lm_logits(text).float(),
        "hidden": hidden.float(),
        "velocity": model.latent_velocity(hidden[1:-1]).float(),
        "vit": model.embed_vit(image).float(),
    }


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> dict[str, torch.Tensor]:
    return outputs(load_bagel(tiny_checkpoint, dtype=torch.bfloat16).model)


@pytest.mark.parametrize("weight_dtype", list(WEIGHT_DTYPES))
def test_weight_dtype_bytes_and_outputs(tiny_checkpoint: Path, reference, weight_dtype: str):
    """Each weight dtype stores the Linear/Embedding weights as stated, and the outputs stay close to bf16."""
    bf16 = load_into(build_bagel(load_bagel_config(tiny_checkpoint), weight_dtype="bf16"), tiny_checkpoint)
    model = load_into(build_bagel(load_bagel_config(tiny_checkpoint), weight_dtype=weight_dtype), tiny_checkpoint)
    storage = WEIGHT_DTYPES[weight_dtype] or torch.bfloat16
    head = head_storage_dtype(weight_dtype, torch.bfloat16)
    assert head == (torch.bfloat16 if storage.itemsize == 1 else None)
    assert model.language_model.lm_head.weight.dtype == (head or storage)
    # every Linear/Embedding weight of the bf16 build but the head, and the same layers of this build
    names = [
        n
        for n, m in bf16.named_modules()
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) and n != "language_model.lm_head"
    ]
    plain_bytes = sum(bf16.get_submodule(n).weight.numel() * 2 for n in names)
    stored = [model.get_submodule(n) for n in names]
    assert all(m.weight.dtype == storage for m in stored)
    assert all(is_low_precision(m) == (storage != torch.bfloat16) for m in stored)
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in stored)
    assert weight_bytes * 2 == plain_bytes * storage.itemsize
    scale_bytes = sum(m.weight_scale.numel() * 4 for m in stored if getattr(m, "weight_scale", None) is not None)
    rows = sum(m.weight.shape[0] for m in stored)
    assert scale_bytes == (4 * rows if storage in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2) else 0)

    def head_bytes(m: Bagel) -> int:
        return m.language_model.lm_head.weight.numel() * m.language_model.lm_head.weight.element_size()

    others = parameter_bytes(bf16) - plain_bytes - head_bytes(bf16)  # norms, biases, sin-cos tables: bf16 in both
    assert parameter_bytes(model) == others + weight_bytes + scale_bytes + head_bytes(model)
    by_dtype = parameter_bytes_by_dtype(model)
    assert sum(by_dtype.values()) == parameter_bytes(model)
    assert by_dtype.get(str(storage).removeprefix("torch."), 0) >= weight_bytes

    got = outputs(model)
    errors = {k: float((got[k] - reference[k]).norm() / reference[k].norm()) for k in reference}
    bound = RELATIVE_BOUNDS[weight_dtype]
    assert max(errors.values()) <= bound, errors
    if storage in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2):
        assert max(errors.values()) > 1e-4  # the weights really were rounded to 8 bits


def test_low_precision_linear_weights_halve_bf16(tiny_checkpoint: Path):
    """fp8 and int8 Linear weights take half the bytes of bf16, plus one fp32 scale per output channel."""
    cfg = load_bagel_config(tiny_checkpoint)
    plain = load_into(build_bagel(cfg, weight_dtype="bf16"), tiny_checkpoint)
    linear_bytes = sum(m.weight.numel() * 2 for m in plain.modules() if isinstance(m, torch.nn.Linear))
    linear_bytes -= plain.language_model.lm_head.weight.numel() * 2  # the head stays at 16 bits
    for name in ("int8", "fp8_e4m3fn", "fp8_e5m2"):
        model = load_into(build_bagel(cfg, weight_dtype=name), tiny_checkpoint)
        linears = [m for m in model.modules() if isinstance(m, LowPrecisionLinear)]
        assert sum(m.weight.numel() * m.weight.element_size() for m in linears) * 2 == linear_bytes
        assert sum(m.weight_scale.numel() * m.weight_scale.element_size() for m in linears) == 4 * sum(
            m.out_features for m in linears
        )


@pytest.mark.parametrize("compute", [torch.float32, torch.float16])
def test_an_8_bit_build_keeps_the_output_head_at_16_bits(tiny_checkpoint: Path, compute: torch.dtype):
    """Under int8/fp8 only ``lm_head`` keeps 16 bits (bf16 for an fp32 compute, else the compute dtype): its logits
    are those of the 16-bit head on the same hidden states, while the decoder's weights really are 8-bit."""
    cfg = load_bagel_config(tiny_checkpoint)
    sixteen = torch.bfloat16 if compute == torch.float32 else compute
    plain = load_into(build_bagel(cfg, weight_dtype=sixteen, dtype=compute), tiny_checkpoint)
    for name in ("int8", "fp8_e4m3fn", "fp8_e5m2"):
        assert head_storage_dtype(name, compute) == sixteen
        model = load_into(build_bagel(cfg, weight_dtype=name, dtype=compute), tiny_checkpoint)
        assert model.language_model.lm_head.weight.dtype == sixteen
        assert model.language_model.model.layers[0].mlp.up_proj.weight.dtype == WEIGHT_DTYPES[name]
        assert model.language_model.model.embed_tokens.weight.dtype == WEIGHT_DTYPES[name]
        hidden = torch.randn(5, cfg.llm.hidden_size, dtype=compute, generator=torch.Generator().manual_seed(0))
        assert torch.equal(model.language_model(hidden), plain.language_model(hidden))
    for name in ("auto", "bf16", "fp16", "fp32"):
        assert head_storage_dtype(name, compute) is None


@pytest.mark.parametrize("storage", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, torch.float16])
@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float16, torch.float32])
def test_store_and_upcast_round_trip(storage: torch.dtype, compute: torch.dtype):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(300, 70, generator=gen) * torch.logspace(-3, 0, 300)[:, None]  # rows of very different size
    w[7] = 0.0  # an all-zero row keeps scale 1
    data, scale = store_weight(w, storage)
    assert data.dtype == storage and data.shape == w.shape
    if storage == torch.float16:
        assert scale is None
    else:
        assert scale.shape == (300,) and scale.dtype == torch.float32 and scale[7] == 1.0
    weight, out_scale = upcast_weight(data, scale, compute, torch.device("cpu"), scale_output=False)
    assert out_scale is None and weight.dtype == compute
    rel = (weight.float() - w).norm(dim=1) / w.norm(dim=1).clamp_min(1e-30)
    # per-row relative error measured: int8 0.010, e4m3fn 0.032, e5m2 0.063, fp16 0.0024 (bf16 compute rounds)
    bound = {torch.int8: 0.015, torch.float8_e4m3fn: 0.045, torch.float8_e5m2: 0.09, torch.float16: 0.004}[storage]
    assert float(rel.max()) < bound and torch.equal(weight[7], torch.zeros(70, dtype=compute))
    if scale is not None:
        raw, factor = upcast_weight(data, scale, compute, torch.device("cpu"), scale_output=True)
        if compute == torch.float16:  # the unscaled product could leave fp16's range: scaled in the weight
            assert factor is None
        else:
            torch.testing.assert_close((raw.float() * factor.float()[:, None]), weight.float(), rtol=1e-2, atol=0)


def test_e4m3fn_upcast_is_exact():
    """The bit-moving fp8 e4m3fn upcast gives every one of the 254 finite values exactly (subnormals too)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    finite = codes[~torch.isnan(codes.float())]
    got, _ = upcast_weight(
        finite[:, None], torch.ones(finite.shape[0]), torch.float32, torch.device("cpu"), scale_output=False
    )
    assert finite.numel() == 254 and torch.equal(got[:, 0], finite.float())


def test_branches_share_each_layers_upcast(tiny_checkpoint: Path, monkeypatch):
    """Three CFG-like branches run layer by layer upcast each weight once (reused by the other two) and give
    exactly what each branch gives alone."""
    import unicache_core.bagel.modeling.operations as operations

    model = load_into(build_bagel(load_bagel_config(tiny_checkpoint), weight_dtype="fp8_e5m2"), tiny_checkpoint)
    h = model.hidden_size
    branches, alone = [], []
    for b in range(3):
        n_ctx = 5 + 2 * b
        for sink in (branches, alone):
            cache = FullKVCache(model.num_layers)
            ctx = torch.randn(n_ctx, h, generator=torch.Generator().manual_seed(10 + b)).to(torch.bfloat16)
            pos = torch.arange(n_ctx)
            model.forward_llm(
                ctx,
                pos,
                cache,
                AttentionCall(
                    token_types=type_tensor(TokenType.INSTRUCTION, n_ctx), rope_positions=pos, causal=True, update=True
                ),
            )
            sink.append(cache)
    x = torch.randn(8, h, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    mask = torch.tensor([False] + [True] * 6 + [False])

    def block(cache, b):
        pos = torch.full((8,), 5 + 2 * b)
        call = AttentionCall(
            token_types=type_tensor(TokenType.CURRENT_LATENT, 8), rope_positions=pos, causal=False, update=False
        )
        return BranchInput(x, pos, cache, call, mask)

    counted = []
    original = operations.upcast_weight
    monkeypatch.setattr(operations, "upcast_weight", lambda *a, **k: counted.append(1) or original(*a, **k))
    together = model.forward_llm_branches([block(c, b) for b, c in enumerate(branches)])
    upcasts_together = len(counted)
    separate = [model.forward_llm(x, block(c, b).positions, c, block(c, b).call, mask) for b, c in enumerate(alone)]
    upcasts_separate = len(counted) - upcasts_together
    for a, s in zip(together, separate):
        assert torch.equal(a, s)
    # per layer: q, k, v, o and the MLP's gate, up, down, for both experts (the block has und and gen
    # tokens) = 14 low-precision Linears: once per layer together, once per branch and layer apart
    assert upcasts_together == 14 * model.num_layers
    assert upcasts_separate == 3 * 14 * model.num_layers
    with pytest.raises(ValueError, match="needs its own cache"):
        model.forward_llm_branches([block(branches[0], 0), block(branches[0], 0)])


@pytest.mark.parametrize("in_features", [64, 24])
def test_int8_kernel_for_few_rows(in_features: int, monkeypatch):
    """Up to 16 rows on the CPU go through torch's int8 kernel when the width allows (a multiple of 16), with
    the upcast path's values; other widths and more rows take the upcast path."""
    import unicache_core.bagel.modeling.operations as operations

    layer = low_precision_operations(torch.int8).Linear(in_features, 40, bias=True, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    layer.load_weight(torch.randn(40, in_features, generator=gen) * 0.05)
    layer.bias = torch.nn.Parameter(torch.randn(40, generator=gen).to(torch.bfloat16), requires_grad=False)
    kernel_calls = []
    original = torch._weight_int8pack_mm
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda *a: kernel_calls.append(1) or original(*a))
    for rows, dtype in (
        (1, torch.bfloat16),
        (16, torch.bfloat16),
        (3, torch.float32),
        (17, torch.bfloat16),
        (2, torch.float16),
    ):
        x = torch.randn(1, rows, in_features, generator=gen).to(dtype)
        before = len(kernel_calls)
        got = layer(x)
        used = len(kernel_calls) > before
        assert used == (in_features % 16 == 0 and rows <= operations.INT8_KERNEL_MAX_ROWS and dtype != torch.float16)
        weight, _ = upcast_weight(
            layer.weight, layer.weight_scale, torch.float32, torch.device("cpu"), scale_output=False
        )
        want = x.float() @ weight.T + layer.bias.float()
        assert got.shape == (1, rows, 40) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=0.02, atol=0.02 * float(want.abs().max()))


def test_upcast_scope_reuses_and_releases():
    layer = low_precision_operations(torch.float8_e4m3fn).Linear(16, 8, bias=True, dtype=torch.bfloat16)
    layer.load_weight(torch.randn(8, 16))
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    plain = layer(x)
    with shared_upcasts() as cache:
        first, second = layer(x), layer(x)
        with shared_upcasts() as inner:  # a nested scope joins the open one
            third = layer(x)
        assert inner is cache and (cache.upcasts, cache.reuses) == (1, 2) and len(cache.weights) == 1
    assert cache.weights == {}
    assert torch.equal(first, plain) and torch.equal(second, plain) and torch.equal(third, plain)


def test_weight_dtype_names_and_errors(tiny_checkpoint: Path):
    assert parse_weight_dtype("INT8") == "int8" and parse_weight_dtype(torch.float8_e5m2) == "fp8_e5m2"
    with pytest.raises(ValueError, match=r"`weight_dtype` 'int4' is not supported; choose one of auto, bf16"):
        parse_weight_dtype("int4")
    assert weight_operations("bf16", torch.bfloat16) is weight_operations("auto", torch.float32)
    assert weight_operations("int8", torch.bfloat16) is low_precision_operations(torch.int8)
    with pytest.raises(ValueError, match="`dtype` torch.float8_e4m3fn cannot hold hidden states"):
        weight_operations("int8", torch.float8_e4m3fn)
    cfg = load_bagel_config(tiny_checkpoint)
    with pytest.raises(ValueError, match="`dtype` torch.float8_e4m3fn cannot hold hidden states.*compute_dtype"):
        Bagel(cfg, dtype=torch.float8_e4m3fn, device="meta")
    with pytest.raises(ValueError, match="lacks the layer class\\(es\\) Conv2d, GroupNorm"):
        Bagel(
            cfg,
            operations=type(
                "Partial",
                (),
                {"Linear": torch.nn.Linear, "LayerNorm": torch.nn.LayerNorm, "Embedding": torch.nn.Embedding},
            ),
            device="meta",
        )
    model = build_bagel(cfg, weight_dtype="int8")
    assert "vae2llm.weight_scale" not in checkpoint_shapes(model) and "vae2llm.weight" in checkpoint_shapes(model)
    with pytest.raises(ValueError, match="no tensor 'vae2llm.weight_scale'"):
        assign_checkpoint_tensor(model, "vae2llm.weight_scale", torch.ones(cfg.llm.hidden_size))
    with pytest.raises(ValueError, match="no tensor 'nothing.here'"):
        assign_checkpoint_tensor(model, "nothing.here", torch.ones(1))
    with pytest.raises(ValueError, match=r"'llm2vae.bias' has shape \(3,\), the model expects \(64,\)"):
        assign_checkpoint_tensor(model, "llm2vae.bias", torch.ones(3))
    with pytest.raises(ValueError, match="cannot store a torch.int64 tensor as torch.int8"):
        store_weight(torch.ones(2, 2, dtype=torch.long), torch.int8)


class CastingOperations:
    """A host-style namespace (as ComfyUI's ``comfy.ops.manual_cast``): each layer keeps its tensors in the dtype
    it was built with and casts them to the input's dtype at every call."""

    class Linear(torch.nn.Linear):
        def forward(self, x):
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return torch.nn.functional.linear(x, self.weight.to(x.dtype), bias)

    class Conv2d(torch.nn.Conv2d):
        def forward(self, x):
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return self._conv_forward(x, self.weight.to(x.dtype), bias)

    class GroupNorm(torch.nn.GroupNorm):
        def forward(self, x):
            return torch.nn.functional.group_norm(
                x, self.num_groups, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps
            )

    class LayerNorm(torch.nn.LayerNorm):
        def forward(self, x):
            return torch.nn.functional.layer_norm(
                x, self.normalized_shape, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps
            )

    class Embedding(torch.nn.Embedding):
        def forward(self, ids, out_dtype=None):
            return torch.nn.functional.embedding(ids, self.weight).to(out_dtype)


def test_load_bagel_builds_from_a_host_namespace(tiny_checkpoint: Path, reference):
    """``weight_dtype=HostOperations(...)``: every weight-bearing layer of BAGEL and its VAE comes from the caller's
    namespace, the weights stored as ``weight_dtype`` by a plain cast (no scale), the VAE in fp32; outputs close to
    bf16."""
    loaded = load_bagel(
        tiny_checkpoint, dtype=torch.bfloat16, weight_dtype=HostOperations(CastingOperations, "fp8_e4m3fn")
    )
    up = loaded.model.language_model.model.layers[0].mlp.up_proj
    assert type(up) is CastingOperations.Linear and up.weight.dtype == torch.float8_e4m3fn
    head = loaded.model.language_model.lm_head  # the output head stays at 16 bits, from the same namespace
    assert type(head) is CastingOperations.Linear and head.weight.dtype == torch.bfloat16
    assert not any(name.endswith("weight_scale") for name, _ in loaded.model.named_parameters())
    assert loaded.model.dtype == torch.bfloat16 and loaded.weight_dtype == "fp8_e4m3fn"
    vae_layers = [m for m in loaded.vae.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.GroupNorm))]
    assert vae_layers and all(type(m).__qualname__.startswith("CastingOperations.") for m in vae_layers)
    assert all(t.dtype == torch.float32 for t in loaded.vae.parameters())
    got = outputs(loaded.model)
    errors = {k: float((got[k] - reference[k]).norm() / reference[k].norm()) for k in reference}
    assert 1e-4 < max(errors.values()) <= RELATIVE_BOUNDS["fp8_e4m3fn"], errors  # unscaled fp8: still close
    same = load_bagel(tiny_checkpoint, dtype=torch.bfloat16, weight_dtype=HostOperations(CastingOperations))  # bf16
    assert all(torch.equal(a, b) for a, b in zip(outputs(same.model).values(), reference.values()))
    with pytest.raises(ValueError, match="`weight_dtype` 'int8' keeps a scale per output channel.*fp8_e4m3fn"):
        load_bagel(tiny_checkpoint, weight_dtype=HostOperations(CastingOperations, "int8"))
    with pytest.raises(ValueError, match="lacks the layer class\\(es\\) Conv2d, GroupNorm, LayerNorm, Embedding"):
        load_bagel(tiny_checkpoint, weight_dtype=HostOperations(type("OnlyLinear", (), {"Linear": torch.nn.Linear})))
