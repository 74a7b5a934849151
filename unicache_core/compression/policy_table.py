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
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

from ..kv.token_types import PROTECTED_TYPES, TASKS, TokenType
from .defaults import DEFAULT_K90_THRESHOLD, RHO0, UNICACHE_GROUPS
from .family import JointPlan, QuantGeometry
from .policy_table_file import (
    MAX_MEASUREMENT_DEPTH,
    READABLE_VERSIONS,
    TABLE_VERSION,
    PolicyTableError,
    check_table_sizes,
    read_table_json,
    table_fields,
)
from .routing import POLICY_KINDS, Kind, PolicyKind, route

logger = logging.getLogger(__name__)

#: File a checkpoint folder may hold with the policy table calibrated on it.
CHECKPOINT_POLICY_FILE = "unicache_policy.json"
#: The shipped paper table (instruction and source-ViT evicted, source-VAE quantized).
PAPER_TABLE = "bagel-7b-mot.json"


def _check_task(task: str) -> str:
    if task not in TASKS:
        raise ValueError(f"`task` must be one of {TASKS}, got {task!r}")
    return task


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
    def from_dict(cls, data: object, origin: str = "policy table") -> PolicyTable:
        """Parse and validate a table (:func:`~.policy_table_file.table_fields`: every key known, ``model_id``
        given); every problem is one :class:`PolicyTableError` naming ``origin``."""
        return cls(**table_fields(data, origin))

    def save(self, path: str | Path) -> None:
        """Write the table as JSON (``policy_table.json``)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path, *, model_id: str | None = None) -> PolicyTable:
        """Read a table written by :meth:`save`; with ``model_id``, refuse a table made for another model."""
        path = Path(path)
        data = read_table_json(path)  # a regular file of bounded size, strict JSON
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


def _named_model(table: PolicyTable, info: dict, model_id: str) -> dict:
    """``info`` with a warning when the table names no model (``model_id`` ""), so nothing checked that it was made
    for this checkpoint: said in the report and the log, never silent."""
    if table.model_id or not model_id:
        return info
    where = f"policy table {info['path']!r}" if info["path"] != "given" else "the given policy table"
    warning = (
        f'{where} names no model (`model_id` is ""): it was not checked against this checkpoint ({model_id}); '
        "calibrate one on it (python -m unicache_core.bagel.calibrate), or write its model_id into the table"
    )
    logger.warning(warning)
    return {**info, "warning": warning}


def _explicit(policy, model_id: str) -> tuple[PolicyTable, dict]:
    """An explicit ``policy`` (path or table), refused if made for another model."""
    if isinstance(policy, PolicyTable):
        if model_id and policy.model_id and policy.model_id != model_id:
            raise PolicyTableError(
                f"the given policy table was made for {policy.model_id!r}, not for this checkpoint ({model_id!r})"
            )
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
    return table, {"path": origin, "model_id": table.model_id, "source": table.source, "warning": None}


def resolve_policy_table(
    policy, checkpoint_dir: str, model_id: str, segment_rows: int | None = None
) -> tuple[PolicyTable, dict]:
    """The table a unicache run uses and a record of where it came from.

    Explicit ``policy`` (path or table) → used, refused if made for another model; else
    ``<checkpoint>/unicache_policy.json``; else the paper table, with a warning in the report. A table that names no
    model gets a warning too. ``segment_rows`` (the most rows one segment of the model holds): a table whose sizes
    exceed it is refused (:func:`~.policy_table_file.check_table_sizes`).
    """
    local = Path(checkpoint_dir) / CHECKPOINT_POLICY_FILE if checkpoint_dir else None
    if policy is not None:
        table, info = _explicit(policy, model_id)
    elif local is not None and os.path.lexists(local):  # a FIFO, folder or broken link there is refused, not skipped
        table = PolicyTable.load(local, model_id=model_id or None)
        info = {"path": str(local), "model_id": table.model_id, "source": table.source, "warning": None}
    else:
        table = paper_policy_table()
        warning = None
        if model_id != table.model_id:
            warning = (
                f"no policy table calibrated on this checkpoint ({model_id or 'unknown model'}): using the paper's "
                f"assignment for {table.model_id}; run `python -m unicache_core.bagel.calibrate` to make one"
            )
            logger.warning(warning)
        return table, {"path": PAPER_TABLE, "model_id": table.model_id, "source": table.source, "warning": warning}
    if segment_rows is not None:
        where = f"policy table {table.origin!r}" if table.origin else "the given policy table"
        check_table_sizes(table.geometry, segment_rows, where)
    return table, _named_model(table, info, model_id)


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
