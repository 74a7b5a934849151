"""BAGEL's text tokenizer: Qwen2 byte-level BPE rebuilt with the HF ``tokenizers`` library.

The official code uses the *slow* ``Qwen2Tokenizer``, which reads only ``vocab.json``,
``merges.txt`` and ``tokenizer_config.json`` (its ``added_tokens_decoder``). We build the same
tokenizer from exactly those files; ``tokenizer.json`` is ignored even when present, so the result
cannot drift from what the official inference code runs. Behaviour reproduced (docs/bagel.md §3.2):

* NFC normalisation of the text (the slow tokenizer's ``prepare_for_tokenization``);
* the Qwen2 pre-tokenizer regex, then byte-to-unicode mapping and BPE by merge rank;
* added tokens (``<|endoftext|>``, ``<|im_start|>``, …) matched verbatim and mapped to their ids;
* ``<|im_start|>``, ``<|im_end|>``, ``<|vision_start|>``, ``<|vision_end|>`` added only when missing
  (BAGEL's ``add_special_tokens``), then resolved by id;
* ``encode`` adds no special tokens; ``decode`` keeps special tokens and joins without spaces.

One deliberate difference: ``encode(text)`` reads the text as plain text, so ``<|im_end|>`` typed in a
prompt becomes the ordinary BPE tokens of those characters and user text cannot close its own turn.
``encode(text, special_tokens=True)`` is the official parsing (the slow tokenizer splits on every added
token, so the same text becomes the control id); the settings' ``special_tokens`` option selects it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from ..errors import CheckpointError

logger = logging.getLogger(__name__)

VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

#: The Qwen2 pre-tokenization pattern (the slow tokenizer's ``PRETOKENIZE_REGEX``).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
#: Tokens BAGEL's ``add_special_tokens`` guarantees, in the order it adds missing ones.
BAGEL_SPECIAL_TOKENS = (IM_START, IM_END, VISION_START, VISION_END)


@dataclass(frozen=True)
class AddedTokenSpec:
    """One entry of ``added_tokens_decoder``."""

    id: int
    content: str
    special: bool = True
    lstrip: bool = False
    rstrip: bool = False
    normalized: bool = False
    single_word: bool = False


#: Largest accepted tokenizer file (Qwen2's vocab.json is about 3 MB); larger files are refused unread.
MAX_TOKENIZER_FILE_BYTES = 64 << 20


def _require(path: Path) -> Path:
    if path.exists() and not path.is_file():  # a folder, FIFO or device: never opened (a FIFO would block)
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise CheckpointError(f"tokenizer file {path} is {kind}; re-download {path.name}")
    if not path.is_file():
        raise CheckpointError(
            f"missing tokenizer file {path}; the checkpoint folder needs {VOCAB_FILE}, {MERGES_FILE} and "
            f"{TOKENIZER_CONFIG_FILE} (download them from the ByteDance-Seed/BAGEL-7B-MoT repository)"
        )
    size = path.stat().st_size
    if size > MAX_TOKENIZER_FILE_BYTES:
        raise CheckpointError(
            f"tokenizer file {path} is {size} bytes, far more than a tokenizer file needs "
            f"(limit {MAX_TOKENIZER_FILE_BYTES}); re-download it"
        )
    return path


def _load_json(path: Path) -> Any:
    try:
        return json.loads(_require(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad UTF-8/JSON, a 5000-digit integer
        raise CheckpointError(f"cannot parse tokenizer file {path}: {exc}; re-download it") from None


def read_vocab(path: Path) -> dict[str, int]:
    """``vocab.json`` → ``{token: id}`` (checks it is a JSON object of ints)."""
    vocab = _load_json(path)
    if not isinstance(vocab, dict):
        raise CheckpointError(
            f"tokenizer file {path} holds a JSON {type(vocab).__name__}; it must be a JSON object mapping "
            f"tokens to integer ids (re-download it)"
        )
    owner: dict[int, str] = {}
    for token, token_id in vocab.items():
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0 or token_id >= 2**32:
            raise CheckpointError(
                f"tokenizer file {path}: token {token!r} has id {token_id!r}; ids must be integers in "
                f"[0, 2**32) (re-download the file)"
            )
        if token_id in owner:
            raise CheckpointError(
                f"tokenizer file {path}: tokens {owner[token_id]!r} and {token!r} share id {token_id}; every id "
                f"must be unique (re-download the file)"
            )
        owner[token_id] = token
    return vocab


def read_merges(path: Path) -> list[tuple[str, str]]:
    """``merges.txt`` → merge pairs in rank order (skips a leading ``#version`` line and blank lines).

    A file without any merge is refused: the BPE would split every word into single bytes, which the model
    never saw.
    """
    try:
        lines = _require(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"cannot read tokenizer file {path}: {exc}; re-download it") from None
    merges: list[tuple[str, str]] = []
    for i, raw in enumerate(lines):
        line = raw.strip()
        if not line or (i == 0 and line.startswith("#version:")):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise CheckpointError(f"tokenizer file {path}, line {i + 1}: expected two tokens, got {raw!r}")
        merges.append((parts[0], parts[1]))
    if not merges:
        raise CheckpointError(
            f"tokenizer file {path} holds no merges, so every word would be split into single "
            f"bytes the model never saw; re-download {path.name}"
        )
    return merges


#: Content of an added token that would match inside ordinary text: letters, digits and spaces only, or no letter or
#: digit at all (". ", "--", "..."); every real control token mixes both (``<|im_end|>``, ``<tool_call>``).
_ORDINARY_TEXT = re.compile(r"[\w\s]+|[\W_]+")


def read_added_tokens(path: Path) -> list[AddedTokenSpec]:
    """``tokenizer_config.json`` → its ``added_tokens_decoder`` entries sorted by id."""
    config = _load_json(path)
    if not isinstance(config, dict):
        raise CheckpointError(f"tokenizer file {path} must hold a JSON object")
    decoder = config.get("added_tokens_decoder", {}) or {}
    if not isinstance(decoder, dict):
        raise CheckpointError(f"tokenizer file {path}: 'added_tokens_decoder' must be an object")
    specs = []
    for key, entry in decoder.items():
        try:
            token_id = int(key)
            content = entry["content"] if isinstance(entry, dict) else entry
        except (ValueError, KeyError, TypeError):
            token_id, content = -1, None
        if token_id < 0 or token_id >= 2**32 or not isinstance(content, str) or not content:
            raise CheckpointError(
                f"tokenizer file {path}: bad added_tokens_decoder entry {key!r}: {entry!r}; keys must be ids "
                f">= 0 and entries objects with a non-empty string 'content' (re-download the file)"
            )
        if len(content) == 1 or _ORDINARY_TEXT.fullmatch(content):
            raise CheckpointError(
                f"tokenizer file {path}: added token {token_id} has the content {content!r}, which is ordinary "
                f"text (a control token mixes letters with other characters, as <|im_end|>): every {content!r} in a "
                f"prompt would become token {token_id}; re-download the file"
            )
        opts = entry if isinstance(entry, dict) else {}
        specs.append(
            AddedTokenSpec(
                id=token_id,
                content=content,
                special=bool(opts.get("special", True)),
                lstrip=bool(opts.get("lstrip", False)),
                rstrip=bool(opts.get("rstrip", False)),
                normalized=bool(opts.get("normalized", False)),
                single_word=bool(opts.get("single_word", False)),
            )
        )
    return sorted(specs, key=lambda s: s.id)


class BagelTokenizer:
    """Qwen2 BPE tokenizer with BAGEL's special-token ids.

    Attributes:
        added_special_tokens: the tokens of BAGEL's four that the files lacked (added at fresh ids).
        bos_token_id: id of ``<|im_start|>``.
        eos_token_id: id of ``<|im_end|>``.
        start_of_image: id of ``<|vision_start|>``.
        end_of_image: id of ``<|vision_end|>``.
        vocab_size: number of ids the tokenizer can produce (BPE vocab + added tokens; the official
            ``len(tokenizer)``). The LLM embedding table may be larger (151665 vs 152064 for Qwen2.5).
    """

    def __init__(
        self,
        vocab: dict[str, int],
        merges: Sequence[tuple[str, str]],
        added_tokens: Sequence[AddedTokenSpec] = (),
    ):
        vocab = dict(vocab)
        specs = list(added_tokens)
        # Put added tokens into the id table so that they keep the ids given in the config even when
        # those are not contiguous with the BPE vocabulary.
        for spec in specs:
            vocab.setdefault(spec.content, spec.id)
        next_id = max(vocab.values(), default=-1) + 1
        # BAGEL's add_special_tokens: add each required token only when it is missing.
        added_here = []
        for name in BAGEL_SPECIAL_TOKENS:
            if name not in vocab:
                added_here.append(name)
                logger.info("adding missing special token %s with id %d", name, next_id)
                specs.append(AddedTokenSpec(id=next_id, content=name, special=False))
                vocab[name] = next_id
                next_id += 1
        self._specs = sorted(specs, key=lambda s: s.id)
        known = set(vocab)
        for rank, (a, b) in enumerate(merges):
            for part in (a, b):
                if part not in known:
                    raise CheckpointError(
                        f"{MERGES_FILE}: merge #{rank + 1} ({a!r}, {b!r}) uses the token {part!r}, which is not "
                        f"in {VOCAB_FILE}; the two tokenizer files do not belong together (re-download both)"
                    )
        model = models.BPE(vocab=vocab, merges=list(merges), fuse_unk=False, byte_fallback=False)
        tok = Tokenizer(model)
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(
            [
                AddedToken(
                    s.content,
                    single_word=s.single_word,
                    lstrip=s.lstrip,
                    rstrip=s.rstrip,
                    normalized=s.normalized,
                    special=True,
                )
                for s in self._specs
            ]
        )
        for s in self._specs:
            got = tok.token_to_id(s.content)
            if got != vocab[s.content]:
                raise CheckpointError(
                    f"added token {s.content!r} resolved to id {got}, expected {vocab[s.content]}; "
                    f"the tokenizer files are inconsistent"
                )
        self._tok = tok
        # The same tokenizer with its added tokens switched off in the input: plain text stays plain.
        self._plain = Tokenizer.from_str(tok.to_str())
        self._plain.encode_special_tokens = True
        self._vocab = vocab
        self.bos_token_id = vocab[IM_START]
        self.eos_token_id = vocab[IM_END]
        self.start_of_image = vocab[VISION_START]
        self.end_of_image = vocab[VISION_END]
        self.vocab_size = max(vocab.values()) + 1
        #: BAGEL special tokens the files lacked and that were added at new ids (empty for Qwen2.5's files).
        self.added_special_tokens: tuple[str, ...] = tuple(added_here)

    @classmethod
    def from_dir(cls, checkpoint_dir: str | Path) -> BagelTokenizer:
        """Build from ``vocab.json`` + ``merges.txt`` + ``tokenizer_config.json`` in ``checkpoint_dir``.

        Raises:
            CheckpointError: a file is missing or unreadable.
        """
        root = Path(checkpoint_dir)
        vocab = read_vocab(root / VOCAB_FILE)
        merges = read_merges(root / MERGES_FILE)
        added = read_added_tokens(root / TOKENIZER_CONFIG_FILE)
        return cls(vocab, merges, added)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, *, special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; none are added.

        ``special_tokens=False``: plain text (``<|im_end|>`` in the text is the BPE tokens of its characters).
        ``special_tokens=True``: the official parsing, an added token's string in the text maps to its id.
        """
        if not isinstance(text, str):
            raise ValueError(f"`text` must be a str, got {type(text).__name__}")
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(
                    f"`text` has a lone surrogate {text[exc.start]!r} at index {exc.start}, which is no "
                    f"character; pass valid Unicode text"
                ) from None
        return (self._tok if special_tokens else self._plain).encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens kept, invalid UTF-8 replaced by U+FFFD)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        """Id of one token string (BPE or added), ``None`` if unknown."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    @property
    def special_token_ids(self) -> dict[str, int]:
        """``{content: id}`` of all added tokens."""
        return {s.content: self._vocab[s.content] for s in self._specs}


def check_bagel_tokens(tokenizer: BagelTokenizer, checkpoint_dir: str | Path) -> None:
    """Refuse a checkpoint's tokenizer that lacks one of BAGEL's four control tokens.

    BAGEL's tokenizer code adds a missing one at a fresh id (:attr:`BagelTokenizer.added_special_tokens`),
    but a trained checkpoint has its own ids for them: a fresh id is another token's (or an untrained)
    embedding row, and every prompt would be framed by the wrong tokens.
    """
    if tokenizer.added_special_tokens:
        path = Path(checkpoint_dir) / TOKENIZER_CONFIG_FILE
        raise CheckpointError(
            f"tokenizer file {path}: its added_tokens_decoder has no {', '.join(tokenizer.added_special_tokens)}, "
            f"so they would get new ids the model never learned; re-download {TOKENIZER_CONFIG_FILE}"
        )


__all__ = [
    "BagelTokenizer",
    "check_bagel_tokens",
    "QWEN2_PRETOKENIZE_REGEX",
    "read_added_tokens",
    "read_merges",
    "read_vocab",
]
