"""TaylorSeer: BAGEL's official feature cache for denoising (``enable_taylorseer``; docs/bagel.md §5.6).

The official code (ByteDance-Seed/Bagel commit 57c390a: ``modeling/cache_utils/taylorseer.py``,
``modeling/bagel/qwen2_navit.py``, ``modeling/bagel/bagel.py``) gives each CFG branch (``gen``, ``cfg_text``,
``cfg_img``) its own state and counts that branch's own forwards ``n = 0, 1, ...`` (a CFG branch outside
``cfg_interval`` is not run and does not count). With ``interval`` I, ``first_steps`` N and ``order`` K (official
3, 5 and 6):

- forward ``n`` is **full** (the decoder layers run) when ``n < N`` or ``(n - (N - 1)) % I == 0``; the others are
  **forecast**: with the defaults, forwards 0-4, 7, 10, 13, ... run the decoder, about one in three after the
  first five;
- on a full forward ``n`` whose previous full forward was ``p``, the Taylor factors of a feature ``h`` become
  ``F'_0 = h`` and, when ``n >= N - 1`` and the branch holds factors, ``F'_(i+1) = (F'_i - F_i) / (n - p)`` for
  ``i < min(len(F), K)`` (backward differences over the step distance; during the first ``N - 1`` forwards only
  ``F'_0`` is kept, so the order grows by one per full forward from forward ``N - 1`` on, up to K);
- a forecast forward ``n`` whose last full forward was ``p`` uses ``sum_i F_i * (n - p)^i / i!`` (in this order
  of operations, in the model dtype) instead of the feature.

The official feature is each decoder layer's whole output (module ``total``: the layer's output with its residual,
``[tokens, hidden]``), kept per layer and per branch, and a forecast forward replaces every layer's output by its
own forecast. Every layer's input is then discarded, so only the last layer's forecast reaches the final norm
and ``llm2vae``: this engine keeps the factors of the last decoder layer only, which gives the same velocities
with ``1 / num_layers`` of the official memory (tests/test_taylorseer.py re-derives the official per-layer rule
from every layer's recorded outputs and compares). A forecast forward calls no cache, so a compressing cache sees
neither attention nor statistics in it (docs/compression.md §11.12).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from . import contexts as C
from .checkpoint.loader import LoadedBagel
from .contexts import Context
from .settings import UnderstandingSettings

if TYPE_CHECKING:  # pragma: no cover
    from .settings import GenerationSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TaylorRule:
    """When a branch runs its decoder and how far its Taylor expansion goes (module docstring).

    Attributes:
        interval: after the first steps, one forward in ``interval`` is full (1: every one).
        first_steps: the first forwards of a branch, all full (>= 1).
        order: highest Taylor order kept (0: reuse the last full forward's feature).
    """

    interval: int
    first_steps: int
    order: int

    @classmethod
    def from_settings(cls, settings) -> TaylorRule:
        """The rule of a :class:`~.settings.GenerationSettings` (its ``taylorseer_*`` fields)."""
        return cls(settings.taylorseer_interval, settings.taylorseer_first_steps, settings.taylorseer_order)

    def is_full(self, forward: int) -> bool:
        """Whether a branch's forward number ``forward`` (0-based, counting its own forwards) runs the decoder."""
        return forward < self.first_steps or (forward - (self.first_steps - 1)) % self.interval == 0


class TaylorFactors:
    """One branch's Taylor factors ``F_0 .. F_k`` of a feature ``[T, H]`` (model dtype), in the branch's forwards."""

    def __init__(self, rule: TaylorRule):
        self.rule = rule
        self.factors: list[Tensor] = []
        self.last_full: int | None = None

    def update(self, forward: int, feature: Tensor) -> None:
        """The feature of full forward ``forward``: new factors by backward differences over the step distance.

        The old factors' storage takes the new differences (same values as the official out-of-place update:
        one subtraction, then one division, each rounded to the feature dtype), so a branch holds its ``k + 1``
        factors and nothing more. ``feature`` is kept as ``F_0`` (not copied): the caller must not modify it.
        """
        old = self.factors if forward >= self.rule.first_steps - 1 and self.last_full is not None else []
        distance = forward - self.last_full if self.last_full is not None else 0
        new = [feature]
        for i in range(min(len(old), self.rule.order)):
            difference = torch.sub(new[i], old[i], out=old[i])
            new.append(difference.div_(distance))
        self.factors = new
        self.last_full = forward

    def forecast(self, forward: int) -> Tensor:
        """``sum_i F_i * x^i / i!`` with ``x = forward - last full forward`` (``[T, H]``, a new tensor)."""
        if self.last_full is None:
            raise RuntimeError("TaylorSeer: a branch was forecast before any full forward")
        x = forward - self.last_full
        out = self.factors[0].clone()  # the official 0 + 1/0! * F_0 * x^0, the same values
        for i, factor in enumerate(self.factors[1:], start=1):
            out += factor.mul(1 / math.factorial(i)).mul(x**i)
        return out

    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.factors)


