"""``python -m unicache_core.bagel.calibrate``: the calibration command line.

The code lives in :mod:`unicache_core.bagel.calibration` (:mod:`~unicache_core.bagel.calibration.cli` for
the arguments); this module is the command's entry point.
"""

from __future__ import annotations

import sys

from .calibration.cli import main

if __name__ == "__main__":
    sys.exit(main())
