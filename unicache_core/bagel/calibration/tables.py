"""Calibrated tables on disk: completing a task's table with the other tasks' entries (merge or the paper's),
checking the output path, and writing the JSON atomically."""

from __future__ import annotations

import json
from pathlib import Path

from unicache_commands.output_files import check_output_file, save_text

from ...compression.policy_table import CHECKPOINT_POLICY_FILE, PolicyTable, PolicyTableError
from ...kv.token_types import TokenType
from .run import TOOL


def finish_table(table: PolicyTable, task: str, base: PolicyTable | None = None) -> PolicyTable:
    """``table`` (this task's measured entries) completed with every other (task, type) pair.

    Pairs come from ``base`` (a ``--merge`` table of the same model) where it has them, else from the paper's
    assignment; ``measurements["filled"]`` names each pair that was not measured in this run. Joint plans
    travel with their entries; the geometry is this run's.
    """
    from ...compression.policy_table import paper_policy_table

    paper = paper_policy_table()
    entries, k90s, strengths, plans = {}, {}, {}, {}
    tasks_meas: dict = {}
    base_filled: dict = {}
    if base is not None:
        tasks_meas.update((base.measurements or {}).get("tasks", {}) or {})
        base_filled = dict((base.measurements or {}).get("filled", {}) or {})
    filled: dict[str, str] = {}
    for key in sorted(
        set(paper.entries) | set(base.entries if base else {}) | set(table.entries), key=lambda k: (k[0], int(k[1]))
    ):
        label = f"{key[0]}/{TokenType(key[1]).name.lower()}"
        if key in table.entries:  # measured now
            entries[key] = table.entries[key]
            k90s[key] = table.k90[key]
            if key in table.plans:
                plans[key] = table.plans[key]
        elif base is not None and key in base.entries:  # kept from the --merge table
            entries[key] = base.entries[key]
            if key in base.k90:
                k90s[key] = base.k90[key]
            if key in base.strengths:
                strengths[key] = base.strengths[key]
            if key in base.plans:
                plans[key] = base.plans[key]
            if label in base_filled:
                filled[label] = base_filled[label]
            elif key not in base.k90:
                filled[label] = "merged"  # an entry of the --merge table that no calibration measured
        else:
            entries[key] = paper.entries[key]
            filled[label] = "paper"
    tasks_meas.update(table.measurements.get("tasks", {}))
    measurements = {
        "tool": TOOL,
        "tasks": tasks_meas,
        "filled": dict(sorted(filled.items())),
        "filled_note": "pairs not measured by a calibration run: 'paper' = the paper's assignment "
        "(unicache_core/compression/tables/bagel-7b-mot.json), 'merged' = kept from the --merge table",
    }
    return PolicyTable(
        entries=entries,
        threshold=table.threshold,
        k90=k90s,
        model_id=table.model_id,
        source="calibrated",
        strengths=strengths,
        plans=plans,
        geometry=table.geometry,
        measurements=measurements,
    )


def check_out(
    out: Path,
    merge: bool,
    model_id: str,
    *,
    checkpoint: Path | None = None,
    prompts: Path | None = None,
    images: Path | None = None,
) -> PolicyTable | None:
    """Refuse an ``--out`` that cannot be written or whose write would harm a file
    (:func:`~unicache_commands.output_files.check_output_file`: never ``--prompts`` nor inside ``--images``, no weights
    file, no checkpoint's file other than its ``unicache_policy.json``); with ``merge``, return the existing table at
    ``out`` (if any).

    The merged table must be of ``model_id``'s model (one ``--merge:`` error otherwise).
    """
    check_output_file(
        "--out",
        out,
        "policy table",
        inputs=[("--prompts", prompts)],
        input_folders=[("--images", images)],
        checkpoints=[checkpoint],
        allowed_names=[CHECKPOINT_POLICY_FILE],
    )
    if merge and out.is_file():
        try:
            table = PolicyTable.load(out)
        except PolicyTableError as exc:
            raise ValueError(f"--merge: {exc}; or give --out a new path to start a new table") from None
        if table.model_id and table.model_id != model_id:
            raise ValueError(
                f"--merge: the table at --out {out} was made for model {table.model_id!r}, not for this checkpoint "
                f"({model_id!r}); give --out a new path (or the table of this checkpoint) to merge into"
            )
        return table
    return None


def write_table(table: PolicyTable, out: Path) -> None:
    """Write ``table`` as JSON to ``out`` (parents made; replaced atomically, no partial file on failure)."""
    save_text(json.dumps(table.to_dict(), indent=1) + "\n", out, "--out")


__all__ = ["check_out", "finish_table", "write_table"]
