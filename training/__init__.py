"""Training the bundled shapes model (BAGEL's architecture at a small width), see ``trainer``.

``python -m training OUT_DIR [--work DIR] [options]`` trains (resumably) and
writes the checkpoint in the official folder layout.
"""

from .config import TrainConfig
from .model import SHAPES_TRANSFORMS, VARIANT, ShapesGeometry, build_models, shapes_config, shapes_tokenizer
from .trainer import run

__all__ = [
    "SHAPES_TRANSFORMS",
    "ShapesGeometry",
    "TrainConfig",
    "VARIANT",
    "build_models",
    "run",
    "shapes_config",
    "shapes_tokenizer",
]
