"""A generated "medium" BAGEL checkpoint for the end-to-end benchmark (random weights, official layout).

Qwen2-0.5B-like LLM geometry (hidden 896, 14 query heads, 2 KV heads, head dim 64) with 4 MoT layers, a
small ViT and VAE (they only run in the prefill and the final decode), and image transforms of
256-512 px, so that an edit's source-VAE + source-ViT context is a few thousand tokens: the regime in
which KV compression changes the attention cost. Written with the tiny checkpoint's tokenizer.
``python -m benchmarks.medium OUT_DIR``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from training.bpe import json_text
from training.model import init_weights
from training.tiny import write_tiny_checkpoint
from unicache_commands.flags import OneLineParser, path_arg
from unicache_core.bagel.config import AEConfig, BagelConfig, LLMConfig, ResizeConfig, TransformConfig, ViTConfig
from unicache_core.bagel.modeling.autoencoder import AutoEncoder
from unicache_core.bagel.modeling.bagel import Bagel

logger = logging.getLogger("benchmarks.medium")

MEDIUM_TRANSFORMS = TransformConfig(vae=ResizeConfig(512, 256, 16), vit=ResizeConfig(504, 224, 14))


def _write_json(path: Path, data: object) -> None:
    path.write_text(json_text(data), encoding="utf-8")


def medium_config(vocab_size: int, num_layers: int = 4) -> BagelConfig:
    llm = LLMConfig(
        hidden_size=896,
        intermediate_size=1792,
        num_hidden_layers=num_layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
    )
    vit = ViTConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=2, num_hidden_layers=2, image_size=980, patch_size=14
    )
    ae = AEConfig(ch=32, ch_mult=(1, 1, 1, 1), num_res_blocks=1)
    return BagelConfig(llm=llm, vit=vit, ae=ae, transforms=MEDIUM_TRANSFORMS)


def write_medium_checkpoint(out_dir: str | Path, *, seed: int = 0, num_layers: int = 4) -> Path:
    """Write (or rewrite) the medium checkpoint; returns its folder. Deterministic for ``seed``."""
    out = Path(out_dir)
    marker = out / "medium.json"
    wanted = {"seed": seed, "num_layers": num_layers, "version": 1}
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        return out  # already written with these settings
    write_tiny_checkpoint(out, seed=seed, force=marker.is_file())  # tokenizer files + layout
    vocab = json.loads((out / "llm_config.json").read_text())["vocab_size"]
    cfg = medium_config(vocab, num_layers)
    gen = torch.Generator().manual_seed(seed)
    model = Bagel(cfg)
    init_weights(model, gen, conv_fan_in=False)
    model.vit_pos_embed.reset_table()
    model.latent_pos_embed.reset_table()
    with torch.no_grad():
        model.llm2vae.weight.copy_(torch.randn(model.llm2vae.weight.shape, generator=gen) * 0.1)
    vae = AutoEncoder(cfg.ae)
    init_weights(vae, gen, conv_fan_in=True)
    with torch.no_grad():
        vae.encoder.conv_out.bias[cfg.ae.z_channels :].fill_(-6.0)
    llm_json = json.loads((out / "llm_config.json").read_text())
    llm_json.update(
        hidden_size=896,
        intermediate_size=1792,
        num_hidden_layers=num_layers,
        max_window_layers=num_layers,
        num_attention_heads=14,
        num_key_value_heads=2,
    )
    _write_json(out / "llm_config.json", llm_json)
    vit_json = json.loads((out / "vit_config.json").read_text())
    vit_json.update(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_hidden_layers=3)
    _write_json(out / "vit_config.json", vit_json)
    ae_json = json.loads((out / "ae_config.json").read_text())
    ae_json.update(ch=32, ch_mult=[1, 1, 1, 1], num_res_blocks=1)
    _write_json(out / "ae_config.json", ae_json)
    _write_json(
        out / "transform_config.json",
        {name: dataclasses.asdict(getattr(cfg.transforms, name)) for name in ("vae", "vit")},
    )
    save_file(
        {k: v.detach().contiguous() for k, v in model.state_dict().items()},
        str(out / "ema.safetensors"),
        metadata={"format": "pt"},
    )
    save_file(
        {k: v.detach().contiguous() for k, v in vae.state_dict().items()},
        str(out / "ae.safetensors"),
        metadata={"format": "pt"},
    )
    marker.write_text(json.dumps(wanted) + "\n")
    logger.info("wrote medium BAGEL checkpoint to %s", out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m benchmarks.medium", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=path_arg)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    write_medium_checkpoint(args.out, seed=args.seed, num_layers=args.layers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
