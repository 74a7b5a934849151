"""The tensors a :class:`~.config.BagelConfig` implies, from its numbers alone: names, shapes, how each is stored,
and the bytes a build holds, without building a module.

A checkpoint's geometry can be checked and its weights counted before anything is built, so no config value
(``num_hidden_layers: 10000000``) makes a check or a plan build millions of modules. BAGEL's tensors are a few
shared ones plus one decoder layer's and one ViT layer's, each repeated: :class:`WeightLayout` keeps those three
groups and the two counts, so counting costs the same at any layer count; :meth:`WeightLayout.checkpoint_shapes`
expands the names (for comparing with a header whose layer count was already checked).

Every tensor has a storage role, as :func:`~.weights.build_bagel` stores it for a ``weight_dtype``:

- ``linear`` / ``embedding``: a Linear's or an Embedding's weight ``[out, in]`` / ``[rows, dim]``, stored as the
  ``weight_dtype`` (``auto``: the compute dtype); fp8 and int8 add one fp32 scale per row;
- ``head``: ``language_model.lm_head.weight``, stored as :func:`~.weights.head_storage_dtype` (16 bits under an
  8-bit ``weight_dtype``), else as a ``linear``;
- ``own``: biases, norms, BAGEL's own tables: the compute dtype;
- ``buffer``: not in checkpoints (RoPE's ``inv_freq``), fp32.

``tests/test_weight_layout.py`` checks names, shapes and bytes against the built model on the tiny, the bundled
and BAGEL-7B-MoT's geometry for every weight dtype and offload mode.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .config import AEConfig, BagelConfig

#: Name prefix of the LLM's decoder layers and of the ViT's encoder layers in a checkpoint.
LLM_LAYERS = "language_model.model.layers."
VIT_LAYERS = "vit_model.vision_model.encoder.layers."
#: Decoder layers kept on the compute device under ``offload="layers"`` (the running one and the prefetched one).
OFFLOAD_RESIDENT_LAYERS = 2
#: Width of the timestep embedder's sinusoidal input (:class:`~.modeling.embeddings.TimestepEmbedder`).
TIMESTEP_FREQUENCIES = 256


@dataclass(frozen=True)
class TensorSpec:
    """One tensor: ``name`` (within its group), ``shape`` and storage ``role`` (module docstring)."""

    name: str
    shape: tuple[int, ...]
    role: str

    @property
    def numel(self) -> int:
        count = 1
        for d in self.shape:
            count *= d
        return count


def _linear(name: str, out_features: int, in_features: int, bias: bool = True) -> list[TensorSpec]:
    specs = [TensorSpec(f"{name}.weight", (out_features, in_features), "linear")]
    return specs + ([TensorSpec(f"{name}.bias", (out_features,), "own")] if bias else [])


def _layer_norm(name: str, size: int) -> list[TensorSpec]:
    return [TensorSpec(f"{name}.weight", (size,), "own"), TensorSpec(f"{name}.bias", (size,), "own")]


def _rms_norm(name: str, size: int) -> list[TensorSpec]:
    return [TensorSpec(f"{name}.weight", (size,), "own")]


def _decoder_layer(config: BagelConfig) -> list[TensorSpec]:
    """One MoT decoder layer (:class:`~.modeling.qwen2_mot.Qwen2MoTDecoderLayer`), names without the prefix."""
    llm = config.llm
    h, d = llm.hidden_size, llm.head_dim
    q_out, kv_out = llm.num_attention_heads * d, llm.num_key_value_heads * d
    specs: list[TensorSpec] = []
    for suffix in ("", "_moe_gen"):
        specs += _linear(f"self_attn.q_proj{suffix}", q_out, h)
        specs += _linear(f"self_attn.k_proj{suffix}", kv_out, h)
        specs += _linear(f"self_attn.v_proj{suffix}", kv_out, h)
        specs += _linear(f"self_attn.o_proj{suffix}", h, q_out, bias=False)
    for name in ("q_norm", "k_norm", "q_norm_moe_gen", "k_norm_moe_gen"):
        specs += _rms_norm(f"self_attn.{name}", d)
    for mlp in ("mlp", "mlp_moe_gen"):
        specs += _linear(f"{mlp}.gate_proj", llm.intermediate_size, h, bias=False)
        specs += _linear(f"{mlp}.up_proj", llm.intermediate_size, h, bias=False)
        specs += _linear(f"{mlp}.down_proj", h, llm.intermediate_size, bias=False)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        specs += _rms_norm(norm, h) + _rms_norm(f"{norm}_moe_gen", h)
    return sorted(specs, key=_decoder_order)


def _decoder_order(spec: TensorSpec) -> int:
    """Registration order of a decoder layer's modules (attention, MLPs, norms), for a stable listing."""
    order = ("self_attn.", "mlp.", "mlp_moe_gen.", "input_layernorm", "post_attention_layernorm")
    return next(i for i, prefix in enumerate(order) if spec.name.startswith(prefix))


