"""ComfyUI glue of the pack: thin V3 node classes over ``unicache_core`` (see docs/nodepack-contract.md).

:func:`comfy_entrypoint` is what ComfyUI loads (a ``ComfyExtension`` listing the nodes); the two mappings name the
same classes by node id for the pack's tools and tests.
"""

from .host import ComfyExtension, filter_prompt_errors
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


class UniCacheExtension(ComfyExtension):
    """The pack as a V3 extension: its node classes (and, in a host, its refusals given once each at ``/prompt``:
    :func:`~.host.filter_prompt_errors`; ComfyUI 0.3.75 calls no ``on_load``, so it is added here)."""

    async def get_node_list(self) -> list:
        filter_prompt_errors(set(NODE_CLASS_MAPPINGS))
        return list(NODE_CLASS_MAPPINGS.values())


async def comfy_entrypoint() -> UniCacheExtension:
    """ComfyUI's V3 entry point (``nodes.load_custom_node`` calls it when the pack exports no V1 mappings)."""
    return UniCacheExtension()


__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "UniCacheExtension", "comfy_entrypoint"]
