"""Token types, tasks and branches, spans in original positions (tests/oracles/spans.py), candidate vs
protected."""

import pytest
import torch
from oracles.spans import Span, candidate_mask, is_protected, positions_of, spans_from_types

from unicache_core.kv.token_types import CANDIDATE_TYPES, PROTECTED_TYPES, TokenType

B, VAE, VIT, TXT, LAT, DEC = (
    TokenType.BOUNDARY,
    TokenType.SOURCE_VAE,
    TokenType.SOURCE_VIT,
    TokenType.INSTRUCTION,
    TokenType.CURRENT_LATENT,
    TokenType.DECODED_TEXT,
)


def _edit_context() -> torch.Tensor:
    """An editing context as BAGEL builds it: [vs] VAE [ve] [vs] ViT [ve] [im_start] text [im_end]."""
    runs = [(B, 1), (VAE, 4), (B, 2), (VIT, 3), (B, 2), (TXT, 5), (B, 1)]
    return torch.cat([torch.full((n,), int(t), dtype=torch.int8) for t, n in runs])


def test_spans_keep_original_positions_and_order():
    spans = spans_from_types(_edit_context())
    assert [(s.token_type, s.start, s.stop) for s in spans] == [
        (B, 0, 1),
        (VAE, 1, 5),
        (B, 5, 7),
        (VIT, 7, 10),
        (B, 10, 12),
        (TXT, 12, 17),
        (B, 17, 18),
    ]
    assert sum(s.length for s in spans) == 18
    assert [s.protected for s in spans] == [True, False, True, False, True, False, True]
    assert spans_from_types(torch.zeros(0, dtype=torch.int8)) == []


def test_positions_of_a_type_across_disjoint_spans():
    types = torch.tensor([int(t) for t in (B, TXT, TXT, B, VIT, B, TXT, B)], dtype=torch.int8)
    assert positions_of(types, "instruction").tolist() == [1, 2, 6]
    assert positions_of(types, TokenType.SOURCE_VIT).tolist() == [4]
    assert positions_of(types, TokenType.SOURCE_VAE).tolist() == []


def test_candidate_and_protected_sets():
    assert set(CANDIDATE_TYPES) == {TXT, VIT, VAE}
    assert set(PROTECTED_TYPES) == {B, LAT, DEC}
    assert not set(CANDIDATE_TYPES) & set(PROTECTED_TYPES)
    types = torch.tensor([int(t) for t in TokenType], dtype=torch.int8)
    mask = candidate_mask(types)
    assert [TokenType(int(t)) for t in types[mask]] == [TXT, VIT, VAE]
    assert all(is_protected(t) for t in PROTECTED_TYPES) and not is_protected(TokenType.UNKNOWN)
    assert Span(LAT, 0, 3).protected


@pytest.mark.parametrize("bad", ["latent", 42, "  "])
def test_parse_rejects_unknown_types(bad):
    with pytest.raises(ValueError, match="unknown token type"):
        TokenType.parse(bad)


def test_parse_accepts_names_ids_and_members():
    assert TokenType.parse("Source_VAE") is VAE
    assert TokenType.parse(2) is VIT
    assert TokenType.parse(LAT) is LAT


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="token_types"):
        spans_from_types(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="token_types"):
        positions_of(torch.zeros(2, 2), B)
