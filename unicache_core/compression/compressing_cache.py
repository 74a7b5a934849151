"""The compressing cache of one context and the per-request session that owns the shared state.

:class:`CompressingKVCache` is a :class:`~unicache_core.kv.segmented_cache.SegmentedKVCache` that

- keeps the token type of every append index (``types``), so any segment can be tagged and accounted;
- on the calls its method asks for, measures attention statistics from the real queries of the call,
  before anything is evicted in it: type masses from the per-store LSE (free), per-key scores from a
  query subsample (:mod:`.scoring`), VL-Cache's layer sparsity;
- hands control to its :class:`~unicache_core.compression.method.CompressionMethod` at the compression
  points (after the first denoising step of its branch and, for UniCache, at the end of every step
  chunk; before the first decoded token for understanding), which shrink it physically (:mod:`.ops`).

:class:`CompressionSession` is the :class:`~unicache_core.kv.cache.CacheSession` of one request: the
branch caches, the chunked statistics (keyed per branch), the rho schedules per (branch, layer chunk),
clocks, and the per-step records returned as the run's report (:mod:`.report`).
"""

from __future__ import annotations

import logging
import math
import time

import torch
from torch import Tensor

from ..kv.cache import AttentionCall, CacheSession, KVCache, RequestInfo, StepInfo, unique_nbytes
from ..kv.segmented_cache import LayerAttention, SegmentedKVCache
from ..kv.token_types import CANDIDATE_TYPES, PROTECTED_TYPES, TokenType
from .config import KVConfig
from .method import CompressionMethod
from .protocol import CallPlan, LayerState
from .report import ReportBuilder, type_name
from .scoring import key_scores, masses_from_lse, query_subsample, row_max_logits
from .stats import ChunkedAttentionStats

logger = logging.getLogger(__name__)

#: Types a method may compress; ``UNKNOWN`` marks a pooled store of several of them (global baselines).
MANAGED_TYPES = frozenset(CANDIDATE_TYPES) | {TokenType.UNKNOWN}
#: Marks the store a method pooled several candidate types into (``LayerState.pooled``) while masses are summed.
_POOLED = object()