class TaylorSeer:
    """One request's TaylorSeer: which steps compute each branch, and each branch's :class:`TaylorFactors`.

    Args:
        rule: the settings' :class:`TaylorRule`.
        step_branches: for each denoising step, the branches it uses (in run order; a CFG branch outside
            ``cfg_interval`` is absent, as :func:`~.denoise.step_branches` decides), so each branch's own
            forward numbers, and the full steps ahead, are known before the loop starts.
    """

    def __init__(self, rule: TaylorRule, step_branches: Sequence[Sequence[str]]):
        self.rule = rule
        self.forward_of: dict[str, dict[int, int]] = {}  # branch -> step -> the branch's forward number there
        self.full_steps: dict[str, list[int]] = {}  # branch -> the steps that run its decoder, ascending
        for step, names in enumerate(step_branches):
            for name in names:
                forwards = self.forward_of.setdefault(name, {})
                forwards[step] = len(forwards)
                if rule.is_full(forwards[step]):
                    self.full_steps.setdefault(name, []).append(step)
        self.factors = {name: TaylorFactors(rule) for name in self.forward_of}
        self.peak_bytes = 0

    @classmethod
    def for_settings(cls, settings, step_branches: Sequence[Sequence[str]]) -> TaylorSeer | None:
        """The request's TaylorSeer when ``settings.taylorseer`` is on, else ``None``."""
        return cls(TaylorRule.from_settings(settings), step_branches) if settings.taylorseer else None

    def is_full(self, branch: str, step: int) -> bool:
        """Whether ``step`` runs ``branch``'s decoder (it must be one of the step's branches)."""
        return self.rule.is_full(self.forward_of[branch][step])

    def forecast_branches(self, step: int, branches: Sequence[str]) -> tuple[str, ...]:
        """The ``branches`` of ``step`` whose output it forecasts."""
        return tuple(name for name in branches if not self.is_full(name, step))

    def next_full(self, step: int, branches: Sequence[str]) -> dict[str, int | None]:
        """For each of ``branches``: the first step after ``step`` that runs its decoder, or ``None``."""
        return {name: next((s for s in self.full_steps.get(name, ()) if s > step), None) for name in branches}

    def velocities(
        self,
        loaded: LoadedBagel,
        contexts: dict[str, Context],
        embeds: Callable[[], Tensor],
        *,
        step: int,
        timestep: float,
    ) -> dict[str, Tensor]:
        """:func:`~.contexts.latent_velocities` of the branches ``step`` computes (their last decoder layer's output
        updates their factors), and the forecast branches' velocities from their factors: ``llm2vae`` of the final
        norm of the forecast, as the official forecast step computes it. ``embeds()`` builds the latent query block
        ``[N + 2, H]``, only when some branch is computed. Returns branch → ``[N, 64]``, in ``contexts``' order."""
        computed = {name: ctx for name, ctx in contexts.items() if self.is_full(name, step)}
        out: dict[str, Tensor] = {}
        if computed:

            def keep(name: str, hidden: Tensor) -> None:
                self.factors[name].update(self.forward_of[name][step], hidden)

            out = C.latent_velocities(loaded, computed, embeds(), step=step, timestep=timestep, last_layer_hook=keep)
        for name in contexts:
            if name not in computed:
                hidden = self.factors[name].forecast(self.forward_of[name][step])
                mask = C.latent_gen_mask(hidden.shape[0] - 2, hidden.device)
                out[name] = loaded.model.latent_velocity(loaded.model.final_norm(hidden, mask)[1:-1])
        self.peak_bytes = max(self.peak_bytes, self.nbytes())
        return {name: out[name] for name in contexts}

    def nbytes(self) -> int:
        """Bytes of every branch's factors now."""
        return sum(f.nbytes() for f in self.factors.values())


def factor_bytes(hidden_size: int, latent_tokens: int, order: int, element_size: int) -> int:
    """Bytes of one branch's factors at ``order`` (``order + 1`` tensors of ``[latent_tokens + 2, hidden_size]``
    in the model dtype): what TaylorSeer adds per branch here, and per (layer, branch) in the official code."""
    return (order + 1) * (latent_tokens + 2) * hidden_size * element_size


def describe_factors(kept: int, official: int, settings, branches: int) -> str:
    """A memory plan's line on TaylorSeer: ``kept`` bytes of factors (the last layer of ``branches`` branches) and the
    ``official`` bytes of every layer's; ``settings``: the plan's (its ``taylorseer_order``)."""
    per = kept / branches / 1e9
    return (
        f"  TaylorSeer: {settings.taylorseer_order + 1} factors of the latent block = {per:.3f} GB per (layer, "
        f"branch); kept for the last layer x {branches} branches (in the LLM phase above); the official code keeps "
        f"every layer's: {official / 1e9:.2f} GB"
    )


#: The CFG branches a generation request may run per denoising step (``gen``, ``cfg_text``, ``cfg_img``).
GENERATION_BRANCHES = 3


def taylorseer_order(settings: GenerationSettings | UnderstandingSettings) -> int | None:
    """The Taylor order a request's TaylorSeer keeps (``settings.taylorseer_order``), or ``None`` without it."""
    if isinstance(settings, UnderstandingSettings) or not getattr(settings, "taylorseer", False):
        return None
    return settings.taylorseer_order


__all__ = [
    "GENERATION_BRANCHES",
    "TaylorFactors",
    "TaylorRule",
    "TaylorSeer",
    "describe_factors",
    "factor_bytes",
    "taylorseer_order",
]
