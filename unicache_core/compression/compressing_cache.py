"""The compressing cache of one context: it measures what its method asks for and applies the method's plans.

:class:`CompressingKVCache` is a :class:`~unicache_core.kv.segmented_cache.SegmentedKVCache` that

- keeps the token type of every append index (``types``), so any segment can be tagged and accounted;
- on the calls its method asks for (:meth:`~unicache_core.compression.method.Method.plan_call`, asked through its
  session), measures from the real queries of the call, before anything is evicted in it: type masses from the
  per-store LSE (free) and the method's own statistic (:meth:`~unicache_core.compression.method.Method.measure`,
  given a :class:`~unicache_core.compression.scoring.CallProbe` of each layer), kept per layer
  (:class:`~unicache_core.compression.protocol.LayerState`) and, for the masses, in the request's
  :class:`~unicache_core.compression.state.RequestState`;
- at the compression points (after the first denoising step of its branch and, for UniCache, at the end of every
  step chunk; before the first decoded token for understanding; at the end of a prefill block when the method says
  so) has its session plan the compression
  (:meth:`~unicache_core.compression.session.CompressionSession.compress`) and applies the plan
  (:meth:`CompressingKVCache.apply`) with the physical operations of :mod:`.ops`.

The cache reaches its session only through :class:`~unicache_core.compression.protocol.CallCoordinator`; the report
reads it through :class:`~unicache_core.compression.protocol.ReportedBranch`.
"""

from __future__ import annotations

import logging
from typing import cast

import torch
from torch import Tensor

from ..kv.cache import AttentionCall, RequestInfo
from ..kv.segmented_cache import LayerAttention, SegmentedKVCache
from ..kv.stores import KVStore
from ..kv.token_types import CANDIDATE_TYPES, TokenType
from .family import FULL_BITS
from .method import Method
from .ops import compress_rows, evict
from .plan import BranchPlan, CallPlan, Keep
from .protocol import CallCoordinator, LayerState, Measurement
from .report import MANAGED_TYPES, type_name
from .scoring import CallProbe, masses_from_lse
from .state import RequestState, clock
from .view import SegmentKey, key_of

logger = logging.getLogger(__name__)

#: Marks the store a method pooled several candidate types into (``LayerState.pooled``) while masses are summed.
_POOLED = object()


