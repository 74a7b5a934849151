"""Config parsing, checkpoint loading, strict checkpoint errors and the tokenizer."""

from __future__ import annotations

import json
import re
import unicodedata
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from unicache_core.bagel.checkpoint.loader import load_bagel
from unicache_core.bagel.config import AEConfig, load_bagel_config
from unicache_core.bagel.tokenizer import BagelTokenizer
from unicache_core.errors import CheckpointError


@pytest.fixture(scope="module")
def loaded_fp32(tiny_checkpoint: Path):
    return load_bagel(tiny_checkpoint, dtype=torch.float32)


# ------------------------------------------------------------------------------------------ config


def test_config_overrides_and_derived_values(tiny_checkpoint_copy: Path):
    llm_path = tiny_checkpoint_copy / "llm_config.json"
    data = json.loads(llm_path.read_text())
    data["tie_word_embeddings"] = True
    data["qk_norm"] = False
    llm_path.write_text(json.dumps(data))
    vit_file = json.loads((tiny_checkpoint_copy / "vit_config.json").read_text())

    cfg = load_bagel_config(tiny_checkpoint_copy)
    assert cfg.llm.qk_norm is True and cfg.llm.tie_word_embeddings is False
    assert cfg.vit.num_hidden_layers == vit_file["num_hidden_layers"] - 1
    assert cfg.llm.head_dim == data["hidden_size"] // data["num_attention_heads"]
    assert cfg.vit.num_positions == (vit_file["image_size"] // vit_file["patch_size"]) ** 2 == 4900
    assert cfg.latent_downsample == 16 and cfg.patch_latent_dim == 64 and cfg.latent_channel == 16
    assert cfg.vit_max_num_patch_per_side == 70 and cfg.max_latent_size == 64


def test_ae_defaults_are_the_real_bagel_vae(tiny_checkpoint_copy: Path):
    (tiny_checkpoint_copy / "ae_config.json").unlink()
    ae = load_bagel_config(tiny_checkpoint_copy).ae
    assert ae == AEConfig()
    assert (ae.ch, ae.ch_mult, ae.num_res_blocks, ae.z_channels, ae.downsample) == (128, (1, 2, 4, 4), 2, 16, 8)
    assert (ae.scale_factor, ae.shift_factor) == (0.3611, 0.1159)


@pytest.mark.parametrize("name", ["llm_config.json", "vit_config.json"])
def test_missing_config_json(tiny_checkpoint_copy: Path, name: str):
    (tiny_checkpoint_copy / name).unlink()
    with pytest.raises(CheckpointError, match=re.escape(name)):
        load_bagel_config(tiny_checkpoint_copy)


@pytest.mark.parametrize("name", ["llm_config.json", "vit_config.json", "ae_config.json"])
def test_invalid_config_json(tiny_checkpoint_copy: Path, name: str):
    (tiny_checkpoint_copy / name).write_text("{ not json")
    with pytest.raises(CheckpointError, match=re.escape(name)):
        load_bagel_config(tiny_checkpoint_copy)


def test_bad_config_values(tiny_checkpoint_copy: Path):
    path = tiny_checkpoint_copy / "llm_config.json"
    data = json.loads(path.read_text())
    data["num_key_value_heads"] = 3
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="num_key_value_heads"):
        load_bagel_config(tiny_checkpoint_copy)
    del data["hidden_size"]
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_bagel_config(tiny_checkpoint_copy)


# ------------------------------------------------------------------------------------------ loading


