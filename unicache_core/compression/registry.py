"""Cache factories by method name: ``make_cache_factory("unicache", KVConfig(...))``."""

from __future__ import annotations

import logging
from importlib import resources
from pathlib import Path
from typing import Callable

from ..kv.cache import CacheFactory, CacheSession, RequestInfo
from .routing import PolicyTable, PolicyTableError
from .method import CompressionMethod
from .baselines import H2OMethod, KIVIMethod, PyramidKVMethod, SnapKVMethod, StreamingLLMMethod, VLCacheMethod
from .compressing_cache import CompressionSession
from .config import METHODS, KVConfig
from .full import FullMethod, FullSession
from .unicache import UniCacheMethod

logger = logging.getLogger(__name__)

#: File a checkpoint folder may hold with the policy table calibrated on it.
CHECKPOINT_POLICY_FILE = "unicache_policy.json"
#: The shipped paper table (instruction and source-ViT evicted, source-VAE quantized).
PAPER_TABLE = "bagel-7b-mot.json"

_BASELINES: dict[str, Callable[[], CompressionMethod]] = {
    "h2o": H2OMethod, "snapkv": SnapKVMethod, "pyramidkv": PyramidKVMethod, "streamingllm": StreamingLLMMethod,
    "kivi": KIVIMethod, "vlcache": VLCacheMethod,
}


def paper_policy_table() -> PolicyTable:
    """The shipped ``unicache_core/compression/tables/bagel-7b-mot.json`` (the paper's assignment)."""
    path = resources.files("unicache_core.compression").joinpath("tables", PAPER_TABLE)
    return PolicyTable.load(Path(str(path)))


def resolve_policy_table(policy, checkpoint_dir: str, model_id: str) -> tuple[PolicyTable, dict]:
    """The table a unicache run uses and a record of where it came from.

    Explicit ``policy`` (path or table) → used, refused if made for another model; else
    ``<checkpoint>/unicache_policy.json``; else the paper table, with a warning in the report.
    """
    if policy is not None:
        if isinstance(policy, PolicyTable):
            table, origin = policy, "given"
        else:
            table, origin = PolicyTable.load(policy, model_id=model_id or None), str(policy)
        if isinstance(policy, PolicyTable) and model_id and table.model_id and table.model_id != model_id:
            raise PolicyTableError(f"the given policy table was made for {table.model_id!r}, not for this "
                                   f"checkpoint ({model_id!r})")
        return table, {"path": origin, "model_id": table.model_id, "source": table.source, "warning": None}
    if checkpoint_dir:
        local = Path(checkpoint_dir) / CHECKPOINT_POLICY_FILE
        if local.is_file():
            table = PolicyTable.load(local, model_id=model_id or None)
            return table, {"path": str(local), "model_id": table.model_id, "source": table.source, "warning": None}
    table = paper_policy_table()
    warning = None
    if model_id != table.model_id:
        warning = (f"no policy table calibrated on this checkpoint ({model_id or 'unknown model'}): using the paper's "
                   f"assignment for {table.model_id}; run `python -m unicache_core.bagel.calibrate` to make one")
        logger.warning(warning)
    return table, {"path": PAPER_TABLE, "model_id": table.model_id, "source": table.source, "warning": warning}


class MethodCacheFactory(CacheFactory):
    """Starts a :class:`~unicache_core.compression.compressing_cache.CompressionSession` of one method per request."""

    def __init__(self, method: str, config: KVConfig, checkpoint_dir: str = ""):
        self.method = method
        self.config = config
        self.checkpoint_dir = checkpoint_dir

    def start(self, request: RequestInfo) -> CacheSession:
        policy_info = None
        if self.method == "unicache":
            table, policy_info = resolve_policy_table(self.config.policy, self.checkpoint_dir, request.model_id)
            method: CompressionMethod = UniCacheMethod(table)
        else:
            method = _BASELINES[self.method]()
        return CompressionSession(request, method, self.config, policy_info)


class FullCacheFactory(CacheFactory):
    """``full`` with a report: uncompressed :class:`~unicache_core.kv.cache.FullKVCache` caches (bit-identical to
    no factory) that also measure attention time, attended rows and bytes."""

    method = "full"

    def __init__(self, config: KVConfig):
        self.config = config

    def start(self, request: RequestInfo) -> CacheSession:
        return FullSession(request, FullMethod(), self.config)


def make_cache_factory(method: str | KVConfig = "full", config: KVConfig | None = None, *,
                       checkpoint_dir: str = "", **settings) -> CacheFactory:
    """The :class:`CacheFactory` of a method selected by name.

    ``make_cache_factory("unicache")``, ``make_cache_factory("h2o", kv_target=0.2)`` or
    ``make_cache_factory(KVConfig(method="kivi", kv_target="40%"))``. ``full`` gives uncompressed caches
    (bit-identical to no factory) that report bytes and attention time like every method. ``checkpoint_dir``: where unicache looks for the checkpoint's
    own policy table.
    """
    if isinstance(method, KVConfig):
        config, method = method, method.method
    if config is None:
        config = KVConfig(method=method, **settings)
    elif settings:
        raise ValueError("pass either a KVConfig or keyword settings, not both")
    if method not in METHODS:
        raise ValueError(f"unknown KV method {method!r}; choose one of {', '.join(METHODS)}")
    if config.method != method:
        raise ValueError(f"method {method!r} differs from config.method {config.method!r}")
    if method == "full":
        return FullCacheFactory(config)
    return MethodCacheFactory(method, config, str(checkpoint_dir) if checkpoint_dir else "")


__all__ = ["CHECKPOINT_POLICY_FILE", "MethodCacheFactory", "make_cache_factory", "paper_policy_table",
           "resolve_policy_table"]