class CompressingKVCache(SegmentedKVCache):
    """Segmented cache of one branch, compressed by ``method`` (see the module docstring).

    Args:
        coordinator: the request's session, which plans with the method and applies the plans.
        request: the request; method: the method as it runs it; state: the request's state, recorded into.
        branch: the branch name.
    """

    holds_every_row = False

    def __init__(
        self, coordinator: CallCoordinator, request: RequestInfo, method: Method, state: RequestState, branch: str
    ):
        super().__init__(request.num_layers, task=request.task, branch=branch)
        self.coordinator = coordinator
        self.method = method
        self.request_state = state
        self.types = torch.zeros(0, dtype=torch.int8)  # [T] TokenType of each append index
        self.images = torch.zeros(0, dtype=torch.int16)  # [T] input image of each append index, -1 for none
        self.state = [LayerState() for _ in range(self.num_layers)]
        self._plan = CallPlan()
        self._call_rows = 0

    # ------------------------------------------------------------------ branch copies

    @property
    def types(self) -> Tensor:
        """``[T]`` int8 :class:`TokenType` of each append index (assigned whole; only ever grows)."""
        return self._types

    @types.setter
    def types(self, value: Tensor) -> None:
        self._types = value
        self._type_rows: dict[int, dict[TokenType, int]] = {}  # prefix length -> its row count per type

    @property
    def images(self) -> Tensor:
        """``[T]`` int16 input image of each append index (-1: no image's row; assigned whole; only ever grows)."""
        return self._images

    @images.setter
    def images(self, value: Tensor) -> None:
        self._images = value
        self._segment_rows: dict[int, dict[SegmentKey, int]] = {}  # prefix length -> its row count per segment

    def clone(self, *, branch: str | None = None) -> CompressingKVCache:
        other = cast(CompressingKVCache, super().clone(branch=branch))
        other.types = self.types  # shared prefix, its own memo of type_rows
        other.images = self.images
        other.state = [state.copy() for state in self.state]
        other._plan = CallPlan()
        return other

    # ------------------------------------------------------------------ the seam

    def begin_call(self, call: AttentionCall) -> None:
        self._plan = self.coordinator.plan_call(self, call)
        if self._plan.compress_before:
            self.coordinator.compress(self, call)
        if self._plan.observe or self._plan.measure:
            self.coordinator.note_observed(self.branch or "", call)
            logger.debug(
                "%s %s step %s: observe=%s measure=%s",
                self.branch,
                call.phase,
                call.step,
                self._plan.observe,
                self._plan.measure,
            )
        if call.update:
            types = call.token_types.detach().to("cpu", torch.int8)
            self.types = torch.cat([self.types, types])
            image = -1 if call.image is None else int(call.image)
            self.images = torch.cat([self.images, torch.full(types.shape, image, dtype=torch.int16)])
        self._call_rows = 0

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tensor:
        st = self.layer(layer)
        plan = self._plan
        sync = self.request_state.sync_timing
        start = clock(q, sync)
        if not (plan.observe or plan.measure) and plan.fused:
            out, _ = st.attend(q, k, v, causal=call.causal, new_mask=call.new_block_mask, fused=True)
            res = None
        else:
            res = st.attend_parts(q, k, v, causal=call.causal, new_mask=call.new_block_mask)
            out = res.out
        mid = clock(q, sync)
        self.request_state.add_time("attention", mid - start)
        self._call_rows += sum(s.num_tokens for s in st.stores) + k.shape[0]
        if res is not None and (plan.observe or plan.measure):
            self._observe(layer, q, k, res, call, plan)
            self.request_state.add_time("stats", clock(q, sync) - mid)
        if call.update:
            st.append(k, v, call.token_types, call.image)
            if plan.store_written:  # the method stores this layer's new rows now, before the next layer runs
                packed = clock(q, sync)
                for keep in self.coordinator.plan_written(self, call, layer).keeps:
                    self._apply_keep(layer, keep)
                self.request_state.add_time("pack", clock(q, sync) - packed)
        return out

    def end_call(self, call: AttentionCall) -> None:
        self.coordinator.note_rows(self.branch or "", call, self._call_rows)
        if self._plan.measure:
            self.request_state.note_measured(self.branch or "", call.phase)
        if self._plan.compress_after:
            self.coordinator.compress(self, call)
        self._plan = CallPlan()

    # ------------------------------------------------------------------ statistics

    def _observe(
        self, layer: int, q: Tensor, k_new: Tensor, res: LayerAttention, call: AttentionCall, plan: CallPlan
    ) -> None:
        st = self.layer(layer)
        ls = self.state[layer]
        parts = [
            (
                None
                if ls.pooled and store.token_type == TokenType.UNKNOWN and store.kind != "full"
                else store.token_type,
                lse,
            )
            for store, lse in zip(st.stores, res.store_lse)
            if store.num_tokens
        ]
        if res.new_lse is not None:
            parts.append((TokenType.CURRENT_LATENT if call.phase == "denoise" else TokenType.UNKNOWN, res.new_lse))
        masses: dict[TokenType, float] = {}
        segment_masses: dict[SegmentKey, float] = {}
        part_masses = masses_from_lse([lse for _, lse in parts], res.lse)
        for (token_type, _), mass in zip(parts, part_masses):
            if token_type is not None:
                masses[token_type] = masses.get(token_type, 0.0) + mass
            else:  # one store of several types (pooled): its mass in the shares they had when pooled
                for member, share in ls.pooled.items():
                    masses[member] = masses.get(member, 0.0) + mass * share
        for store, mass in zip((s for s in st.stores if s.num_tokens), part_masses):
            if store.token_type in CANDIDATE_TYPES:
                key = key_of(store)
                segment_masses[key] = segment_masses.get(key, 0.0) + mass
        ls.segment_masses = segment_masses
        if plan.measure:
            probe = CallProbe(layer, call, q, k_new, res, tuple(st.stores), st.appended_tokens)
            measurement = self.method.measure(probe)
            ls.record(measurement)
            if call.phase == "prefill" and call.update and measurement.scores is not None:
                self._new_block_masses(st.appended_tokens, measurement, masses)
        ls.masses = masses
        if call.phase in ("denoise", "decode") and call.step is not None:
            candidate = {t: m for t, m in masses.items() if t in CANDIDATE_TYPES}
            self.request_state.note_masses(self.branch or "", layer, int(call.step), candidate)

    def _new_block_masses(self, appended: int, measurement: Measurement, masses: dict[TokenType, float]) -> None:
        """The masses of a prefill block's own types, from its keys' scores (their LSE is one part, ``UNKNOWN``)."""
        dense = measurement.scores
        assert dense is not None
        masses.pop(TokenType.UNKNOWN, None)
        types = self.types  # begin_call already appended the new block's types
        per_key = dense.sum(dim=1).cpu() / (measurement.queries * dense.shape[1])
        tail = per_key[appended:]
        for t in torch.unique(types[appended : appended + tail.shape[0]]).tolist():
            sel = types[appended : appended + tail.shape[0]] == t
            masses[TokenType(t)] = masses.get(TokenType(t), 0.0) + float(tail[sel].sum())

    # ------------------------------------------------------------------ accounting

    def type_rows(self, layer: int) -> dict[TokenType, int]:
        """Uncompressed row count per type in ``layer`` (every appended row, compressed or not)."""
        n = self.layer(layer).appended_tokens
        if n not in self._type_rows:
            counts = torch.bincount(self.types[:n].long(), minlength=len(TokenType)).tolist()
            self._type_rows[n] = {TokenType(i): c for i, c in enumerate(counts) if c}
        return dict(self._type_rows[n])

    def segment_rows(self, layer: int) -> dict[SegmentKey, int]:
        """Uncompressed row count per segment of ``layer``: per (candidate type, input image), and per protected
        type (image ``None``)."""
        n = self.layer(layer).appended_tokens
        if n not in self._segment_rows:
            types, images = self.types[:n].long(), self.images[:n].long()
            if images.shape[0] < n:  # rows appended to a layer directly (not through a call) name no image
                images = torch.cat([images, torch.full((n - images.shape[0],), -1, dtype=torch.long)])
            candidate = torch.zeros(n, dtype=torch.bool)
            for t in CANDIDATE_TYPES:
                candidate |= types == int(t)
            images = torch.where(candidate, images, torch.full_like(images, -1))
            width = int(images.max()) + 2 if n else 1
            counts = torch.bincount(types * width + images + 1, minlength=len(TokenType) * width).tolist()
            self._segment_rows[n] = {
                SegmentKey(TokenType(i // width), None if i % width == 0 else i % width - 1): c
                for i, c in enumerate(counts)
                if c
            }
        return dict(self._segment_rows[n])

    def row_bytes(self, layer: int) -> int:
        """Bytes of one uncompressed row (K+V over the KV heads) in ``layer``; 0 while empty."""
        geometry = self.layer(layer).geometry
        if geometry is None:
            return 0
        h, d, dtype = geometry
        return 2 * h * d * dtype.itemsize

    # ------------------------------------------------------------------ plans

    def apply(self, plan: BranchPlan, frozen: frozenset[int] = frozenset()) -> list[tuple[int, list[KVStore], KVStore]]:
        """Carry out a method's plan: each layer's changes in order, then its records (budgets, flags, pooled types;
        the schedule's rho and the method's state are the request state's, recorded by the session), then the
        changed layers' evicted stores moved into one buffer each (storages in ``frozen`` left alone: rows a cache
        that follows no replacement holds). Returns each replacement made, in order: ``(layer, the stores replaced,
        the store that replaced them)``."""
        replaced = []
        for index in sorted(plan.layers):
            layer_plan = plan.layers[index]
            ls = self.state[index]
            if layer_plan.pooled and not ls.pooled:
                ls.pooled = dict(layer_plan.pooled)
            for keep in layer_plan.keeps:
                replaced.append((index, *self._apply_keep(index, keep)))
            if layer_plan.budgets is not None:
                ls.budgets = dict(layer_plan.budgets)
            for key, reason in layer_plan.flags.items():
                if reason is None:
                    ls.flags.pop(key, None)
                else:
                    ls.flags[key] = reason
            if layer_plan.keeps:  # the layer's evicted rows in one buffer: one attention call reads them all
                replaced.extend((index, [old], new) for old, new in self.layer(index).pool_evicted(frozen))
        return replaced

    def _apply_keep(self, index: int, keep: Keep) -> tuple[list[KVStore], KVStore]:
        """One change of a layer plan: the stores of ``keep.segments`` become the store it describes (returned with
        the stores it replaced)."""
        st = self.layer(index)
        wanted = set(keep.segments)
        stores = [i for i, store in enumerate(st.stores) if key_of(store) in wanted]
        old = [st.stores[i] for i in stores]
        if not stores:
            raise RuntimeError(
                f"{self.method.name}: layer {index} of branch {self.branch} holds none of "
                f"the segments {list(keep.segments)} its plan names"
            )
        if keep.bits == FULL_BITS:  # full-precision rows: an eviction (SnapKV's window and pooling included)
            if keep.scores is None:
                raise RuntimeError(f"{self.method.name}: evicting rows of layer {index} needs their scores")
            store = evict(
                st,
                stores,
                keep.rows,
                keep.scores,
                recent=keep.recent,
                forced=keep.forced,
                smooth_kernel=keep.smooth_kernel,
                merge=keep.merge,
            )
        else:
            store = compress_rows(
                st, stores, keep.choice, keep.scores, recent=keep.recent, fit_values=keep.fit_values, merge=keep.merge
            )
        if keep.expected_bytes is not None and store.nbytes() != keep.expected_bytes:
            reason = (
                f"the store holds {store.nbytes()} B where the plan counted {keep.expected_bytes} B "
                "(a byte formula and a store disagree: please report it)"
            )
            logger.warning("%s layer %d of %s: %s", self.method.name, index, self.branch, reason)
            self.state[index].flags[f"bytes:{type_name(store.token_type)}"] = reason
        return old, store

    def managed_full_bytes(self, layer: int | None = None) -> int:
        """K+V bytes the compressible (candidate) rows would hold uncompressed (no index tensors)."""
        layers = range(self.num_layers) if layer is None else [layer]
        total = 0
        for lay in layers:
            rows = self.type_rows(lay)
            total += self.row_bytes(lay) * sum(n for t, n in rows.items() if t in CANDIDATE_TYPES)
        return total

    def split_bytes(self) -> tuple[int, int]:
        """``(managed, protected)`` bytes held now (stores of candidate types / of protected types)."""
        managed = protected = 0
        for layer in self.layers:
            for store in layer.stores:
                if store.token_type in MANAGED_TYPES:
                    managed += store.nbytes()
                else:
                    protected += store.nbytes()
        return managed, protected

    def stores_of(self, layer: int) -> list[KVStore]:
        """The stores of ``layer``, in order (read-only: the report's snapshots)."""
        return list(self.layer(layer).stores)


__all__ = ["CompressingKVCache"]
