"""Cache factories by method name: ``make_cache_factory("unicache", KVConfig(...))``."""

from __future__ import annotations

from collections.abc import Callable

from ..kv.cache import CacheFactory, CacheSession, RequestInfo
from .baselines import H2OMethod, KIVIMethod, PyramidKVMethod, SnapKVMethod, StreamingLLMMethod, VLCacheMethod
from .compressing_cache import CompressionSession
from .config import METHODS, KVConfig
from .full import FullMethod, FullSession
from .method import CompressionMethod
from .policy_table import resolve_policy_table
from .unicache import UniCacheMethod

_BASELINES: dict[str, Callable[[], CompressionMethod]] = {
    "h2o": H2OMethod,
    "snapkv": SnapKVMethod,
    "pyramidkv": PyramidKVMethod,
    "streamingllm": StreamingLLMMethod,
    "kivi": KIVIMethod,
    "vlcache": VLCacheMethod,
}


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
            table.require_task(request.task)
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


def make_cache_factory(
    method: str | KVConfig = "full", config: KVConfig | None = None, *, checkpoint_dir: str = "", **settings
) -> CacheFactory:
    """The :class:`CacheFactory` of a method selected by name.

    ``make_cache_factory("unicache")``, ``make_cache_factory("h2o", kv_target=0.2)`` or
    ``make_cache_factory(KVConfig(method="kivi", kv_target="40%"))``. ``full`` gives uncompressed caches
    (bit-identical to no factory) that report bytes and attention time like every method. ``checkpoint_dir``: where
    unicache looks for the checkpoint's own policy table.
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


__all__ = ["FullCacheFactory", "MethodCacheFactory", "make_cache_factory"]
