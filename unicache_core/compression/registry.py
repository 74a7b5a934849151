"""Cache factories of a method: ``make_cache_factory("unicache")``, ``make_cache_factory(SnapKV(window=32))``."""

from __future__ import annotations

from typing import Any

from ..kv.cache import CacheFactory, CacheSession, RequestInfo
from .full_cache import FullSession
from .method import Method, method_from_name
from .methods import Full
from .session import CompressionSession


class MethodCacheFactory(CacheFactory):
    """Starts a :class:`~unicache_core.compression.session.CompressionSession` of one method per request.

    Attributes:
        method: the method as the user gave it (its files are resolved for each request: :meth:`Method.bind`;
            its name is ``method.name``).
        checkpoint_dir: where the method looks for the checkpoint's own files (UniCache's policy table).
    """

    def __init__(self, method: Method, checkpoint_dir: str = ""):
        self.method = method
        self.checkpoint_dir = checkpoint_dir

    def start(self, request: RequestInfo) -> CacheSession:
        bound, policy_info = self.method.bind(request, self.checkpoint_dir)
        return CompressionSession(request, bound, policy_info, self.method.settings())


class FullCacheFactory(CacheFactory):
    """``full`` with a report: uncompressed :class:`~unicache_core.kv.cache.FullKVCache` caches (bit-identical to no
    factory) that also measure attention time, attended rows and bytes."""

    def __init__(self, method: Full):
        self.method = method

    def start(self, request: RequestInfo) -> CacheSession:
        return FullSession(request, self.method)


def make_cache_factory(method: str | Method = "full", *, checkpoint_dir: str = "", **settings: Any) -> CacheFactory:
    """The :class:`CacheFactory` of a method, given as an object or by name with its settings.

    ``make_cache_factory("unicache")``, ``make_cache_factory("h2o", kv_target=0.2)`` or
    ``make_cache_factory(KIVI(kv_target="40%"))``. ``full`` gives uncompressed caches (bit-identical to no factory)
    that report bytes and attention time like every method. ``checkpoint_dir``: where a method looks for the
    checkpoint's own files (UniCache: its policy table).
    """
    chosen = method_from_name(method, **settings)
    if isinstance(chosen, Full):
        return FullCacheFactory(chosen)
    return MethodCacheFactory(chosen, str(checkpoint_dir) if checkpoint_dir else "")


__all__ = ["FullCacheFactory", "MethodCacheFactory", "make_cache_factory"]
