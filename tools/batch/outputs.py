"""A finished run on disk: its outputs under ``OUT/<run>/`` with names made safe, and its summary fields.

Node ids and file names come from the host and may hold anything (``/../../x``, ``..``, absolute paths, NUL,
thousands of characters): :func:`safe_part` keeps letters, digits, ``-``, ``_`` and ``.`` (no leading dot)
and caps the length, so a name is one plain path component, and :class:`RunFolder` checks that every file
lands directly in the run's folder before it writes (temp file + rename, never through a symlink).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from tools.batch.client import Outcome, one_line
from tools.batch.work import Run, kv_saved

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def safe_part(text: str, limit: int) -> str:
    """``text`` as one safe file-name component of at most ``limit`` characters (its extension kept)."""
    name = _UNSAFE.sub("_", str(text)).lstrip(".") or "_"
    if len(name) > limit:
        stem, dot, ext = name.rpartition(".")
        keep = f".{ext}" if dot and stem and len(ext) <= 8 else ""
        name = name[: limit - len(keep)] + keep
    return name


def output_name(node_id: str, filename: str, k: int) -> str:
    """``node<id>_<k>_<file>`` for output ``k`` of a node (only the last path component of ``filename``)."""
    last = str(filename).replace("\\", "/").rsplit("/", 1)[-1]
    return f"node{safe_part(node_id, 32)}_{k}_{safe_part(last, 96)}"


class RunFolder:
    """``root/<index:04d>/``: unique safe names, atomic writes, nothing outside the folder."""

    def __init__(self, root: Path, index: int):
        self.dir = Path(root) / f"{index:04d}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._real = self.dir.resolve()
        self._names: set[str] = set()

    def write(self, name: str, data: bytes) -> Path:
        name = self._unique(safe_part(name, 160))
        path = self.dir / name
        if path.parent != self.dir or (self._real / name).parent != self._real:
            raise ValueError(f"output name {name!r} leaves {self.dir}")  # safe_part makes this impossible
        fd, tmp = tempfile.mkstemp(dir=self._real, prefix=".part-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, self._real / name)  # replaces a symlink of that name, never follows it
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def _unique(self, name: str) -> str:
        stem, dot, ext = name.rpartition(".")
        if not dot or not stem:
            stem, ext = name, ""
        candidate, n = name, 1
        while candidate in self._names:
            candidate = f"{stem}-{n}" + (f".{ext}" if ext else "")
            n += 1
        self._names.add(candidate)
        return candidate


def record_outcome(run: Run, outcome: Outcome, out_root: Path, report_ids: list[str]) -> None:
    """Write ``outcome``'s files under ``out_root/<run>/``; fill ``run``'s status, outputs and KV figures."""
    run.host, run.prompt_id = outcome.host, outcome.prompt_id
    folder = RunFolder(out_root, run.index)
    try:
        _write_files(run, outcome, folder)
        (folder.dir / "history.json").write_text(json.dumps(outcome.history, indent=1))
    except (ValueError, RecursionError) as e:  # host JSON too deep or odd to write back out
        run.status, run.error = "failed", f"the host's answer cannot be stored: {one_line(e, 200)}"
        return
    except OSError as e:
        run.status, run.error = "failed", f"cannot write the outputs under {folder.dir}: {one_line(e, 200)}"
        return
    if outcome.status != "success":
        run.status, run.error = "error", outcome.error
        return
    run.status, run.error = "success", None
    ui: dict[str, dict] = {nid: {"unicache_kv": data} for nid, data in outcome.kv.items()}
    for nid, text in outcome.texts:
        ui.setdefault(nid, {}).setdefault("text", []).append(text)
    run.kv_bytes_saved, run.kv_summary = kv_saved([ui.get(nid, {}) for nid in report_ids] or list(ui.values()))
    if len(report_ids) > 1:  # e.g. an A/B workflow: every report node's numbers, by node id
        run.kv_by_node = {nid: kv_saved([ui.get(nid, {})])[1] for nid in report_ids}


def _write_files(run: Run, outcome: Outcome, folder: RunFolder) -> None:
    counts: dict[str, int] = {}
    for nid, filename, data in outcome.images:
        k = counts[f"i{nid}"] = counts.get(f"i{nid}", -1) + 1
        run.outputs.append(str(folder.write(output_name(nid, filename, k), data)))
    for nid, text in outcome.texts:
        k = counts[f"t{nid}"] = counts.get(f"t{nid}", -1) + 1
        run.outputs.append(str(folder.write(f"node{safe_part(nid, 32)}_{k}.txt", text.encode(errors="replace"))))
    for nid, data in outcome.kv.items():
        name = f"node{safe_part(nid, 32)}_unicache_kv.json"
        run.outputs.append(str(folder.write(name, json.dumps(data, indent=1).encode())))
