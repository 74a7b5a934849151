"""K90 routing: which policy family (evict / quantize / protect) each (task, token type) gets.

docs/compression.md §8.1 and §8.4: a segment whose attention is concentrated (K90 <= 0.3) is evicted
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

from ..kv.token_types import PROTECTED_TYPES, TokenType

PolicyKind = Literal["evict", "quantize", "protect"]
TASKS: tuple[str, ...] = ("understanding", "t2i", "edit")
POLICY_KINDS: tuple[str, ...] = ("evict", "quantize", "protect")
DEFAULT_K90_THRESHOLD = 0.3
CANDIDATE: tuple[TokenType, ...] = (TokenType.INSTRUCTION, TokenType.SOURCE_VIT, TokenType.SOURCE_VAE)


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


class PolicyTableError(ValueError):
    """A policy-table file is malformed, of another version, or made for another model."""


#: Strength a table entry gives when it names none: the retention at which a type starts (rho0 of the task).
DEFAULT_STRENGTH: dict[str, float] = {"understanding": 0.2, "t2i": 0.5, "edit": 0.5}


@dataclass(frozen=True)
class PolicyTable:
    """Mapping ``(task, TokenType) -> PolicyKind`` fixed at plan time, with a default strength per entry.

    Protected types (boundary, current latent, decoded text) and UNKNOWN always map to ``"protect"``.
    A candidate pair missing from ``entries`` raises ValueError.

    Attributes:
        entries: ``{(task, type): kind}`` for candidate types.
        threshold: the K90 threshold used to build it.
        k90: the K90 values it was built from (calibration), per pair.
        model_id: the model the table was made for (:func:`unicache_core.bagel.checkpoint.model_id.model_id_of`);
            ``""`` = any model.
        source: ``"paper"`` (the UniCache paper's assignment) or ``"calibrated"``.
        strengths: ``{(task, type): retained ratio}`` default strength of each entry.
        measurements: free JSON of what the table was derived from (calibration runs, sensitivity).
    """

    entries: Mapping[tuple[str, TokenType], str] = field(default_factory=_default_entries)
    threshold: float = DEFAULT_K90_THRESHOLD
    k90: Mapping[tuple[str, TokenType], float] = field(default_factory=dict)
    model_id: str = ""
    source: str = "paper"
    strengths: Mapping[tuple[str, TokenType], float] = field(default_factory=dict)
    measurements: Mapping = field(default_factory=dict)

    def __post_init__(self) -> None:
        for (task, ttype), kind in self.entries.items():
            _check_task(task)
            if kind not in POLICY_KINDS:
                raise ValueError(f"policy kind for ({task}, {TokenType(ttype).name}) must be one of "
                                 f"{POLICY_KINDS}, got {kind!r}")
        if self.source not in ("paper", "calibrated"):
            raise ValueError(f"`source` must be 'paper' or 'calibrated', got {self.source!r}")

    @classmethod
    def default(cls) -> "PolicyTable":
        """The paper's assignment (docs/compression.md §8.1): instruction and source-ViT evicted, source-VAE quantized."""
        return cls()

    @classmethod
    def from_k90(
        cls,
        k90s: Mapping[tuple[str, TokenType | str | int], float | Sequence[float]],
        threshold: float = DEFAULT_K90_THRESHOLD,
        model_id: str = "",
        measurements: Mapping | None = None,
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
        return cls(entries=entries, threshold=threshold, k90=medians, model_id=model_id, source="calibrated",
                   measurements=dict(measurements or {}))

    def strength(self, task: str, token_type: TokenType | str | int) -> float:
        """Default retained ratio of an entry (its table value, else the task's starting rho)."""
        key = (_check_task(task), TokenType.parse(token_type))
        return float(self.strengths.get(key, DEFAULT_STRENGTH[task]))

    def tasks(self) -> set[str]:
        return {task for task, _ in self.entries}

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
            row = {"task": task, "type": TokenType(ttype).name.lower(), "kind": kind,
                   "strength": self.strength(task, ttype)}
            if (task, ttype) in self.k90:
                row["k90"] = self.k90[(task, ttype)]
            rows.append(row)
        return {"format": "unicache-policy-table", "version": 1, "model_id": self.model_id, "source": self.source,
                "threshold": self.threshold, "entries": rows, "measurements": dict(self.measurements)}

    @classmethod
    def from_dict(cls, data: Mapping, origin: str = "policy table") -> "PolicyTable":
        """Parse and validate a table; every problem is one :class:`PolicyTableError` naming ``origin``."""
        def bad(msg: str) -> PolicyTableError:
            return PolicyTableError(f"{origin}: {msg}; write it with `python -m unicache_core.bagel.calibrate` or start "
                                    "from unicache_core/compression/tables/bagel-7b-mot.json")

        if not isinstance(data, Mapping):
            raise bad(f"expected a JSON object, got {type(data).__name__}")
        if data.get("format") != "unicache-policy-table":
            raise bad(f"`format` must be 'unicache-policy-table', got {data.get('format')!r}")
        if data.get("version") != 1:
            raise bad(f"unsupported `version` {data.get('version')!r} (this library reads version 1)")
        model_id = data.get("model_id", "")
        if not isinstance(model_id, str):
            raise bad(f"`model_id` must be a string, got {model_id!r}")
        source = data.get("source", "paper")
        if source not in ("paper", "calibrated"):
            raise bad(f"`source` must be 'paper' or 'calibrated', got {source!r}")
        threshold = data.get("threshold", DEFAULT_K90_THRESHOLD)
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
            raise bad(f"`threshold` must be a number in [0, 1], got {threshold!r}")
        rows = data.get("entries")
        if not isinstance(rows, list) or not rows:
            raise bad("`entries` must be a non-empty list")
        entries: dict[tuple[str, TokenType], str] = {}
        k90s: dict[tuple[str, TokenType], float] = {}
        strengths: dict[tuple[str, TokenType], float] = {}
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise bad(f"`entries[{i}]` must be an object, got {row!r}")
            task = row.get("task")
            if task not in TASKS:
                raise bad(f"`entries[{i}].task` must be one of {TASKS}, got {task!r}")
            try:
                ttype = TokenType.parse(row.get("type"))
            except (ValueError, TypeError):
                raise bad(f"`entries[{i}].type` {row.get('type')!r} is not a token type "
                          f"({', '.join(t.name.lower() for t in CANDIDATE)})") from None
            if ttype not in CANDIDATE:
                raise bad(f"`entries[{i}].type` {ttype.name.lower()} is protected or unknown; only "
                          f"{', '.join(t.name.lower() for t in CANDIDATE)} get a policy")
            kind = row.get("kind")
            if kind not in POLICY_KINDS:
                raise bad(f"`entries[{i}].kind` must be one of {POLICY_KINDS}, got {kind!r}")
            key = (task, ttype)
            if key in entries:
                raise bad(f"`entries[{i}]` repeats ({task}, {ttype.name.lower()})")
            entries[key] = kind
            for name, target in (("k90", k90s), ("strength", strengths)):
                if name in row:
                    value = row[name]
                    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                            or not 0.0 <= value <= 1.0:
                        raise bad(f"`entries[{i}].{name}` must be a number in [0, 1], got {value!r}")
                    target[key] = float(value)
        measurements = data.get("measurements", {})
        if not isinstance(measurements, Mapping):
            raise bad("`measurements` must be an object")
        return cls(entries=entries, threshold=float(threshold), k90=k90s, model_id=model_id, source=source,
                   strengths=strengths, measurements=dict(measurements))

    def save(self, path: str | Path) -> None:
        """Write the table as JSON (``policy_table.json``)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path, *, model_id: str | None = None) -> "PolicyTable":
        """Read a table written by :meth:`save`; with ``model_id``, refuse a table made for another model."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise PolicyTableError(f"policy table {str(path)!r} does not exist; pass an existing JSON file") from None
        except IsADirectoryError:
            raise PolicyTableError(f"policy table {str(path)!r} is a folder; pass the JSON file inside it") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise PolicyTableError(f"policy table {str(path)!r} cannot be read as UTF-8 text ({exc})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PolicyTableError(f"policy table {str(path)!r} is not valid JSON: {exc}") from None
        table = cls.from_dict(data, origin=f"policy table {str(path)!r}")
        if model_id is not None and table.model_id and table.model_id != model_id:
            raise PolicyTableError(
                f"policy table {str(path)!r} was made for model {table.model_id!r}, not for this checkpoint "
                f"({model_id!r}); calibrate one for it (python -m unicache_core.bagel.calibrate) or drop --policy to use "
                "the default")
        return table
