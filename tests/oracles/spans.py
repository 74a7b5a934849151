"""Typed spans over a packed context, in original token positions: maximal same-type runs, the positions
of one type, and which tokens a policy may act on (references for the token-type tests)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unicache_core.kv.token_types import CANDIDATE_TYPES, PROTECTED_TYPES, TokenType


def is_protected(token_type: TokenType) -> bool:
    """True for types that every method keeps in full precision."""
    return TokenType(token_type) in PROTECTED_TYPES


@dataclass(frozen=True)
class Span:
    """A maximal run ``[start, stop)`` of one token type in a context, in ORIGINAL token positions."""

    token_type: TokenType
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start

    @property
    def protected(self) -> bool:
        return is_protected(self.token_type)


def spans_from_types(token_types: torch.Tensor) -> list[Span]:
    """Split a context's ``[T]`` token-type tensor into maximal same-type runs, in order.

    Example: ``[5, 3, 3, 5, 1, 1, 5]`` → boundary ``[0,1)``, source_vae ``[1,3)``, boundary ``[3,4)``,
    instruction ``[4,6)``, boundary ``[6,7)``.
    """
    if token_types.dim() != 1:
        raise ValueError(f"`token_types` must be 1-D [T], got shape {tuple(token_types.shape)}")
    values = token_types.tolist()
    spans: list[Span] = []
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            spans.append(Span(TokenType(values[start]), start, i))
            start = i
    return spans


def positions_of(token_types: torch.Tensor, token_type: TokenType | str | int) -> torch.Tensor:
    """``[n]`` int64 original positions of every token of ``token_type`` (ascending; spans may be disjoint)."""
    if token_types.dim() != 1:
        raise ValueError(f"`token_types` must be 1-D [T], got shape {tuple(token_types.shape)}")
    wanted = int(TokenType.parse(token_type))
    return torch.nonzero(token_types.to(torch.int64) == wanted).squeeze(1)


def candidate_mask(token_types: torch.Tensor) -> torch.Tensor:
    """``[T]`` bool: True where a compression policy may act (not protected, not unknown)."""
    allowed = torch.tensor([int(t) for t in CANDIDATE_TYPES], device=token_types.device)
    return torch.isin(token_types.to(torch.int64), allowed)
