"""``UniCacheKVConfig``: the KV-compression method of a request → ``UNICACHE_KV`` (a frozen method object,
:mod:`unicache_core.compression.methods`)."""

from __future__ import annotations

import logging

from unicache_core.compression import METHODS, method_from_name
from unicache_core.compression.defaults import (
    DEFAULT_REDUCTION,
    RHO0,
    RHO_FLOOR,
    SCORE_QUERIES,
    SCORE_QUERIES_OF_METHOD,
    UNICACHE_OBJECTIVE,
    UNICACHE_OBJECTIVES,
    UNICACHE_SCORE_QUERIES,
)

from . import host
from .base import KV, UniCacheNode
from .host import io
from .validation import check_widgets

logger = logging.getLogger(__name__)

#: Policy choice meaning "the checkpoint's own unicache_policy.json, else the shipped paper table".
DEFAULT_POLICY = "default"


def _per_task(values: dict[str, float]) -> str:
    """``values`` per task as the tooltips say them, from unicache_core/compression/defaults.py."""
    names = {"understanding": "understanding", "t2i": "text-to-image", "edit": "edit"}
    return ", ".join(f"{values[task]:g} {name}" for task, name in names.items() if task in values)


def policy_choices() -> list[str]:
    try:
        files = host.policy_files()
    except ImportError:  # no host: the shipped tables
        files = sorted(p.name for p in host.SHIPPED_POLICY_DIR.glob("*.json"))
    return [DEFAULT_POLICY] + [f for f in files if f != DEFAULT_POLICY]


class UniCacheKVConfig(UniCacheNode):
    @classmethod
    def define_schema(cls):
        def share(name: str, default: float, low: float, tip: str):
            return io.Float.Input(name, default=default, min=low, max=1.0, step=0.01, tooltip=tip)

        return io.Schema(
            node_id="UniCacheKVConfig",
            display_name="UniCache KV Config",
            category="UniCache/cache",
            description="KV-cache compression for the UniCache task nodes: `unicache` (typed: each token type kept at "
            "the rows and bits its calibrated policy gives, retention rho per step), a baseline (h2o, snapkv, "
            "pyramidkv, streamingllm, kivi, vlcache, lookm) or `full` (no compression, still reports bytes). Protected "
            "tokens (boundaries, the current latent, decoded text) are never compressed. Without this node a task "
            "runs with the full cache.",
            inputs=[
                io.Combo.Input(
                    "method",
                    options=list(METHODS),
                    default="unicache",
                    tooltip="Compression method. full = uncompressed (bit-identical to no KV node).",
                ),
                share(
                    "kv_target",
                    0.0,
                    0.0,
                    "Retained share of the compressible KV memory (0.2 = keep 20%, 5x less). 0 = the task's default "
                    f"(the paper's retention: {_per_task({t: round(1 - r, 6) for t, r in DEFAULT_REDUCTION.items()})}; "
                    "for unicache: its rho schedule). For unicache an explicit target fixes rho0.",
                ),
                share(
                    "rho",
                    0.0,
                    0.0,
                    f"unicache only: starting retention rho0 in (0, 1]. 0 = the preset ({_per_task(RHO0)}). Ignored by "
                    "the other methods.",
                ),
                share(
                    "rho_floor",
                    -1.0,
                    -1.0,
                    "unicache only: the lowest retention the schedule decays to (<= rho). -1 = the preset "
                    f"({_per_task(RHO_FLOOR)}); 0 is a real floor. Ignored by the other methods.",
                ),
                io.Combo.Input(
                    "policy",
                    options=policy_choices(),
                    default=DEFAULT_POLICY,
                    tooltip="unicache only: the policy table (which token type is evicted or quantized). default = "
                    "the checkpoint's unicache_policy.json, else the shipped paper table. Other tables: JSON files "
                    "in models/unicache_policies.",
                ),
                io.Int.Input(
                    "score_queries",
                    optional=True,
                    default=SCORE_QUERIES_OF_METHOD,
                    min=SCORE_QUERIES_OF_METHOD,
                    max=65536,
                    step=1,
                    tooltip="Most queries a forward scores keys with (strided image or latent queries, or the last "
                    f"text queries). {SCORE_QUERIES_OF_METHOD} = the method's default ({UNICACHE_SCORE_QUERIES} "
                    f"unicache, {SCORE_QUERIES} the baselines). More is more exact and slower.",
                ),
                io.Combo.Input(
                    "objective",
                    optional=True,
                    options=list(UNICACHE_OBJECTIVES),
                    default=UNICACHE_OBJECTIVE,
                    tooltip="unicache only: speed = the types the policy table evicts are evicted, so fewer rows are "
                    "read at every step (the paper's UniCache; never slower than full KV); memory = they may be kept "
                    "at low bits instead, every row read (the least error for the bytes, slower on a CPU).",
                ),
            ],
            outputs=[
                KV.Output(
                    "kv",
                    display_name="kv",
                    tooltip="KV-compression settings; connect to the `kv` input of a task node.",
                )
            ],
        )

    @classmethod
    def execute(
        cls,
        method,
        kv_target,
        rho,
        rho_floor,
        policy,
        score_queries=SCORE_QUERIES_OF_METHOD,
        objective=UNICACHE_OBJECTIVE,
    ) -> io.NodeOutput:
        valid = check_widgets(cls, kv_target=kv_target, rho=rho, rho_floor=rho_floor)
        if valid is not True:  # a nan would otherwise read as "not set" below
            raise ValueError(f"UniCache KV config: {valid}")
        unicache = method == "unicache"
        if not unicache and (rho > 0 or rho_floor >= 0 or policy != DEFAULT_POLICY or objective != UNICACHE_OBJECTIVE):
            logger.warning("rho, rho_floor, policy and objective apply to unicache only; ignored for method %r", method)
        policy_path = str(host.policy_path(policy)) if unicache and policy != DEFAULT_POLICY else None
        settings: dict = {"kv_target": kv_target if kv_target > 0 else None}
        if int(score_queries) != SCORE_QUERIES_OF_METHOD:
            settings["score_queries"] = int(score_queries)
        if unicache:
            settings.update(
                rho=rho if rho > 0 else None,
                rho_floor=rho_floor if rho_floor >= 0 else None,
                policy=policy_path,
                objective=objective,
            )
        try:
            return io.NodeOutput(method_from_name(method, **settings))
        except ValueError as exc:
            raise ValueError(f"UniCache KV config: {exc}") from None
