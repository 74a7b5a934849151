"""UniCache for BAGEL: the ComfyUI node pack entry (V3 API: ``comfy_entrypoint``).

ComfyUI imports this package from ``custom_nodes/``. The library ``unicache_core`` lives next to it; when it
is not installed into the environment, the pack folder is appended to ``sys.path`` so it imports.
"""

import logging
import os
import sys

try:
    import unicache_core  # noqa: F401  (installed with `pip install -e .`)
except ImportError:
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))

if __package__:  # ComfyUI (and any import by package name)
    from .nodes import comfy_entrypoint
    from .nodes import host as _host
else:
    # Imported as a plain top-level module: pytest sets the checkout folder up as a package and, when the
    # folder's name is not an identifier (e.g. "comfyui-unicache-bagel"), imports this file as "__init__".
    _here = os.path.dirname(os.path.abspath(__file__))
    if _here not in sys.path:
        sys.path.append(_here)
    from nodes import comfy_entrypoint
    from nodes import host as _host

try:
    _host.register_folders()  # the `bagel` and `unicache_policies` model folders
except ImportError:  # imported outside ComfyUI
    logging.getLogger(__name__).debug("folder_paths not importable: model folders not registered")

WEB_DIRECTORY = "./web"

# No NODE_CLASS_MAPPINGS here: ComfyUI takes a pack's V1 mappings before its V3 entry point.
__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
