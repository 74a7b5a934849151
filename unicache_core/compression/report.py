"""Per-step records of a compressing run and the JSON report built from them.

One record per (step, branch that ran it): rho, per type the policy, budget, bytes held, rows, bits/group
and attention mass, plus the time spent in attention, statistics and allocation. The summary gives the
full, steady and peak bytes, the retention achieved against the budget, and the flags of budgets a
segment could not reach. Everything is plain JSON (``json.dumps(report)`` works).
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from ..kv.cache import AttentionCall, StepInfo
from ..kv.token_types import CANDIDATE_TYPES, TokenType

if TYPE_CHECKING:  # pragma: no cover
    from .compressing_cache import CompressingKVCache, CompressionSession

REPORT_FORMAT = "unicache-kv-report"


def _type_name(t: TokenType) -> str:
    return "candidate" if t == TokenType.UNKNOWN else t.name.lower()


def branch_snapshot(cache: "CompressingKVCache") -> dict:
    """Bytes, rows and settings per type of one branch cache, summed over its layers."""
    if hasattr(cache, "snapshot_types"):  # the full method's FullKVCache
        managed, protected = cache.split_bytes()
        return {"types": cache.snapshot_types(), "managed_bytes": managed, "protected_bytes": protected,
                "full_managed_bytes": cache.managed_full_bytes(), "rho": None, "compressed": False}
    types: dict[str, dict] = {}
    for layer, st in enumerate(cache.layers):
        ls = cache.state[layer]
        for store in st.stores:
            name = _type_name(store.token_type)
            entry = types.setdefault(name, {"policy": "protect", "bytes": 0, "rows_per_head": 0.0, "stores": {}})
            entry["bytes"] += store.nbytes()
            entry["rows_per_head"] += store.num_tokens / cache.num_layers
            entry["stores"][store.kind] = entry["stores"].get(store.kind, 0) + 1
            if store.token_type in CANDIDATE_TYPES or store.token_type == TokenType.UNKNOWN:
                entry["policy"] = {"full": "full", "evicted": "evict", "quantized": "quantize"}[store.kind] \
                    if entry["policy"] in ("protect", "full") else entry["policy"]
            if store.kind == "quantized":
                entry["bits"], entry["group_size"], entry["residual"] = store.bits, store.group_size, store.residual
        for name, budget in ls.budgets.items():
            entry = types.setdefault(name, {"policy": "full", "bytes": 0, "rows_per_head": 0.0, "stores": {}})
            entry["budget_bytes"] = entry.get("budget_bytes", 0) + int(budget)
        for t, m in ls.masses.items():
            entry = types.get(_type_name(t))
            if entry is not None:
                entry["mass"] = entry.get("mass", 0.0) + m / cache.num_layers
    full_rows = cache.type_rows(0)
    for t, n in full_rows.items():
        if _type_name(t) in types:
            types[_type_name(t)]["full_rows"] = n
    for entry in types.values():
        entry["rows_per_head"] = round(entry["rows_per_head"], 2)
        if "mass" in entry:
            entry["mass"] = round(entry["mass"], 6)
    managed, protected = cache.split_bytes()
    return {"types": types, "managed_bytes": managed, "protected_bytes": protected,
            "full_managed_bytes": cache.managed_full_bytes(),
            "rho": (round(statistics.fmean(cache.rho.values()), 6) if cache.rho else None),
            "compressed": cache.compressions > 0}


class ReportBuilder:
    """Collects the records of one session; :meth:`build` returns the report dict."""

    def __init__(self, session: "CompressionSession", policy_info: dict):
        self.session = session
        self.policy_info = policy_info
        self.steps: list[dict] = []
        self.peak_bytes = 0
        self._rows: dict[str, int] = {}
        self._current: dict | None = None
        self._compressed_now: set[str] = set()
        self.flags: dict[str, str] = {}

    def note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.session.held_bytes())

    def begin_step(self, step: StepInfo) -> None:
        self._rows = {}
        self._compressed_now = set()

    def note_rows(self, branch: str, call: AttentionCall, rows: int) -> None:
        if call.phase in ("denoise", "decode"):
            self._rows[branch] = self._rows.get(branch, 0) + rows

    def note_compression(self, cache: "CompressingKVCache") -> None:
        self._compressed_now.add(cache.branch)
        for layer, ls in enumerate(cache.state):
            for t, reason in ls.flags.items():
                self.flags[f"{cache.branch}/{_type_name(t) if isinstance(t, TokenType) else t}"] = reason

    def end_step(self, step: StepInfo, timers: dict) -> None:
        self.note_peak()
        caches = {c.branch: c for c in self.session.live_caches()}
        branches = {}
        for name in step.branches:
            cache = caches.get(name)
            if cache is None:
                continue
            snap = branch_snapshot(cache)
            snap["attended_rows"] = self._rows.get(name, 0)
            snap["compressed_after"] = name in self._compressed_now
            branches[name] = snap
        managed = protected = 0
        for cache in caches.values():
            m, p = cache.split_bytes()
            managed, protected = managed + m, protected + p
        self.steps.append({
            "phase": step.phase, "step": step.step, "timestep": step.timestep, "branches": branches,
            "managed_bytes_all": managed, "protected_bytes_all": protected, "held_bytes": self.session.held_bytes(),
            "attention_s": timers["attention"], "stats_s": timers["stats"], "alloc_s": timers["alloc"],
            "step_s": timers.get("step"),
        })

    def build(self) -> dict:
        session = self.session
        caches = [c for c in session.live_caches() if c.branch != "plan"]
        full = sum(c.managed_full_bytes() for c in caches)
        first = next((i for i, s in enumerate(self.steps)
                      if any(b.get("compressed") for b in s["branches"].values())), None)
        after = self.steps[first:] if first is not None else []
        if session.method.name == "full":
            after = [s for s in self.steps if s["phase"] != "decode" or "plan" not in s["branches"]]
        steady = statistics.fmean(s["managed_bytes_all"] for s in after) if after else None
        target = session.target_ratio
        rho_weighted = None
        weights = [(b["rho"], b["full_managed_bytes"]) for s in after for b in s["branches"].values()
                   if b.get("rho") is not None]
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
            "first_compressed_step": None if first is None else self.steps[first]["step"],
            "flags": dict(self.flags),
        }
        budget = rho_weighted if session.method.name == "unicache" else target
        if budget is not None and summary["achieved_ratio"] is not None:
            summary["budget_ratio"] = budget
            summary["within_budget"] = summary["achieved_ratio"] <= budget * (1 + 1e-9)
            summary["budget_unreachable"] = bool(self.flags)  # see `flags`: fixed parts exceed the budget
        return {
            "format": REPORT_FORMAT, "version": 1, "method": session.method.name, "task": session.request.task,
            "model_id": session.request.model_id, "config": session.config.to_dict(), "policy": self.policy_info,
            "summary": summary, "steps": self.steps,
        }


__all__ = ["REPORT_FORMAT", "ReportBuilder", "branch_snapshot"]
