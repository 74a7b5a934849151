"""KV token types and typed spans over a packed context.

BAGEL packs every context as one sequence of tokens; each cached key/value row belongs to
exactly one :class:`TokenType`. The numeric values follow UniCache's BAGEL adapter type ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch


class TokenType(IntEnum):
    """Type of one cached KV row (one packed token)."""

    UNKNOWN = 0
    INSTRUCTION = 1  # prompt / system text tokens (und expert)
    SOURCE_VIT = 2  # SigLIP tokens of an input image (und expert)
    SOURCE_VAE = 3  # clean VAE latent tokens of an input image (gen expert)
    CURRENT_LATENT = 4  # the noisy latent being denoised (never cached, always protected)
    BOUNDARY = 5  # <|im_start|>, <|im_end|>, <|vision_start|>, <|vision_end|>
    DECODED_TEXT = 6  # tokens generated while answering (understanding)

    @classmethod
    def parse(cls, value: "TokenType | str | int") -> "TokenType":
        """Accept an enum member, its name (any case) or its integer id."""
        if isinstance(value, TokenType):
            return value
        if isinstance(value, str):
            try:
                return cls[value.strip().upper()]
            except KeyError:
                raise ValueError(
                    f"unknown token type {value!r}; expected one of {[t.name.lower() for t in cls]}"
                ) from None
        try:
            return cls(int(value))
        except ValueError:
            raise ValueError(f"unknown token type id {value!r}; expected 0..{max(cls)}") from None


#: Types that are never compressed, whatever the method (docs/compression.md §8.3).
PROTECTED_TYPES: frozenset[TokenType] = frozenset(
    {TokenType.BOUNDARY, TokenType.CURRENT_LATENT, TokenType.DECODED_TEXT}
)

#: Types a compression policy may act on.
CANDIDATE_TYPES: tuple[TokenType, ...] = (
    TokenType.INSTRUCTION,
    TokenType.SOURCE_VIT,
    TokenType.SOURCE_VAE,
)


def is_protected(token_type: TokenType) -> bool:
    """True for types that every method keeps in full precision."""
    return TokenType(token_type) in PROTECTED_TYPES


def type_tensor(token_type: TokenType, count: int, device: torch.device | str | None = None) -> torch.Tensor:
    """A ``[count]`` int8 tensor filled with ``token_type``."""
    return torch.full((count,), int(token_type), dtype=torch.int8, device=device)


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