class CompressingKVCache(SegmentedKVCache):
    """Segmented cache of one branch, compressed by ``session.method`` (see the module docstring)."""

    def __init__(self, session: CompressionSession, branch: str):
        super().__init__(session.request.num_layers, task=session.request.task, branch=branch)
        self.session = session
        self.types = torch.zeros(0, dtype=torch.int8)  # [T] TokenType of each append index
        self.state = [LayerState() for _ in range(self.num_layers)]
        self.first_denoise_step: int | None = None
        self.compressions = 0
        self.rho: dict[int, float] = {}  # layer chunk -> scheduled retention (unicache)
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

    def clone(self, *, branch: str | None = None) -> CompressingKVCache:
        other = super().clone(branch=branch)
        other.types = self.types  # shared prefix, its own memo of type_rows
        other.state = [state.copy() for state in self.state]
        other.rho = dict(self.rho)
        other._plan = CallPlan()
        return other

    # ------------------------------------------------------------------ the seam

    def begin_call(self, call: AttentionCall) -> None:
        if call.phase == "denoise" and self.first_denoise_step is None:
            self.first_denoise_step = int(call.step or 0)
        self._plan = self.session.method.plan_call(self, call)
        if self._plan.compress_before:
            self.session.compress(self, call)
        if self._plan.observe or self._plan.score:
            logger.debug(
                "%s %s step %s: observe=%s score=%s",
                self.branch,
                call.phase,
                call.step,
                self._plan.observe,
                self._plan.score,
            )
        if call.update:
            types = call.token_types.detach().to("cpu", torch.int8)
            self.types = torch.cat([self.types, types])
        self._call_rows = 0

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tensor:
        st = self.layer(layer)
        plan = self._plan
        timers = self.session.timers
        start = self.session.clock(q)
        if not (plan.observe or plan.score) and self.session.config.fused:
            out, _ = st.attend(q, k, v, causal=call.causal, new_mask=call.new_block_mask, fused=True)
            res = None
        else:
            res = st.attend_parts(q, k, v, causal=call.causal, new_mask=call.new_block_mask)
            out = res.out
        mid = self.session.clock(q)
        timers["attention"] += mid - start
        self._call_rows += sum(s.num_tokens for s in st.stores) + k.shape[0]
        if res is not None and (plan.observe or plan.score):
            self._observe(layer, q, k, res, call, plan)
            timers["stats"] += self.session.clock(q) - mid
        if call.update:
            st.append(k, v, call.token_types)
        return out

    def end_call(self, call: AttentionCall) -> None:
        self.session.note_rows(self.branch, call, self._call_rows)
        if self._plan.observe and call.phase in ("denoise", "decode"):
            self.session.report.note_observed(self.branch)
        if self._plan.compress_after:
            self.session.compress(self, call)
        self._plan = CallPlan()

    # ------------------------------------------------------------------ statistics

    def _observe(
        self, layer: int, q: Tensor, k_new: Tensor, res: LayerAttention, call: AttentionCall, plan: CallPlan
    ) -> None:
        st = self.layer(layer)
        ls = self.state[layer]
        parts = [
            (
                _POOLED
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
        for (token_type, _), mass in zip(parts, masses_from_lse([lse for _, lse in parts], res.lse)):
            if token_type is _POOLED:  # one store of several types: its mass in the shares they had when pooled
                for member, share in ls.pooled.items():
                    masses[member] = masses.get(member, 0.0) + mass * share
            else:
                masses[token_type] = masses.get(token_type, 0.0) + mass
        if plan.score:
            dense, n_q = self._score(layer, q, k_new, res, call, plan)
            if call.phase == "prefill" and call.update:
                # masses of the new block's own types come from its keys' scores (their LSE is one part)
                masses.pop(TokenType.UNKNOWN, None)
                types = self.types  # begin_call already appended the new block's types
                per_key = dense.sum(dim=1).cpu() / (n_q * dense.shape[1])
                tail = per_key[st.appended_tokens :]
                for t in torch.unique(types[st.appended_tokens : st.appended_tokens + tail.shape[0]]).tolist():
                    sel = types[st.appended_tokens : st.appended_tokens + tail.shape[0]] == t
                    masses[TokenType(t)] = masses.get(TokenType(t), 0.0) + float(tail[sel].sum())
        ls.masses = masses
        if call.phase in ("denoise", "decode") and call.step is not None:
            self.session.stats.update(
                layer, int(call.step), {t: m for t, m in masses.items() if t in CANDIDATE_TYPES}, branch=self.branch
            )

    def _score(
        self, layer: int, q: Tensor, k_new: Tensor, res: LayerAttention, call: AttentionCall, plan: CallPlan
    ) -> tuple[Tensor, int]:
        st = self.layer(layer)
        ls = self.state[layer]
        if 0 < plan.num_queries < q.shape[0]:
            idx = query_subsample(q.shape[0], plan.num_queries, last=plan.last_queries, device=q.device)
            qs, lse = q.index_select(0, idx), res.lse.index_select(0, idx)
        else:  # every query is scored: no subsample to gather
            idx, qs, lse = None, q, res.lse
        tn = k_new.shape[0] if call.update else 0
        total = st.appended_tokens + tn
        hkv = k_new.shape[1]
        dense = torch.zeros(total, hkv, dtype=torch.float32, device=q.device)
        visible = None
        if call.update:
            if call.new_block_mask is not None:
                visible = call.new_block_mask.to(q.device)
                visible = visible if idx is None else visible.index_select(0, idx)
            elif call.causal:
                rows = torch.arange(q.shape[0], device=q.device) if idx is None else idx
                visible = torch.arange(tn, device=q.device)[None, :] <= rows[:, None]
        # every resident row that can be scored, in one pass (protected rows only for the sparsity count)
        scored = [
            store
            for store in st.stores
            if store.num_tokens
            and store.score_keys() is not None
            and (plan.sparsity or store.token_type not in PROTECTED_TYPES)
        ]
        keys, index = _scored_rows(scored, hkv)
        merged = call.update and visible is None and tn > 0
        if merged:  # every query sees the whole new block: its keys are scored in the same pass
            new_index = torch.arange(st.appended_tokens, total, device=q.device).unsqueeze(1).expand(-1, hkv)
            keys = k_new if keys is None else torch.cat([keys, k_new.to(keys.dtype)])
            index = new_index if index is None else torch.cat([index.to(q.device), new_index])
        thresholds = None
        if plan.sparsity:
            rowmax = torch.full(lse.shape, float("-inf"), device=q.device)
            if keys is not None:
                rowmax = torch.maximum(rowmax, row_max_logits(qs, keys))
            if call.update and not merged:
                rowmax = torch.maximum(rowmax, row_max_logits(qs, k_new, visible=visible))
            thresholds = rowmax + math.log(self.session.method.sparsity_threshold)
        counts = torch.zeros(q.shape[1], dtype=torch.int64, device=q.device) if plan.sparsity else None
        valid = 0
        if keys is not None:
            scores, c = key_scores(qs, keys, lse, count_above=thresholds)
            dense.scatter_add_(0, index.to(q.device), scores)
            if c is not None:
                counts += c
                valid += qs.shape[0] * keys.shape[0]
        if call.update and not merged:
            scores, c = key_scores(qs, k_new, lse, visible=visible, count_above=thresholds)
            dense[st.appended_tokens :] += scores
            if c is not None:
                counts += c
                valid += int(visible.sum()) if visible is not None else qs.shape[0] * tn
        if plan.sparsity:
            ls.sparsity = 1.0 - float(counts.sum()) / max(1, valid * q.shape[1])
        ls.last_scores = dense
        ls.last_score_queries = int(qs.shape[0])
        if ls.scores is None:
            ls.scores = dense.clone()
        elif ls.scores.shape == dense.shape:  # nothing appended since: a new tensor (forks share the old one)
            ls.scores = ls.scores + dense
        else:
            grown = torch.zeros_like(dense)
            grown[: ls.scores.shape[0]] = ls.scores
            ls.scores = grown.add_(dense)
        return dense, int(qs.shape[0])

    # ------------------------------------------------------------------ accounting

    def type_rows(self, layer: int) -> dict[TokenType, int]:
        """Uncompressed row count per type in ``layer`` (every appended row, compressed or not)."""
        n = self.layer(layer).appended_tokens
        if n not in self._type_rows:
            counts = torch.bincount(self.types[:n].long(), minlength=len(TokenType)).tolist()
            self._type_rows[n] = {TokenType(i): c for i, c in enumerate(counts) if c}
        return dict(self._type_rows[n])

    def row_bytes(self, layer: int) -> int:
        """Bytes of one uncompressed row (K+V over the KV heads) in ``layer``; 0 while empty."""
        meta = self.layer(layer)._kv_meta
        if meta is None:
            return 0
        h, d, dtype, _ = meta
        return 2 * h * d * dtype.itemsize

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

    def snapshot_types(self) -> dict[str, dict]:
        """Per type name, summed over the layers: the policy acting on it, bytes held, rows per KV head, store
        kinds, KIVI settings, budget bytes, attention mass and uncompressed rows (the report's ``types``)."""
        types: dict[str, dict] = {}
        for layer, st in enumerate(self.layers):
            ls = self.state[layer]
            for store in st.stores:
                name = type_name(store.token_type)
                entry = types.setdefault(name, {"policy": "protect", "bytes": 0, "rows_per_head": 0.0, "stores": {}})
                entry["bytes"] += store.nbytes()
                entry["rows_per_head"] += store.num_tokens / self.num_layers
                entry["stores"][store.kind] = entry["stores"].get(store.kind, 0) + 1
                if store.token_type in MANAGED_TYPES:
                    entry["policy"] = (
                        {"full": "full", "evicted": "evict", "quantized": "quantize"}[store.kind]
                        if entry["policy"] in ("protect", "full")
                        else entry["policy"]
                    )
                if store.kind == "quantized":
                    entry["bits"], entry["group_size"], entry["residual"] = store.bits, store.group_size, store.residual
            for name, budget in ls.budgets.items():
                entry = types.setdefault(name, {"policy": "full", "bytes": 0, "rows_per_head": 0.0, "stores": {}})
                entry["budget_bytes"] = entry.get("budget_bytes", 0) + int(budget)
            for t, m in ls.masses.items():
                entry = types.get(type_name(t))
                if entry is not None:
                    entry["mass"] = entry.get("mass", 0.0) + m / self.num_layers
        for t, n in self.type_rows(0).items():
            if type_name(t) in types:
                types[type_name(t)]["full_rows"] = n
        for entry in types.values():
            entry["rows_per_head"] = round(entry["rows_per_head"], 2)
            if "mass" in entry:
                entry["mass"] = round(entry["mass"], 6)
        return types


class CompressionSession(CacheSession):
    """Per-request state of a compressing method (see the module docstring)."""

    def __init__(
        self, request: RequestInfo, method: CompressionMethod, config: KVConfig, policy_info: dict | None = None
    ):
        super().__init__(request)
        self.method = method
        self.config = config
        self.stats = ChunkedAttentionStats.for_task(request.task)
        self.schedules: dict = {}
        self.timers = {"attention": 0.0, "stats": 0.0, "alloc": 0.0}
        self.step: StepInfo | None = None
        self.target_ratio: float | None = None  # resolved memory target (ratio of full managed bytes)
        self.released: set[str] = set()
        self._step_start: float | None = None  # perf_counter() when the current step began
        self.report = ReportBuilder(self, policy_info or {})
        method.start(self)

    def clock(self, like: Tensor | None = None) -> float:
        """``perf_counter()``, after the device of ``like`` finished its work when ``config.sync_timing``."""
        if self.config.sync_timing and like is not None and like.is_cuda:
            torch.cuda.synchronize(like.device)
        return time.perf_counter()

    # ------------------------------------------------------------------ caches

    def new_cache(self, branch: str) -> KVCache:
        super().new_cache(branch)  # validates the name
        cache = CompressingKVCache(self, branch)
        self.caches[branch] = cache
        return cache

    def fork(self, parent: KVCache, branch: str) -> KVCache:
        cache = super().fork(parent, branch)
        logger.debug("fork %s -> %s at %d tokens", parent.branch, branch, cache.num_tokens)
        return cache

    def release(self, branch: str) -> None:
        super().release(branch)
        self.released.add(branch)

    def live_caches(self) -> list[CompressingKVCache]:
        """The branch caches of this request that were built and not yet released."""
        return [c for c in self.caches.values() if isinstance(c, CompressingKVCache)]

    def held_bytes(self) -> int:
        """Bytes of every live branch cache, storages shared by branches counted once."""
        return unique_nbytes(t for c in self.live_caches() for t in c.tensors())

    # ------------------------------------------------------------------ steps

    def begin_step(self, step: StepInfo) -> None:
        if self.step is None:
            self.report.note_peak()
        self.step = step
        self.timers = {"attention": 0.0, "stats": 0.0, "alloc": 0.0}
        self.report.begin_step(step)
        self._step_start = time.perf_counter()

    def end_step(self, step: StepInfo) -> None:
        timers = dict(self.timers)
        timers["step"] = 0.0 if self._step_start is None else time.perf_counter() - self._step_start
        self.report.end_step(step, timers)

    def note_rows(self, branch: str, call: AttentionCall, rows: int) -> None:
        """Record the rows ``call`` of ``branch`` attended over (summed over its layers)."""
        self.report.note_rows(branch, call, rows)

    def resolve_target(self) -> float:
        """The memory target as a ratio of the full managed bytes of every live branch (bytes are converted)."""
        if self.target_ratio is None:
            target = self.method.target(self)
            if isinstance(target, int):
                full = sum(c.managed_full_bytes() for c in self.live_caches() if c.branch != "plan")
                ratio = 1.0 if full == 0 else min(1.0, target / full)
                logger.info("kv_target %d bytes = %.4f of the %d full managed bytes", target, ratio, full)
                self.target_ratio = ratio
            else:
                self.target_ratio = float(target)
        return self.target_ratio

    def compress(self, cache: CompressingKVCache, call: AttentionCall | None) -> None:
        """Run the method's compression on ``cache`` (at ``call``), timed as allocation and recorded."""
        start = self.clock()
        self.method.compress(self, cache, call)
        cache.compressions += 1
        self.timers["alloc"] += self.clock() - start
        self.report.note_compression(cache)

    def finish(self) -> dict:
        """The request's KV report (:mod:`.report`)."""
        return self.report.build()


def _scored_rows(stores: list, num_kv_heads: int) -> tuple[Tensor | None, Tensor | None]:
    """The rows of ``stores`` that scoring reads, as one key set: ``(keys [N, Hkv, d], append index [N, Hkv] int64)``
    (row ``i`` of head ``h`` is the key of append index ``index[i, h]``), or ``(None, None)`` without stores."""
    if not stores:
        return None, None
    keys, index = [], []
    for store in stores:
        keys.append(store.score_keys())
        rows = store.token_index.long()
        index.append(rows.unsqueeze(1).expand(-1, num_kv_heads) if rows.dim() == 1 else rows.t())
    if len(stores) == 1:
        return keys[0], index[0]
    return torch.cat(keys), torch.cat(index)


__all__ = ["CompressingKVCache", "CompressionSession", "MANAGED_TYPES"]
