"""ComfyUI glue of the pack: thin V1 node classes over ``unicache_core`` (see docs/nodepack-contract.md)."""

from .items_nodes import UniCacheImageItem, UniCacheTextItem
from .kv_nodes import UniCacheKVConfig
from .loader_node import UniCacheBagelLoader
from .report_node import UniCacheKVReport
from .task_nodes import UniCacheImageEdit, UniCacheTextToImage, UniCacheUnderstand

NODE_CLASS_MAPPINGS = {
    "UniCacheBagelLoader": UniCacheBagelLoader,
    "UniCacheKVConfig": UniCacheKVConfig,
    "UniCacheTextToImage": UniCacheTextToImage,
    "UniCacheImageEdit": UniCacheImageEdit,
    "UniCacheUnderstand": UniCacheUnderstand,
    "UniCacheKVReport": UniCacheKVReport,
    "UniCacheImageItem": UniCacheImageItem,
    "UniCacheTextItem": UniCacheTextItem,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "UniCacheBagelLoader": "UniCache BAGEL Loader",
    "UniCacheKVConfig": "UniCache KV Config",
    "UniCacheTextToImage": "UniCache BAGEL Text to Image",
    "UniCacheImageEdit": "UniCache BAGEL Image Edit",
    "UniCacheUnderstand": "UniCache BAGEL Understand",
    "UniCacheKVReport": "UniCache KV Report",
    "UniCacheImageItem": "UniCache BAGEL Image Item",
    "UniCacheTextItem": "UniCache BAGEL Text Item",
}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
