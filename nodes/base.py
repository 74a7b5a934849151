"""What every node of the pack shares: ComfyUI's V3 node base with the pack's input check, the pack's own socket
types, and the warnings a node shows on itself.

A node declares each input once, as a typed V3 input in its ``define_schema`` (bounds, default and tooltip there);
:meth:`UniCacheNode.validate_inputs` checks every declared widget against that declaration
(:func:`~.validation.check_widgets`), so no node lists its widgets a second time.
"""

from __future__ import annotations

import logging

from .host import io
from .validation import check_widgets

logger = logging.getLogger(__name__)

#: The pack's socket types (their names are the node-pack contract's: docs/nodepack-contract.md).
MODEL = io.Custom("BAGEL_MODEL")
KV = io.Custom("UNICACHE_KV")
REPORT = io.Custom("UNICACHE_KV_REPORT")
ITEMS = io.Custom("BAGEL_ITEMS")

#: The ``ui`` key of a node's warnings (web/unicache.js draws them on the node).
WARNINGS_UI = "unicache_warnings"
CATEGORY = "UniCache/BAGEL"


class UniCacheNode(io.ComfyNode):
    """The pack's V3 node base: ``validate_inputs`` checks every widget value against its declaration."""

    @classmethod
    def validate_inputs(cls, **values) -> bool | str:
        return check_widgets(cls, **values)


def warnings_ui(node: str, lines: list[str], ui: dict | None = None) -> dict:
    """``ui`` with the warning ``lines`` under :data:`WARNINGS_UI` (drawn on the node by web/unicache.js), each also
    logged with the node's name. An empty list is sent too: the frontend then clears the last run's warnings."""
    for line in lines:
        logger.warning("%s: %s", node, line)
    return {**(ui or {}), WARNINGS_UI: list(lines)}


__all__ = ["CATEGORY", "ITEMS", "KV", "MODEL", "REPORT", "WARNINGS_UI", "UniCacheNode", "warnings_ui"]
