"""Write a tiny random BAGEL checkpoint with exactly the official folder layout (for tests and demos).

``python -m unicache_core.bagel.tiny OUT_DIR [--seed N]`` writes::

    llm_config.json  vit_config.json  ae_config.json  transform_config.json
    ema.safetensors  ae.safetensors
    vocab.json  merges.txt  tokenizer_config.json

Same tensor names as BAGEL-7B-MoT with tiny shapes (LLM width 64, 2 MoT layers; ViT width 32,
2 layers built from a file that says 3; VAE width 32). ``transform_config.json`` shrinks the image
transforms to :data:`TINY_TRANSFORMS` (VAE long edge <= 128 px, short edge >= 64; ViT 112 / 56 with the
official patch 14), so inputs are processed at about 1/8 of the official 512-1024 px. The tokenizer
is a byte-level BPE trained on a small built-in English text with the Qwen2 pre-tokenizer, followed
by the Qwen special tokens at the same offsets as in Qwen2.5. Weights are random but scaled so that
activations stay finite and outputs are not degenerate. The result depends only on ``seed``. Total
size is a few MB.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

from .config import AEConfig, BagelConfig, LLMConfig, ResizeConfig, TransformConfig, ViTConfig
from .modeling import AutoEncoder, Bagel
from .tokenizer import QWEN2_PRETOKENIZE_REGEX

logger = logging.getLogger(__name__)

#: Qwen2.5 special tokens in id order (first id = size of the BPE vocabulary).
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

TINY_NUM_MERGES = 300

#: Image transform sizes of the tiny model. VAE sides are multiples of 16 (one latent token per 16 px,
#: at most 8 of the 64 latent positions per side); ViT sides multiples of the patch 14, at most 8 of
#: the 70 positions per side. A 60x45 input becomes 80x64 (5x4 latent tokens, 6x5 ViT patches).
TINY_TRANSFORMS = TransformConfig(vae=ResizeConfig(128, 64, 16), vit=ResizeConfig(112, 56, 14))

_CORPUS = """
A small red cat sat on the warm mat near the window, watching the birds in the garden.
The quick brown fox jumps over the lazy dog while the sun sets behind the hills.
Please describe the image in detail: what objects do you see, and what colors are they?
Generate a photo of a blue car parked in front of an old house with a green door.
Change the color of the sky to orange and add a flock of white birds flying over the sea.
The model reads the picture, thinks about the question, and writes a short answer.
There are three apples, two bananas and one large watermelon on the wooden table.
A painting of a mountain lake at sunrise, with mist over the water and tall pine trees.
Remove the person from the background and make the lighting softer and warmer.
What is the man holding in his hand? He is holding a yellow umbrella in the rain.
The children are playing football in the park on a bright and sunny afternoon.
Turn the dog into a cat, keep the same pose, and do not change the background.
An astronaut riding a horse on the moon, digital art, highly detailed, 4k.
The kitchen has white walls, a black stove, and a bowl of fresh fruit on the counter.
Describe the scene: a busy street at night with neon signs, taxis and people walking.
This is a simple test sentence, written in plain English, for the tiny tokenizer.
Numbers like 12, 345 and 6789 are split into single digits by the Qwen pre-tokenizer.
It's the model's job to answer; they're ready, we'll see, I'd say you've done well.
"""


def _corpus_lines() -> list[str]:
    return [line.strip() for line in _CORPUS.strip().splitlines() if line.strip()]


def train_tiny_bpe(num_merges: int = TINY_NUM_MERGES) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train a byte-level BPE with the Qwen2 pre-tokenizer on the built-in text.

    Returns:
        ``(vocab {token: id}, merges [(a, b)] in rank order)``; the vocab holds the 256 byte symbols
        plus one token per merge.
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + num_merges,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=alphabet,
        special_tokens=[],
    )
    tok.train_from_iterator(_corpus_lines() * 4, trainer=trainer)
    state = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    # Byte symbols in GPT-2/Qwen order (printable bytes first), then merged tokens by rank.
    if set(alphabet) != set(_BYTE_SYMBOLS):
        raise RuntimeError("tokenizers' ByteLevel alphabet differs from the GPT-2 byte table")
    vocab: dict[str, int] = {}
    for ch in _BYTE_SYMBOLS:
        vocab[ch] = len(vocab)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return vocab, [(a, b) for a, b in merges]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable-character table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_SYMBOLS = tuple(_bytes_to_unicode().values())


def tiny_config(vocab_size: int) -> BagelConfig:
    """The tiny model's config.

    The LLM vocabulary equals the tokenizer's size (no padded rows, unlike Qwen's 152064 > 151665), so a
    random tiny model can never sample an id the tokenizer cannot decode.
    """
    llm = LLMConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
    )
    vit = ViTConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_hidden_layers=2,
        image_size=980,
        patch_size=14,
    )
    ae = AEConfig(ch=32, ch_mult=(1, 1, 1, 1), num_res_blocks=2)
    return BagelConfig(llm=llm, vit=vit, ae=ae, transforms=TINY_TRANSFORMS)


def _init_weights(module: torch.nn.Module, gen: torch.Generator, *, conv_fan_in: bool) -> None:
    """Deterministic init: norms 1/0, linear/embedding N(0, 0.02), convs N(0, 1/fan_in)."""
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


def build_tiny_models(vocab_size: int, seed: int = 0) -> tuple[Bagel, AutoEncoder, BagelConfig]:
    """Random tiny :class:`Bagel` and :class:`AutoEncoder` (fp32, CPU), deterministic for ``seed``."""
    cfg = tiny_config(vocab_size)
    gen = torch.Generator().manual_seed(seed)
    model = Bagel(cfg)
    _init_weights(model, gen, conv_fan_in=False)
    model.vit_pos_embed.reset_table()
    model.latent_pos_embed.reset_table()
    with torch.no_grad():
        model.llm2vae.weight.copy_(torch.randn(model.llm2vae.weight.shape, generator=gen) * 0.1)
    vae = AutoEncoder(cfg.ae)
    _init_weights(vae, gen, conv_fan_in=True)
    with torch.no_grad():
        # Small posterior std (as in the real VAE): logvar channels biased to -6.
        vae.encoder.conv_out.bias[cfg.ae.z_channels :].fill_(-6.0)
    return model, vae, cfg


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


#: Every file :func:`write_tiny_checkpoint` writes (``ae_config.json`` marks a small checkpoint: the real
#: BAGEL folder has none, the official loader hard-codes the VAE size; the same holds for
#: ``transform_config.json``, which older tiny checkpoints lack).
TINY_FILES = frozenset({
    "llm_config.json", "vit_config.json", "ae_config.json", "transform_config.json", "ema.safetensors",
    "ae.safetensors", "vocab.json", "merges.txt", "tokenizer_config.json",
})


def _check_target(out: Path, force: bool) -> None:
    """Refuse to overwrite anything but an earlier tiny checkpoint (e.g. a real BAGEL folder) unless forced."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"`out_dir` {out} exists and is not a folder; give a folder path")
    if force or not out.is_dir():
        return
    present = {p.name for p in out.iterdir()}
    if not present:
        return
    if "ae_config.json" in present and present <= TINY_FILES:
        return  # an earlier tiny checkpoint: rewrite it
    raise ValueError(
        f"`out_dir` {out} is not empty and does not hold a tiny checkpoint ({len(present)} entries, e.g. "
        f"{sorted(present)[:3]}); refusing to overwrite it. Choose an empty or new folder, or pass force=True "
        "(--force) to overwrite"
    )


