"""The caches and session of ``full`` (:class:`~unicache_core.compression.methods.full.Full`): the uncompressed
cache, measured and reported like every other method's.

The caches are :class:`~unicache_core.kv.cache.FullKVCache` (the same attention code, so results are
bit-identical to running without a factory); they only add clocks, attended-row counts and the byte
split (managed vs protected) the report needs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kv.cache import AttentionCall, CacheSession, FullKVCache, KVCache
from ..kv.token_types import CANDIDATE_TYPES, TokenType
from .protocol import LayerState
from .session import CompressionSession


class ReportingFullKVCache(FullKVCache):
    """A :class:`FullKVCache` that reports its attention time, attended rows and bytes to its session."""

    holds_every_row = True

    def __init__(self, session: FullSession, branch: str):
        super().__init__(session.request.num_layers, task=session.request.task, branch=branch)
        self.coordinator = session
        self.request_state = session.state
        self.state = [LayerState() for _ in range(self.num_layers)]
        self.images = torch.zeros(0, dtype=torch.int16)  # [T] input image of each row, -1 for none
        self._rows = 0

    def begin_call(self, call: AttentionCall) -> None:
        self._rows = 0
        if call.update:
            image = -1 if call.image is None else int(call.image)
            self.images = torch.cat([self.images, torch.full(call.token_types.shape, image, dtype=torch.int16)])

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tensor:
        start = self.coordinator.clock(q)
        self._rows += self.layers[layer].num_rows + k.shape[0]
        out = super().attend(layer, q, k, v, call)
        self.request_state.add_time("attention", self.coordinator.clock(q) - start)
        return out

    def end_call(self, call: AttentionCall) -> None:
        self.coordinator.note_rows(self.branch or "", call, self._rows)

    @property
    def types(self) -> Tensor:
        types = self.layers[0].token_types
        return torch.zeros(0, dtype=torch.int8) if types is None else types.cpu()

    def type_rows(self, layer: int) -> dict[TokenType, int]:
        types = self.layers[layer].token_types
        if types is None:
            return {}
        counts = torch.bincount(types.long().cpu(), minlength=len(TokenType)).tolist()
        return {TokenType(i): c for i, c in enumerate(counts) if c}

    def row_bytes(self, layer: int) -> int:
        """Bytes of one row (K+V over the KV heads) in ``layer``; 0 while empty."""
        chunks = self.layers[layer].chunks
        if not chunks:
            return 0
        keys = chunks[0][0]
        return 2 * keys.shape[1] * keys.shape[2] * keys.element_size()

    def managed_full_bytes(self, layer: int | None = None) -> int:
        layers = range(self.num_layers) if layer is None else [layer]
        return sum(
            self.row_bytes(i) * sum(n for t, n in self.type_rows(i).items() if t in CANDIDATE_TYPES) for i in layers
        )

    def split_bytes(self) -> tuple[int, int]:
        managed = self.managed_full_bytes()
        total = sum(self.row_bytes(i) * sum(self.type_rows(i).values()) for i in range(self.num_layers))
        return managed, total - managed

    def stores_of(self, layer: int) -> list:
        """No stores: the report reads an uncompressed cache by its rows (``holds_every_row``)."""
        return []


class FullSession(CompressionSession):
    """The session of ``make_cache_factory("full")``: full caches plus the same report as every method."""

    def new_cache(self, branch: str) -> KVCache:
        CacheSession.new_cache(self, branch)  # validates the branch name (its full cache is not kept)
        cache = ReportingFullKVCache(self, branch)
        self.caches[branch] = cache
        return cache

    def live_caches(self):
        return [c for c in self.caches.values() if isinstance(c, ReportingFullKVCache)]


__all__ = ["FullSession", "ReportingFullKVCache"]
