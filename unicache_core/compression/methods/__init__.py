"""The built-in methods, one file each; importing this package registers them (in this order) with
:data:`~unicache_core.compression.method.METHODS`."""

# ruff: noqa: I001  (the import order is the registration order, the order users are offered the methods in)

from .full import Full
from .unicache import UniCache
from .h2o import H2O
from .snapkv import SnapKV
from .pyramidkv import PyramidKV
from .streamingllm import StreamingLLM
from .kivi import KIVI
from .vlcache import VLCache
from .lookm import LOOKM

__all__ = ["H2O", "KIVI", "LOOKM", "Full", "PyramidKV", "SnapKV", "StreamingLLM", "UniCache", "VLCache"]
