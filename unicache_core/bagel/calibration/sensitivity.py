"""The single-type sensitivity ablation (docs/compression.md §8.4): each candidate type alone evicted and
alone quantized at the task's target retention, compared with the full-KV calibration run."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence

import torch

from ...compression.family import JointPlan
from ...compression.policy_table import PolicyTable
from ...compression.routing import PolicyKind
from ...compression.session import CompressionSession
from ...kv.cache import CacheFactory, RequestInfo
from ...kv.token_types import CANDIDATE_TYPES, THINK, TokenType
from .options import SENSITIVITY_RATIO, CalibrationOptions
from .requests import run_request


def output_change(task: str, result, reference) -> dict:
    """Output change of a compressed run against the full-KV reference.

    Understanding: ``1 - token agreement`` over the longer answer; t2i / edit: the relative L2 of the
    final latents ``[B, C, H, W]`` (and ``1 - cosine``). ``"change"`` holds the metric the ablation compares.
    """
    if task == "understanding":
        a, b = list(result.token_ids), list(reference.token_ids)
        n = max(len(a), len(b))
        agree = 1.0 if n == 0 else sum(1 for x, y in zip(a, b) if x == y) / n
        return {"token_agreement": agree, "change": 1.0 - agree}
    x, ref = result.latents.double().flatten(), reference.latents.double().flatten()
    denom = float(ref.norm())
    rel = float((x - ref).norm()) / denom if denom > 0 else float((x - ref).norm())
    cos = float(torch.nn.functional.cosine_similarity(x, ref, dim=0))
    return {"latent_rel_l2": rel, "one_minus_cosine": max(0.0, 1.0 - cos), "change": rel}


def single_type_table(
    task: str, ttype: TokenType, kind: str, model_id: str, plan: JointPlan | None = None
) -> PolicyTable:
    """A table that applies ``kind`` to ``ttype`` in ``task`` and protects every other candidate type (``plan``:
    the bits of a ``joint`` kind)."""
    entries = {(task, t): (kind if t == ttype else "protect") for t in CANDIDATE_TYPES}
    return PolicyTable(
        entries=entries,
        model_id=model_id,
        source="calibrated",
        plans={} if plan is None else {(task, ttype): plan},
        measurements={"purpose": f"sensitivity: {kind} {ttype.name.lower()} only"},
    )


class _KeepSession(CacheFactory):
    """Wraps a cache factory and keeps what the last session it started held per type: the pipeline releases a
    generation's caches before its VAE decode, so each branch is measured as it is released (and the branches
    still live when the run ends, an answer's, by :func:`type_retained`)."""

    def __init__(self, inner: CacheFactory):
        self.inner = inner
        self.last: CompressionSession | None = None
        self.released: dict[TokenType, list[int]] = {}

    def start(self, request: RequestInfo) -> CompressionSession:
        session = self.inner.start(request)
        if not isinstance(session, CompressionSession):  # what every method of make_cache_factory starts
            raise TypeError(f"the ablation measures a compression method's session, got {type(session).__name__}")
        self.last, self.released = session, {}
        release = session.release

        def measured_release(branch: str) -> None:
            cache = session.caches.get(branch)
            if cache is not None and branch != THINK:
                for ttype, (held, full) in _type_bytes(cache).items():
                    total = self.released.setdefault(ttype, [0, 0])
                    total[0], total[1] = total[0] + held, total[1] + full
            release(branch)

        vars(session)["release"] = measured_release  # this session's own release, in front of its class's
        return session


def _type_bytes(cache) -> dict[TokenType, tuple[int, int]]:
    """``{type: (bytes held, uncompressed bytes)}`` of one branch cache, summed over its layers."""
    out: dict[TokenType, tuple[int, int]] = {}
    for layer in range(cache.num_layers):
        rows = cache.type_rows(layer)
        for ttype in set(rows) | {s.token_type for s in cache.layer(layer).stores}:
            held = sum(s.nbytes() for s in cache.layer(layer).stores if s.token_type == ttype)
            full = rows.get(ttype, 0) * cache.row_bytes(layer)
            before = out.get(ttype, (0, 0))
            out[ttype] = (before[0] + held, before[1] + full)
    return out


def type_retained(keep: _KeepSession, ttype: TokenType) -> float | None:
    """Bytes the last run's branch caches held for ``ttype`` at its end over its uncompressed bytes (``None`` if
    absent): the released branches as measured on release, plus the ones still live."""
    if keep.last is None:
        raise ValueError("type_retained reads the session of a run: run a request through `keep` first")
    held, full = keep.released.get(ttype, [0, 0])
    for cache in keep.last.live_caches():
        if cache.branch == THINK:
            continue
        h, f = _type_bytes(cache).get(ttype, (0, 0))
        held, full = held + h, full + f
    return None if full == 0 else held / full


