"""The KV terms of a memory plan (:mod:`.plan`), phase by phase, as the caches fill and compress.

What a KV method holds at each phase comes from the method itself (:mod:`unicache_core.compression.method`), never
from its name or its flags: :meth:`~unicache_core.compression.method.Method.kv_timeline` (when it measures and first
compresses a branch), :meth:`~unicache_core.compression.method.Method.written_store` (how an image's rows are stored
as each layer writes them: the very function the run's written-row storage applies) and
:meth:`~unicache_core.compression.method.Method.kept_bytes` (what its first compression keeps of a branch). The
method is the configured one (its target, policy table, rho and every setting of its own), bound to the checkpoint as
a run binds it (:func:`bound_method`).

The request's context is prefilled block by block, call by call as the run makes them (each input image's VAE block
and ViT block into ``gen``, ``cfg_text`` forked from it after the images, the prompt into ``gen`` and then into
``cfg_img``), then denoised (generation) or answered (understanding). :func:`kv_phases` gives, for each phase, what
the caches hold and what a forward of that phase holds beside them (docs/memory.md, "The peak, phase by phase"):

- ``prefill:item<j>``: after call ``j``, the blocks before it as stored and block ``j`` itself; beside them one
  layer's rows of the branch gathered at the compute dtype for the attention call (:data:`GATHER`) and, for a
  block stored compressed as written, its rows of one layer uncompressed;
- ``denoise:first`` (generation): what the first denoising step's forward reads (the branches compressed before it,
  the others as prefilled), the gathered layer of the largest branch and a key scorer's transient;
  ``denoise:compress``: the most the caches hold while the branches are first compressed, one after the other
  (``gen``, ``cfg_text``, ``cfg_img``: a branch's new stores beside the old ones another branch still holds);
  ``denoise``: the later steps, every branch compressed;
- ``decode`` (understanding): the context compressed before the first answer token, and the answer's rows.

Rows a fork shares (``cfg_text``'s images, ``gen``'s) are one store for every method while the context fills (copy
on write: a compressing cache's boundary rows are one store per layer, so ``gen``'s first boundary rows after the
fork copy those it held). After their compression they stay one store when the method plans them with the parent
(``shares_forked_rows``); else each branch keeps its own.

``kv_full`` is what the official code holds (every branch apart, uncompressed); ``kv_compressed`` what the method
keeps after every branch's first compression.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, cast

import torch

from ...kv.token_types import Task, TokenType
from ..config import BagelConfig
from ..taylorseer import GENERATION_BRANCHES
from .accounting import BOUNDARY_TOKENS, RequestTokens, kv_bytes_per_token

#: A forward's attention call holds one layer's rows of its branch at the compute dtype (``full``: the layer's
#: chunks concatenated; a compressing cache: its stores gathered and dequantized).
GATHER = True


@dataclass(frozen=True)
class KVPhase:
    """What one phase holds: ``kv`` bytes of caches, ``transient`` bytes beside them (a gathered layer and a
    layer's new rows), ``scoring`` bytes (a key scorer), and the rows and branches of its forward (0 rows: no
    forward runs in it, a compression between calls)."""

    name: str
    kv: int
    transient: int
    scoring: int
    tokens: int
    branches: int
    #: ``kv`` is at most what the phase holds, not its bytes (what a method's first compression keeps, where the run
    #: decides it: :attr:`~unicache_core.compression.method.KVTimeline.kept_exact`)
    bound: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@functools.lru_cache(maxsize=64)
def _bound(method: Any, task: str, layers: int, checkpoint: str, model_id: str) -> Any:
    from ...compression import method_from_name
    from ...kv.cache import RequestInfo

    chosen = method_from_name(method)
    quiet = logging.getLogger("unicache_core.compression.policy_table")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # a plan makes no report: the run says which table it uses
    try:
        request = RequestInfo(task=cast(Task, task), num_layers=layers, model_id=model_id)
        bound, _ = chosen.bind(request, checkpoint)
    finally:
        quiet.setLevel(level)
    return bound


def bound_method(kv_method: Any, task: str, config: BagelConfig, checkpoint: str = "") -> Any:
    """The method a run of ``task`` on ``checkpoint`` (a folder, or ``""`` for BAGEL-7B-MoT's geometry) uses: a name
    with its defaults, or the configured method object, bound as the run binds it (UniCache: its policy table, the
    given one, the checkpoint's, else the paper's)."""
    from ..checkpoint.model_id import BAGEL_7B_MOT, model_id_of

    model_id = BAGEL_7B_MOT
    if checkpoint:
        try:
            model_id = model_id_of(checkpoint)
        except (OSError, ValueError):
            model_id = ""
    key = (kv_method, task, config.llm.num_hidden_layers, str(checkpoint), model_id)
    try:
        return _bound(*key)
    except TypeError:  # a method whose settings hold something unhashable (a policy table object): bound each time
        return _bound.__wrapped__(*key)


def _segment(config: BagelConfig, dtype: torch.dtype, rows: int) -> Any:
    """``rows`` rows of one layer as just written, uncompressed (:class:`~unicache_core.compression.family.Segment`)."""
    from ...compression.family import FULL_BITS, Segment

    llm, elem = config.llm, dtype.itemsize
    full = 2 * rows * llm.num_key_value_heads * llm.head_dim * elem
    return Segment(rows, rows, FULL_BITS, full, True, llm.num_key_value_heads, llm.head_dim, elem)


@dataclass(frozen=True)
class _Block:
    """One prefill call: its branch, its ``content`` rows of ``kind`` and its boundary rows (a text's content is
    its instruction), and whether it comes after the fork."""

    branch: str
    kind: TokenType
    content: int
    image: bool


def _blocks(tokens: RequestTokens) -> list[_Block]:
    """The prefill calls of ``tokens`` in the order the run makes them (module docstring)."""
    system = [_Block("gen", TokenType.INSTRUCTION, tokens.system, False)] if tokens.system else []
    images = []
    for vae, vit in tokens.image_blocks():
        if vae and tokens.task != "understanding":
            images.append(_Block("gen", TokenType.SOURCE_VAE, vae, True))
        if vit:
            images.append(_Block("gen", TokenType.SOURCE_VIT, vit, True))
    text = tokens.prompt + BOUNDARY_TOKENS * (tokens.texts - 1)
    prompt = [_Block("gen", TokenType.INSTRUCTION, text, False)]
    if tokens.task != "understanding":
        prompt.append(_Block("cfg_img", TokenType.INSTRUCTION, text + (tokens.system and tokens.system), False))
    return system + images + prompt


class _Caches:
    """One layer of the branch caches as the plan fills and compresses them (every layer holds the same rows): each
    branch's own candidate segments (``(type, segment)``), the segments ``cfg_text`` forked from ``gen`` (one store
    while both hold them) and each branch's boundary rows."""

    def __init__(self, config: BagelConfig, dtype: torch.dtype, method: Any, task: str):
        self.config, self.dtype, self.method, self.task = config, dtype, method, task
        self.row = _segment(config, dtype, 1).full_bytes
        self.own: dict[str, list[tuple[TokenType, Any]]] = {"gen": [], "cfg_text": [], "cfg_img": []}
        self.shared: list[tuple[TokenType, Any]] = []
        self.holders: set[str] = set()  # the branches that still hold the forked stores
        self.boundary = {"gen": 0, "cfg_text": 0, "cfg_img": 0}
        self.shared_boundary = 0  # boundary rows gen and cfg_text hold in one store
        self.joins = method.kv_timeline(task).shares_forked_rows

    def add(self, block: _Block) -> int:
        """Prefill ``block``; returns the rows of one layer it adds that are stored compressed as written."""
        from dataclasses import replace

        segment = _segment(self.config, self.dtype, block.content)
        choice = self.method.written_store(self.task, block.kind, segment) if block.image else None
        if choice is not None:
            held = segment.choice_bytes(choice)
            segment = replace(segment, held_rows=choice.rows, held_bits=choice.bits, held_bytes=held)
        if block.content:
            self.own[block.branch].append((block.kind, segment))
        if block.branch == "gen" and self.shared_boundary and self.method.compresses:
            self.shared_boundary = 0  # a compressing cache keeps a layer's boundary rows in one store: copied
        self.boundary[block.branch] += BOUNDARY_TOKENS
        return block.content if choice is not None else 0

    def fork(self) -> None:
        """``cfg_text`` forks ``gen``: every row gen holds, one store for both."""
        self.shared, self.own["gen"], self.holders = self.own["gen"], [], {"gen", "cfg_text"}
        self.boundary["cfg_text"] = self.shared_boundary = self.boundary["gen"]

    def held(self) -> int:
        """Bytes of one layer of every cache, a store two branches hold counted once."""
        own = sum(s.held_bytes for segments in self.own.values() for _, s in segments)
        shared = sum(s.held_bytes for _, s in self.shared) if self.holders else 0
        return own + shared + (sum(self.boundary.values()) - self.shared_boundary) * self.row

    def managed_full(self) -> int:
        """Uncompressed bytes of one layer's candidate rows of every branch (a fork's counted in each)."""
        own = sum(s.full_bytes for segments in self.own.values() for _, s in segments)
        return own + len(self.holders) * sum(s.full_bytes for _, s in self.shared)

    def _kept(self, segments: list[tuple[TokenType, Any]], ratio: float) -> list[tuple[TokenType, Any]]:
        from dataclasses import replace

        if not segments:
            return []
        layers = self.config.llm.num_hidden_layers
        kept = self.method.kept_bytes(self.task, segments, layers, ratio) // layers
        pooled = _segment(self.config, self.dtype, sum(s.full_rows for _, s in segments))
        return [(TokenType.UNKNOWN, replace(pooled, held_bytes=kept))]

    def compress(self, branch: str, ratio: float) -> None:
        """The branch's first compression (:meth:`~unicache_core.compression.method.Method.kept_bytes`): a method
        that plans the forked rows with the parent replaces them in both branches; another pools them with the
        branch's own rows into stores of its own, and the other branch keeps the old ones."""
        if self.joins:
            if branch == "gen" and self.holders:
                self.shared = self._kept(self.shared, ratio)
            self.own[branch] = self._kept(self.own[branch], ratio)
            return
        forked = self.shared if branch in self.holders else []
        self.own[branch] = self._kept(self.own[branch] + forked, ratio)
        self.holders.discard(branch)
        if not self.holders:
            self.shared = []


