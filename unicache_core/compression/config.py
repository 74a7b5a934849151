"""Settings of a KV-compression method, validated once (CLI, API and nodes share them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..sizes import parse_size, split_size
from .defaults import DEFAULT_REDUCTION, FIT_VALUE_RANGES, RECENT_FRACTION, SCORE_QUERIES, WINDOW
from .family import QuantGeometry
from .policy_table import PolicyTable

#: Every method selectable by name (``full`` = no compression).
METHODS: tuple[str, ...] = ("full", "unicache", "h2o", "snapkv", "pyramidkv", "streamingllm", "kivi", "vlcache")


def parse_kv_target(value: Any) -> float | int | None:
    """A retained ratio ``(0, 1]`` of the full managed KV bytes (float) or a byte count (int > 1).

    Strings: ``"0.2"``, ``"20%"``, ``"150MB"``, ``"64MiB"``, ``"123456"`` (bytes). ``None`` stays ``None``.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"`kv_target` must be a ratio in (0, 1] or a byte count, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        if text.endswith("%"):
            try:
                percent = float(text[:-1])
            except ValueError:
                raise ValueError(f"`kv_target` {value!r} is not a percentage like '20%'") from None
            if not math.isfinite(percent) or not 0.0 < percent <= 100.0:
                raise ValueError(
                    f"`kv_target` {value!r} is outside (0%, 100%]; give the share of the KV to keep, "
                    f"e.g. 20% (5x less KV)"
                )
            return percent / 100.0
        parsed = split_size(text)
        if parsed is None:
            raise ValueError(f"`kv_target` {value!r} is neither a ratio (0.2, 20%) nor a size (150MB, 64MiB, 123456)")
        number, unit = parsed
        if unit:  # a size is always a byte count, even when it comes out as 1 (unicache_core.sizes: one parser)
            size = parse_size(text, "`kv_target`", minimum=0, example="150MB")
            if size <= 1:
                raise ValueError(
                    f"`kv_target` {value!r} is {size} byte(s), which holds no KV; give a size of at "
                    f"least one KV row (e.g. 150MB) or a ratio (0.2, 20%)"
                )
            return size
        if number.as_integer_ratio()[1] != 1 or "." in text or "e" in text.lower():
            return parse_kv_target(float(number))  # 0.2, 1e-1: a ratio
        return parse_kv_target(int(number))  # 123456: bytes; 1: the whole KV
    if isinstance(value, int):
        if value == 1:
            return 1.0
        if value < 1:
            raise ValueError(f"`kv_target` must be a ratio in (0, 1] or a byte count > 1, got {value!r}")
        return parse_size(value, "`kv_target`", example="150MB")  # at most unicache_core.sizes.MAX_BYTES
    if isinstance(value, float):
        if not math.isfinite(value) or not 0.0 < value <= 1.0:
            raise ValueError(f"`kv_target` ratio must be in (0, 1] (e.g. 0.2 = keep 20%, 5x less KV), got {value!r}")
        return value
    raise ValueError(f"`kv_target` must be a ratio in (0, 1] or a byte count, got {type(value).__name__}")


