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


def _share(name: str, default: float, low: float, tip: str):
    """A share widget in [low, 1]."""
    return io.Float.Input(name, default=default, min=low, max=1.0, step=0.01, tooltip=tip)


def _config_inputs() -> list:
    """The widgets of UniCacheKVConfig, in their order on the node."""
    return [
        io.Combo.Input(
            "method",
            options=list(METHODS),
            default="unicache",
            tooltip="Compression method. full = uncompressed (bit-identical to no KV node).",
        ),
        _share(
            "kv_target",
            0.0,
            0.0,
            "Retained share of the compressible KV memory (0.2 = keep 20%, 5x less). 0 = the task's default "
            f"(the paper's retention: {_per_task({t: round(1 - r, 6) for t, r in DEFAULT_REDUCTION.items()})}; "
            "for unicache: its rho schedule). unicache: a target is rho0 (rho, rho_floor unset); not for full.",
        ),
        _share(
            "rho",
            0.0,
            0.0,
            f"unicache only: starting retention rho0 in (0, 1]. 0 = the preset ({_per_task(RHO0)}). Refused "
            "with another method or beside kv_target.",
        ),
        _share(
            "rho_floor",
            -1.0,
            -1.0,
            "unicache only: the lowest retention the schedule decays to (<= rho). -1 = the preset "
            f"({_per_task(RHO_FLOOR)}); 0 is a real floor. Refused with another method or beside kv_target.",
        ),
        io.Combo.Input(
            "policy",
            options=policy_choices(),
            default=DEFAULT_POLICY,
            tooltip="unicache only (refused with another method): the policy table (which token type is "
            "evicted or quantized). default = the checkpoint's unicache_policy.json, else the shipped paper "
            "table. Other tables: JSON files in models/unicache_policies.",
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
    ]


class UniCacheKVConfig(UniCacheNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="UniCacheKVConfig",
            display_name="UniCache KV Config",
            category="UniCache/cache",
            description="KV-cache compression for the UniCache task nodes: `unicache` (typed: each token type kept at "
            "the rows and bits its calibrated policy gives, retention rho per step), a baseline (h2o, snapkv, "
            "pyramidkv, streamingllm, kivi, vlcache, lookm) or `full` (no compression, still reports bytes). Protected "
            "tokens (boundaries, the current latent, decoded text) are never compressed. Without this node a task "
            "runs with the full cache.",
            inputs=_config_inputs(),
            outputs=[
                KV.Output(
                    "kv",
                    display_name="kv",
                    tooltip="KV-compression settings; connect to the `kv` input of a task node.",
                )
            ],
        )

    @classmethod
    def validate_inputs(cls, **values) -> bool | str:
        """The widgets against their declarations, then (when none is linked) the settings against the method: a
        setting the method does not take, or two that contradict each other, is refused at ``/prompt`` as the
        command line refuses it, never run as if it were unset."""
        valid = check_widgets(cls, **values)
        if valid is not True or any(values.get(name) is None for name in ("method", *_SETTINGS) if name != "objective"):
            return valid
        settings = {name: values.get(name, unset) for name, unset in _SETTINGS.items()}
        try:
            _method(values["method"], **settings, policy_path="(checked at run)")
        except ValueError as exc:
            return str(exc)
        return True

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
        valid = check_widgets(cls, kv_target=kv_target, rho=rho, rho_floor=rho_floor, objective=objective)
        if valid is not True:  # a nan would otherwise read as "not set" below
            raise ValueError(f"UniCache KV config: {valid}")
        widgets = {"kv_target": kv_target, "rho": rho, "rho_floor": rho_floor, "policy": policy, "objective": objective}
        policy_path = str(host.policy_path(policy)) if method == "unicache" and policy != DEFAULT_POLICY else None
        try:
            return io.NodeOutput(_method(method, **widgets, policy_path=policy_path, score_queries=score_queries))
        except ValueError as exc:
            raise ValueError(f"UniCache KV config: {exc}") from None


#: The widgets that set a method's settings, and each one's value meaning "unset" (the task's preset).
_SETTINGS = {"kv_target": 0.0, "rho": 0.0, "rho_floor": -1.0, "policy": DEFAULT_POLICY, "objective": UNICACHE_OBJECTIVE}


def _given(widgets: dict) -> dict:
    """The widgets set to a value (``kv_target``, ``rho`` > 0, ``rho_floor`` >= 0, a ``policy`` file)."""
    limits = {"kv_target": 0.0, "rho": 0.0}
    given = {name: widgets[name] for name, low in limits.items() if widgets[name] > low}
    if widgets["rho_floor"] >= 0:
        given["rho_floor"] = widgets["rho_floor"]
    if widgets["policy"] != DEFAULT_POLICY:
        given["policy"] = widgets["policy"]
    if widgets.get("objective", UNICACHE_OBJECTIVE) != UNICACHE_OBJECTIVE:
        given["objective"] = widgets["objective"]
    return given


def _method(method: str, *, policy_path: str | None, score_queries: int = SCORE_QUERIES_OF_METHOD, **widgets):
    """The method of the widgets. A widget at its unset value (:data:`_SETTINGS`) is left out; any other is given,
    so a setting of another method (``rho`` with ``h2o``, ``kv_target`` with ``full``) or one that contradicts
    another (``rho`` beside ``kv_target``) is one ValueError naming the widget, never ignored."""
    given = _given(widgets)
    for name, value in given.items():
        applies = method == "unicache" or name == "kv_target" and method != "full"
        if not applies:
            which = (
                "the unicache method only" if name != "kv_target" else "the compressing methods (full keeps every row)"
            )
            unset = _SETTINGS[name]
            raise ValueError(
                f"{name} = {value!r} applies to {which}, not to {method!r}; set {name} to "
                f"{unset if isinstance(unset, str) else f'{unset:g}'} (unset) or choose another method"
            )
    if "policy" in given:
        given["policy"] = policy_path
    if int(score_queries) != SCORE_QUERIES_OF_METHOD:
        given["score_queries"] = int(score_queries)
    return method_from_name(method, **given)