def kv_phases(
    config: BagelConfig, dtype: torch.dtype, tokens: RequestTokens, kv_method: Any, *, checkpoint: str = ""
) -> list[KVPhase]:
    """The LLM phases of ``tokens`` under ``kv_method`` (a name or the configured method object; ``checkpoint``:
    where its files are found, :func:`bound_method`), in the order they run (module docstring)."""
    method = bound_method(kv_method, tokens.task, config, checkpoint)
    timeline = method.kv_timeline(tokens.task)
    layers = config.llm.num_hidden_layers
    per_layer = kv_bytes_per_token(config, dtype) // max(1, layers)
    caches = _Caches(config, dtype, method, tokens.task)
    understanding = tokens.task == "understanding"
    phases: list[KVPhase] = []
    rows = {"gen": 0, "cfg_img": 0}
    blocks = _blocks(tokens)
    forked = False
    for index, block in enumerate(blocks):
        if not (forked or understanding or block.image) and index and blocks[index - 1].image:
            caches.fork()  # cfg_text: gen after its images, before the text
            forked = True
        written = caches.add(block)
        count = block.content + BOUNDARY_TOKENS
        rows[block.branch] += count
        scored = "prefill" in timeline.scored or ("prompt" in timeline.scored and forked and block.branch == "gen")
        scoring = scoring_bytes(config, rows[block.branch]) if scored and timeline.compresses else 0
        transient = (rows[block.branch] if GATHER else 0) + written
        phases.append(KVPhase(f"prefill:item{index}", caches.held() * layers, transient * per_layer, scoring, count, 1))
    if understanding:
        ratio = method.retained_ratio(tokens.task, caches.managed_full() * layers)
        if timeline.compresses:
            caches.compress("gen", ratio)
        kv = (caches.held() + tokens.decoded * caches.row) * layers
        bound = timeline.compresses and not timeline.kept_exact
        phases.append(KVPhase("decode", kv, (rows["gen"] + tokens.decoded) * per_layer, 0, 1, 1, bound))
        return phases
    return phases + _denoise_phases(caches, method, timeline, tokens, rows["gen"] * per_layer)


