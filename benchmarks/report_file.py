"""Writing a benchmark's JSON report."""

from __future__ import annotations

import json
from pathlib import Path


def write_json_report(path: Path, report: dict) -> None:
    """Write ``report`` as indented JSON to ``path``, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
