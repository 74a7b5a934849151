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

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

from unicache_core.errors import UniCacheError
from unicache_core.bagel.config import AEConfig, BagelConfig, LLMConfig, ResizeConfig, TransformConfig, ViTConfig
from unicache_core.bagel.modeling import AutoEncoder, Bagel
from unicache_core.bagel.tokenizer import QWEN2_PRETOKENIZE_REGEX

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


def train_tiny_bpe(
    num_merges: int = TINY_NUM_MERGES, lines: list[str] | None = None
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train a byte-level BPE with the Qwen2 pre-tokenizer on ``lines`` (default: the built-in text).

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
    tok.train_from_iterator(_corpus_lines() * 4 if lines is None else lines, trainer=trainer)
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


#: Rows of BAGEL-7B-MoT's embedding table (Qwen2.5's padded vocabulary).
FULL_VOCAB_SIZE = 152064
#: First id of Qwen2.5's added tokens (``<|endoftext|>``); its BPE vocabulary has 151643 entries.
QWEN25_ADDED_TOKENS_START = 151643
#: Qwen2.5's 22 added tokens in id order from :data:`QWEN25_ADDED_TOKENS_START` (``<|im_start|>`` 151644,
#: ``<|im_end|>`` 151645, ``<|vision_start|>`` 151652, ``<|vision_end|>`` 151653: BAGEL's ids).
QWEN25_ADDED_TOKENS = QWEN_SPECIAL_TOKENS + (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
)
#: Name of the single file :func:`write_tiny_single_file` writes (next to ``ae.safetensors`` and ``tokenizer/``).
TINY_SINGLE_FILE = "bagel-tiny.safetensors"
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


def build_tiny_models(
    vocab_size: int, seed: int = 0, *, full_vae: bool = False
) -> tuple[Bagel, AutoEncoder, BagelConfig]:
    """Random tiny :class:`Bagel` and :class:`AutoEncoder` (fp32, CPU), deterministic for ``seed``.

    ``full_vae`` only changes the VAE (the BAGEL weights are the same for both).
    """
    cfg = tiny_config(vocab_size, full_vae=full_vae)
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


def _json_text(data: object) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def _write_json(path: Path, data: object) -> None:
    path.write_text(_json_text(data), encoding="utf-8")


#: Every file :func:`write_tiny_checkpoint` writes (``ae_config.json`` marks a small checkpoint: the real
#: BAGEL folder has none, the official loader hard-codes the VAE size; the same holds for
#: ``transform_config.json``, which older tiny checkpoints lack).
TINY_FILES = frozenset({
    "llm_config.json", "vit_config.json", "ae_config.json", "transform_config.json", "ema.safetensors",
    "ae.safetensors", "vocab.json", "merges.txt", "tokenizer_config.json",
})
#: Everything :func:`write_tiny_single_file` writes into its folder.
TINY_SINGLE_FILE_ENTRIES = frozenset({
    TINY_SINGLE_FILE, TINY_SINGLE_FILE + ".comfyui-bagel.json", "ae.safetensors", "tokenizer",
})


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


@dataclasses.dataclass
class _TinyParts:
    """Everything a tiny checkpoint holds, in memory (shared by the folder and the single-file writers)."""

    tokenizer_files: dict[str, str]
    configs: dict[str, dict]
    ema: dict[str, torch.Tensor]
    ae: dict[str, torch.Tensor]
    special_token_ids: dict[str, int]
    dtype: str


def _tokenizer_config(added: dict[int, str]) -> dict:
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {
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
    }


def _tiny_parts(
    seed: int, *, full_vocab: bool, full_vae: bool, dtype: str, tokenizer_dir: str | Path | None
) -> _TinyParts:
    from unicache_core.bagel.checkpoint.single_file import BAGEL_SPECIAL_TOKEN_IDS
    from unicache_core.bagel.tokenizer import BAGEL_SPECIAL_TOKENS, BagelTokenizer

    if dtype not in _DTYPES:
        raise ValueError(f"`dtype` must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if tokenizer_dir is not None:
        src = Path(tokenizer_dir)
        tokenizer = BagelTokenizer.from_dir(src)  # checks the three files
        if tokenizer.added_special_tokens:
            raise ValueError(f"the tokenizer in {src} lacks BAGEL's special tokens {list(tokenizer.added_special_tokens)}")
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


def bpe_tokenizer_files(
    vocab: dict[str, int], merges: list[tuple[str, str]], *, full_vocab: bool = False
) -> tuple[dict[str, str], dict[str, int], dict[int, str], int]:
    """The three tokenizer files of a byte-level BPE with Qwen's special tokens appended.

    Returns:
        ``(files {name: text}, BAGEL special ids {token: id}, added tokens {id: token}, vocab_size)``;
        with ``full_vocab`` the special tokens sit at Qwen2.5's ids and ``vocab_size`` is 152,064.
    """
    from unicache_core.bagel.tokenizer import BAGEL_SPECIAL_TOKENS

    n_bpe = len(vocab)
    if full_vocab:
        # Qwen2.5's layout: BAGEL's special tokens at their real ids (the BPE ids below stay small; the
        # rows in between exist in the model but no text encodes to them)
        added = {QWEN25_ADDED_TOKENS_START + i: tok for i, tok in enumerate(QWEN25_ADDED_TOKENS)}
        vocab_size = FULL_VOCAB_SIZE
    else:
        added = {n_bpe + i: tok for i, tok in enumerate(QWEN_SPECIAL_TOKENS)}
        vocab_size = n_bpe + len(QWEN_SPECIAL_TOKENS)
    merges_text = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
    files = {"vocab.json": _json_text(vocab), "merges.txt": merges_text,
             "tokenizer_config.json": _json_text(_tokenizer_config(added))}
    ids = {tok: i for i, tok in added.items() if tok in BAGEL_SPECIAL_TOKENS}
    return files, ids, added, vocab_size


def model_parts(
    model: Bagel, vae: AutoEncoder, cfg: BagelConfig, tokenizer_files: dict[str, str], special_token_ids: dict[str, int],
    *, bos: int, eos: int, dtype: str = "fp32",
) -> "_TinyParts":
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
    torch_dtype = _DTYPES[dtype]
    ema = {k: v.detach().to(torch_dtype).contiguous() for k, v in model.state_dict().items()}
    ae_sd = {k: v.detach().contiguous() for k, v in vae.state_dict().items()}  # the VAE stays fp32
    return _TinyParts(
        tokenizer_files=files,
        configs={"llm_config.json": llm_json, "vit_config.json": vit_json, "ae_config.json": ae_json,
                 "transform_config.json": tf_json},
        ema=ema, ae=ae_sd, special_token_ids=ids, dtype=dtype,
    )


def write_parts(parts: "_TinyParts", out: Path) -> None:
    """Write a checkpoint folder in the official layout (tokenizer files, configs, ``ema``/``ae`` safetensors)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in parts.tokenizer_files.items():
        (out / name).write_text(text, encoding="utf-8")
    for name, data in parts.configs.items():
        _write_json(out / name, data)
    save_file(parts.ema, str(out / "ema.safetensors"), metadata={"format": "pt"})
    save_file(parts.ae, str(out / "ae.safetensors"), metadata={"format": "pt"})


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
    from unicache_core.bagel.checkpoint.single_file import TINY_VARIANT, build_metadata, write_single_file

    out = Path(out_dir)
    _check_target(out, force, marker=TINY_SINGLE_FILE, allowed=TINY_SINGLE_FILE_ENTRIES)
    parts = _tiny_parts(seed, full_vocab=full_vocab, full_vae=full_vae, dtype=dtype, tokenizer_dir=tokenizer_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = out / "tokenizer"
    tok.mkdir(exist_ok=True)
    for name, text in parts.tokenizer_files.items():
        (tok / name).write_text(text, encoding="utf-8")
    meta = build_metadata(TINY_VARIANT, parts.dtype, parts.configs, parts.special_token_ids,
                          converter="training.tiny", seed=seed)
    path = write_single_file(parts.ema, out / TINY_SINGLE_FILE, meta, sidecar=sidecar)
    save_file(parts.ae, str(out / "ae.safetensors"), metadata={"format": "pt"})
    logger.info("wrote tiny single-file BAGEL checkpoint to %s", path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a tiny random BAGEL checkpoint (official layout, or the "
                                                 "single-file form with --single-file).")
    parser.add_argument("out_dir", help="folder to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed for the weights (default 0)")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty folder that is not a tiny checkpoint")
    parser.add_argument("--single-file", action="store_true",
                        help=f"write {TINY_SINGLE_FILE} (configs in its metadata) + ae.safetensors + tokenizer/")
    parser.add_argument("--sidecar", action="store_true", help="with --single-file: metadata in a sidecar JSON")
    parser.add_argument("--full-vocab", action="store_true",
                        help="152,064 embedding rows, BAGEL's special tokens at their real ids (151644, ...)")
    parser.add_argument("--full-vae", action="store_true", help="real FLUX VAE geometry (ch 128, ch_mult 1-2-4-4)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(_DTYPES), help="stored dtype of the BAGEL weights")
    parser.add_argument("--tokenizer-dir", default=None,
                        help="use this tokenizer (vocab.json, merges.txt, tokenizer_config.json) instead of the tiny BPE")
    args = parser.parse_args(argv)
    if args.sidecar and not args.single_file:
        sys.stderr.write("error: --sidecar needs --single-file\n")
        return 2
    options = dict(seed=args.seed, force=args.force, full_vocab=args.full_vocab, full_vae=args.full_vae,
                   dtype=args.dtype, tokenizer_dir=args.tokenizer_dir)
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
