"""The BAGEL engine's command line: ``python -m unicache_core.bagel`` (:mod:`.main`).

Argument checks (:mod:`.checks`), the item list of repeated ``--image`` or ``--items FILE.json`` (:mod:`.items`,
:mod:`.items_file`), the files a command reads and writes (:mod:`.files`) and the ``plan`` command
(:mod:`.memory`). The top layer of the engine: it calls the run path and the memory plan, and nothing of the engine
imports it (import-linter contract ``engine-in-three-packages``).
"""
