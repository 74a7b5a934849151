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

    def __init__(self, session: FullSession, branch: str):
        super().__init__(session.request.num_layers, task=session.request.task, branch=branch)
        self.session = session
        self.state = [LayerState() for _ in range(self.num_layers)]
        self.rho: dict[int, float] = {}
        self.compressions = 0
        self.images = torch.zeros(0, dtype=torch.int16)  # [T] input image of each row, -1 for none
        self._rows = 0

    def begin_call(self, call: AttentionCall) -> None:
        self._rows = 0
        if call.update:
            image = -1 if call.image is None else int(call.image)
            self.images = torch.cat([self.images, torch.full(call.token_types.shape, image, dtype=torch.int16)])

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tensor:
        start = self.session.clock(q)
        self._rows += self.layers[layer].num_rows + k.shape[0]
        out = super().attend(layer, q, k, v, call)
        self.session.timers["attention"] += self.session.clock(q) - start
        return out

    def end_call(self, call: AttentionCall) -> None:
        self.session.note_rows(self.branch or "", call, self._rows)

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

    def _row_bytes(self, layer: int) -> int:
        chunks = self.layers[layer].chunks
        if not chunks:
            return 0
        keys = chunks[0][0]
        return 2 * keys.shape[1] * keys.shape[2] * keys.element_size()

    def managed_full_bytes(self, layer: int | None = None) -> int:
        layers = range(self.num_layers) if layer is None else [layer]
        return sum(
            self._row_bytes(i) * sum(n for t, n in self.type_rows(i).items() if t in CANDIDATE_TYPES) for i in layers
        )

    def split_bytes(self) -> tuple[int, int]:
        managed = self.managed_full_bytes()
        total = sum(self._row_bytes(i) * sum(self.type_rows(i).values()) for i in range(self.num_layers))
        return managed, total - managed

    def snapshot_images(self) -> dict[str, dict]:
        """Per input image: its candidate rows per type, held in full (the report's ``images``)."""
        types = self.types.long()
        images = self.images.long()[: types.shape[0]]
        row_bytes = sum(self._row_bytes(i) for i in range(self.num_layers))
        out: dict[str, dict] = {}
        for t in CANDIDATE_TYPES:
            for image in torch.unique(images[(types == int(t)) & (images >= 0)]).tolist():
                n = int(((types == int(t)) & (images == image)).sum())
                entry = out.setdefault(str(image), {"bytes": 0, "full_bytes": 0, "types": {}})
                entry["types"][t.name.lower()] = {"bytes": n * row_bytes, "rows_per_head": float(n), "full_rows": n}
                entry["bytes"] += n * row_bytes
                entry["full_bytes"] += n * row_bytes
        return dict(sorted(out.items(), key=lambda kv: int(kv[0])))

    def snapshot_types(self) -> dict[str, dict]:
        """Per-type bytes and rows (the report's ``types``; every row is held in full)."""
        out: dict[str, dict] = {}
        rows = self.type_rows(0)
        for t, n in rows.items():
            policy = "full" if t in CANDIDATE_TYPES else "protect"
            out[t.name.lower()] = {
                "policy": policy,
                "bytes": n * sum(self._row_bytes(i) for i in range(self.num_layers)),
                "rows_per_head": float(n),
                "full_rows": n,
                "stores": {"full": self.num_layers},
            }
        return out


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
