"""What a compression method is: when a cache measures, when it compresses, and how.

A method is stateless across requests; per-request state lives in the
:class:`~unicache_core.compression.compressing_cache.CompressionSession` and per-branch state in each
:class:`~unicache_core.compression.compressing_cache.CompressingKVCache`. Adding a method means subclassing
:class:`CompressionMethod` and registering it (:mod:`.registry`): pipelines and model files never change.

Timeline shared by every method (docs/compression.md §8.1, §8.6, §8.10):

- generation / editing: prefill at full KV; the first denoising step of each branch runs at full KV
  and is observed (its real latent queries score the keys before anything is evicted); the cache is
  compressed right after it. Baselines compress once (selection frozen afterwards); UniCache
  re-allocates at the end of every step chunk, where it measures the type masses only: per-key scores are
  gathered once, at the branch's first observation (the paper's engine freezes its H2O selection after the
  first scoring, and understanding's decoded tokens already measured masses only).
- understanding: the prompt prefill is observed (the question's queries: the post-modality window);
  the cache is compressed before the first decoded token, so every decoded token reads compressed KV.
- protected types (boundary, current latent, decoded text) are never touched; the think-mode ``plan``
  context is never compressed.
"""

from __future__ import annotations

from abc import ABC

from torch import Tensor

from ..kv.cache import AttentionCall
from ..kv.token_types import CANDIDATE_TYPES
from .defaults import VLCACHE_THRESHOLD
from .ops import evict, evicted_row_bytes, floor_bytes, rows_for_bytes
from .protocol import CallPlan, CompressibleBranch, MethodSession


