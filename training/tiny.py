"""Write a tiny random BAGEL checkpoint with exactly the official folder layout (for tests and demos).

``python -m training.tiny OUT_DIR [--seed N]`` writes::

    llm_config.json  vit_config.json  ae_config.json  transform_config.json
    ema.safetensors  ae.safetensors
    vocab.json  merges.txt  tokenizer_config.json

Same tensor names as BAGEL-7B-MoT with tiny shapes (LLM width 64, 2 MoT layers; ViT width 32,
2 layers built from a file that says 3; VAE width 32). ``transform_config.json`` shrinks the image
transforms to :data:`TINY_TRANSFORMS` (VAE long edge <= 128 px, short edge >= 64; ViT 112 / 56 with the
official patch 14), so inputs are processed at about 1/8 of the official 512-1024 px. The tokenizer
is a byte-level BPE trained on a small built-in English text with the Qwen2 pre-tokenizer, followed
by the Qwen special tokens at the same offsets as in Qwen2.5. Weights are random but scaled so that
activations stay finite and outputs are not degenerate. The result depends only on ``seed`` (and the
options). Total size is a few MB.

Options for host tests (ComfyUI, single-file checkpoints; all off by default)::

    python -m training.tiny OUT --single-file [--sidecar] [--full-vocab] [--full-vae]
        [--dtype bf16] [--tokenizer-dir DIR]

``--single-file`` writes ``OUT/bagel-tiny.safetensors`` (the BAGEL tensors with the configs in its
``comfyui_bagel`` metadata, variant ``UniCache-tiny-random``), ``OUT/ae.safetensors`` and
``OUT/tokenizer/``; ``--full-vocab`` gives the model BAGEL-7B-MoT's 152,064 embedding rows and puts
BAGEL's special tokens at their real ids (151644, 151645, 151652, 151653; the tiny BPE ids stay small),
so ComfyUI's Qwen2.5 tokenizer fits it (``--tokenizer-dir`` copies that tokenizer into the checkpoint
instead of the tiny BPE); ``--full-vae`` uses the real FLUX VAE geometry (ch 128, ch_mult 1-2-4-4,
random finite weights, ~335 MB in fp32). The folder form and the single-file form written with the same
seed and options hold the same tensors, so they give the same images.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from unicache_commands.flags import OneLineParser
from unicache_core.bagel.checkpoint.single_file import (
    BAGEL_SPECIAL_TOKEN_IDS,
    TINY_VARIANT,
    build_metadata,
    write_single_file,
)
from unicache_core.bagel.config import AEConfig, BagelConfig, LLMConfig, ResizeConfig, TransformConfig, ViTConfig
from unicache_core.bagel.modeling import AutoEncoder, Bagel
from unicache_core.bagel.tokenizer import BAGEL_SPECIAL_TOKENS, BagelTokenizer
from unicache_core.errors import UniCacheError

from .bpe import FULL_VOCAB_SIZE, TOKENIZER_FILES, bpe_tokenizer_files, train_tiny_bpe
from .checkpoint_files import DTYPES, CheckpointParts, model_parts, write_parts
from .model import init_weights

logger = logging.getLogger(__name__)

#: Name of the single file :func:`write_tiny_single_file` writes (next to ``ae.safetensors`` and ``tokenizer/``).
TINY_SINGLE_FILE = "bagel-tiny.safetensors"

#: Image transform sizes of the tiny model. VAE sides are multiples of 16 (one latent token per 16 px,
#: at most 8 of the 64 latent positions per side); ViT sides multiples of the patch 14, at most 8 of
#: the 70 positions per side. A 60x45 input becomes 80x64 (5x4 latent tokens, 6x5 ViT patches).
TINY_TRANSFORMS = TransformConfig(vae=ResizeConfig(128, 64, 16), vit=ResizeConfig(112, 56, 14))


def tiny_config(vocab_size: int, *, full_vae: bool = False) -> BagelConfig:
    """The tiny model's config.

    The LLM vocabulary equals the tokenizer's size (no padded rows, unlike Qwen's 152064 > 151665), so a
    random tiny model can never sample an id the tokenizer cannot decode (the ``full_vocab`` option of the
    writers uses 152064 rows instead). ``full_vae``: the real FLUX VAE geometry (ch 128, ch_mult 1-2-4-4).
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
    ae = AEConfig() if full_vae else AEConfig(ch=32, ch_mult=(1, 1, 1, 1), num_res_blocks=2)
    return BagelConfig(llm=llm, vit=vit, ae=ae, transforms=TINY_TRANSFORMS)


