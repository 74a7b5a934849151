"""``python -m unicache_core.bagel``: the engine's command line, in :mod:`unicache_core.bagel.cli.main`."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
