"""The quality report's rows beside UniCache's own (:mod:`benchmarks.quality`), and which UniCache row each baseline
is paired with.

Every baseline runs at the bytes UniCache achieved at a target. A baseline whose family cannot hold that many bytes
holds more or fewer: KIVI stops at 2 bits, about 91% reduction on the bundled model's fp32 KV where the extreme target
asks 95%, and between its 2- and 4-bit settings it may leave part of its budget. A comparison at unequal bytes says
little about either method, so for such a baseline UniCache runs once more at the bytes the baseline achieved (the row
``unicache@<baseline>``, shared by the baselines that held the same bytes within the tolerance) and the baseline's
paired differences are taken against that row: every paired difference in the report is at equal bytes.
"""

from __future__ import annotations

#: The row of unicache run with the shipped paper table instead of the checkpoint's calibrated one.
PAPER_ROW = "unicache_paper_table"
#: The TaylorSeer rows (TaylorSeer at its official settings): at full KV once per task, with UniCache per target.
FULL_TAYLORSEER_ROW, UNICACHE_TAYLORSEER_ROW = "full+taylorseer", "unicache+taylorseer"
#: UniCache rows, run first at each target: the baselines are matched to the first one's achieved bytes.
UNICACHE_ROWS = ("unicache", PAPER_ROW)
#: A baseline holding more than this share above UniCache's bytes did not reach them (its family's least setting).
BYTES_TOLERANCE = 0.05
#: The prefix of the UniCache row run at a baseline's bytes.
AT_BYTES_PREFIX = "unicache@"


def unequal_bytes(unicache_reduction: float, achieved_reduction: float) -> bool:
    """Did a baseline asked for UniCache's bytes (``1 - unicache_reduction`` of full KV) hold more or fewer than them
    (``1 - achieved_reduction``) by more than :data:`BYTES_TOLERANCE` of them?"""
    unicache_held, held = 1.0 - unicache_reduction, 1.0 - achieved_reduction
    return abs(held - unicache_held) > BYTES_TOLERANCE * unicache_held


def at_bytes_row(baseline: str) -> str:
    """The name of the UniCache row run at ``baseline``'s bytes."""
    return f"{AT_BYTES_PREFIX}{baseline}"


def is_unicache_row(method: str) -> bool:
    """A row of UniCache itself (at the target, with the paper table, with TaylorSeer or at a baseline's bytes)."""
    return method in UNICACHE_ROWS or method == UNICACHE_TAYLORSEER_ROW or method.startswith(AT_BYTES_PREFIX)


__all__ = [
    "AT_BYTES_PREFIX",
    "BYTES_TOLERANCE",
    "FULL_TAYLORSEER_ROW",
    "PAPER_ROW",
    "UNICACHE_ROWS",
    "UNICACHE_TAYLORSEER_ROW",
    "at_bytes_row",
    "is_unicache_row",
    "unequal_bytes",
]
