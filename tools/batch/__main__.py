"""``python -m tools.batch``: see :mod:`tools.batch`."""

import sys

from tools.batch.cli import main

sys.exit(main())
