"""Chunked, EMA-smoothed attention statistics per (branch, layer chunk, step chunk, token type).

docs/compression.md §8.5: layers are chunked by 4 (layer 0 alone), steps by 5 (step 0 alone). The
mass of a type is the full-softmax share that falls on its currently retained keys, averaged over
heads and queries. Budgets for cell ``(c, s)`` read cell ``(c, s-1)`` (§9.2).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..kv.token_types import TokenType
from ..validation import check_int, check_ratio
from .defaults import EMA_DECAY, LAYER_CHUNK_SIZE, RHO0, STEP_CHUNK_SIZE, UNDERSTANDING_EMA_WINDOW

logger = logging.getLogger(__name__)


def layer_chunk(layer: int, size: int = LAYER_CHUNK_SIZE) -> int:
    """Layer 0 alone, then chunks of ``size``: ``0 if l == 0 else 1 + (l - 1) // size``."""
    check_int("layer", layer, 0)
    check_int("size", size, 1)
    return 0 if layer == 0 else 1 + (layer - 1) // size


def step_chunk(step: int, size: int = STEP_CHUNK_SIZE) -> int:
    """Step 0 alone, then chunks of ``size``: ``0 if t == 0 else 1 + (t - 1) // size``."""
    check_int("step", step, 0)
    check_int("size", size, 1)
    return 0 if step == 0 else 1 + (step - 1) // size


def layer_chunks(num_layers: int, size: int = LAYER_CHUNK_SIZE) -> dict[int, list[int]]:
    """``{layer_chunk: [layers]}`` of a model with ``num_layers`` layers, layer 0 alone (§8.5)."""
    chunks: dict[int, list[int]] = {}
    for layer in range(num_layers):
        chunks.setdefault(layer_chunk(layer, size), []).append(layer)
    return chunks


def fallback_budget_ratio(task: str) -> float:
    """The budget ratio while no statistics exist yet (§8.6): the task's ``rho0`` (0.2 understanding, 0.5 t2i
    and edit)."""
    if task not in RHO0:
        raise ValueError(f"`task` must be one of {tuple(RHO0)}, got {task!r}")
    return RHO0[task]