def _vit_layer(config: BagelConfig) -> list[TensorSpec]:
    """One SigLIP encoder layer (:class:`~.modeling.siglip.SiglipEncoderLayer`), names without the prefix."""
    hv, inter = config.vit.hidden_size, config.vit.intermediate_size
    specs = _layer_norm("layer_norm1", hv)
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        specs += _linear(f"self_attn.{proj}", hv, hv)
    return specs + _layer_norm("layer_norm2", hv) + _linear("mlp.fc1", inter, hv) + _linear("mlp.fc2", hv, inter)


def _shared(config: BagelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The tensors outside the repeated layers: (those before the ViT layers, those after them), full names."""
    llm, vit = config.llm, config.vit
    h = llm.hidden_size
    before = [TensorSpec("language_model.model.embed_tokens.weight", (llm.vocab_size, h), "embedding")]
    before += _rms_norm("language_model.model.norm", h) + _rms_norm("language_model.model.norm_moe_gen", h)
    before.append(TensorSpec("language_model.lm_head.weight", (llm.vocab_size, h), "head"))
    vm = "vit_model.vision_model."
    patch = vit.num_channels * vit.patch_size**2
    before += _linear(f"{vm}embeddings.patch_embedding", vit.hidden_size, patch)
    before.append(
        TensorSpec(f"{vm}embeddings.position_embedding.weight", (vit.num_positions, vit.hidden_size), "embedding")
    )
    after = _layer_norm(f"{vm}post_layernorm", vit.hidden_size)
    after += _linear("connector.fc1", h, vit.hidden_size) + _linear("connector.fc2", h, h)
    after.append(TensorSpec("vit_pos_embed.pos_embed", (config.vit_max_num_patch_per_side**2, h), "own"))
    after += _linear("time_embedder.mlp.0", h, TIMESTEP_FREQUENCIES) + _linear("time_embedder.mlp.2", h, h)
    after += _linear("vae2llm", h, config.patch_latent_dim) + _linear("llm2vae", config.patch_latent_dim, h)
    after.append(TensorSpec("latent_pos_embed.pos_embed", (config.max_latent_size**2, h), "own"))
    after.append(TensorSpec("language_model.model.rotary_emb.inv_freq", ((llm.head_dim + 1) // 2,), "buffer"))
    return before, after


@dataclass(frozen=True)
class WeightLayout:
    """BAGEL's tensors for one config: the shared ones and one decoder / ViT layer, each repeated ``*_count`` times.

    Attributes:
        shared: every tensor outside the repeated layers (full names).
        llm_layer, vit_layer: one layer's tensors, named within the layer (``self_attn.q_proj.weight``).
        llm_count, vit_count: the decoder's and the (built) ViT encoder's layer counts.
    """

    shared: tuple[TensorSpec, ...]
    llm_layer: tuple[TensorSpec, ...]
    vit_layer: tuple[TensorSpec, ...]
    llm_count: int
    vit_count: int

    def groups(self) -> Iterator[tuple[str, tuple[TensorSpec, ...], int]]:
        """``(name prefix, tensors, times)`` of the shared tensors and of each kind of layer."""
        yield "", self.shared, 1
        yield LLM_LAYERS, self.llm_layer, self.llm_count
        yield VIT_LAYERS, self.vit_layer, self.vit_count

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name → shape of every tensor a checkpoint must hold (buffers excluded); one entry per layer, so call it
        once the layer counts are known to be those of a real file (:mod:`.checkpoint.config_check`)."""
        shapes = {s.name: s.shape for s in self.shared if s.role != "buffer"}
        for prefix, layer, count in (
            (LLM_LAYERS, self.llm_layer, self.llm_count),
            (VIT_LAYERS, self.vit_layer, self.vit_count),
        ):
            for index in range(count):
                shapes.update((f"{prefix}{index}.{s.name}", s.shape) for s in layer if s.role != "buffer")
        return shapes


def bagel_layout(config: BagelConfig) -> WeightLayout:
    """The :class:`WeightLayout` of ``config`` (its cost does not depend on the layer counts)."""
    before, after = _shared(config)
    return WeightLayout(
        shared=tuple(before + after),
        llm_layer=tuple(_decoder_layer(config)),
        vit_layer=tuple(_vit_layer(config)),
        llm_count=config.llm.num_hidden_layers,
        vit_count=config.vit.num_hidden_layers,
    )


# ------------------------------------------------------------------------------------------------ VAE


def _conv(name: str, out_channels: int, in_channels: int, kernel: int) -> list[TensorSpec]:
    return [
        TensorSpec(f"{name}.weight", (out_channels, in_channels, kernel, kernel), "own"),
        TensorSpec(f"{name}.bias", (out_channels,), "own"),
    ]


def _resnet(name: str, in_channels: int, out_channels: int) -> list[TensorSpec]:
    specs = _layer_norm(f"{name}.norm1", in_channels) + _conv(f"{name}.conv1", out_channels, in_channels, 3)
    specs += _layer_norm(f"{name}.norm2", out_channels) + _conv(f"{name}.conv2", out_channels, out_channels, 3)
    if in_channels != out_channels:
        specs += _conv(f"{name}.nin_shortcut", out_channels, in_channels, 1)
    return specs


def _mid(name: str, channels: int) -> list[TensorSpec]:
    specs = _resnet(f"{name}.block_1", channels, channels) + _layer_norm(f"{name}.attn_1.norm", channels)
    for proj in ("q", "k", "v", "proj_out"):
        specs += _conv(f"{name}.attn_1.{proj}", channels, channels, 1)
    return specs + _resnet(f"{name}.block_2", channels, channels)


def vae_layout(config: AEConfig) -> list[TensorSpec]:
    """Every tensor of the FLUX VAE of ``config`` (:class:`~.modeling.autoencoder.AutoEncoder`), all ``own``
    (the VAE is kept in fp32). Its length grows with ``len(ch_mult) * num_res_blocks``, which the config bounds."""
    mults = (1,) + tuple(config.ch_mult)
    specs = _conv("encoder.conv_in", config.ch, config.in_channels, 3)
    block_in = config.ch
    for level, mult in enumerate(config.ch_mult):
        block_in = config.ch * mults[level]
        for block in range(config.num_res_blocks):
            specs += _resnet(f"encoder.down.{level}.block.{block}", block_in, config.ch * mult)
            block_in = config.ch * mult
        if level != len(config.ch_mult) - 1:
            specs += _conv(f"encoder.down.{level}.downsample.conv", block_in, block_in, 3)
    specs += _mid("encoder.mid", block_in) + _layer_norm("encoder.norm_out", block_in)
    specs += _conv("encoder.conv_out", 2 * config.z_channels, block_in, 3)
    block_in = config.ch * config.ch_mult[-1]
    specs += _conv("decoder.conv_in", block_in, config.z_channels, 3) + _mid("decoder.mid", block_in)
    for level in reversed(range(len(config.ch_mult))):
        block_out = config.ch * config.ch_mult[level]
        for block in range(config.num_res_blocks + 1):
            specs += _resnet(f"decoder.up.{level}.block.{block}", block_in, block_out)
            block_in = block_out
        if level != 0:
            specs += _conv(f"decoder.up.{level}.upsample.conv", block_in, block_in, 3)
    return specs + _layer_norm("decoder.norm_out", block_in) + _conv("decoder.conv_out", config.out_ch, block_in, 3)


# ---------------------------------------------------------------------------------------------- bytes


def _storage(weight_dtype: str, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(the storage of ``linear``/``embedding`` weights, that of the ``head``) for a ``weight_dtype`` name."""
    from .weights import WEIGHT_DTYPES, head_storage_dtype, parse_weight_dtype

    name = parse_weight_dtype(weight_dtype)
    storage = WEIGHT_DTYPES[name] or dtype
    head = head_storage_dtype(name, dtype)
    return storage, storage if head is None else head


def _stored(
    spec: TensorSpec, storage: torch.dtype, head: torch.dtype, dtype: torch.dtype
) -> list[tuple[torch.dtype, int]]:
    """``[(dtype, bytes)]`` a build holds for ``spec``."""
    from .modeling.operations import SCALED_STORAGE

    if spec.role == "buffer":
        return [(torch.float32, spec.numel * 4)]
    if spec.role == "own":
        return [(dtype, spec.numel * dtype.itemsize)]
    kept = head if spec.role == "head" else storage
    stored = [(kept, spec.numel * kept.itemsize)]
    if kept in SCALED_STORAGE:  # one fp32 scale per row
        stored.append((torch.float32, spec.shape[0] * 4))
    return stored


def weight_bytes(layout: WeightLayout, weight_dtype: str, dtype: torch.dtype, offload: str = "none") -> dict[str, int]:
    """The bytes a build of ``layout`` with ``weight_dtype`` computing in ``dtype`` holds, as the memory plan counts
    them: ``weights_device_<dtype>`` per stored dtype on the compute device, ``weights_host`` (the decoder layers
    beyond the first :data:`OFFLOAD_RESIDENT_LAYERS` under ``offload="layers"``) and ``upcast`` (the larger of one
    decoder layer's and the head's low-precision weights upcast to ``dtype`` at once)."""
    storage, head = _storage(weight_dtype, dtype)
    parts: dict[str, int] = {}
    host = 0
    resident = min(layout.llm_count, OFFLOAD_RESIDENT_LAYERS) if offload == "layers" else layout.llm_count
    for prefix, specs, count in layout.groups():
        on_device = resident if prefix == LLM_LAYERS else count
        for spec in specs:
            for kept, size in _stored(spec, storage, head, dtype):
                key = f"weights_device_{str(kept).removeprefix('torch.')}"
                parts[key] = parts.get(key, 0) + size * on_device
                host += size * (count - on_device)
    parts["weights_host"] = host

    def upcast(specs: tuple[TensorSpec, ...], role: str, kept: torch.dtype) -> int:
        return sum(s.numel for s in specs if s.role == role) * dtype.itemsize if kept != dtype else 0

    layer_upcast = upcast(layout.llm_layer, "linear", storage) if layout.llm_count else 0
    parts["upcast"] = max(layer_upcast, upcast(layout.shared, "head", head))
    return parts


def vae_bytes(config: AEConfig) -> int:
    """Bytes of the fp32 VAE's parameters."""
    return sum(spec.numel * 4 for spec in vae_layout(config))


__all__ = [
    "LLM_LAYERS",
    "OFFLOAD_RESIDENT_LAYERS",
    "TensorSpec",
    "VIT_LAYERS",
    "WeightLayout",
    "bagel_layout",
    "vae_bytes",
    "vae_layout",
    "weight_bytes",
]
