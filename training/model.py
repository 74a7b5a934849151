"""The bundled model's architecture (BAGEL's, at a small width) and its tokenizer for the shapes world."""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from unicache_core.bagel.config import AEConfig, BagelConfig, LLMConfig, ResizeConfig, TransformConfig, ViTConfig
from unicache_core.bagel.modeling import AutoEncoder, Bagel
from unicache_core.bagel.tokenizer import BagelTokenizer
from unicache_core.shapes.world import vocabulary_text

from .bpe import bpe_tokenizer_files, train_tiny_bpe

#: 128 px images: 8x8 = 64 latent tokens (16 px each) and 8x8 = 64 ViT patches (112 px, patch 14).
SHAPES_TRANSFORMS = TransformConfig(vae=ResizeConfig(128, 128, 16), vit=ResizeConfig(112, 112, 14))
#: BPE merges of the shapes tokenizer: enough for every word of the world to be one token.
SHAPES_NUM_MERGES = 160
VARIANT = "UniCache-shapes"


@dataclass(frozen=True)
class ShapesGeometry:
    """The widths and depths of the bundled model (the defaults are the shipped ones); ``TrainConfig.model``
    holds overrides of these fields by name.

    The VAE keeps FLUX's GroupNorm of 32 groups, so ``ae_ch`` must be at least 64: with 32 (one channel per
    group) every norm removes each channel's mean over the image and a flat background's colour is lost
    (docs/shapes.md, the model table).
    """

    hidden: int = 128
    layers: int = 6
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 384
    vit_hidden: int = 64
    vit_layers: int = 2
    vit_heads: int = 2
    ae_ch: int = 64
    ae_mult: tuple[int, ...] = (1, 1, 1, 1)
    ae_res_blocks: int = 1


def shapes_config(vocab_size: int, geometry: ShapesGeometry = ShapesGeometry()) -> BagelConfig:
    """A small BAGEL of ``geometry``: MoT Qwen2 LLM, SigLIP NaViT (as built, the file says one layer more),
    FLUX-style VAE."""
    g = geometry
    llm = LLMConfig(
        hidden_size=g.hidden,
        intermediate_size=g.intermediate,
        num_hidden_layers=g.layers,
        num_attention_heads=g.heads,
        num_key_value_heads=g.kv_heads,
        vocab_size=vocab_size,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
    )
    vit = ViTConfig(
        hidden_size=g.vit_hidden,
        intermediate_size=2 * g.vit_hidden,
        num_attention_heads=g.vit_heads,
        num_hidden_layers=g.vit_layers,
        image_size=980,
        patch_size=14,
    )
    ae = AEConfig(
        ch=g.ae_ch, ch_mult=tuple(g.ae_mult), num_res_blocks=g.ae_res_blocks, scale_factor=1.0, shift_factor=0.0
    )
    return BagelConfig(llm=llm, vit=vit, ae=ae, transforms=SHAPES_TRANSFORMS)


@functools.lru_cache(maxsize=1)
def shapes_tokenizer_files() -> tuple[dict[str, str], dict[str, int], int, int, int]:
    """``(files, BAGEL special ids, vocab_size, bos, eos)`` of the BPE trained on the world's text."""
    vocab, merges = train_tiny_bpe(SHAPES_NUM_MERGES, vocabulary_text())
    files, ids, added, vocab_size = bpe_tokenizer_files(vocab, merges)
    return files, ids, vocab_size, min(added), min(added) + 2


def shapes_tokenizer() -> BagelTokenizer:
    """The shapes tokenizer (:func:`shapes_tokenizer_files`) as a :class:`BagelTokenizer`."""
    files = shapes_tokenizer_files()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in files.items():
            (Path(tmp) / name).write_text(text, encoding="utf-8")
        return BagelTokenizer.from_dir(tmp)