def test_load_fp32(loaded_fp32, tiny_checkpoint: Path):
    model, vae = loaded_fp32.model, loaded_fp32.vae
    assert loaded_fp32.dtype == torch.float32 and loaded_fp32.device == torch.device("cpu")
    for name, t in list(model.state_dict().items()) + list(vae.state_dict().items()):
        assert t.device.type == "cpu", name
        assert t.dtype == torch.float32, name
    assert not any(p.requires_grad for p in model.parameters())
    # Weights equal the file bit for bit.
    ema = load_file(str(tiny_checkpoint / "ema.safetensors"))
    for name, t in model.state_dict().items():
        assert torch.equal(t, ema[name]), name
    # The non-persistent RoPE buffer was materialised with the right values.
    d = loaded_fp32.config.llm.head_dim
    theta = loaded_fp32.config.llm.rope_theta
    expected = torch.tensor([theta ** (-(2 * i) / d) for i in range(d // 2)], dtype=torch.float32)
    inv = model.language_model.model.rotary_emb.inv_freq
    assert inv.device.type == "cpu"
    torch.testing.assert_close(inv, expected, rtol=1e-6, atol=0)


def test_load_bf16_keeps_vae_fp32(tiny_checkpoint: Path, loaded_fp32):
    loaded = load_bagel(tiny_checkpoint, dtype="bf16")
    assert loaded.dtype == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 for t in loaded.model.state_dict().values())
    assert all(t.dtype == torch.float32 for t in loaded.vae.state_dict().values())
    ref = loaded_fp32.model.language_model.lm_head.weight
    assert torch.equal(loaded.model.language_model.lm_head.weight, ref.to(torch.bfloat16))


def test_device_map_through_accelerate(tiny_checkpoint: Path):
    loaded = load_bagel(tiny_checkpoint, dtype=torch.float32, device_map={"": "cpu"})
    assert all(t.device.type == "cpu" for t in loaded.model.state_dict().values())
    assert loaded.model.language_model.model.rotary_emb.inv_freq.device.type == "cpu"


def test_bad_dtype_is_value_error(tiny_checkpoint: Path):
    with pytest.raises(ValueError, match="dtype"):
        load_bagel(tiny_checkpoint, dtype=torch.int8)


def test_model_keys_equal_checkpoint_keys(loaded_fp32, tiny_checkpoint: Path):
    with safe_open(str(tiny_checkpoint / "ema.safetensors"), framework="pt") as fh:
        ema_keys = set(fh.keys())
    with safe_open(str(tiny_checkpoint / "ae.safetensors"), framework="pt") as fh:
        ae_keys = set(fh.keys())
    assert set(loaded_fp32.model.state_dict()) == ema_keys
    assert set(loaded_fp32.vae.state_dict()) == ae_keys


# ------------------------------------------------------------------------------------------ strict errors


def _rewrite(path: Path, edit) -> None:
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_missing_key(tiny_checkpoint_copy: Path):
    name = "language_model.model.layers.1.self_attn.k_norm_moe_gen.weight"
    _rewrite(tiny_checkpoint_copy / "ema.safetensors", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"missing keys 1: .*k_norm_moe_gen") as info:
        load_bagel(tiny_checkpoint_copy, dtype=torch.float32)
    assert "ema.safetensors" in str(info.value)


def test_unexpected_key(tiny_checkpoint_copy: Path):
    _rewrite(tiny_checkpoint_copy / "ae.safetensors", lambda t: t.update({"decoder.extra.weight": torch.ones(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected keys 1: decoder\.extra\.weight") as info:
        load_bagel(tiny_checkpoint_copy, dtype=torch.float32)
    assert "ae.safetensors" in str(info.value)


def test_many_missing_keys_are_summarised(tiny_checkpoint_copy: Path):
    def drop_gen_expert(t):  # every layer keeps some keys, so the header layer count still matches
        for k in [k for k in t if k.startswith("language_model.model.layers.") and "moe_gen" in k]:
            del t[k]

    _rewrite(tiny_checkpoint_copy / "ema.safetensors", drop_gen_expert)
    with pytest.raises(CheckpointError, match=r"missing keys 28: .*and 8 more"):
        load_bagel(tiny_checkpoint_copy, dtype=torch.float32)


def test_wrong_shape(tiny_checkpoint_copy: Path):
    name = "vae2llm.weight"
    _rewrite(tiny_checkpoint_copy / "ema.safetensors", lambda t: t.update({name: torch.zeros(64, 63)}))
    with pytest.raises(CheckpointError, match=r"'vae2llm\.weight' has shape \(64, 63\).*expects \(64, 64\)"):
        load_bagel(tiny_checkpoint_copy, dtype=torch.float32)


@pytest.mark.parametrize("name", ["ema.safetensors", "ae.safetensors"])
def test_truncated_safetensors(tiny_checkpoint_copy: Path, name: str):
    path = tiny_checkpoint_copy / name
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=re.escape(name) + ".*corrupt or truncated"):
        load_bagel(tiny_checkpoint_copy, dtype=torch.float32)


def test_garbage_safetensors(tiny_checkpoint_copy: Path):
    (tiny_checkpoint_copy / "ema.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="ema.safetensors"):
        load_bagel(tiny_checkpoint_copy, dtype=torch.float32)


@pytest.mark.parametrize(
    "name", ["ema.safetensors", "ae.safetensors", "vocab.json", "merges.txt", "tokenizer_config.json"]
)
def test_missing_file(tiny_checkpoint_copy: Path, name: str):
    (tiny_checkpoint_copy / name).unlink()
    with pytest.raises(CheckpointError, match=re.escape(name)):
        load_bagel(tiny_checkpoint_copy, dtype=torch.float32)


def test_missing_folder(tmp_path: Path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_bagel(tmp_path / "nope")


# ------------------------------------------------------------------------------------------ tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


# The Qwen2 pattern with \p{L} / \p{N} narrowed to ASCII (valid for the ASCII inputs used below).
_ASCII_QWEN_PATTERN = re.compile(
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]| ?[^\sA-Za-z0-9]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _reference_encode(text: str, vocab: dict[str, int], merges: list[tuple[str, str]]) -> list[int]:
    """The slow Qwen2Tokenizer algorithm (regex split, byte map, lowest-rank-first BPE) for ASCII text."""
    ranks = {pair: i for i, pair in enumerate(merges)}
    byte_map = _bytes_to_unicode()
    ids = []
    for piece in _ASCII_QWEN_PATTERN.findall(text):
        word = [byte_map[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            pairs = [(word[i], word[i + 1]) for i in range(len(word) - 1)]
            best = min(pairs, key=lambda p: ranks.get(p, float("inf")))
            if best not in ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        ids.extend(vocab[w] for w in word)
    return ids


def test_tokenizer_matches_reference_bpe(tiny_checkpoint: Path):
    tok = BagelTokenizer.from_dir(tiny_checkpoint)
    vocab = json.loads((tiny_checkpoint / "vocab.json").read_text(encoding="utf-8"))
    lines = (tiny_checkpoint / "merges.txt").read_text(encoding="utf-8").splitlines()[1:]
    merges = [tuple(line.split()) for line in lines if line.strip()]
    for text in [
        "The cat sat on the mat.",
        "Generate a photo of an unusual zebra-striped giraffe!!  Then\n\nstop it's 2024",
        "   leading spaces, trailing spaces   ",
        "What's THE answer?I'll say 42; they've said 7.\r\nOk",
    ]:
        assert tok.encode(text) == _reference_encode(text, vocab, merges), text


def test_tokenizer_roundtrip_and_special_ids(tiny_checkpoint: Path):
    tok = BagelTokenizer.from_dir(tiny_checkpoint)
    config = json.loads((tiny_checkpoint / "tokenizer_config.json").read_text())
    ids_by_name = {v["content"]: int(k) for k, v in config["added_tokens_decoder"].items()}
    assert tok.bos_token_id == ids_by_name["<|im_start|>"]
    assert tok.eos_token_id == ids_by_name["<|im_end|>"]
    assert tok.start_of_image == ids_by_name["<|vision_start|>"]
    assert tok.end_of_image == ids_by_name["<|vision_end|>"]
    assert tok.vocab_size == max(ids_by_name.values()) + 1
    text = "Ünïcödé & emoji 🐱 in text, numbers 123"
    assert tok.decode(tok.encode(text)) == text
    # With the official parsing, special-token strings inside the text are single ids; encode adds none by itself.
    ids = tok.encode("hi<|im_end|><|vision_start|>", special_tokens=True)
    assert ids[-2:] == [tok.eos_token_id, tok.start_of_image]
    assert tok.bos_token_id not in tok.encode("hi")
    assert tok.decode([tok.bos_token_id] + tok.encode("a cat") + [tok.eos_token_id]) == "<|im_start|>a cat<|im_end|>"


def test_tokenizer_nfc_normalisation(tiny_checkpoint: Path):
    tok = BagelTokenizer.from_dir(tiny_checkpoint)
    decomposed = "cafe\u0301"
    assert decomposed != unicodedata.normalize("NFC", decomposed)
    assert tok.encode(decomposed) == tok.encode(unicodedata.normalize("NFC", decomposed))


def test_tokenizer_adds_missing_bagel_tokens(tiny_checkpoint_copy: Path):
    path = tiny_checkpoint_copy / "tokenizer_config.json"
    config = json.loads(path.read_text())
    decoder = config["added_tokens_decoder"]
    keep = {k: v for k, v in decoder.items() if v["content"] not in ("<|vision_start|>", "<|vision_end|>")}
    kept_max = max(int(k) for k in decoder)
    config["added_tokens_decoder"] = keep
    path.write_text(json.dumps(config))
    tok = BagelTokenizer.from_dir(tiny_checkpoint_copy)
    assert (tok.start_of_image, tok.end_of_image) == (kept_max + 1, kept_max + 2)
    assert tok.encode("<|vision_start|>", special_tokens=True) == [tok.start_of_image]
