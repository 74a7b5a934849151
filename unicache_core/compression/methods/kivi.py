"""KIVI (https://arxiv.org/abs/2402.02750): every compressible row quantized, keys per channel, values per token."""

from __future__ import annotations

from dataclasses import dataclass

from ...kv.quant import SUPPORTED_BITS
from ..family import JointChoice, QuantGeometry, lookup_order
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
            choice = next(
                (
                    c
                    for bits, group in lookup_order(geometry)
                    if (c := segment.quantized(n, bits, group, geometry, budget)) is not None
                ),
                None,
            )
            flags = {}
            if choice is None:
                choice = JointChoice(n, min(SUPPORTED_BITS), max(geometry.groups), 0)
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
