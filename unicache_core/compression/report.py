"""Per-step records of a compressing run and the JSON report built from them.

One record per (step, branch that ran it): rho, per type the policy, budget, bytes held, rows, bits/group
and attention mass, plus the time spent in attention, statistics and allocation. The summary gives the
full, steady and peak bytes, the retention achieved against the budget, and the flags of budgets a
segment could not reach. Everything is plain JSON (``json.dumps(report)`` works).

With TaylorSeer a denoising step may forecast a branch's output instead of computing it: the step's record lists
those branches in ``forecast`` (their entries say ``"forecast": true``, attend over no rows and are never
``observed``: the method measured nothing in them), and the summary counts each branch's computed
(``denoise_forwards``) and forecast (``forecast_forwards``) steps and lists the steps that forecast a branch
(``forecast_steps``).
"""

from __future__ import annotations

import statistics

import torch

from ..kv.cache import AttentionCall, StepInfo
from ..kv.quantized_store import QuantizedStore
from ..kv.stores import KVStore
from ..kv.token_types import CANDIDATE_TYPES, THINK, TokenType
from .protocol import ReportedBranch, ReportedSession
from .state import RequestState

#: The ``format`` field of every KV report (and what a report reader checks first).
REPORT_FORMAT = "unicache-kv-report"
#: Types a method may compress; ``UNKNOWN`` marks a pooled store of several of them (global baselines).
MANAGED_TYPES = frozenset(CANDIDATE_TYPES) | {TokenType.UNKNOWN}
#: The policy a store's kind shows in the report.
_KIND_POLICY = {"full": "full", "evicted": "evict", "quantized": "quantize"}


def type_name(t: TokenType) -> str:
    """A token type's name in the report: lower case, ``candidate`` for a pool of several candidate types."""
    return "candidate" if t == TokenType.UNKNOWN else t.name.lower()


def branch_snapshot(cache: ReportedBranch, state: RequestState) -> dict:
    """Bytes, rows and settings per type of one branch cache, summed over its layers."""
    managed, protected = cache.split_bytes()
    record = state.branch(cache.branch or "")
    return {
        "types": types_snapshot(cache),
        "images": images_snapshot(cache),
        "managed_bytes": managed,
        "protected_bytes": protected,
        "full_managed_bytes": cache.managed_full_bytes(),
        "rho": (round(statistics.fmean(record.rho.values()), 6) if record.rho else None),
        "compressed": record.compressions > 0,
    }


def types_snapshot(cache: ReportedBranch) -> dict[str, dict]:
    """Per type name, summed over the layers: the policy acting on it, bytes held, rows per KV head, store kinds,
    KIVI settings, budget bytes, attention mass and uncompressed rows (the report's ``types``)."""
    if cache.holds_every_row:
        return _full_types(cache)
    types: dict[str, dict] = {}
    for layer in range(cache.num_layers):
        ls = cache.state[layer]
        for store in cache.stores_of(layer):
            name = type_name(store.token_type)
            entry = types.setdefault(name, {"policy": "protect", "bytes": 0, "rows_per_head": 0.0, "stores": {}})
            entry["bytes"] += store.nbytes()
            entry["rows_per_head"] += store.num_tokens / cache.num_layers
            entry["stores"][store.kind] = entry["stores"].get(store.kind, 0) + 1
            if store.token_type in MANAGED_TYPES and entry["policy"] in ("protect", "full"):
                entry["policy"] = _KIND_POLICY[store.kind]
            if isinstance(store, QuantizedStore):
                entry["bits"], entry["group_size"], entry["residual"] = store.bits, store.group_size, store.residual
        for name, budget in ls.budgets.items():
            entry = types.setdefault(name, {"policy": "full", "bytes": 0, "rows_per_head": 0.0, "stores": {}})
            entry["budget_bytes"] = entry.get("budget_bytes", 0) + int(budget)
        for t, m in ls.masses.items():
            massed = types.get(type_name(t))
            if massed is not None:
                massed["mass"] = massed.get("mass", 0.0) + m / cache.num_layers
    for t, n in cache.type_rows(0).items():
        if type_name(t) in types:
            types[type_name(t)]["full_rows"] = n
    for entry in types.values():
        entry["rows_per_head"] = round(entry["rows_per_head"], 2)
        if "mass" in entry:
            entry["mass"] = round(entry["mass"], 6)
    return types


def _full_types(cache: ReportedBranch) -> dict[str, dict]:
    """The ``types`` of an uncompressed cache: every row held in full, one store per type and layer."""
    out: dict[str, dict] = {}
    row_bytes = sum(cache.row_bytes(i) for i in range(cache.num_layers))
    for t, n in cache.type_rows(0).items():
        out[t.name.lower()] = {
            "policy": "full" if t in CANDIDATE_TYPES else "protect",
            "bytes": n * row_bytes,
            "rows_per_head": float(n),
            "full_rows": n,
            "stores": {"full": cache.num_layers},
        }
    return out