def build_tiny_models(
    vocab_size: int, seed: int = 0, *, full_vae: bool = False
) -> tuple[Bagel, AutoEncoder, BagelConfig]:
    """Random tiny :class:`Bagel` and :class:`AutoEncoder` (fp32, CPU), deterministic for ``seed``.

    ``full_vae`` only changes the VAE (the BAGEL weights are the same for both).
    """
    cfg = tiny_config(vocab_size, full_vae=full_vae)
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
        # Small posterior std (as in the real VAE): logvar channels biased to -6.
        vae.encoder.conv_out.bias[cfg.ae.z_channels :].fill_(-6.0)
    return model, vae, cfg


#: Every file :func:`write_tiny_checkpoint` writes (``ae_config.json`` marks a small checkpoint: the real
#: BAGEL folder has none, the official loader hard-codes the VAE size; the same holds for
#: ``transform_config.json``, which older tiny checkpoints lack).
TINY_FILES = frozenset(
    {
        "llm_config.json",
        "vit_config.json",
        "ae_config.json",
        "transform_config.json",
        "ema.safetensors",
        "ae.safetensors",
        "vocab.json",
        "merges.txt",
        "tokenizer_config.json",
    }
)
#: Everything :func:`write_tiny_single_file` writes into its folder.
TINY_SINGLE_FILE_ENTRIES = frozenset(
    {
        TINY_SINGLE_FILE,
        TINY_SINGLE_FILE + ".comfyui-bagel.json",
        "ae.safetensors",
        "tokenizer",
    }
)


def _check_target(out: Path, force: bool, *, marker: str = "ae_config.json", allowed: frozenset = TINY_FILES) -> None:
    """Refuse to overwrite anything but an earlier tiny checkpoint (e.g. a real BAGEL folder) unless forced."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"`out_dir` {out} exists and is not a folder; give a folder path")
    if force or not out.is_dir():
        return
    present = {p.name for p in out.iterdir()}
    if not present:
        return
    if marker in present and present <= allowed:
        return  # an earlier tiny checkpoint: rewrite it
    raise ValueError(
        f"`out_dir` {out} is not empty and does not hold a tiny checkpoint ({len(present)} entries, e.g. "
        f"{sorted(present)[:3]}); refusing to overwrite it. Choose an empty or new folder, or pass force=True "
        "(--force) to overwrite"
    )


def _tiny_parts(
    seed: int, *, full_vocab: bool, full_vae: bool, dtype: str, tokenizer_dir: str | Path | None
) -> CheckpointParts:
    if dtype not in DTYPES:
        raise ValueError(f"`dtype` must be one of {sorted(DTYPES)}, got {dtype!r}")
    if tokenizer_dir is not None:
        src = Path(tokenizer_dir)
        tokenizer = BagelTokenizer.from_dir(src)  # checks the three files
        if tokenizer.added_special_tokens:
            raise ValueError(
                f"the tokenizer in {src} lacks BAGEL's special tokens {list(tokenizer.added_special_tokens)}"
            )
        files = {name: (src / name).read_text(encoding="utf-8") for name in TOKENIZER_FILES}
        ids = {name: tokenizer.token_to_id(name) for name in BAGEL_SPECIAL_TOKENS}
        vocab_size = FULL_VOCAB_SIZE if full_vocab else tokenizer.vocab_size
        if tokenizer.vocab_size > vocab_size:
            raise ValueError(f"the tokenizer in {src} has {tokenizer.vocab_size} ids, more than {vocab_size} rows")
        bos, eos = ids["<|im_start|>"] - 1, ids["<|im_end|>"]
    else:
        files, ids, added, vocab_size = bpe_tokenizer_files(*train_tiny_bpe(), full_vocab=full_vocab)
        if full_vocab:
            assert ids == BAGEL_SPECIAL_TOKEN_IDS
        bos, eos = min(added), min(added) + 2
    model, vae, cfg = build_tiny_models(vocab_size, seed, full_vae=full_vae)
    return model_parts(model, vae, cfg, files, ids, bos=bos, eos=eos, dtype=dtype)


def write_tiny_checkpoint(
    out_dir: str | Path,
    *,
    seed: int = 0,
    force: bool = False,
    full_vocab: bool = False,
    full_vae: bool = False,
    dtype: str = "fp32",
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write the tiny checkpoint folder and return its path (created if needed).

    An existing folder is only overwritten when it is empty or holds an earlier tiny checkpoint,
    unless ``force`` is set; anything else raises ``ValueError`` (a real checkpoint is never clobbered).

    Options (the defaults write the small standard tiny checkpoint):
        full_vocab: 152,064 embedding rows (BAGEL-7B-MoT's) with BAGEL's special tokens at their real
            ids (151644, 151645, 151652, 151653), as a model run with ComfyUI's Qwen2.5 tokenizer needs.
        full_vae: the real FLUX VAE geometry (ch 128, ch_mult 1-2-4-4), random but finite weights (~335 MB).
        dtype: stored dtype of the BAGEL weights (``fp32``, ``bf16``, ``fp16``); the VAE is always fp32.
        tokenizer_dir: copy this tokenizer (``vocab.json``, ``merges.txt``, ``tokenizer_config.json``,
            e.g. ComfyUI's ``qwen25_tokenizer``) instead of the built-in tiny BPE.

    The same ``seed`` and options give exactly the tensors :func:`write_tiny_single_file` writes.
    """
    out = Path(out_dir)
    _check_target(out, force)
    parts = _tiny_parts(seed, full_vocab=full_vocab, full_vae=full_vae, dtype=dtype, tokenizer_dir=tokenizer_dir)
    write_parts(parts, out)
    logger.info("wrote tiny BAGEL checkpoint to %s", out)
    return out


