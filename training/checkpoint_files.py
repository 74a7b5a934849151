"""A model in memory as the files of an official checkpoint folder: configs with the official field names,
the ``ema``/``ae`` state dicts and the tokenizer files (:func:`model_parts`), written by :func:`write_parts`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors.torch import save_file

from unicache_core.bagel.config import BagelConfig
from unicache_core.bagel.modeling import AutoEncoder, Bagel

from .bpe import json_text

#: Stored dtypes of the BAGEL weights by name (the VAE is always fp32).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass
class CheckpointParts:
    """Everything a checkpoint folder holds, in memory (shared by the folder and the single-file writers)."""

    tokenizer_files: dict[str, str]
    configs: dict[str, dict]
    ema: dict[str, torch.Tensor]
    ae: dict[str, torch.Tensor]
    special_token_ids: dict[str, int]
    dtype: str


def model_parts(
    model: Bagel,
    vae: AutoEncoder,
    cfg: BagelConfig,
    tokenizer_files: dict[str, str],
    special_token_ids: dict[str, int],
    *,
    bos: int,
    eos: int,
    dtype: str = "fp32",
) -> CheckpointParts:
    """Configs (official field names) and state dicts of ``model`` and ``vae``, ready to write."""
    files, ids = tokenizer_files, special_token_ids
    llm = cfg.llm
    llm_json = {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "hidden_act": "silu",
        "hidden_size": llm.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": llm.intermediate_size,
        "max_position_embeddings": llm.max_position_embeddings,
        "max_window_layers": llm.num_hidden_layers,
        "model_type": "qwen2",
        "num_attention_heads": llm.num_attention_heads,
        "num_hidden_layers": llm.num_hidden_layers,
        "num_key_value_heads": llm.num_key_value_heads,
        "rms_norm_eps": llm.rms_norm_eps,
        "rope_scaling": None,
        "rope_theta": llm.rope_theta,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype],
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": llm.vocab_size,
    }
    vit = cfg.vit
    vit_json = {
        "hidden_size": vit.hidden_size,
        "image_size": vit.image_size,
        "intermediate_size": vit.intermediate_size,
        "model_type": "siglip_vision_model",
        "num_attention_heads": vit.num_attention_heads,
        "num_hidden_layers": vit.num_hidden_layers + 1,  # the file counts the dropped layer
        "patch_size": vit.patch_size,
    }
    ae = cfg.ae
    ae_json = {
        "resolution": ae.resolution,
        "in_channels": ae.in_channels,
        "downsample": ae.downsample,
        "ch": ae.ch,
        "out_ch": ae.out_ch,
        "ch_mult": list(ae.ch_mult),
        "num_res_blocks": ae.num_res_blocks,
        "z_channels": ae.z_channels,
        "scale_factor": ae.scale_factor,
        "shift_factor": ae.shift_factor,
    }
    tf_json = {name: dataclasses.asdict(getattr(cfg.transforms, name)) for name in ("vae", "vit")}
    torch_dtype = DTYPES[dtype]
    ema = {k: v.detach().to(torch_dtype).contiguous() for k, v in model.state_dict().items()}
    ae_sd = {k: v.detach().contiguous() for k, v in vae.state_dict().items()}  # the VAE stays fp32
    return CheckpointParts(
        tokenizer_files=files,
        configs={
            "llm_config.json": llm_json,
            "vit_config.json": vit_json,
            "ae_config.json": ae_json,
            "transform_config.json": tf_json,
        },
        ema=ema,
        ae=ae_sd,
        special_token_ids=ids,
        dtype=dtype,
    )


def write_parts(parts: CheckpointParts, out: Path) -> None:
    """Write a checkpoint folder in the official layout (tokenizer files, configs, ``ema``/``ae`` safetensors)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in parts.tokenizer_files.items():
        (out / name).write_text(text, encoding="utf-8")
    for name, data in parts.configs.items():
        (out / name).write_text(json_text(data), encoding="utf-8")
    save_file(parts.ema, str(out / "ema.safetensors"), metadata={"format": "pt"})
    save_file(parts.ae, str(out / "ae.safetensors"), metadata={"format": "pt"})
