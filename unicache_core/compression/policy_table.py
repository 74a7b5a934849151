"""The policy table: which policy (evict / quantize / joint / protect) each (task, token type) gets, with a
default strength, the calibrated bits per budget level of joint entries and the model's quantization
geometry, read from and written to JSON (``format: unicache-policy-table``, version 2; version 1 tables,
which have neither joint entries nor geometry, still load).

The paper's assignment ships as ``tables/bagel-7b-mot.json``; calibration (:mod:`unicache_core.bagel.calibrate`)
writes a checkpoint's own ``unicache_policy.json``. :func:`resolve_policy_table` picks the table of a run.
Every problem with a table file is one :class:`PolicyTableError` naming the file.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

from unicache_commands.input_files import read_text_file

from ..kv.token_types import CANDIDATE_TYPES, PROTECTED_TYPES, TASKS, TokenType
from .defaults import DEFAULT_K90_THRESHOLD, RHO0, UNICACHE_GROUPS
from .family import JointPlan, QuantGeometry
from .routing import POLICY_KINDS, Kind, PolicyKind, route

logger = logging.getLogger(__name__)

#: File a checkpoint folder may hold with the policy table calibrated on it.
CHECKPOINT_POLICY_FILE = "unicache_policy.json"
#: The shipped paper table (instruction and source-ViT evicted, source-VAE quantized).
PAPER_TABLE = "bagel-7b-mot.json"
#: Deepest nesting of a table's free ``measurements`` JSON (calibration writes a few levels).
MAX_MEASUREMENT_DEPTH = 64
#: Largest policy-table file read (the calibrated tables with their measurements are well under 1 MB).
MAX_TABLE_BYTES = 64 << 20
#: The version :meth:`PolicyTable.save` writes, and every version :meth:`PolicyTable.from_dict` reads.
TABLE_VERSION = 2
READABLE_VERSIONS = (1, 2)


class PolicyTableError(ValueError):
    """A policy-table file is malformed, of another version, or made for another model."""


def _check_task(task: str) -> str:
    if task not in TASKS:
        raise ValueError(f"`task` must be one of {TASKS}, got {task!r}")
    return task


def _nesting_depth(value: object) -> int:
    """Depth of nested JSON containers in ``value`` (0 for a scalar), counted without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children: Iterable
        if isinstance(item, Mapping):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth + 1)
        if deepest > MAX_MEASUREMENT_DEPTH:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


