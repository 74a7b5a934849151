"""What a run measured, as typed records: :class:`GenerationInfo` (a text-to-image or edit round) and
:class:`UnderstandingInfo` (an answer).

Each is a frozen dataclass read by attribute (``result.info.forwards``); it is also a read-only mapping of the same
values (``result.info["forwards"]``, :meth:`RunInfo.as_dict` for a JSON report), in which the TaylorSeer entries
appear only when TaylorSeer ran.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any


class RunInfo(Mapping[str, Any]):
    """A frozen record that reads as a mapping of its fields (the fields that are None left out where
    :attr:`OPTIONAL` names them)."""

    #: Fields left out of the mapping while they are None.
    OPTIONAL: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The record's fields as a dict (a JSON report's)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        return {k: v for k, v in out.items() if not (k in self.OPTIONAL and v is None)}

    def __getitem__(self, key: str) -> Any:
        return self.as_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())


@dataclass(frozen=True)
class GenerationInfo(RunInfo):
    """What one generation (one round) measured.

    Attributes:
        context_tokens: tokens in each branch's context after the prefill.
        cache_bytes: bytes each branch's cache held after denoising.
        forwards: decoder forwards per CFG branch (the steps that ran its decoder).
        source_latent: how the last input image's source latent was made (``"checkpoint_vae"``, ``"external_vae"``,
            ``"given"``; None without an input image); ``source_latents``: every input image's, in request order;
            ``images``: their count.
        prefill_s, think_s, denoise_s, decode_s: seconds of each phase.
        vae: which VAE decoded (``"checkpoint"``, ``"external"``; None without a decode).
        latent_format: the latent constants (``convention``, ``scale_factor``, ``shift_factor``).
        forecasts: with TaylorSeer, the steps that forecast each branch (None without TaylorSeer);
            ``taylorseer_peak_bytes``: the most bytes its Taylor factors held.
    """

    OPTIONAL = ("forecasts", "taylorseer_peak_bytes")

    context_tokens: dict[str, int]
    cache_bytes: dict[str, int]
    forwards: dict[str, int]
    source_latent: str | None
    source_latents: list[str]
    images: int
    prefill_s: float
    think_s: float
    denoise_s: float
    decode_s: float
    vae: str | None
    latent_format: dict[str, Any]
    forecasts: dict[str, int] | None = None
    taylorseer_peak_bytes: int | None = None


@dataclass(frozen=True)
class UnderstandingInfo(RunInfo):
    """What one answer measured: ``prefill_s`` and ``decode_s`` seconds, the tokens of its context
    (``context_tokens``, ``{"gen": n}``), the bytes its cache held (``cache_bytes``) and its input ``images``."""

    prefill_s: float
    decode_s: float
    context_tokens: dict[str, int]
    cache_bytes: int
    images: int


__all__ = ["GenerationInfo", "RunInfo", "UnderstandingInfo"]
