"""K90 routing: which policy family (evict / quantize / protect) each (task, token type) gets.

kv-compression.md §8.1 and §8.4: a segment whose attention is concentrated (K90 <= 0.3) is evicted
with H2O; a diffuse one is quantized with KIVI. The plan is static per task.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Mapping, Sequence

import torch
from torch import Tensor

from ..segments import PROTECTED_TYPES, TokenType

PolicyKind = Literal["evict", "quantize", "protect"]
TASKS: tuple[str, ...] = ("understanding", "t2i", "edit")
POLICY_KINDS: tuple[str, ...] = ("evict", "quantize", "protect")
DEFAULT_K90_THRESHOLD = 0.3


def k90(mass: Tensor, coverage: float = 0.9) -> float:
    """Fraction of tokens needed to cover ``coverage`` of a segment's attention mass.

    Args:
        mass: ``[n]`` non-negative attention mass per token (already averaged over heads and queries).
        coverage: mass fraction to cover (0.9 for K90).

    Returns:
        ``k / n`` with ``k`` the fewest highest-mass tokens whose sum reaches ``coverage`` of the total;
        1.0 for an empty or zero-mass segment (counted as dense).
    """
    if mass.dim() != 1:
        raise ValueError(f"`mass` must be a 1-D [n] tensor, got {tuple(mass.shape)}")
    if not 0.0 < coverage <= 1.0:
        raise ValueError(f"`coverage` must be in (0, 1], got {coverage!r}")
    n = mass.shape[0]
    m = mass.double().clamp_min(0.0)
    total = float(m.sum()) if n else 0.0
    if n == 0 or total <= 0.0 or not math.isfinite(total):
        return 1.0
    csum = torch.cumsum(torch.sort(m, descending=True).values, dim=0)
    need = coverage * total * (1.0 - 1e-9)  # tolerance: 0.1 * 9 must count as 0.9
    k = int(torch.searchsorted(csum, torch.tensor([need], dtype=csum.dtype)).item()) + 1
    return min(k, n) / n


def segment_k90(probs: Tensor, token_types: Tensor, coverage: float = 0.9) -> dict[TokenType, float]:
    """K90 of every type present in ``token_types``.

    Args:
        probs: ``[Hq, Tq, T]`` attention probabilities; token_types: ``[T]`` :class:`TokenType` ids.
    """
    if probs.dim() != 3 or token_types.dim() != 1 or probs.shape[2] != token_types.shape[0]:
        raise ValueError(f"`probs` [Hq, Tq, T] and `token_types` [T] disagree: {tuple(probs.shape)} vs "
                         f"{tuple(token_types.shape)}")
    per_token = probs.float().mean(dim=(0, 1))
    out: dict[TokenType, float] = {}
    for value in torch.unique(token_types).tolist():
        out[TokenType(int(value))] = k90(per_token[token_types == value], coverage)
    return out


def route(k90_value: float, threshold: float = DEFAULT_K90_THRESHOLD) -> PolicyKind:
    """``"evict"`` when ``k90_value <= threshold`` (concentrated attention), else ``"quantize"``."""
    if not 0.0 <= k90_value <= 1.0:
        raise ValueError(f"`k90_value` must be in [0, 1], got {k90_value!r}")
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"`threshold` must be in [0, 1], got {threshold!r}")
    return "evict" if k90_value <= threshold else "quantize"


def _check_task(task: str) -> str:
    if task not in TASKS:
        raise ValueError(f"`task` must be one of {TASKS}, got {task!r}")
    return task


def _default_entries() -> dict[tuple[str, TokenType], str]:
    # §8.1. Types absent from a task (source_vae in understanding, both source types in t2i) get the
    # family they have where present, so an unexpected segment is still handled consistently.
    entries: dict[tuple[str, TokenType], str] = {}
    for task in TASKS:
        entries[(task, TokenType.INSTRUCTION)] = "evict"
        entries[(task, TokenType.SOURCE_VIT)] = "evict"
        entries[(task, TokenType.SOURCE_VAE)] = "quantize"
    return entries


@dataclass(frozen=True)
class PolicyTable:
    """Mapping ``(task, TokenType) -> PolicyKind`` fixed at plan time.

    Protected types (boundary, current latent, decoded text) and UNKNOWN always map to ``"protect"``.
    A candidate pair missing from ``entries`` raises ValueError.

    Attributes:
        entries: ``{(task, type): kind}`` for candidate types.
        threshold: the K90 threshold used to build it (informational).
        k90: the K90 values it was built from, when built by :meth:`from_k90`.
        model_id: free text recorded in the JSON (e.g. the checkpoint name).
    """

    entries: Mapping[tuple[str, TokenType], str] = field(default_factory=_default_entries)
    threshold: float = DEFAULT_K90_THRESHOLD
    k90: Mapping[tuple[str, TokenType], float] = field(default_factory=dict)
    model_id: str = ""

    def __post_init__(self) -> None:
        for (task, ttype), kind in self.entries.items():
            _check_task(task)
            if kind not in POLICY_KINDS:
                raise ValueError(f"policy kind for ({task}, {TokenType(ttype).name}) must be one of "
                                 f"{POLICY_KINDS}, got {kind!r}")

    @classmethod
    def default(cls) -> "PolicyTable":
        """The table of kv-compression.md §8.1."""
        return cls()

    @classmethod
    def from_k90(
        cls,
        k90s: Mapping[tuple[str, TokenType | str | int], float | Sequence[float]],
        threshold: float = DEFAULT_K90_THRESHOLD,
        model_id: str = "",
    ) -> "PolicyTable":
        """Build from calibration K90 values: a float per pair, or a list whose median is used (§8.4)."""
        entries: dict[tuple[str, TokenType], str] = {}
        medians: dict[tuple[str, TokenType], float] = {}
        for (task, ttype), value in k90s.items():
            key = (_check_task(task), TokenType.parse(ttype))
            if isinstance(value, (int, float)):
                med = float(value)
            else:
                if len(value) == 0:
                    raise ValueError(f"`k90s[{key[0]}, {key[1].name}]` has no samples")
                med = float(statistics.median(float(v) for v in value))
            if key[1] in PROTECTED_TYPES:
                continue
            medians[key] = med
            entries[key] = route(med, threshold)
        return cls(entries=entries, threshold=threshold, k90=medians, model_id=model_id)

    def kind(self, task: str, token_type: TokenType | str | int) -> PolicyKind:
        """Policy family of ``token_type`` in ``task``."""
        _check_task(task)
        ttype = TokenType.parse(token_type)
        if ttype in PROTECTED_TYPES or ttype == TokenType.UNKNOWN:
            return "protect"
        try:
            return self.entries[(task, ttype)]  # type: ignore[return-value]
        except KeyError:
            raise ValueError(f"no policy for (task={task!r}, token_type={ttype.name.lower()}) in this table; "
                             f"known pairs: {sorted((t, k.name.lower()) for t, k in self.entries)}") from None

    def plan(self, task: str) -> dict[TokenType, PolicyKind]:
        """``{type: kind}`` for every :class:`TokenType` in ``task`` (missing candidate pairs are skipped)."""
        out: dict[TokenType, PolicyKind] = {}
        for ttype in TokenType:
            if ttype in PROTECTED_TYPES or ttype == TokenType.UNKNOWN or (task, ttype) in self.entries:
                out[ttype] = self.kind(task, ttype)
        return out

    def to_dict(self) -> dict:
        rows = []
        for (task, ttype), kind in sorted(self.entries.items(), key=lambda kv: (kv[0][0], int(kv[0][1]))):
            row = {"task": task, "type": TokenType(ttype).name.lower(), "kind": kind}
            if (task, ttype) in self.k90:
                row["k90"] = self.k90[(task, ttype)]
            rows.append(row)
        return {"format": "unicache-policy-table", "version": 1, "model_id": self.model_id,
                "threshold": self.threshold, "entries": rows}

    @classmethod
    def from_dict(cls, data: Mapping) -> "PolicyTable":
        if data.get("format") != "unicache-policy-table" or data.get("version") != 1:
            raise ValueError(f"not a version-1 unicache policy table: format={data.get('format')!r}, "
                             f"version={data.get('version')!r}")
        entries: dict[tuple[str, TokenType], str] = {}
        k90s: dict[tuple[str, TokenType], float] = {}
        for row in data.get("entries", []):
            key = (_check_task(row["task"]), TokenType.parse(row["type"]))
            entries[key] = row["kind"]
            if "k90" in row:
                k90s[key] = float(row["k90"])
        return cls(entries=entries, threshold=float(data.get("threshold", DEFAULT_K90_THRESHOLD)), k90=k90s,
                   model_id=str(data.get("model_id", "")))

    def save(self, path: str | Path) -> None:
        """Write the table as JSON (``policy_table.json``)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "PolicyTable":
        """Read a table written by :meth:`save`."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"policy table {str(path)!r} is not valid JSON: {exc}") from None
        return cls.from_dict(data)