@dataclass
class ChunkedAttentionStats:
    """EMA of mass and K90 per cell ``(branch, layer_chunk, step_chunk, type)``; one instance per request.

    The first update of a cell stores the value; later ones apply
    ``ema = decay * ema + (1 - decay) * x``. With ``carry_across_steps`` (understanding) a new cell
    starts from the latest EMA of the same (branch, layer chunk, type) before applying the update.

    Attributes:
        decay: EMA decay (0.8 t2i/edit; ``1 - 1/16`` understanding).
        carry_across_steps: see above.
        fallback_previous_layer_chunk: :meth:`budget_masses` falls back to cell ``(c-1, s)`` when
            ``(c, s-1)`` is missing (understanding).
        layer_chunk_size, step_chunk_size: 4 and 5.
    """

    decay: float = EMA_DECAY
    carry_across_steps: bool = False
    fallback_previous_layer_chunk: bool = False
    layer_chunk_size: int = LAYER_CHUNK_SIZE
    step_chunk_size: int = STEP_CHUNK_SIZE
    _mass: dict = field(default_factory=dict, init=False, repr=False)
    _k90: dict = field(default_factory=dict, init=False, repr=False)
    _last_mass: dict = field(default_factory=dict, init=False, repr=False)
    _last_k90: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        check_ratio("decay", self.decay, allow_zero=True, allow_one=False)

    @classmethod
    def for_task(cls, task: str, ema_window_size: int = UNDERSTANDING_EMA_WINDOW) -> ChunkedAttentionStats:
        """Presets of §8.5: t2i/edit decay 0.8; understanding decay ``1 - 1/ema_window_size``, carried."""
        if task == "understanding":
            check_int("ema_window_size", ema_window_size, 1)
            return cls(decay=1.0 - 1.0 / ema_window_size, carry_across_steps=True, fallback_previous_layer_chunk=True)
        if task in ("t2i", "edit"):
            return cls(decay=EMA_DECAY)
        raise ValueError(f"`task` must be 'understanding', 't2i' or 'edit', got {task!r}")

    def cell(self, layer: int, step: int) -> tuple[int, int]:
        """``(layer_chunk, step_chunk)`` of a layer and step."""
        return layer_chunk(layer, self.layer_chunk_size), step_chunk(step, self.step_chunk_size)

    def _ema(self, table: dict, last: dict, key: tuple, value: float) -> None:
        branch, c, _, ttype = key
        run_key = (branch, c, ttype)
        if key in table:
            table[key] = self.decay * table[key] + (1.0 - self.decay) * value
        elif self.carry_across_steps and run_key in last:
            table[key] = self.decay * last[run_key] + (1.0 - self.decay) * value
        else:
            table[key] = value
        last[run_key] = table[key]

    def update(
        self,
        layer: int,
        step: int,
        masses: Mapping[TokenType, float],
        k90s: Mapping[TokenType, float] | None = None,
        branch: str = "gen",
    ) -> None:
        """Fold one attention call's per-type masses (and optional K90s) into its cell.

        A NaN/inf or negative value raises (it would otherwise poison the EMA and every later budget).
        """
        for name, values in (("mass", masses), ("k90", k90s or {})):
            for ttype, value in values.items():
                if not (math.isfinite(value) and value >= 0):
                    raise ValueError(
                        f"attention {name} of {TokenType(ttype).name.lower()} at layer {layer}, step "
                        f"{step} ({branch}) is {value!r}; the attention produced non-finite values "
                        "(check the model dtype for overflow)"
                    )
        c, s = self.cell(layer, step)
        for ttype, value in masses.items():
            self._ema(self._mass, self._last_mass, (branch, c, s, TokenType(ttype)), float(value))
        for ttype, value in (k90s or {}).items():
            self._ema(self._k90, self._last_k90, (branch, c, s, TokenType(ttype)), float(value))

    def mass(
        self, layer_chunk_idx: int, step_chunk_idx: int, token_type: TokenType, branch: str = "gen"
    ) -> float | None:
        """EMA mass of one cell and type, or ``None``."""
        return self._mass.get((branch, layer_chunk_idx, step_chunk_idx, TokenType(token_type)))

    def k90(
        self, layer_chunk_idx: int, step_chunk_idx: int, token_type: TokenType, branch: str = "gen"
    ) -> float | None:
        """EMA K90 of one cell and type, or ``None``."""
        return self._k90.get((branch, layer_chunk_idx, step_chunk_idx, TokenType(token_type)))

    def cell_masses(
        self, layer_chunk_idx: int, step_chunk_idx: int, types: Iterable[TokenType], branch: str = "gen"
    ) -> dict[TokenType, float] | None:
        """Masses of ``types`` in one cell (0.0 for a type never observed there); ``None`` if none was."""
        types = [TokenType(t) for t in types]
        values = {t: self.mass(layer_chunk_idx, step_chunk_idx, t, branch) for t in types}
        if all(v is None for v in values.values()):
            return None
        return {t: (0.0 if v is None else v) for t, v in values.items()}

    def total_mass(
        self, layer_chunk_idx: int, step_chunk_idx: int, types: Iterable[TokenType], branch: str = "gen"
    ) -> float | None:
        """``m_s`` of §8.7: summed EMA mass of ``types`` in one cell, or ``None``."""
        masses = self.cell_masses(layer_chunk_idx, step_chunk_idx, types, branch)
        return None if masses is None else sum(masses.values())

    def budget_masses(
        self, layer: int, step: int, types: Iterable[TokenType], branch: str = "gen"
    ) -> dict[TokenType, float] | None:
        """Weights for the budgets of ``(layer, step)``: cell ``(c, s-1)``; understanding falls back to ``(c-1, s)``.

        Returns ``None`` when neither exists; the caller then uses :func:`fallback_budget_ratio`.
        """
        types = list(types)
        c, s = self.cell(layer, step)
        if s > 0:
            found = self.cell_masses(c, s - 1, types, branch)
            if found is not None:
                return found
        if self.fallback_previous_layer_chunk and c > 0:
            found = self.cell_masses(c - 1, s, types, branch)
            if found is not None:
                logger.debug("budget weights for cell (%d, %d) bootstrapped from layer chunk %d", c, s, c - 1)
                return found
        return None