def images_snapshot(cache: ReportedBranch) -> dict[str, dict]:
    """Per input image (its index as a string), summed over the layers: per candidate type the bytes held, the rows
    held per KV head and the rows it had, and the image's bytes held and full bytes (the report's ``images``). A
    store of one image's rows counts for that image; a store pooling several (a pool of types or a baseline's one
    store) is split by the images its rows belong to. ``{}`` without image rows."""
    if cache.holds_every_row:
        return _full_images(cache)
    rows = {key: n for key, n in cache.segment_rows(0).items() if key.image is not None}
    if not rows:
        return {}
    row_bytes = sum(cache.row_bytes(layer) for layer in range(cache.num_layers))
    out: dict[str, dict] = {}
    for key, n in sorted(rows.items(), key=lambda kv: (kv[0].image, kv[0].type)):
        entry = out.setdefault(str(key.image), {"bytes": 0, "full_bytes": 0, "types": {}})
        entry["types"][type_name(key.type)] = {"bytes": 0, "rows_per_head": 0.0, "full_rows": n}
        entry["full_bytes"] += n * row_bytes
    for layer in range(cache.num_layers):
        for store in cache.stores_of(layer):
            if not store.num_tokens or store.token_type not in MANAGED_TYPES:
                continue
            for (image, token_type), share in _image_shares(cache, store).items():
                entry = out.get(str(image), {}).get("types", {}).get(type_name(token_type))
                if entry is None:
                    continue
                nbytes = store.nbytes() * share
                entry["bytes"] += nbytes
                entry["rows_per_head"] += store.num_tokens * share / cache.num_layers
                out[str(image)]["bytes"] += nbytes
    for totals in out.values():
        totals["bytes"] = int(round(totals["bytes"]))
        for per_type in totals["types"].values():
            per_type["bytes"] = int(round(per_type["bytes"]))
            per_type["rows_per_head"] = round(per_type["rows_per_head"], 2)
    return out


def _full_images(cache: ReportedBranch) -> dict[str, dict]:
    """The ``images`` of an uncompressed cache: each image's candidate rows per type, held in full."""
    types = cache.types.long()
    images = cache.images.long()[: types.shape[0]]
    row_bytes = sum(cache.row_bytes(i) for i in range(cache.num_layers))
    out: dict[str, dict] = {}
    for t in CANDIDATE_TYPES:
        for image in torch.unique(images[(types == int(t)) & (images >= 0)]).tolist():
            n = int(((types == int(t)) & (images == image)).sum())
            entry = out.setdefault(str(image), {"bytes": 0, "full_bytes": 0, "types": {}})
            entry["types"][t.name.lower()] = {"bytes": n * row_bytes, "rows_per_head": float(n), "full_rows": n}
            entry["bytes"] += n * row_bytes
            entry["full_bytes"] += n * row_bytes
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def _image_shares(cache: ReportedBranch, store: KVStore) -> dict[tuple[int, TokenType], float]:
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


def image_totals(caches: list) -> dict[str, dict]:
    """Per input image, over ``caches`` (branches, each counted): the full and held bytes of its rows now, in all
    and per candidate type (the report summary's ``images``; ``{}`` without image rows)."""
    out: dict[str, dict] = {}
    for cache in caches:
        for image, snap in images_snapshot(cache).items():
            entry = out.setdefault(image, {"full_bytes": 0, "held_bytes": 0, "types": {}})
            entry["full_bytes"] += snap["full_bytes"]
            entry["held_bytes"] += snap["bytes"]
            for name, t in snap["types"].items():
                row_bytes = snap["full_bytes"] / max(1, sum(v["full_rows"] for v in snap["types"].values()))
                per = entry["types"].setdefault(name, {"full_bytes": 0, "held_bytes": 0})
                per["full_bytes"] += int(round(t["full_rows"] * row_bytes))
                per["held_bytes"] += t["bytes"]
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