@dataclass(frozen=True)
class PolicyTable:
    """Mapping ``(task, TokenType) -> PolicyKind`` fixed at plan time, with a default strength per entry.

    Protected types (boundary, current latent, decoded text) and UNKNOWN always map to ``"protect"``.
    A candidate pair missing from ``entries`` raises ValueError.

    Attributes:
        entries: ``{(task, type): kind}`` for candidate types (default: the shipped paper table's).
        threshold: the K90 threshold used to build it.
        k90: the K90 values it was built from (calibration), per pair.
        model_id: the model the table was made for (:func:`unicache_core.bagel.checkpoint.model_id.model_id_of`);
            ``""`` = any model.
        source: ``"paper"`` (the UniCache paper's assignment) or ``"calibrated"``.
        strengths: ``{(task, type): retained ratio}`` default strength of each entry.
        measurements: free JSON of what the table was derived from (calibration runs, sensitivity).
        plans: ``{(task, type): JointPlan}``, the bits per budget level of every ``joint`` entry.
        geometry: the model's quantization geometry (groups, residual rule; docs/compression.md §11.2); a
            table built in code (calibration's) offers :data:`UNICACHE_GROUPS`, the paper's file KIVI's groups.
        origin: where the table was read from (its file), named by errors; ``""`` for a table built in code.
    """

    entries: Mapping[tuple[str, TokenType], str] = field(default_factory=lambda: dict(paper_policy_table().entries))
    threshold: float = DEFAULT_K90_THRESHOLD
    k90: Mapping[tuple[str, TokenType], float] = field(default_factory=dict)
    model_id: str = ""
    source: str = "paper"
    strengths: Mapping[tuple[str, TokenType], float] = field(default_factory=dict)
    measurements: Mapping = field(default_factory=dict)
    plans: Mapping[tuple[str, TokenType], JointPlan] = field(default_factory=dict)
    geometry: QuantGeometry = field(default_factory=lambda: QuantGeometry(groups=UNICACHE_GROUPS))
    origin: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        for (task, ttype), kind in self.entries.items():
            _check_task(task)
            if kind not in POLICY_KINDS:
                raise ValueError(
                    f"policy kind for ({task}, {TokenType(ttype).name}) must be one of {POLICY_KINDS}, got {kind!r}"
                )
            if kind == "joint" and (task, ttype) not in self.plans:
                raise ValueError(
                    f"the joint entry ({task}, {TokenType(ttype).name.lower()}) needs its plan (bits per budget level)"
                )
        if self.source not in ("paper", "calibrated"):
            raise ValueError(f"`source` must be 'paper' or 'calibrated', got {self.source!r}")

    @classmethod
    def default(cls) -> PolicyTable:
        """The paper's assignment (docs/compression.md §8.1, the shipped table's entries): instruction and
        source-ViT evicted, source-VAE quantized; made for any model."""
        return cls()

    @classmethod
    def from_k90(
        cls,
        k90s: Mapping[tuple[str, TokenType | str | int], float | Sequence[float]],
        threshold: float = DEFAULT_K90_THRESHOLD,
        model_id: str = "",
        measurements: Mapping | None = None,
    ) -> PolicyTable:
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
        return cls(
            entries=entries,
            threshold=threshold,
            k90=medians,
            model_id=model_id,
            source="calibrated",
            measurements=dict(measurements or {}),
        )

    def strength(self, task: str, token_type: TokenType | str | int) -> float:
        """Default retained ratio of an entry (its table value, else the task's starting rho)."""
        key = (_check_task(task), TokenType.parse(token_type))
        return float(self.strengths.get(key, RHO0[task]))

    def plan_for(self, task: str, token_type: TokenType | str | int) -> JointPlan | None:
        """The bits per budget level of a ``joint`` entry (``None`` for the other kinds)."""
        return self.plans.get((_check_task(task), TokenType.parse(token_type)))

    def tasks(self) -> set[str]:
        """The tasks the table has entries for."""
        return {task for task, _ in self.entries}

    def require_task(self, task: str) -> None:
        """A :class:`PolicyTableError` naming the table's file and what to do when it has no entry for ``task``."""
        if task not in self.tasks():
            where = f"policy table {self.origin!r}" if self.origin else "the given policy table"
            raise PolicyTableError(
                f"{where} has no entry for the {task!r} task (it covers {', '.join(sorted(self.tasks()))}); "
                "calibrate the task into it (python -m unicache_core.bagel.calibrate --merge --out <that file>) or "
                "pass a table that covers it"
            )

    def kind(self, task: str, token_type: TokenType | str | int) -> PolicyKind:
        """Policy family of ``token_type`` in ``task``."""
        _check_task(task)
        ttype = TokenType.parse(token_type)
        if ttype in PROTECTED_TYPES or ttype == TokenType.UNKNOWN:
            return Kind.PROTECT
        try:
            return Kind(self.entries[(task, ttype)])
        except KeyError:
            where = f"policy table {self.origin!r}" if self.origin else "this table"
            raise ValueError(
                f"no policy for (task={task!r}, token_type={ttype.name.lower()}) in {where}; "
                f"known pairs: {sorted((t, k.name.lower()) for t, k in self.entries)}; calibrate "
                "the task into it (python -m unicache_core.bagel.calibrate --merge)"
            ) from None

    def plan(self, task: str) -> dict[TokenType, PolicyKind]:
        """``{type: kind}`` for every :class:`TokenType` in ``task`` (missing candidate pairs are skipped)."""
        out: dict[TokenType, PolicyKind] = {}
        for ttype in TokenType:
            if ttype in PROTECTED_TYPES or ttype == TokenType.UNKNOWN or (task, ttype) in self.entries:
                out[ttype] = self.kind(task, ttype)
        return out

    def to_dict(self) -> dict:
        """The table as the JSON object :meth:`save` writes (entries sorted by task and type)."""
        rows = []
        for (task, ttype), kind in sorted(self.entries.items(), key=lambda kv: (kv[0][0], int(kv[0][1]))):
            row = {
                "task": task,
                "type": TokenType(ttype).name.lower(),
                "kind": kind,
                "strength": self.strength(task, ttype),
            }
            if (task, ttype) in self.k90:
                row["k90"] = self.k90[(task, ttype)]
            if (task, ttype) in self.plans:
                row["plan"] = self.plans[(task, ttype)].to_list()
            rows.append(row)
        return {
            "format": "unicache-policy-table",
            "version": TABLE_VERSION,
            "model_id": self.model_id,
            "source": self.source,
            "threshold": self.threshold,
            "quantization": self.geometry.to_dict(),
            "entries": rows,
            "measurements": dict(self.measurements),
        }

    @classmethod
    def from_dict(cls, data: Mapping, origin: str = "policy table") -> PolicyTable:
        """Parse and validate a table; every problem is one :class:`PolicyTableError` naming ``origin``."""

        def bad(msg: str) -> PolicyTableError:
            return PolicyTableError(
                f"{origin}: {msg}; write it with `python -m unicache_core.bagel.calibrate` or start "
                "from unicache_core/compression/tables/bagel-7b-mot.json"
            )

        if not isinstance(data, Mapping):
            raise bad(f"expected a JSON object, got {type(data).__name__}")
        if data.get("format") != "unicache-policy-table":
            raise bad(f"`format` must be 'unicache-policy-table', got {data.get('format')!r}")
        if data.get("version") not in READABLE_VERSIONS:
            raise bad(
                f"unsupported `version` {data.get('version')!r} (this library reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))})"
            )
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
        plans: dict[tuple[str, TokenType], JointPlan] = {}
        try:
            geometry = QuantGeometry.from_dict(data.get("quantization", {}))
        except ValueError as exc:
            raise bad(f"`quantization`: {exc}") from None
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise bad(f"`entries[{i}]` must be an object, got {row!r}")
            task = row.get("task")
            if task not in TASKS:
                raise bad(f"`entries[{i}].task` must be one of {TASKS}, got {task!r}")
            try:
                ttype = TokenType.parse(row["type"])
            except (ValueError, TypeError, KeyError):
                raise bad(
                    f"`entries[{i}].type` {row.get('type')!r} is not a token type "
                    f"({', '.join(t.name.lower() for t in CANDIDATE_TYPES)})"
                ) from None
            if ttype not in CANDIDATE_TYPES:
                raise bad(
                    f"`entries[{i}].type` {ttype.name.lower()} is protected or unknown; only "
                    f"{', '.join(t.name.lower() for t in CANDIDATE_TYPES)} get a policy"
                )
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
                    if (
                        isinstance(value, bool)
                        or not isinstance(value, (int, float))
                        or not math.isfinite(value)
                        or not 0.0 <= value <= 1.0
                    ):
                        raise bad(f"`entries[{i}].{name}` must be a number in [0, 1], got {value!r}")
                    target[key] = float(value)
            if "plan" in row:
                try:
                    plans[key] = JointPlan.from_list(row["plan"])
                except ValueError as exc:
                    raise bad(f"`entries[{i}].plan`: {exc}") from None
            elif kind == "joint":
                raise bad(f"`entries[{i}]` is joint but has no `plan` (its bits per budget level)")
        measurements = data.get("measurements", {})
        if not isinstance(measurements, Mapping):
            raise bad("`measurements` must be an object")
        if _nesting_depth(measurements) > MAX_MEASUREMENT_DEPTH:
            raise bad(f"`measurements` nests more than {MAX_MEASUREMENT_DEPTH} levels deep")
        return cls(
            entries=entries,
            threshold=float(threshold),
            k90=k90s,
            model_id=model_id,
            source=source,
            strengths=strengths,
            measurements=dict(measurements),
            plans=plans,
            geometry=geometry,
        )

    def save(self, path: str | Path) -> None:
        """Write the table as JSON (``policy_table.json``)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path, *, model_id: str | None = None) -> PolicyTable:
        """Read a table written by :meth:`save`; with ``model_id``, refuse a table made for another model."""
        path = Path(path)
        try:  # a regular file of bounded size only: a FIFO would block, /dev/zero never end
            text = read_text_file(
                path, label=f"policy table {str(path)!r}", max_bytes=MAX_TABLE_BYTES, advice="pass a JSON file"
            )
        except FileNotFoundError:
            raise PolicyTableError(f"policy table {str(path)!r} does not exist; pass an existing JSON file") from None
        except IsADirectoryError:
            raise PolicyTableError(f"policy table {str(path)!r} is a folder; pass the JSON file inside it") from None
        except (OSError, ValueError) as exc:
            raise PolicyTableError(str(exc)) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PolicyTableError(f"policy table {str(path)!r} is not valid JSON: {exc}") from None
        except RecursionError:
            raise PolicyTableError(
                f"policy table {str(path)!r} nests JSON too deeply to be read; a policy table is "
                "a flat list of entries: write it with `python -m unicache_core.bagel.calibrate` "
                "or start from unicache_core/compression/tables/bagel-7b-mot.json"
            ) from None
        table = cls.from_dict(data, origin=f"policy table {str(path)!r}")
        table = replace(table, origin=str(path))
        if model_id is not None and table.model_id and table.model_id != model_id:
            raise PolicyTableError(
                f"policy table {str(path)!r} was made for model {table.model_id!r}, not for this checkpoint "
                f"({model_id!r}); use a table calibrated on this checkpoint (python -m unicache_core.bagel.calibrate)"
            )
        return table


def paper_policy_table() -> PolicyTable:
    """The shipped ``unicache_core/compression/tables/bagel-7b-mot.json`` (the paper's assignment)."""
    path = resources.files("unicache_core.compression").joinpath("tables", PAPER_TABLE)
    return PolicyTable.load(Path(str(path)))


def resolve_policy_table(policy, checkpoint_dir: str, model_id: str) -> tuple[PolicyTable, dict]:
    """The table a unicache run uses and a record of where it came from.

    Explicit ``policy`` (path or table) → used, refused if made for another model; else
    ``<checkpoint>/unicache_policy.json``; else the paper table, with a warning in the report.
    """
    if policy is not None:
        if isinstance(policy, PolicyTable):
            table, origin = policy, "given"
        else:
            try:
                table, origin = PolicyTable.load(policy, model_id=model_id or None), str(policy)
            except PolicyTableError as exc:
                if "was made for model" not in str(exc):
                    raise
                raise PolicyTableError(
                    f"{exc}, or leave the policy unset to use the checkpoint's own {CHECKPOINT_POLICY_FILE} (else "
                    f"the paper's table)"
                ) from None
        if isinstance(policy, PolicyTable) and model_id and table.model_id and table.model_id != model_id:
            raise PolicyTableError(
                f"the given policy table was made for {table.model_id!r}, not for this checkpoint ({model_id!r})"
            )
        return table, {"path": origin, "model_id": table.model_id, "source": table.source, "warning": None}
    if checkpoint_dir:
        local = Path(checkpoint_dir) / CHECKPOINT_POLICY_FILE
        if os.path.lexists(local):  # a FIFO, folder or broken link there is refused (PolicyTable.load), not skipped
            table = PolicyTable.load(local, model_id=model_id or None)
            return table, {"path": str(local), "model_id": table.model_id, "source": table.source, "warning": None}
    table = paper_policy_table()
    warning = None
    if model_id != table.model_id:
        warning = (
            f"no policy table calibrated on this checkpoint ({model_id or 'unknown model'}): using the paper's "
            f"assignment for {table.model_id}; run `python -m unicache_core.bagel.calibrate` to make one"
        )
        logger.warning(warning)
    return table, {"path": PAPER_TABLE, "model_id": table.model_id, "source": table.source, "warning": warning}


__all__ = [
    "CHECKPOINT_POLICY_FILE",
    "MAX_MEASUREMENT_DEPTH",
    "PAPER_TABLE",
    "PolicyTable",
    "PolicyTableError",
    "READABLE_VERSIONS",
    "TABLE_VERSION",
    "paper_policy_table",
    "resolve_policy_table",
]
