"""BAGEL network modules (``nn.Module`` only); parameter names equal the official checkpoint keys."""

from .autoencoder import AutoEncoder
from .bagel import Bagel, grid_position_ids, patchify

__all__ = ["AutoEncoder", "Bagel", "grid_position_ids", "patchify"]