def init_weights(module: torch.nn.Module, gen: torch.Generator, *, conv_fan_in: bool) -> None:
    """The deterministic init of every small model written here (the shapes model, the tiny and the medium
    checkpoints): norms 1/0, linear/embedding N(0, 0.02), convs N(0, 1/fan_in) with ``conv_fan_in``."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
            if isinstance(owner, (torch.nn.LayerNorm, torch.nn.GroupNorm)) or "norm" in name.split(".")[-2]:
                param.fill_(1.0 if leaf == "weight" else 0.0)
            elif name.endswith("pos_embed"):
                continue  # filled with the sin-cos table
            elif conv_fan_in and param.dim() == 4:
                fan_in = param.shape[1] * param.shape[2] * param.shape[3]
                param.copy_(torch.randn(param.shape, generator=gen) / fan_in**0.5)
            elif conv_fan_in and leaf == "bias":
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)


#: Modules that turn image content into LLM inputs (``unit_input_init`` of :func:`build_models` scales them):
#: the understanding side (ViT patches into the LLM) and the generation side (timestep and VAE latents).
INPUT_MODULES: tuple[str, ...] = ("vit_model", "connector", "time_embedder", "vae2llm")
UND_INPUT_MODULES: tuple[str, ...] = ("vit_model", "connector")


def unit_init_modules(spec: bool | str | Sequence[str]) -> tuple[str, ...]:
    """The :data:`INPUT_MODULES` that ``spec`` names: ``True`` / ``"all"`` = all of them, ``False`` / ``""`` /
    ``"none"`` = none, ``"und"`` = :data:`UND_INPUT_MODULES`, else a comma-separated string or a list of names."""
    if spec is True or spec == "all":
        return INPUT_MODULES
    if spec is False or not spec or spec == "none":
        return ()
    if spec == "und":
        return UND_INPUT_MODULES
    names = [n for n in spec.split(",") if n] if isinstance(spec, str) else list(spec)
    unknown = [n for n in names if n not in INPUT_MODULES]
    if unknown:
        raise ValueError(
            f"unknown input module(s) {unknown} for unit-gain init; use 'all', 'und' or some of {list(INPUT_MODULES)}"
        )
    return tuple(n for n in INPUT_MODULES if n in names)


def build_models(
    cfg: BagelConfig, seed: int, *, unit_input_init: bool | str | Sequence[str] = False
) -> tuple[Bagel, AutoEncoder]:
    """Freshly initialised fp32 models (N(0, 0.02) linears, fan-in VAE convs, sin-cos position tables).

    ``unit_input_init`` (:func:`unit_init_modules`) starts those of the image input modules at
    N(0, 1/fan_in) instead, so an image token's content is about as large as the frozen sin-cos position
    table added to it; at N(0, 0.02) it is ~8x smaller. Each module draws the same values whichever others
    are chosen. What it does on each side (it helps understanding learn and weakens the generation path's
    use of the caption) is measured in docs/shapes.md, "Initialisation".
    """
    chosen = unit_init_modules(unit_input_init)
    gen = torch.Generator().manual_seed(seed)
    model = Bagel(cfg)
    init_weights(model, gen, conv_fan_in=False)
    input_gen = torch.Generator().manual_seed(seed + 1)  # its own stream: the VAE's init below is unchanged
    with torch.no_grad():
        for module in INPUT_MODULES if chosen else ():
            for param in getattr(model, module).parameters():
                if param.dim() >= 2 and param.requires_grad:
                    draw = torch.randn(param.shape, generator=input_gen) / param[0].numel() ** 0.5
                    if module in chosen:
                        param.copy_(draw)
    model.vit_pos_embed.reset_table()
    model.latent_pos_embed.reset_table()
    vae = AutoEncoder(cfg.ae)
    init_weights(vae, gen, conv_fan_in=True)
    with torch.no_grad():
        vae.encoder.conv_out.bias[cfg.ae.z_channels :].fill_(-4.0)  # start with a small posterior std
    return model, vae