class ReportBuilder:
    """Collects the records of one session; :meth:`build` returns the report dict."""

    def __init__(self, session: ReportedSession, state: RequestState, policy_info: dict):
        self.session = session
        self.state = state
        self.policy_info = policy_info
        self.steps: list[dict] = []
        self.peak_bytes = 0
        self._rows: dict[str, int] = {}
        self._current: dict | None = None
        self._compressed_now: set[str] = set()
        self._observed_now: set[str] = set()
        self.flags: dict[str, str] = {}

    def note_peak(self) -> None:
        """Raise the peak to the bytes the session holds now."""
        self.peak_bytes = max(self.peak_bytes, self.session.held_bytes())

    def begin_step(self, step: StepInfo) -> None:
        self._rows = {}
        self._compressed_now = set()
        self._observed_now = set()

    def note_observed(self, branch: str) -> None:
        """``branch`` measured attention statistics in this step (a call its method planned to observe)."""
        self._observed_now.add(branch)

    def note_rows(self, branch: str, call: AttentionCall, rows: int) -> None:
        """Add the rows a denoising or decoding call of ``branch`` attended over to this step's count."""
        if call.phase in ("denoise", "decode"):
            self._rows[branch] = self._rows.get(branch, 0) + rows

    def note_compression(self, cache: ReportedBranch) -> None:
        """Mark ``cache`` compressed in this step and keep the flags of budgets it could not reach."""
        self._compressed_now.add(cache.branch or "")
        for ls in cache.state:
            for t, reason in ls.flags.items():
                self.flags[f"{cache.branch}/{type_name(t) if isinstance(t, TokenType) else t}"] = reason

    def end_step(self, step: StepInfo, timers: dict) -> None:
        """Append the record of ``step``: a snapshot of every branch that ran in it, bytes and ``timers``."""
        self.note_peak()
        caches = {c.branch: c for c in self.session.live_caches()}
        branches = {}
        for name in step.branches:
            cache = caches.get(name)
            if cache is None:
                continue
            snap = branch_snapshot(cache, self.state)
            snap["attended_rows"] = self._rows.get(name, 0)
            snap["compressed_after"] = name in self._compressed_now
            snap["observed"] = name in self._observed_now
            snap["forecast"] = name in step.forecast
            branches[name] = snap
        managed = protected = 0
        for cache in caches.values():
            m, p = cache.split_bytes()
            managed, protected = managed + m, protected + p
        self.steps.append(
            {
                "phase": step.phase,
                "step": step.step,
                "timestep": step.timestep,
                "branches": branches,
                "forecast": [name for name in step.branches if name in step.forecast],
                "managed_bytes_all": managed,
                "protected_bytes_all": protected,
                "held_bytes": self.session.held_bytes(),
                "attention_s": timers["attention"],
                "stats_s": timers["stats"],
                "alloc_s": timers["alloc"],
                "pack_s": timers["pack"],
                "step_s": timers.get("step"),
            }
        )

    def build(self) -> dict:
        """The report: format, method, task, config, policy, the summary over the steps, and the steps."""
        session = self.session
        caches = [c for c in session.live_caches() if c.branch != THINK]
        full = sum(c.managed_full_bytes() for c in caches)
        first = next(
            (i for i, s in enumerate(self.steps) if any(b.get("compressed") for b in s["branches"].values())), None
        )
        after = self.steps[first:] if first is not None else []
        if not session.method.compresses:
            after = [s for s in self.steps if s["phase"] != "decode" or THINK not in s["branches"]]
        steady = statistics.fmean(s["managed_bytes_all"] for s in after) if after else None
        target = self.state.target_ratio
        rho_weighted = None
        weights = [
            (b["rho"], b["full_managed_bytes"])
            for s in after
            for b in s["branches"].values()
            if b.get("rho") is not None
        ]
        if weights and sum(w for _, w in weights):
            rho_weighted = sum(r * w for r, w in weights) / sum(w for _, w in weights)
        summary = {
            "full_managed_bytes": full,
            "steady_managed_bytes": None if steady is None else round(steady),
            "peak_bytes": self.peak_bytes,
            "protected_bytes": self.steps[-1]["protected_bytes_all"] if self.steps else None,
            "target_ratio": target,
            "achieved_ratio": None if steady is None or not full else steady / full,
            "reduction": None if steady is None or not full else 1.0 - steady / full,
            "compression": None if not steady else full / steady,
            "rho_mean": rho_weighted,
            "stats_seconds": sum(s["stats_s"] for s in self.steps),
            "alloc_seconds": sum(s["alloc_s"] for s in self.steps),
            "attention_seconds": sum(s["attention_s"] for s in self.steps),
            "prefill_seconds": {kind: round(t, 6) for kind, t in self.state.prefill_timers.items()},
            "first_compressed_step": None if first is None else self.steps[first]["step"],
            "flags": dict(self.flags),
            "images": image_totals(caches),
            **_forward_counts(self.steps),
        }
        budget = rho_weighted if session.method.budget == "rho" else target
        if budget is not None and summary["achieved_ratio"] is not None:
            summary["budget_ratio"] = budget
            summary["within_budget"] = summary["achieved_ratio"] <= budget * (1 + 1e-9)
            summary["budget_unreachable"] = bool(self.flags)  # see `flags`: fixed parts exceed the budget
        return {
            "format": REPORT_FORMAT,
            "version": 1,
            "method": session.method.name,
            "task": session.request.task,
            "model_id": session.request.model_id,
            "config": dict(session.settings),
            "policy": self.policy_info,
            "summary": summary,
            "steps": self.steps,
        }


def _forward_counts(steps: list[dict]) -> dict:
    """Per branch, the denoising steps that computed it and those that forecast it (TaylorSeer), and the steps
    that forecast some branch."""
    computed: dict[str, int] = {}
    forecast: dict[str, int] = {}
    for record in steps:
        if record["phase"] != "denoise":
            continue
        for name in record["branches"]:
            counts = forecast if name in record["forecast"] else computed
            counts[name] = counts.get(name, 0) + 1
    return {
        "denoise_forwards": computed,
        "forecast_forwards": forecast,
        "forecast_steps": [r["step"] for r in steps if r["phase"] == "denoise" and r["forecast"]],
    }


__all__ = [
    "MANAGED_TYPES",
    "REPORT_FORMAT",
    "ReportBuilder",
    "branch_snapshot",
    "image_totals",
    "images_snapshot",
    "type_name",
    "types_snapshot",
]