def write_tiny_single_file(
    out_dir: str | Path,
    *,
    seed: int = 0,
    force: bool = False,
    full_vocab: bool = False,
    full_vae: bool = False,
    dtype: str = "fp32",
    tokenizer_dir: str | Path | None = None,
    sidecar: bool = False,
) -> Path:
    """Write the single-file form of the tiny checkpoint into ``out_dir``; returns the ``.safetensors`` path.

    ``out_dir`` gets ``bagel-tiny.safetensors`` (the BAGEL tensors, configs in its ``comfyui_bagel``
    metadata, variant ``UniCache-tiny-random``; with ``sidecar`` in ``bagel-tiny.safetensors.comfyui-bagel.json``
    instead), ``ae.safetensors`` (the VAE, for ``load_bagel(..., vae=)`` or ComfyUI's ``VAELoader`` when
    ``full_vae``) and ``tokenizer/`` (for ``tokenizer_dir=``). Options as in :func:`write_tiny_checkpoint`;
    the same seed and options give the same tensors as that folder.
    """
    out = Path(out_dir)
    _check_target(out, force, marker=TINY_SINGLE_FILE, allowed=TINY_SINGLE_FILE_ENTRIES)
    parts = _tiny_parts(seed, full_vocab=full_vocab, full_vae=full_vae, dtype=dtype, tokenizer_dir=tokenizer_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = out / "tokenizer"
    tok.mkdir(exist_ok=True)
    for name, text in parts.tokenizer_files.items():
        (tok / name).write_text(text, encoding="utf-8")
    meta = build_metadata(
        TINY_VARIANT, parts.dtype, parts.configs, parts.special_token_ids, converter="training.tiny", seed=seed
    )
    path = write_single_file(parts.ema, out / TINY_SINGLE_FILE, meta, sidecar=sidecar)
    save_file(parts.ae, str(out / "ae.safetensors"), metadata={"format": "pt"})
    logger.info("wrote tiny single-file BAGEL checkpoint to %s", path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(
        description="Write a tiny random BAGEL checkpoint (official layout, or the "
        "single-file form with --single-file)."
    )
    parser.add_argument("out_dir", help="folder to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed for the weights (default 0)")
    parser.add_argument(
        "--force", action="store_true", help="overwrite a non-empty folder that is not a tiny checkpoint"
    )
    parser.add_argument(
        "--single-file",
        action="store_true",
        help=f"write {TINY_SINGLE_FILE} (configs in its metadata) + ae.safetensors + tokenizer/",
    )
    parser.add_argument("--sidecar", action="store_true", help="with --single-file: metadata in a sidecar JSON")
    parser.add_argument(
        "--full-vocab",
        action="store_true",
        help="152,064 embedding rows, BAGEL's special tokens at their real ids (151644, ...)",
    )
    parser.add_argument("--full-vae", action="store_true", help="real FLUX VAE geometry (ch 128, ch_mult 1-2-4-4)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="stored dtype of the BAGEL weights")
    parser.add_argument(
        "--tokenizer-dir",
        default=None,
        help="use this tokenizer (vocab.json, merges.txt, tokenizer_config.json) instead of the tiny BPE",
    )
    args = parser.parse_args(argv)
    if args.sidecar and not args.single_file:
        sys.stderr.write("error: --sidecar needs --single-file\n")
        return 2
    options = dict(
        seed=args.seed,
        force=args.force,
        full_vocab=args.full_vocab,
        full_vae=args.full_vae,
        dtype=args.dtype,
        tokenizer_dir=args.tokenizer_dir,
    )
    try:
        if args.single_file:
            written = write_tiny_single_file(args.out_dir, sidecar=args.sidecar, **options)
            out = written.parent
        else:
            out = write_tiny_checkpoint(args.out_dir, **options)
    except (ValueError, OSError, UniCacheError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    sys.stdout.write(f"wrote {out} ({total / 1e6:.2f} MB)\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