def _denoise_phases(caches: _Caches, method: Any, timeline: Any, tokens: RequestTokens, gathered: int) -> list[KVPhase]:
    """``denoise:first``, ``denoise:compress`` and ``denoise`` (module docstring)."""
    layers = caches.config.llm.num_hidden_layers
    per_layer = caches.row
    if tokens.system:  # think mode: the plan decoded in a fork of gen, then appended to gen
        caches.boundary["gen"] += BOUNDARY_TOKENS
        caches.own["gen"].append((TokenType.INSTRUCTION, _segment(caches.config, caches.dtype, tokens.decoded)))
    latent = tokens.latent + BOUNDARY_TOKENS
    if not timeline.compresses:
        kv = caches.held() * layers
        return [
            KVPhase("denoise:first", kv, gathered, 0, latent, GENERATION_BRANCHES),
            KVPhase("denoise:compress", kv, 0, 0, 0, GENERATION_BRANCHES),
            KVPhase("denoise", kv, gathered, 0, latent, GENERATION_BRANCHES),
        ]
    ratio = method.retained_ratio(tokens.task, caches.managed_full() * layers)
    before = {"every": ("gen", "cfg_text", "cfg_img"), "prompted": ("gen",) if caches.holders else ()}
    early = before.get(timeline.compressed_before, ())
    peak = 0
    for branch in ("gen", "cfg_text", "cfg_img"):
        if branch in early:
            caches.compress(branch, ratio)
            peak = max(peak, caches.held())
    read = caches.held() * layers
    late = [b for b in ("gen", "cfg_text", "cfg_img") if b not in early]
    scoring = scoring_bytes(caches.config, gathered // per_layer) if late and "first_step" in timeline.scored else 0
    for branch in late:
        caches.compress(branch, ratio)
        peak = max(peak, caches.held())
    steady = caches.held() * layers
    return [
        KVPhase("denoise:first", read, gathered, scoring, latent, GENERATION_BRANCHES),
        KVPhase("denoise:compress", peak * layers, 0, 0, 0, GENERATION_BRANCHES),
        KVPhase("denoise", steady, gathered, 0, latent, GENERATION_BRANCHES, not timeline.kept_exact),
    ]


def kv_parts(
    config: BagelConfig, dtype: torch.dtype, tokens: RequestTokens, kv_method: Any, *, checkpoint: str = ""
) -> dict[str, int]:
    """``kv_full`` (the official code's: every branch apart, uncompressed), ``kv_shared`` (what every method holds
    before compressing: the images' rows once), ``kv_compressed`` (after every branch's first compression; not for a
    method that never compresses)."""
    branches = tokens.kv_bytes(config, dtype)
    full = sum(branches.values())
    shared = full - branches.get("cfg_text", 0)  # cfg_text is a fork of gen: every row it holds is gen's
    parts = {"kv_full": full, "kv_shared": shared}
    method = bound_method(kv_method, tokens.task, config, checkpoint)
    if method.kv_timeline(tokens.task).compresses:
        last = kv_phases(config, dtype, tokens, kv_method, checkpoint=checkpoint)[-1]
        parts["kv_compressed"] = last.kv - (
            tokens.decoded * kv_bytes_per_token(config, dtype) if last.name == "decode" else 0
        )
    return parts


def scoring_bytes(config: BagelConfig, context_tokens: int) -> int:
    """Most bytes :func:`~unicache_core.compression.scoring.key_scores` holds while it scores one layer's
    ``context_tokens`` keys during a forward: two fp32 copies of a chunk of logits of its query subsample (at most
    :data:`~unicache_core.compression.scoring.SCORE_ELEMENTS`: the logits and their exp; the NaN-cleaned copy takes
    the place of one) and the keys in fp32. Sized on CPU tensor accounting at BAGEL-7B's widths (2 layers, four
    256 px sources: the first step peaked 86 MB above the layer's upcast weights, for 72 MB of one logits chunk and
    the keys; docs/results/real_width_images.json)."""
    from ...compression.defaults import SCORE_QUERIES
    from ...compression.scoring import SCORE_ELEMENTS

    llm = config.llm
    logits = min(SCORE_ELEMENTS, llm.num_attention_heads * SCORE_QUERIES * context_tokens)
    return 2 * logits * 4 + context_tokens * llm.num_key_value_heads * llm.head_dim * 4


def kv_per_image(
    config: BagelConfig,
    dtype: torch.dtype,
    tokens: RequestTokens,
    sizes,
    *,
    kv_method: Any = "full",
    checkpoint: str = "",
) -> tuple[dict[str, Any], ...]:
    """Each input image's uncompressed KV bytes per branch (its blocks, boundaries included, in ``gen`` and, for a
    generation, in ``cfg_text``, which holds every image when the prompt comes last) and ``held_bytes``, what the
    branches hold of it together while the context fills (one store for both branches, as the method writes it)."""
    per_token = kv_bytes_per_token(config, dtype)
    method = bound_method(kv_method, tokens.task, config, checkpoint)
    layers = config.llm.num_hidden_layers

    def stored(kind: TokenType, rows: int) -> int:
        segment = _segment(config, dtype, rows)
        choice = method.written_store(tokens.task, kind, segment)
        held = segment.full_bytes if choice is None else segment.choice_bytes(choice)
        return layers * held + BOUNDARY_TOKENS * per_token

    out = []
    for size, (vae, vit) in zip(sizes, tokens.image_blocks()):
        blocks = vit + BOUNDARY_TOKENS + (vae + BOUNDARY_TOKENS if vae else 0)
        branches = ("gen",) if tokens.task == "understanding" else ("gen", "cfg_text")
        held = stored(TokenType.SOURCE_VIT, vit) + (stored(TokenType.SOURCE_VAE, vae) if vae else 0)
        out.append(
            {
                "size": list(size),
                "vae_tokens": vae,
                "vit_tokens": vit,
                "bytes_per_branch": {name: blocks * per_token for name in branches},
                "held_bytes": int(held),
            }
        )
    return tuple(out)


__all__ = ["GATHER", "KVPhase", "bound_method", "kv_parts", "kv_per_image", "kv_phases", "scoring_bytes"]
