"""What a compression method is: a frozen object of settings that measures its own statistic from what an attention
call exposes and decides, from a read-only view of the branch, when to measure and what to keep. It never touches
a cache.

A method is a frozen dataclass whose fields are its settings with their defaults (``SnapKV(window=64, kernel=5)``,
``UniCache(rho=0.3)``); a subclass with a ``name`` registers itself (:data:`METHODS`, :func:`method_from_name`).
Its hooks, all pure (docs/compression.md §12):

- :meth:`Method.plan_call` when a forward pass begins (prefill blocks, denoising steps, decoded tokens): what the
  call measures and whether the branch is compressed before it or after it (a
  :class:`~unicache_core.compression.plan.CallPlan`); a prefill call may measure and compress right after its
  block is written, before the next item is prefilled;
- :meth:`Method.measure` in each layer of a call whose plan says ``measure``: its statistic (a
  :class:`~unicache_core.compression.protocol.Measurement`) from the
  :class:`~unicache_core.compression.scoring.CallProbe` of the layer (the call's queries and new keys, the
  attention it computed, the resident stores); the cache keeps it for the layer;
- :meth:`Method.plan_written` while the context fills (prefill calls whose plan says ``store_written``): right after
  a layer's new rows are appended, what they are stored as (a
  :class:`~unicache_core.compression.plan.LayerPlan` the cache applies before the next layer runs);
- :meth:`Method.plan` at a compression point: given a read-only
  :class:`~unicache_core.compression.view.BranchView` (per layer and type: rows, masses, measurements, geometry,
  bytes; the request's target), the :class:`~unicache_core.compression.plan.BranchPlan` (rows kept, bits and
  groups per segment) that the cache then applies. State a method keeps across compressions of a branch
  (UniCache's schedules) goes out in the plan and comes back in the next view.

Timeline shared by every method (docs/compression.md §8.1, §8.6, §8.10):

- generation / editing: prefill at full KV (a method that stores rows as they are written, UniCache, quantizes an
  image's new rows in each layer at once, before the next item is prefilled: docs/compression.md §13); the first
  denoising step of each branch runs at that KV and is observed (its real latent queries score the keys before
  anything is evicted); the cache is compressed right after it. Baselines compress once (selection frozen
  afterwards); UniCache re-allocates at the end of every step chunk, where it measures the type masses only: per-key
  scores are gathered once, at the branch's first observation.
- understanding: the prompt prefill is observed (the question's queries: the post-modality window); the cache is
  compressed before the first decoded token, so every decoded token reads compressed KV.
- protected types (boundary, current latent, decoded text) are never touched; the ``think`` branch is
  never compressed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ..kv.cache import AttentionCall, RequestInfo
from ..kv.token_types import THINK, Task, TokenType
from ..validation import check_bool, check_int
from .defaults import DEFAULT_REDUCTION, SCORE_QUERIES
from .family import JointChoice, Segment
from .grants import UnitNeed
from .plan import BranchPlan, CallPlan, LayerPlan
from .protocol import Measurement
from .targets import parse_kv_target

if TYPE_CHECKING:  # pragma: no cover
    from .scoring import CallProbe
    from .view import BranchView

#: Every selectable method by name, in the order they were registered (``full`` first).
METHODS: dict[str, type[Method]] = {}


@dataclass(frozen=True)
class KVTimeline:
    """When a method measures and first compresses a request's branches on the shared timeline (module docstring):
    what the memory plan needs of it to price each phase (``unicache_core/bagel/memory/plan_kv.py``).

    Attributes:
        compresses: False for a method that never shrinks a cache (``full``).
        scored: the phases whose forward holds a key scorer's transient: ``"prefill"`` (every prefilled block),
            ``"prompt"`` (the text block prefilled after a branch's input images), ``"first_step"`` (the first
            denoising step of a branch compressed after it).
        compressed_before: the generation branches compressed before their first denoising step reads them:
            ``"none"``, ``"prompted"`` (a branch whose text follows its images, measured as it was prefilled) or
            ``"every"`` (at the end of the prefill). Understanding is always compressed before its first decoded
            token.
        shares_forked_rows: rows a fork shares with its parent stay one store after their compression (planned by
            the parent); else the branch that compresses them keeps its own copy and the other its old rows.
        kept_exact: :meth:`Method.kept_bytes` gives the bytes the first compression keeps; False: at most them (a
            method that moves bytes between types and branches by what the run measures).
    """

    compresses: bool = True
    scored: tuple[str, ...] = ()
    compressed_before: str = "none"
    shares_forked_rows: bool = False
    kept_exact: bool = True


@dataclass(frozen=True, kw_only=True)
class Method:
    """Base of every method: the settings every method shares, the registry and the shared timeline.

    Attributes:
        kv_target: memory target of the compressible (non-protected) KV: a retained ratio in (0, 1] of its full
            bytes, or a byte count over all branches (``"20%"``, ``"150MB"`` are parsed). ``None``: the method's
            default (the paper's reduction for the task; UniCache: its rho schedule).
        score_queries: most queries a call scores keys with (strided latent queries, or the last text queries).
        fused: on calls that gather no statistics, attend through one head-major workspace per layer in a single
            exact attention call instead of one call per store and an LSE merge (faster; docs/engine.md,
            "Measurements behind the engine's choices").
        sync_timing: synchronise CUDA around timed attention calls (exact per-call clocks, slower).

    Class attributes (not settings; what the cache, the memory plan and the report read of a method instead of its
    name): ``name`` (the registry name; a subclass without one is not registered), ``compresses`` (False: the method
    never shrinks a cache, ``full``), ``budget`` (what the method's bytes are aimed at: ``"kv_target"``, or
    ``"rho"`` for a method whose retention schedule sets them), ``compresses_written`` (prefill calls ask
    :meth:`plan_written` for each layer's new rows), ``needs_scores`` (its observed calls :meth:`measure` per-key
    scores), ``measures_prompt`` (generation: the text prefilled after the input images is measured as it is
    prefilled, and the branch is compressed before its first denoising step reads it: :meth:`plan_prefill`).

    What the memory plan knows of a method comes from the method itself, never from these flags
    (``unicache_core/bagel/memory/plan_kv.py``): :meth:`kv_timeline` (when it measures and compresses),
    :meth:`written_store` (how an image's rows are stored as they are written: the function the run's own
    written-row storage applies) and :meth:`kept_bytes` (what its first compression keeps of a branch).
    """

    name: ClassVar[str] = ""
    compresses: ClassVar[bool] = True
    budget: ClassVar[str] = "kv_target"
    compresses_written: ClassVar[bool] = False
    needs_scores: ClassVar[bool] = True
    measures_prompt: ClassVar[bool] = False

    kv_target: float | int | None = None
    score_queries: int = SCORE_QUERIES
    fused: bool = True
    sync_timing: bool = False

    def __init_subclass__(cls, register: bool = True, **kwargs: Any) -> None:
        """A subclass that names itself is selectable by that name (``register=False``: an internal method)."""
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if name and register:
            METHODS[name] = cls

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_target", parse_kv_target(self.kv_target))
        check_int("score_queries", self.score_queries, 1)
        check_bool("fused", self.fused)
        check_bool("sync_timing", self.sync_timing)

    # ------------------------------------------------------------------ settings

    def settings(self) -> dict[str, Any]:
        """The settings as plain JSON (the report's ``config``): ``method`` and every field."""
        out: dict[str, Any] = {"method": self.name}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = str(value) if isinstance(value, Path) else value
        return out

    def bind(self, request: RequestInfo, checkpoint_dir: str) -> tuple[Method, dict]:
        """The method as it runs one request (files it names resolved) and what the report says of its policy."""
        return self, {}

    def target(self, task: str) -> float | int:
        """The memory target of a request: the explicit ``kv_target``, else ``1 - DEFAULT_REDUCTION[task]``."""
        if self.kv_target is not None:
            return self.kv_target
        return round(1.0 - DEFAULT_REDUCTION[task], 6)

    # ------------------------------------------------------------------ when

    def is_compression_step(self, view: BranchView, step: int) -> bool:
        """Denoising: compress after this step of the branch? Default: once, after its first step."""
        return view.compressions == 0

    def plan_call(self, view: BranchView, call: AttentionCall) -> CallPlan:
        """What ``call`` measures on the branch and whether the branch is compressed before or after it."""
        if view.branch == THINK:
            return CallPlan()
        if view.task == "understanding":
            if call.phase == "prefill":
                written = self.compresses_written and call.update
                return CallPlan(observe=True, measure=self.needs_scores, store_written=written)
            if call.phase == "decode":
                if view.compressions == 0:  # the first decoded token already reads compressed KV
                    return CallPlan(observe=True, compress_before=True)
                if view.recompresses_unread(int(call.step or 0)):
                    return CallPlan()
                return self.plan_decode(view, call)
            return CallPlan()
        if call.phase == "prefill":
            return self.plan_prefill(view, call)
        if call.phase != "denoise":
            return CallPlan()
        if view.compressions == 0 and view.measured_phase == "prefill":
            return CallPlan(compress_before=True)  # measured as the prompt was prefilled: compressed before any read
        step = int(call.step or 0)
        if self.is_compression_step(view, step) and not view.recompresses_unread(step):
            # keys are scored at the branch's first observation only (module docstring)
            return CallPlan(observe=True, measure=self.needs_scores and view.compressions == 0, compress_after=True)
        return CallPlan()  # the fast path: nothing is measured on the steps that do not compress

    def plan_prefill(self, view: BranchView, call: AttentionCall) -> CallPlan:
        """A generation's prefill call (one context item's block, written before the next item is prefilled).

        Default: rows stored as written where the method does (``compresses_written``); with ``measures_prompt``, a
        text block that follows the input images is measured (:meth:`measure`, the instruction's queries over the
        images' rows), and the branch is compressed before its first denoising step reads it. A method that compresses
        right at the end of a block returns ``compress_after=True`` here (the session plans with the view of this
        call: ``view.call`` is the block, ``view.measured_phase`` is ``"prefill"``)."""
        measure = self.measures_prompt and self.prompt_after_images(view, call)
        return CallPlan(measure=measure, store_written=self.compresses_written and call.update)

    @staticmethod
    def prompt_after_images(view: BranchView, call: AttentionCall) -> bool:
        """Whether ``call`` appends a text block to a branch that already holds input images' rows (an instruction or
        a question after the images: the post-modality window)."""
        if not call.update or call.image is not None:
            return False
        return any(key.image is not None for key in view.layer(0).segment_rows)

    def plan_decode(self, view: BranchView, call: AttentionCall) -> CallPlan:
        """Understanding decode calls after the first compression (default: the fast path, nothing measured: a
        decoded token is one query row, so per-call statistics would be a visible share of its cost)."""
        return CallPlan()

    # ------------------------------------------------------------------ what

    def measure(self, probe: CallProbe) -> Measurement:
        """The method's statistic of one layer of a call whose plan says ``measure`` (default: the attention each
        row receives from at most ``score_queries`` queries: the last ones of a text call, an evenly strided subset
        of a denoising call's latents)."""
        found = probe.key_scores(self.score_queries, last=probe.windowed)
        return Measurement(found.scores, found.queries)

    # ------------------------------------------------------------------ how

    def plan_written(self, view: BranchView, layer: int) -> LayerPlan:
        """What the rows just appended to ``layer`` are stored as (called after each layer's append of a prefill call
        whose plan says ``store_written``; default: kept as they are). Only changes that need no scores belong here."""
        return LayerPlan()

    def plan(self, view: BranchView) -> BranchPlan:
        """What the branch keeps, layer by layer (called at the compression points)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement plan()")

    # ------------------------------------------------------------------ what the memory plan reads

    def kv_timeline(self, task: Task) -> KVTimeline:
        """When this method measures and first compresses a request of ``task`` (what :meth:`plan_call` and
        :meth:`plan_prefill` do, told to the memory plan): every observed call of a scoring method scores keys, an
        understanding's prefill calls included; a ``measures_prompt`` method measures a generation's prompt and
        compresses that branch before its first step."""
        if not self.compresses:
            return KVTimeline(compresses=False)
        scores: tuple[str, ...] = ("prefill",) if self.needs_scores and task == "understanding" else ()
        if task != "understanding":
            scores = (("prompt",) if self.measures_prompt else ()) + (("first_step",) if self.needs_scores else ())
        return KVTimeline(scored=scores, compressed_before="prompted" if self.measures_prompt else "none")

    def written_store(self, task: Task, token_type: TokenType, segment: Segment) -> JointChoice | None:
        """How ``segment``, one input image's rows of ``token_type`` just written to a layer, is stored at once
        (the rows and bits it keeps); ``None``: kept whole until the branch's first compression (default). The run's
        written-row storage applies this to every such segment (:meth:`plan_written`); the memory plan prices an
        image's rows with it."""
        return None

    def retained_ratio(self, task: Task, managed_full: int) -> float:
        """The share of a branch's compressible bytes the first compression aims at, for a request whose
        compressible KV holds ``managed_full`` bytes uncompressed (a byte target is spread over them)."""
        target = self.target(task)
        if isinstance(target, float):
            return target
        return min(1.0, target / managed_full) if managed_full > 0 else 1.0

    def kept_bytes(self, task: Task, segments: Sequence[tuple[TokenType, Segment]], layers: int, ratio: float) -> int:
        """Bytes the branch's first compression keeps of ``layers`` layers that each hold ``segments`` (candidate
        rows by type, as held before it) at the retained ``ratio`` (:meth:`retained_ratio`); default: every row as
        held (a method that plans its own compression overrides it with the bytes its plan keeps)."""
        return layers * sum(segment.held_bytes for _, segment in segments)

    def grant_needs(self, view: BranchView) -> dict[int, UnitNeed] | None:
        """Per layer, its budget and its ladder of levels (:class:`~.grants.UnitNeed`) at the least retention the
        branch can reach, when the method wants the session to move bytes between branches and layers: floors first,
        then by sensitivity (UniCache, docs/compression.md §11.8); ``None``: no such need."""
        return None


def method_from_name(name: str | Method, **settings: Any) -> Method:
    """The method registered as ``name`` with ``settings`` (a :class:`Method` is returned as it is; the built-in methods
    are registered when :mod:`unicache_core.compression` is imported, which importing this module does first).

    A setting the method does not take is one clear error naming the settings it does take.
    """
    if isinstance(name, Method):
        if settings:
            raise ValueError("pass either a method object or a name with settings, not both")
        return name
    if not isinstance(name, str) or name not in METHODS:
        raise ValueError(f"unknown KV method {name!r}; choose one of {', '.join(METHODS)}")
    cls = METHODS[name]
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(settings) - set(known))
    if unknown:
        owners = [other for other, c in METHODS.items() if unknown[0] in {f.name for f in dataclasses.fields(c)}]
        if len(owners) == 1:
            raise ValueError(
                f"`{unknown[0]}` applies to the {owners[0]} method only, not to {name!r} (which takes "
                f"{', '.join(known)}); drop `{unknown[0]}` or choose the {owners[0]} method"
            )
        raise ValueError(f"`{unknown[0]}` is not a setting of the {name} method; it takes {', '.join(known)}")
    return cls(**settings)


__all__ = ["KVTimeline", "METHODS", "Method", "method_from_name"]
