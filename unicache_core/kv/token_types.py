"""The vocabulary every layer shares: the tasks, the cache branches of a request, and KV token types.

BAGEL packs every context as one sequence of tokens; each cached key/value row belongs to
exactly one :class:`TokenType`. The numeric values follow UniCache's BAGEL adapter type ids.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Literal

import torch

#: The three request kinds: answer about images, generate an image from text, edit an image.
Task = Literal["understanding", "t2i", "edit"]
TASKS: tuple[str, ...] = ("understanding", "t2i", "edit")
#: ``gen``/``cfg_text``/``cfg_img``: BAGEL's CFG contexts; ``plan``: the think-mode plan decoding context.
Branch = Literal["gen", "cfg_text", "cfg_img", "plan"]
BRANCHES: tuple[str, ...] = ("gen", "cfg_text", "cfg_img", "plan")
#: The think-mode branch: a fork of ``gen`` that the reasoning is decoded in.
THINK: Branch = "plan"


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
    def parse(cls, value: TokenType | str | int) -> TokenType:
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


def type_tensor(token_type: TokenType, count: int, device: torch.device | str | None = None) -> torch.Tensor:
    """A ``[count]`` int8 tensor filled with ``token_type``."""
    return torch.full((count,), int(token_type), dtype=torch.int8, device=device)