def type_alone(
    loaded,
    task: str,
    ttype: TokenType,
    table: PolicyTable,
    ratio: float,
    inputs: Sequence[tuple[str, object]],
    references: Sequence,
    options: CalibrationOptions,
) -> dict:
    """Every input run under ``table`` (``ttype`` compressed alone, :func:`single_type_table`) with rho fixed at
    ``ratio``: mean output change against ``references``, per-prompt metrics, the most bytes of ``ttype`` held
    (``type_retained``) and the report's flags."""
    from ...compression import UniCache, make_cache_factory
    from ..pipeline import BagelPipeline

    keep = _KeepSession(make_cache_factory(UniCache(rho=ratio, rho_floor=ratio, policy=table)))
    pipe = BagelPipeline(loaded, keep)
    changes: list[dict] = []
    flags: dict[str, object] = {}
    retained: list[float] = []
    for (prompt, image), ref in zip(inputs, references):
        res = run_request(pipe, task, prompt, image, options)
        changes.append(output_change(task, res, ref))
        flags.update(((res.kv_report or {}).get("summary") or {}).get("flags") or {})
        r = type_retained(keep, ttype)
        if r is not None:
            retained.append(r)
        keep.last = None
    metrics = {k: [round(c[k], 8) for c in changes] for k in changes[0] if k != "change"}
    return {
        "change": statistics.fmean(c["change"] for c in changes),
        "per_prompt": metrics,
        "type_retained": None if not retained else round(max(retained), 6),
        "flags": flags,
    }


def _one_policy(
    loaded,
    task: str,
    ttype: TokenType,
    kind: str,
    model_id: str,
    inputs: Sequence[tuple[str, object]],
    references: Sequence,
    options: CalibrationOptions,
) -> dict:
    """Every input run with only ``ttype`` handled by ``kind`` at the task's sensitivity ratio."""
    return type_alone(
        loaded,
        task,
        ttype,
        single_type_table(task, ttype, kind, model_id),
        SENSITIVITY_RATIO[task],
        inputs,
        references,
        options,
    )


def sensitivity(
    loaded,
    task: str,
    inputs: Sequence[tuple[str, object]],
    references: Sequence,
    k90_choice: Mapping[str, PolicyKind],
    model_id: str,
    options: CalibrationOptions,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """The single-type ablation of §8.4 for each type of ``k90_choice``; returns the ``sensitivity`` measurements.

    Args:
        loaded: the :class:`~unicache_core.bagel.LoadedBagel` the calibration ran on.
        task: pipeline task name.
        inputs: ``[(prompt, image or None)]`` of the calibration run.
        references: the calibration run's results, one per input (full KV).
        k90_choice: ``{type name: "evict" | "quantize"}`` the K90 routing chose, in report order.
        model_id: the checkpoint's model id (written into the single-type tables).
        options: the calibration's run options.
        progress: called with one line per (type, policy) measured.

    A comparison counts (``comparable``) only when both policies held the type at or under the target
    ratio; otherwise (e.g. a segment shorter than KIVI's 32-row residual cannot be quantized) ``agrees``
    is ``None``.
    """
    ratio = SENSITIVITY_RATIO[task]
    out: dict = {
        "ratio": ratio,
        "metric": "1 - token agreement" if task == "understanding" else "latent relative L2",
        "reference": "the calibration run (full KV)",
        "types": {},
    }
    agrees: dict[str, bool | None] = {}
    for name in k90_choice:
        ttype = TokenType.parse(name)
        entry: dict = {}
        for kind in ("evict", "quantize"):
            entry[kind] = _one_policy(loaded, task, ttype, kind, model_id, inputs, references, options)
            if progress is not None:
                progress(
                    f"sensitivity {name} {kind}: change {entry[kind]['change']:.4g}, "
                    f"retained {entry[kind]['type_retained']}"
                )
        ev, qu = entry["evict"]["change"], entry["quantize"]["change"]
        comparable = all(
            entry[k]["type_retained"] is not None and entry[k]["type_retained"] <= ratio * (1 + 1e-6)
            for k in ("evict", "quantize")
        )
        preferred = None if ev == qu else ("evict" if ev < qu else "quantize")
        entry["comparable"] = comparable
        entry["preferred"] = preferred
        entry["k90_choice"] = k90_choice[name]
        entry["agrees"] = None if preferred is None or not comparable else preferred == k90_choice[name]
        agrees[name] = entry["agrees"]
        out["types"][name] = entry
    out["note"] = (
        "'type_retained': the most bytes of the type held after a run (over the live branches) as a share "
        "of its uncompressed bytes; a comparison counts ('comparable') only when both policies are at or "
        "under 'ratio'; 'flags': budgets a quantized segment could not reach even at 2-bit/G128 with "
        "the 32-row residual"
    )
    return {"sensitivity": out, "sensitivity_agrees": agrees}


__all__ = ["output_change", "sensitivity", "single_type_table", "type_alone", "type_retained"]
