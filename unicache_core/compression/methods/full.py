"""``full``: no compression. The caches hold every row; the report measures them like every other method's."""

from __future__ import annotations

from dataclasses import dataclass

from ...kv.cache import AttentionCall
from ..method import Method
from ..plan import BranchPlan, CallPlan
from ..view import BranchView


@dataclass(frozen=True, kw_only=True)
class Full(Method):
    """Never observes, never compresses (its caches are :class:`~unicache_core.kv.cache.FullKVCache` s, bit-identical
    to running without a cache factory)."""

    name = "full"
    compresses = False
    needs_scores = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kv_target is not None:  # accepted and ignored, it would let a run look compressed that is not
            raise ValueError(
                f"`kv_target` ({self.kv_target}) does not apply to the full method, which keeps every row; drop "
                "`kv_target` or choose a compressing method (unicache, h2o, ...)"
            )

    def target(self, task: str) -> float:
        return 1.0

    def plan_call(self, view: BranchView, call: AttentionCall) -> CallPlan:
        return CallPlan()

    def plan(self, view: BranchView) -> BranchPlan:
        return BranchPlan()


__all__ = ["Full"]