class CompressionMethod(ABC):  # noqa: B024 (replaced by the method redesign)
    """Base of every method. Subclasses implement :meth:`compress_layers`.

    Class attributes:
        name: registry name.
        needs_scores: per-key scores are gathered at the observed calls.
        window_queries: score with the last ``config.window`` queries (SnapKV) instead of a strided
            subsample of ``config.score_queries``.
        sparsity_threshold: VL-Cache's relative threshold (used when a plan asks for sparsity).
    """

    name: str = "base"
    needs_scores: bool = True
    needs_sparsity: bool = False
    window_queries: bool = False
    sparsity_threshold: float = VLCACHE_THRESHOLD

    def start(self, session: MethodSession) -> None:
        """Called once when a request's session starts."""

    def target(self, session: MethodSession) -> float | int:
        """The memory target (ratio or bytes) of the request."""
        return session.config.target_ratio(session.request.task)

    # ------------------------------------------------------------------ when

    def _queries(self, session: MethodSession) -> int:
        return session.config.window if self.window_queries else session.config.score_queries

    def is_compression_step(self, cache: CompressibleBranch, step: int) -> bool:
        """Denoising: compress after this step of the branch? Default: once, after its first step."""
        return cache.compressions == 0

    def plan_call(self, cache: CompressibleBranch, call: AttentionCall) -> CallPlan:
        """What ``call`` measures on ``cache`` and whether the cache is compressed before or after it."""
        session = cache.session
        if cache.branch == "plan":
            return CallPlan()
        task = session.request.task
        if task == "understanding":
            if call.phase == "prefill":
                return CallPlan(
                    observe=True,
                    score=self.needs_scores,
                    last_queries=True,
                    num_queries=self._queries(session),
                    sparsity=self.needs_sparsity,
                )
            if call.phase == "decode":
                if cache.compressions == 0:  # the first decoded token already reads compressed KV
                    return CallPlan(observe=True, compress_before=True)
                if _recompresses_unread_cache(cache, int(call.step or 0)):
                    return CallPlan()
                return self.plan_decode(cache, call)
            return CallPlan()
        if call.phase != "denoise":
            return CallPlan()
        step = int(call.step or 0)
        if self.is_compression_step(cache, step) and not _recompresses_unread_cache(cache, step):
            # keys are scored at the branch's first observation only (module docstring)
            return CallPlan(
                observe=True,
                score=self.needs_scores and cache.compressions == 0,
                last_queries=self.window_queries,
                num_queries=self._queries(session),
                sparsity=self.needs_sparsity,
                compress_after=True,
            )
        return CallPlan()  # the fast path: nothing is measured on the steps that do not compress

    def plan_decode(self, cache: CompressibleBranch, call: AttentionCall) -> CallPlan:
        """Understanding decode calls after the first compression (default: the fast path, nothing measured:
        a decoded token is one query row, so per-call statistics would be a visible share of its cost)."""
        return CallPlan()

    # ------------------------------------------------------------------ how

    def compress(self, session: MethodSession, cache: CompressibleBranch, call: AttentionCall | None) -> None:
        """Compress every layer of ``cache`` (called at the compression points)."""
        self.compress_layers(session, cache)

    def compress_layers(self, session: MethodSession, cache: CompressibleBranch) -> None:
        """Shrink the candidate segments of every layer of ``cache`` (override this or :meth:`compress`)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither compress() nor compress_layers()")


def candidate_indices(cache: CompressibleBranch, layer: int) -> list[int]:
    """Store indices of every non-empty candidate (or pooled) segment of ``layer``."""
    st = cache.layer(layer)
    return [
        i
        for i, s in enumerate(st.stores)
        if s.num_tokens and (s.token_type in CANDIDATE_TYPES or int(s.token_type) == 0)
    ]


class GlobalEvictionMethod(CompressionMethod):
    """One eviction policy over ALL compressible KV of a layer (protected segments kept), matched to a byte target.

    Subclasses give the scores (:meth:`layer_scores`) and, optionally, per-layer row budgets.
    """

    recent_fraction: float | None = None  # share of the budget kept as the most recent rows
    smooth_kernel: int = 1

    def layer_scores(self, cache: CompressibleBranch, layer: int) -> Tensor | None:
        """``[T_appended, Hkv]`` fp32 score of every appended row of ``layer`` (higher = keep; default: the
        attention accumulated over every scored call, H2O)."""
        return cache.state[layer].scores

    def forced_rows(self, cache: CompressibleBranch, layer: int) -> Tensor | None:
        """Optional ``[T_appended]`` bool of rows always kept (inside the budget)."""
        return None

    def layer_rows(self, cache: CompressibleBranch, budgets: list[int], rows: list[int]) -> list[int]:
        """Rows per KV head for each layer, given each layer's byte-budget rows (default: as is)."""
        return budgets

    def compress_layers(self, session: MethodSession, cache: CompressibleBranch) -> None:
        """Evict every layer's pooled candidate rows down to the rows its share of the byte target buys."""
        ratio = session.resolve_target()
        budget_rows, pool_rows = [], []
        # Rows round down on the branch's running byte total, not per layer: the branch holds at most its
        # budget, and misses it by less than one row overall instead of one row per layer.
        spent = carried = 0
        for layer in range(cache.num_layers):
            st = cache.layer(layer)
            full = cache.managed_full_bytes(layer)
            budget = floor_bytes(ratio, full)
            meta = st._kv_meta
            if meta is None or full == 0:
                budget_rows.append(0)
                pool_rows.append(0)
                continue
            h, d, dtype, _ = meta
            elem = cache.row_bytes(layer) // (2 * h * d)
            carried += budget
            rows = rows_for_bytes(carried - spent, h, d, elem)
            spent += rows * evicted_row_bytes(h, d, elem)
            budget_rows.append(rows)
            pool_rows.append(sum(st.stores[i].num_tokens for i in candidate_indices(cache, layer)))
            cache.state[layer].budgets = {"candidate": budget}
        rows = self.layer_rows(cache, budget_rows, pool_rows)
        for layer, keep in enumerate(rows):
            idx = candidate_indices(cache, layer)
            if not idx or keep >= pool_rows[layer]:
                continue  # the target keeps everything: the segment stays as it is
            st = cache.layer(layer)
            h, d, _, _ = st._kv_meta
            if keep * evicted_row_bytes(h, d, cache.row_bytes(layer) // (2 * h * d)) >= sum(
                st.stores[i].nbytes() for i in idx
            ):
                continue  # the kept rows and their indices would hold as much as the rows do now
            scores = self.layer_scores(cache, layer)
            if scores is None:
                raise RuntimeError(f"{self.name}: layer {layer} of branch {cache.branch} was never scored")
            recent = 0
            if self.recent_fraction:
                recent = min(keep, int(keep * self.recent_fraction + 0.5))
            evict(
                cache.layer(layer),
                idx,
                min(keep, pool_rows[layer]),
                scores,
                recent=recent,
                forced=self.forced_rows(cache, layer),
                smooth_kernel=self.smooth_kernel,
            )


def _recompresses_unread_cache(cache: CompressibleBranch, step: int) -> bool:
    """Whether a re-compression at ``step`` would come after the last call that reads the cache: the request's last
    denoising step or last possible decoded token (``max_new_tokens``), or the branch's last computed step when
    the later ones are forecast (TaylorSeer: :meth:`~unicache_core.kv.cache.StepInfo.next_call_step`).

    The first compression still runs (the report's figures are those of a compressed cache); later ones,
    with their statistics, are skipped there: on the e2e bench's 6-step run the last step ends a step chunk,
    and its compression cost 10% of a tiny model's step time for nothing.
    """
    info = cache.session.step
    if cache.compressions == 0 or info is None or info.phase not in ("denoise", "decode"):
        return False
    if info.phase == "denoise" and info.step == step:
        return info.next_call_step(cache.branch) is None
    return step >= info.total - 1


__all__ = ["CompressionMethod", "GlobalEvictionMethod", "candidate_indices"]
