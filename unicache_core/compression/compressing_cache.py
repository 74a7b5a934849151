"""The compressing cache of one context: it measures what its method asks for and applies the method's plans.

:class:`CompressingKVCache` is a :class:`~unicache_core.kv.segmented_cache.SegmentedKVCache` that

- keeps the token type of every append index (``types``), so any segment can be tagged and accounted;
- on the calls its method asks for (:meth:`~unicache_core.compression.method.Method.plan_call`), measures attention
  statistics from the real queries of the call, before anything is evicted in it: type masses from the per-store
  LSE (free), per-key scores from a query subsample (:mod:`.scoring`), VL-Cache's layer sparsity;
- at the compression points (after the first denoising step of its branch and, for UniCache, at the end of every
  step chunk; before the first decoded token for understanding) has its session plan the compression
  (:meth:`~unicache_core.compression.session.CompressionSession.compress`) and applies the plan
  (:meth:`CompressingKVCache.apply`) with the physical operations of :mod:`.ops`.

The session of a request is :class:`~unicache_core.compression.session.CompressionSession`.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from ..kv.cache import AttentionCall
from ..kv.segmented_cache import LayerAttention, SegmentedKVCache
from ..kv.stores import KVStore, QuantizedStore
from ..kv.token_types import CANDIDATE_TYPES, PROTECTED_TYPES, TokenType
from .family import FULL_BITS
from .ops import compress_rows, evict
from .plan import BranchPlan, CallPlan, Keep
from .protocol import LayerState
from .report import type_name
from .scoring import key_scores, masses_from_lse, query_subsample, row_max_logits, scorable, scored_rows
from .view import BranchView, SegmentKey, key_of

if TYPE_CHECKING:  # pragma: no cover
    from .session import CompressionSession

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
        self.images = torch.zeros(0, dtype=torch.int16)  # [T] input image of each append index, -1 for none
        self.state = [LayerState() for _ in range(self.num_layers)]
        self.first_denoise_step: int | None = None
        self.compressions = 0
        self.rho: dict[int, float] = {}  # layer chunk -> scheduled retention (unicache)
        self.method_state: Any = None  # what the method's last plan keeps for this branch (BranchPlan.state)
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
        other.rho = dict(self.rho)
        other.method_state = self.method_state  # a frozen value: shared
        other._plan = CallPlan()
        return other

    # ------------------------------------------------------------------ the seam

    def begin_call(self, call: AttentionCall) -> None:
        if call.phase == "denoise" and self.first_denoise_step is None:
            self.first_denoise_step = int(call.step or 0)
        self._plan = self.session.method.plan_call(BranchView(self, call), call)
        if self._plan.compress_before:
            self.session.compress(self, call)
        if self._plan.observe or self._plan.score:
            self.session.note_observed(self.branch or "", call)
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
            image = -1 if call.image is None else int(call.image)
            self.images = torch.cat([self.images, torch.full(types.shape, image, dtype=torch.int16)])
        self._call_rows = 0

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tensor:
        st = self.layer(layer)
        plan = self._plan
        timers = self.session.timers
        start = self.session.clock(q)
        if not (plan.observe or plan.score) and self.session.method.fused:
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
            st.append(k, v, call.token_types, call.image)
            if plan.store_written:  # the method stores this layer's new rows now, before the next layer runs
                for keep in self.session.method.plan_written(BranchView(self, call), layer).keeps:
                    self._apply_keep(layer, keep)
        return out

    def end_call(self, call: AttentionCall) -> None:
        self.session.note_rows(self.branch or "", call, self._call_rows)
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
        segment_masses: dict[SegmentKey, float] = {}
        part_masses = masses_from_lse([lse for _, lse in parts], res.lse)
        for (token_type, _), mass in zip(parts, part_masses):
            if isinstance(token_type, TokenType):
                masses[token_type] = masses.get(token_type, 0.0) + mass
            else:  # one store of several types (_POOLED): its mass in the shares they had when pooled
                for member, share in ls.pooled.items():
                    masses[member] = masses.get(member, 0.0) + mass * share
        for store, mass in zip((s for s in st.stores if s.num_tokens), part_masses):
            if store.token_type in CANDIDATE_TYPES:
                key = key_of(store)
                segment_masses[key] = segment_masses.get(key, 0.0) + mass
        ls.segment_masses = segment_masses
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
                layer,
                int(call.step),
                {t: m for t, m in masses.items() if t in CANDIDATE_TYPES},
                branch=self.branch or "",
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
            if store.num_tokens and scorable(store) and (plan.sparsity or store.token_type not in PROTECTED_TYPES)
        ]
        keys, index = scored_rows(scored, hkv)
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
            thresholds = rowmax + math.log(self.session.method.sparsity_threshold())
        counts = torch.zeros(q.shape[1], dtype=torch.int64, device=q.device)
        valid = 0
        if keys is not None and index is not None:
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

    def apply(self, plan: BranchPlan) -> list[tuple[int, list[KVStore], KVStore]]:
        """Carry out a method's plan: each layer's changes in order, then its records (budgets, flags, pooled types),
        the schedule's rho and the method's state for the next view. Returns each replacement made: ``(layer, the
        stores replaced, the store that replaced them)``."""
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
        self.rho.update(plan.rho)
        self.method_state = plan.state
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
                f"{self.session.method.name}: layer {index} of branch {self.branch} holds none of "
                f"the segments {list(keep.segments)} its plan names"
            )
        if keep.bits == FULL_BITS:  # full-precision rows: an eviction (SnapKV's window and pooling included)
            if keep.scores is None:
                raise RuntimeError(f"{self.session.method.name}: evicting rows of layer {index} needs their scores")
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
                st,
                stores,
                keep.rows,
                keep.bits,
                keep.group,
                keep.residual,
                keep.scores,
                recent=keep.recent,
                fit_values=keep.fit_values,
            )
        if keep.expected_bytes is not None and store.nbytes() != keep.expected_bytes:
            reason = (
                f"the store holds {store.nbytes()} B where the plan counted {keep.expected_bytes} B "
                "(a byte formula and a store disagree: please report it)"
            )
            logger.warning("%s layer %d of %s: %s", self.session.method.name, index, self.branch, reason)
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

    def snapshot_images(self) -> dict[str, dict]:
        """Per input image (its index as a string), summed over the layers: per candidate type the bytes held, the
        rows held per KV head and the rows it had, and the image's bytes held and full bytes (the report's
        ``images``). A store of one image's rows counts for that image; a store pooling several (a pool of types or
        a baseline's one store) is split by the images its rows belong to. ``{}`` without image rows."""
        rows = {key: n for key, n in self.segment_rows(0).items() if key.image is not None}
        if not rows:
            return {}
        row_bytes = sum(self.row_bytes(layer) for layer in range(self.num_layers))
        out: dict[str, dict] = {}
        for key, n in sorted(rows.items(), key=lambda kv: (kv[0].image, kv[0].type)):
            entry = out.setdefault(str(key.image), {"bytes": 0, "full_bytes": 0, "types": {}})
            entry["types"][type_name(key.type)] = {"bytes": 0, "rows_per_head": 0.0, "full_rows": n}
            entry["full_bytes"] += n * row_bytes
        for st in self.layers:
            for store in st.stores:
                if not store.num_tokens or store.token_type not in MANAGED_TYPES:
                    continue
                for (image, token_type), share in _image_shares(self, store).items():
                    entry = out.get(str(image), {}).get("types", {}).get(type_name(token_type))
                    if entry is None:
                        continue
                    nbytes = store.nbytes() * share
                    entry["bytes"] += nbytes
                    entry["rows_per_head"] += store.num_tokens * share / self.num_layers
                    out[str(image)]["bytes"] += nbytes
        for totals in out.values():
            totals["bytes"] = int(round(totals["bytes"]))
            for per_type in totals["types"].values():
                per_type["bytes"] = int(round(per_type["bytes"]))
                per_type["rows_per_head"] = round(per_type["rows_per_head"], 2)
        return out

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
                if isinstance(store, QuantizedStore):
                    entry["bits"], entry["group_size"], entry["residual"] = store.bits, store.group_size, store.residual
            for name, budget in ls.budgets.items():
                entry = types.setdefault(name, {"policy": "full", "bytes": 0, "rows_per_head": 0.0, "stores": {}})
                entry["budget_bytes"] = entry.get("budget_bytes", 0) + int(budget)
            for t, m in ls.masses.items():
                massed = types.get(type_name(t))
                if massed is not None:
                    massed["mass"] = massed.get("mass", 0.0) + m / self.num_layers
        for t, n in self.type_rows(0).items():
            if type_name(t) in types:
                types[type_name(t)]["full_rows"] = n
        for entry in types.values():
            entry["rows_per_head"] = round(entry["rows_per_head"], 2)
            if "mass" in entry:
                entry["mass"] = round(entry["mass"], 6)
        return types


def _image_shares(cache: CompressingKVCache, store) -> dict[tuple[int, TokenType], float]:
    """The share of ``store``'s rows that belongs to each (input image, type) (rows of no image left out)."""
    if store.image is not None and store.token_type != TokenType.UNKNOWN:
        return {(store.image, store.token_type): 1.0}
    index = store.token_index.long().reshape(-1).cpu()
    known = index < cache.images.shape[0]  # rows appended to a layer directly name no image
    images = torch.full_like(index, -1)
    images[known] = cache.images[index[known]].long()
    types = cache.types[index].long()
    mine = images >= 0
    if not bool(mine.any()):
        return {}
    width = len(TokenType)
    counts = torch.bincount(images[mine] * width + types[mine]).tolist()
    total = index.numel()
    return {(i // width, TokenType(i % width)): c / total for i, c in enumerate(counts) if c}


__all__ = ["CompressingKVCache", "MANAGED_TYPES"]