def write_tiny_checkpoint(out_dir: str | Path, *, seed: int = 0, force: bool = False) -> Path:
    """Write the tiny checkpoint folder and return its path (created if needed).

    An existing folder is only overwritten when it is empty or holds an earlier tiny checkpoint,
    unless ``force`` is set; anything else raises ``ValueError`` (a real checkpoint is never clobbered).
    """
    out = Path(out_dir)
    _check_target(out, force)
    out.mkdir(parents=True, exist_ok=True)
    vocab, merges = train_tiny_bpe()
    n_bpe = len(vocab)
    added = {str(n_bpe + i): tok for i, tok in enumerate(QWEN_SPECIAL_TOKENS)}
    model, vae, cfg = build_tiny_models(n_bpe + len(QWEN_SPECIAL_TOKENS), seed)

    _write_json(out / "vocab.json", vocab)
    with open(out / "merges.txt", "w", encoding="utf-8") as fh:
        fh.write("#version: 0.2\n")
        for a, b in merges:
            fh.write(f"{a} {b}\n")
    _write_json(
        out / "tokenizer_config.json",
        {
            "add_prefix_space": False,
            "added_tokens_decoder": {
                i: {
                    "content": tok,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": True,
                }
                for i, tok in added.items()
            },
            "additional_special_tokens": [t for t in QWEN_SPECIAL_TOKENS if t != "<|endoftext|>"],
            "bos_token": None,
            "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "model_max_length": 131072,
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        },
    )
    llm = cfg.llm
    _write_json(
        out / "llm_config.json",
        {
            "architectures": ["Qwen2ForCausalLM"],
            "attention_dropout": 0.0,
            "bos_token_id": n_bpe,
            "eos_token_id": n_bpe + 2,
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
            "torch_dtype": "float32",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": llm.vocab_size,
        },
    )
    vit = cfg.vit
    _write_json(
        out / "vit_config.json",
        {
            "hidden_size": vit.hidden_size,
            "image_size": vit.image_size,
            "intermediate_size": vit.intermediate_size,
            "model_type": "siglip_vision_model",
            "num_attention_heads": vit.num_attention_heads,
            "num_hidden_layers": vit.num_hidden_layers + 1,  # the file counts the dropped layer
            "patch_size": vit.patch_size,
        },
    )
    ae = cfg.ae
    _write_json(
        out / "ae_config.json",
        {
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
        },
    )
    _write_json(
        out / "transform_config.json",
        {name: dataclasses.asdict(getattr(cfg.transforms, name)) for name in ("vae", "vit")},
    )
    ema = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(ema, str(out / "ema.safetensors"), metadata={"format": "pt"})
    ae_sd = {k: v.detach().contiguous() for k, v in vae.state_dict().items()}
    save_file(ae_sd, str(out / "ae.safetensors"), metadata={"format": "pt"})
    logger.info("wrote tiny BAGEL checkpoint to %s", out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a tiny random BAGEL checkpoint (official layout).")
    parser.add_argument("out_dir", help="folder to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed for the weights (default 0)")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty folder that is not a tiny checkpoint")
    args = parser.parse_args(argv)
    try:
        out = write_tiny_checkpoint(args.out_dir, seed=args.seed, force=args.force)
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    sys.stdout.write(f"wrote {out} ({total / 1e6:.2f} MB)\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
