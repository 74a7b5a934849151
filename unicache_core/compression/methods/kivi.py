"""KIVI (https://arxiv.org/abs/2402.02750): every compressible row quantized, keys per channel, values per token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...kv.quant import SUPPORTED_BITS
from ...kv.token_types import Task, TokenType
from ..family import JointChoice, QuantGeometry, Segment, lookup_order
from ..method import Method
from ..ops import floor_bytes
from ..plan import BranchPlan, Keep, LayerPlan
from ..view import BranchView


@dataclass(frozen=True, kw_only=True)
class KIVI(Method):
    """Every compressible row at the most precise (bits, group) whose real bytes fit the target, the newest rows in
    full precision with the bytes left (docs/compression.md §11.2: the settings UniCache's quantize route takes,
    without scores). A pool that no setting fits is quantized at the smallest one when that still shrinks it, else
    left as it is (flagged either way). Values take KIVI's min-max ranges.

    Attributes:
        residual: a fixed number of full-precision residual rows; ``None`` (default): it follows the segment.
    """

    name = "kivi"
    needs_scores = False
    residual: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        QuantGeometry().with_residual(self.residual)

    def choice(self, segment: Segment, budget: int, geometry: QuantGeometry) -> tuple[JointChoice, bool]:
        """The most precise (bits, group) whose real bytes fit ``budget`` for every row of ``segment``, and whether
        one fits (else the smallest setting)."""
        n = segment.held_rows
        for bits, group in lookup_order(geometry):
            found = segment.quantized(n, bits, group, geometry, budget)
            if found is not None:
                return found, True
        return JointChoice(n, min(SUPPORTED_BITS), max(geometry.groups), 0), False

    def kept_bytes(self, task: Task, segments: Sequence[tuple[TokenType, Segment]], layers: int, ratio: float) -> int:
        """The bytes :meth:`plan` keeps of ``layers`` layers that each pool ``segments``: the setting its budget
        buys, where it shrinks them."""
        if not segments or ratio >= 1.0:
            return layers * sum(segment.held_bytes for _, segment in segments)
        first = segments[0][1]
        rows = sum(segment.held_rows for _, segment in segments)
        pooled = Segment(
            full_rows=rows,
            held_rows=rows,
            held_bits=first.held_bits,
            held_bytes=sum(segment.held_bytes for _, segment in segments),
            shared_rows=True,
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            elem=first.elem,
        )
        budget = floor_bytes(ratio, sum(segment.full_bytes for _, segment in segments))
        choice, _ = self.choice(pooled, budget, QuantGeometry().with_residual(self.residual))
        return layers * min(pooled.held_bytes, pooled.choice_bytes(choice))

    def plan(self, view: BranchView) -> BranchPlan:
        ratio = view.target
        geometry = QuantGeometry().with_residual(self.residual)
        plans = {}
        for index in range(view.num_layers):
            layer = view.layer(index)
            keys = layer.candidate_keys
            if not keys or layer.geometry is None:
                continue
            n = layer.held_rows(keys)
            segment = layer.segment(keys, full_rows=n)
            budget = floor_bytes(ratio, layer.managed_full_bytes)
            budgets = {"candidate": budget}
            if ratio >= 1.0:
                plans[index] = LayerPlan(budgets=budgets)
                continue  # the target keeps everything: nothing is quantized
            choice, fits = self.choice(segment, budget, geometry)
            flags = {}
            if not fits:
                need = segment.choice_bytes(choice)
                kept = "it is used" if need < segment.held_bytes else "the rows stay as they are (it would hold more)"
                flags["candidate"] = (
                    f"no KIVI setting fits {budget} B for {n} rows: the smallest is {choice.bits}-bit, "
                    f"G{choice.group}, R0 ({need} B); {kept}"
                )
            keeps: tuple[Keep, ...] = ()
            if segment.choice_bytes(choice) < segment.held_bytes:  # never a store that holds more
                keeps = (
                    Keep(
                        segments=keys,
                        rows=n,
                        bits=choice.bits,
                        group=choice.group,
                        residual=choice.residual,
                        expected_bytes=segment.choice_bytes(choice),
                    ),
                )
            plans[index] = LayerPlan(keeps=keeps, budgets=budgets, flags=flags)
        return BranchPlan(layers=plans)


__all__ = ["KIVI"]