def _ratio(name: str, value: Any, *, allow_zero: bool = False) -> float | None:
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (0.0 <= value <= 1.0 if allow_zero else 0.0 < value <= 1.0)
    if not ok:
        interval = "[0, 1]" if allow_zero else "(0, 1]"
        raise ValueError(f"`{name}` must be a number in {interval}, got {value!r}")
    return float(value)


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class KVConfig:
    """How one request's KV cache is compressed.

    Attributes:
        method: one of :data:`METHODS`.
        kv_target: memory target of the compressible (non-protected) KV: a retained ratio in (0, 1] of its
            full bytes, or a byte count over all branches. ``None``: the paper's reduction for the task
            (:data:`DEFAULT_REDUCTION`; baselines) / the rho schedule (unicache). For ``unicache`` an
            explicit target fixes ``rho0`` to it (the schedule may still decay to its floor).
        rho: unicache only: starting retention ``rho0`` (default 0.2 understanding, 0.5 t2i/edit).
        rho_floor: unicache only: the lowest retention the schedule may reach (default 0.35 t2i, 0.1 edit).
        policy: unicache only: a policy-table path or object (default: the table next to the checkpoint,
            else the shipped paper table ``unicache_core/compression/tables/bagel-7b-mot.json``).
        score_queries: most queries a call scores keys with (strided for latents, the last ones for text).
        window: observation window of SnapKV / PyramidKV (64).
        recent_fraction: recent share of an eviction budget (H2O-style; 0.25).
        kivi_residual: a fixed number of full-precision residual rows for the quantized segments of unicache
            and kivi (at most the segment; dropped when it does not fit the budget). ``None`` (default):
            the residual follows the segment's length (docs/compression.md §11.2).
        fit_ranges: unicache only: least-squares ranges for its quantized values (``None``, default: True,
            docs/compression.md §11.10); False quantizes them with KIVI's min-max, as the KIVI baseline does.
        fused: on calls that gather no statistics (the fast path), attend through one temporary head-major
            workspace per layer (resident rows, dequantized ones included, plus the new block) in a single
            exact attention call, instead of one call per store and an LSE merge (default on: measured
            about 15% faster per edit step on the medium benchmark checkpoint).
        sync_timing: synchronise CUDA around timed attention calls (exact per-call clocks, slower).
    """

    method: str = "full"
    kv_target: float | int | None = None
    rho: float | None = None
    rho_floor: float | None = None
    policy: Any = None
    score_queries: int = SCORE_QUERIES
    window: int = WINDOW
    recent_fraction: float = RECENT_FRACTION
    kivi_residual: int | None = None
    fit_ranges: bool | None = None
    fused: bool = True
    sync_timing: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown KV method {self.method!r}; choose one of {', '.join(METHODS)}")
        object.__setattr__(self, "kv_target", parse_kv_target(self.kv_target))
        rho = _ratio("rho", self.rho)
        floor = _ratio("rho_floor", self.rho_floor, allow_zero=True)
        if rho is not None and floor is not None and floor > rho:
            raise ValueError(f"`rho_floor` ({floor}) must not exceed `rho` ({rho}); lower the floor or raise rho")
        object.__setattr__(self, "rho", rho)
        object.__setattr__(self, "rho_floor", floor)
        if self.method != "unicache":
            for name in ("rho", "rho_floor", "policy"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"`{name}` applies to the unicache method only, not to {self.method!r}; "
                        "use `kv_target` to set a baseline's memory"
                    )
        if self.policy is not None and not isinstance(self.policy, (str, Path, PolicyTable)):
            raise ValueError(f"`policy` must be a policy-table path or PolicyTable, got {type(self.policy).__name__}")
        _positive_int("score_queries", self.score_queries)
        _positive_int("window", self.window)
        if self.kivi_residual is not None:
            _positive_int("kivi_residual", self.kivi_residual, 0)
        _ratio("recent_fraction", self.recent_fraction, allow_zero=True)
        if self.fit_ranges is not None:
            if not isinstance(self.fit_ranges, bool):
                raise ValueError(f"`fit_ranges` must be True, False or None, got {self.fit_ranges!r}")
            if self.method != "unicache":
                raise ValueError(f"`fit_ranges` applies to the unicache method only, not to {self.method!r}")
        for name in ("fused", "sync_timing"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be True or False, got {getattr(self, name)!r}")

    def quant_geometry(self, base: QuantGeometry) -> QuantGeometry:
        """``base`` (a table's or the default geometry) with the fixed residual of ``kivi_residual`` when set."""
        if self.kivi_residual is None:
            return base
        return replace(base, residual_max=self.kivi_residual, residual_share=1.0)

    @property
    def fits_value_ranges(self) -> bool:
        """UniCache's values get least-squares ranges (``fit_ranges``, default :data:`FIT_VALUE_RANGES`)."""
        return FIT_VALUE_RANGES if self.fit_ranges is None else self.fit_ranges

    def target_ratio(self, task: str) -> float | int:
        """The explicit target, or ``1 - DEFAULT_REDUCTION[task]``."""
        if self.kv_target is not None:
            return self.kv_target
        return round(1.0 - DEFAULT_REDUCTION[task], 6)

    def to_dict(self) -> dict:
        """The settings as plain JSON (the report's ``config``; a table object is named by its model id)."""
        policy = self.policy
        if isinstance(policy, PolicyTable):
            policy = policy.model_id
        return {
            "method": self.method,
            "kv_target": self.kv_target,
            "rho": self.rho,
            "rho_floor": self.rho_floor,
            "policy": None if policy is None else str(policy),
            "score_queries": self.score_queries,
            "window": self.window,
            "recent_fraction": self.recent_fraction,
            "kivi_residual": self.kivi_residual,
            "fit_ranges": self.fit_ranges,
            "fused": self.fused,
        }


__all__ = ["KVConfig", "METHODS", "parse_kv_target"]
