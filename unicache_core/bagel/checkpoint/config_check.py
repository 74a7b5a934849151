"""Check a checkpoint's config against its safetensors headers before anything is built from it.

Building follows the config, so a config saying ``num_hidden_layers: 10000000`` or ``hidden_size: 2**40``
must fail here (cheaply, from the headers' names and shapes) rather than make the loader build millions
of modules or overflow. Checked: LLM layers, vocabulary and width, MLP width, attention widths; ViT
layers, width, MLP width, patch and position table; VAE levels and blocks per level, base width and
latent channels. Every name and shape is then checked against the layout the config implies
(:func:`check_names_and_shapes` with :mod:`..weight_layout`, whose expansion is now bounded by the files), still
before any module is built.

Each message names where the config came from (a folder's JSON file, or ``file.safetensors[metadata]:
llm_config.json`` for a single file's metadata) and the weights file it disagrees with.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import NoReturn

from ...errors import CheckpointError
from ..config import AEConfig, BagelConfig
from .header import SafetensorsHeader

#: Names listed in a message before "... and N more".
MAX_LISTED = 20


def listing(names: list[str]) -> str:
    """``"N: a, b, c … and M more"``: a count and the first :data:`MAX_LISTED` names."""
    shown = ", ".join(names[:MAX_LISTED])
    more = f" … and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else ""
    return f"{len(names)}: {shown}{more}"


def check_names_and_shapes(header: SafetensorsHeader, expected: Mapping[str, Sequence[int]]) -> None:
    """Refuse a weights file whose tensor names or shapes differ from ``expected`` (the layout the configs give,
    :mod:`..weight_layout`, or a built model's); the message lists the names."""
    path, shapes = header.path, header.shapes
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing keys {listing(missing)}")
        if unexpected:
            parts.append(f"unexpected keys {listing(unexpected)}")
        raise CheckpointError(
            f"{path} does not match the model built from the config files: {'; '.join(parts)}. "
            f"Check that the config JSON (the folder's files, or a single file's metadata) belongs to "
            f"these weights"
        )
    for name in sorted(shapes):
        if tuple(shapes[name]) != tuple(expected[name]):
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {tuple(shapes[name])}, the config expects "
                f"{tuple(expected[name])}; the config JSON files do not match these weights"
            )


