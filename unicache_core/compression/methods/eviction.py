"""The global eviction baselines' shared plan: one eviction over all of a layer's candidate KV, matched to bytes.

The baselines are compared the way UniCache's code compares them (docs/compression.md §8.10): one policy over
the whole conditioning KV (instruction, source-ViT and source-VAE pooled), boundary and current-latent rows
protected, the selection made once after the first (full-KV) denoising step of each branch, or after the prompt
prefill for understanding, matched to the same byte target.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from ...kv.token_types import Task, TokenType
from ..family import Segment
from ..method import Method
from ..ops import evicted_bytes, floor_bytes, rows_for_bytes
from ..plan import BranchPlan, Keep, LayerPlan
from ..view import BranchView, LayerView, RowGeometry


@dataclass(frozen=True, kw_only=True)
class GlobalEviction(Method):
    """Keep each layer's best-scored candidate rows (per KV head) that its share of the byte target buys.

    Subclasses give the scores (:meth:`layer_scores`) and, optionally, rows always kept, a recent window, a
    smoothing kernel and per-layer row budgets.
    """

    def layer_scores(self, view: BranchView, layer: LayerView) -> Tensor | None:
        """``[T_appended, Hkv]`` fp32 score of every appended row (higher = keep): each method's own, from what its
        :meth:`~unicache_core.compression.method.Method.measure` recorded (or from the rows themselves)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement layer_scores()")

    def forced_rows(self, view: BranchView, layer: LayerView) -> Tensor | None:
        """Optional ``[T_appended]`` bool of rows always kept (inside the budget)."""
        return None

    def recent_share(self) -> float:
        """Share of a layer's kept rows that are its most recent ones."""
        return 0.0

    def smooth_kernel(self) -> int:
        """Width of the 1-D average pooling of the scores along the rows (1: none)."""
        return 1

    def merge_rule(self) -> str:
        """How the dropped rows are merged into the kept ones (:data:`~..merging.MERGES`; default ``none``)."""
        return "none"

    def layer_rows(self, view: BranchView, budgets: list[int], rows: list[int]) -> list[int]:
        """Rows per KV head for each layer, given each layer's byte-budget rows (default: as is)."""
        return budgets

    def kept_bytes(self, task: Task, segments: Sequence[tuple[TokenType, Segment]], layers: int, ratio: float) -> int:
        """The bytes :meth:`plan` keeps of ``layers`` layers that each pool ``segments``: each layer's budget, its
        rounding carried to the next, in the evicted store its rows buy (the memory plan's KV after it)."""
        if not segments:
            return 0
        first = segments[0][1]
        span = sum(segment.full_rows for _, segment in segments)
        held = sum(segment.held_bytes for _, segment in segments)
        full = sum(segment.full_bytes for _, segment in segments)
        geometry = (first.num_kv_heads, first.head_dim, first.elem)
        spent = carried = kept = 0
        for _ in range(layers):
            carried += floor_bytes(ratio, full)
            rows = min(rows_for_bytes(carried - spent, span, *geometry), span)
            layer = evicted_bytes(rows, span, *geometry)
            spent += layer
            kept += held if ratio >= 1.0 or layer >= held else layer
        return kept

    def plan(self, view: BranchView) -> BranchPlan:
        """Every layer's pooled candidate rows down to the rows its share of the byte target buys."""
        ratio = view.target
        layers = [view.layer(i) for i in range(view.num_layers)]
        budget_rows, pool_rows, spans, budgets = [], [], [], {}
        # Rows round down on the branch's running byte total, not per layer: the branch holds at most its
        # budget, and misses it by less than one row overall instead of one row per layer.
        spent = carried = 0
        for layer in layers:
            full = layer.managed_full_bytes
            budget = floor_bytes(ratio, full)
            geo = layer.geometry
            if geo is None or full == 0:
                budget_rows.append(0)
                pool_rows.append(0)
                spans.append(0)
                continue
            carried += budget
            span = layer.span_rows(layer.candidate_keys)  # the pooled store names its rows within it
            rows = rows_for_bytes(carried - spent, span, geo.num_kv_heads, geo.head_dim, geo.elem)
            spent += evicted_bytes(rows, span, geo.num_kv_heads, geo.head_dim, geo.elem)
            budget_rows.append(rows)
            spans.append(span)
            pool_rows.append(layer.held_rows(layer.candidate_keys))
            budgets[layer.index] = budget
        kept_rows = self.layer_rows(view, budget_rows, pool_rows)
        if kept_rows != budget_rows:
            kept_rows = _within(kept_rows, [(layer.geometry, span) for layer, span in zip(layers, spans)], spent)
        plans = {}
        for layer, keep in zip(layers, kept_rows):
            keys = layer.candidate_keys
            lp_budget = {"candidate": budgets[layer.index]} if layer.index in budgets else None
            if not keys or keep >= pool_rows[layer.index] or layer.geometry is None:
                plans[layer.index] = LayerPlan(budgets=lp_budget)
                continue  # the target keeps everything: the segment stays as it is
            geo = layer.geometry
            kept = min(keep, pool_rows[layer.index])
            kept_bytes = evicted_bytes(kept, spans[layer.index], geo.num_kv_heads, geo.head_dim, geo.elem)
            if kept_bytes >= layer.held_bytes(keys):
                plans[layer.index] = LayerPlan(budgets=lp_budget)
                continue  # the kept rows and their indices would hold as much as the rows do now
            scores = self.layer_scores(view, layer)
            if scores is None:
                raise RuntimeError(f"{self.name}: layer {layer.index} of branch {view.branch} was never scored")
            share = self.recent_share()
            recent = min(keep, int(keep * share + 0.5)) if share else 0
            action = Keep(
                segments=keys,
                rows=kept,
                scores=scores,
                recent=recent,
                forced=self.forced_rows(view, layer),
                smooth_kernel=self.smooth_kernel(),
                merge=self.merge_rule(),
                expected_bytes=kept_bytes,
            )
            plans[layer.index] = LayerPlan(keeps=(action,), budgets=lp_budget)
        return BranchPlan(layers=plans)


def _within(rows: list[int], layers: list[tuple[RowGeometry | None, int]], limit: int) -> list[int]:
    """``rows`` per layer, cut from the deepest layers until their evicted stores hold at most ``limit`` bytes: rows
    moved between layers (PyramidKV) can move an index from its bitmap to its list, which costs a few bytes more.
    ``layers``: each layer's row geometry and span."""
    rows = list(rows)

    def layer_bytes(i: int) -> int:
        geo, span = layers[i]
        return 0 if geo is None else evicted_bytes(rows[i], span, geo.num_kv_heads, geo.head_dim, geo.elem)

    held = [layer_bytes(i) for i in range(len(rows))]
    total, i = sum(held), len(rows) - 1
    while i >= 0 and total > limit:  # only the layer cut changes: its bytes are recomputed, the others kept
        if rows[i]:
            rows[i] -= 1
            total -= held[i]
            held[i] = layer_bytes(i)
            total += held[i]
        else:
            i -= 1
    return rows


__all__ = ["GlobalEviction"]
