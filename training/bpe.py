"""Byte-level BPE tokenizers in Qwen2's file format, for the small checkpoints written here.

:func:`train_tiny_bpe` trains one with the Qwen2 pre-tokenizer (on a built-in English text, or given lines);
:func:`bpe_tokenizer_files` writes its ``vocab.json``, ``merges.txt`` and ``tokenizer_config.json`` with
Qwen's special tokens appended (or at Qwen2.5's real ids, ``full_vocab``).
"""

from __future__ import annotations

import json

from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

from unicache_core.bagel.tokenizer import BAGEL_SPECIAL_TOKENS, QWEN2_PRETOKENIZE_REGEX

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
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")


def json_text(data: object) -> str:
    """``data`` as the indented JSON text every written file uses."""
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


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


def bpe_tokenizer_files(
    vocab: dict[str, int], merges: list[tuple[str, str]], *, full_vocab: bool = False
) -> tuple[dict[str, str], dict[str, int], dict[int, str], int]:
    """The three tokenizer files of a byte-level BPE with Qwen's special tokens appended.

    Returns:
        ``(files {name: text}, BAGEL special ids {token: id}, added tokens {id: token}, vocab_size)``;
        with ``full_vocab`` the special tokens sit at Qwen2.5's ids and ``vocab_size`` is 152,064.
    """
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
    files = {
        "vocab.json": json_text(vocab),
        "merges.txt": merges_text,
        "tokenizer_config.json": json_text(_tokenizer_config(added)),
    }
    ids = {tok: i for i, tok in added.items() if tok in BAGEL_SPECIAL_TOKENS}
    return files, ids, added, vocab_size