def _indices(names: Mapping[str, object], prefix: str) -> set[int]:
    """The ``N`` of every ``{prefix}N.`` name (module-list indices present in a header)."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    found = set()
    for name in names:
        match = pattern.match(name)
        if match:
            found.add(int(match.group(1)))
    return found


class _HeaderCheck:
    """Compares one config source with one header; every failure is one :class:`CheckpointError`."""

    def __init__(self, header: SafetensorsHeader, source: str):
        self.shapes = header.shapes
        self.file_name = header.path.name
        self.source = source

    def fail(self, detail: str) -> NoReturn:
        raise CheckpointError(
            f"{self.source} does not match the weights: {detail}; the config files do not belong to these weights "
            f"(re-download the checkpoint folder)"
        )

    def count(self, prefix: str, what: str, expected: int) -> None:
        """The header holds ``{prefix}0.`` to ``{prefix}{expected - 1}.`` and no other index."""
        found = _indices(self.shapes, prefix)
        if found != set(range(expected)):
            have = f"{len(found)} ({prefix}{min(found)} to {prefix}{max(found)})" if found else f"no {prefix}*"
            self.fail(f"{what}, but {self.file_name} holds {have}")

    def shape(self, name: str, expected: tuple[int, ...], fields: str) -> None:
        """The header holds ``name`` with the shape ``expected`` (which the config ``fields`` give)."""
        if name not in self.shapes:
            self.fail(f"{self.file_name} lacks the tensor {name!r}")
        if tuple(self.shapes[name]) != tuple(expected):
            self.fail(
                f"{fields} give {name} the shape {tuple(expected)}, but {self.file_name} stores "
                f"{tuple(self.shapes[name])}"
            )


def check_model_config(config: BagelConfig, ema: SafetensorsHeader, *, llm_source: str, vit_source: str) -> None:
    """Refuse LLM / ViT configs whose layer counts or main widths disagree with the BAGEL weights' header.

    Args:
        config: the parsed configs.
        ema: the header of the BAGEL weights (``ema.safetensors``, or the single file).
        llm_source, vit_source: where the LLM and ViT configs came from, named in the messages.
    """
    llm, vit = config.llm, config.vit
    lm_check, vit_check = _HeaderCheck(ema, llm_source), _HeaderCheck(ema, vit_source)
    lm = "language_model.model."
    lm_check.count(f"{lm}layers.", f"num_hidden_layers = {llm.num_hidden_layers} layers", llm.num_hidden_layers)
    lm_check.shape(f"{lm}embed_tokens.weight", (llm.vocab_size, llm.hidden_size), "vocab_size and hidden_size")
    lm_check.shape(
        f"{lm}layers.0.mlp.gate_proj.weight",
        (llm.intermediate_size, llm.hidden_size),
        "intermediate_size and hidden_size",
    )
    lm_check.shape(
        f"{lm}layers.0.self_attn.q_proj.weight",
        (llm.num_attention_heads * llm.head_dim, llm.hidden_size),
        "num_attention_heads and hidden_size",
    )
    lm_check.shape(
        f"{lm}layers.0.self_attn.k_proj.weight",
        (llm.num_key_value_heads * llm.head_dim, llm.hidden_size),
        "num_key_value_heads and hidden_size",
    )
    vm = "vit_model.vision_model."
    # the file counts one more ViT layer than is built (BAGEL drops the last one)
    vit_check.count(
        f"{vm}encoder.layers.",
        f"num_hidden_layers = {vit.num_hidden_layers + 1} means {vit.num_hidden_layers} built layers (the "
        f"last is dropped)",
        vit.num_hidden_layers,
    )
    vit_check.shape(
        f"{vm}embeddings.patch_embedding.weight",
        (vit.hidden_size, vit.num_channels * vit.patch_size**2),
        "hidden_size, num_channels and patch_size",
    )
    vit_check.shape(
        f"{vm}embeddings.position_embedding.weight",
        (vit.num_positions, vit.hidden_size),
        "image_size, patch_size and hidden_size",
    )
    vit_check.shape(
        f"{vm}encoder.layers.0.mlp.fc1.weight",
        (vit.intermediate_size, vit.hidden_size),
        "intermediate_size and hidden_size",
    )


def check_vae_config(config: AEConfig, ae: SafetensorsHeader, *, source: str) -> None:
    """Refuse a VAE config whose levels, blocks or main widths disagree with the VAE weights' header.

    Args:
        config: the parsed VAE config.
        ae: the header of the VAE weights (``ae.safetensors``).
        source: where the VAE config came from (a file, or ``"the built-in FLUX VAE config"``).
    """
    check = _HeaderCheck(ae, source)
    levels = len(config.ch_mult)
    check.count("encoder.down.", f"ch_mult has {levels} levels", levels)
    check.count("decoder.up.", f"ch_mult has {levels} levels", levels)
    blocks = f"num_res_blocks = {config.num_res_blocks} blocks per level"
    for level in range(levels):
        check.count(f"encoder.down.{level}.block.", blocks, config.num_res_blocks)
        check.count(f"decoder.up.{level}.block.", f"{blocks} (+1 in the decoder)", config.num_res_blocks + 1)
    check.shape("encoder.conv_in.weight", (config.ch, config.in_channels, 3, 3), "ch and in_channels")
    check.shape(
        "encoder.conv_out.weight",
        (2 * config.z_channels, config.ch * config.ch_mult[-1], 3, 3),
        "z_channels, ch and ch_mult",
    )
    check.shape(
        "decoder.conv_out.weight", (config.out_ch, config.ch * config.ch_mult[0], 3, 3), "out_ch, ch and ch_mult"
    )


__all__ = ["MAX_LISTED", "check_model_config", "check_names_and_shapes", "check_vae_config", "listing"]
