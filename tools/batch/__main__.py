"""``python -m tools.batch``: see :mod:`tools.batch` (with ``--ray``, under :mod:`tools.batch.supervisor`)."""

import sys

from tools.batch.cli import main
from tools.batch.supervisor import supervise

argv = sys.argv[1:]
sys.exit(supervise(main, argv) if "--ray" in argv else main(argv))
