"""What a batch is made of: the workflow, its runs (seed, prompt) and the per-run record of the summary."""

from __future__ import annotations

import copy
import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from unicache_commands.input_files import read_text_file

logger = logging.getLogger("unicache.batch")

#: Nodes whose ``seed``/``prompt`` inputs a run varies.
SEEDED_NODES = ("UniCacheTextToImage", "UniCacheImageEdit", "UniCacheUnderstand")
REPORT_NODE = "UniCacheKVReport"
SEED_MAX = 2**64 - 1
#: Most runs in one batch: the summary keeps one record per run (about 1 KB in memory and in the JSON), so a batch
#: is bounded; split a larger one with --seed-start.
MAX_COUNT = 100_000
#: Largest workflow file read (the shipped ones are a few KB).
MAX_WORKFLOW_BYTES = 16 << 20
#: Largest --seeds / --prompts file read.
MAX_LIST_BYTES = 64 << 20


@dataclass
class Run:
    """One run of the batch and, once it is over, what happened to it (one entry of the summary's ``runs``).

    ``status``: pending, success (outputs written), error (the host ran the graph and a node failed) or failed
    (no usable result: the host went away for good, answered something malformed, or the batch timed out).
    ``attempts``: times a host accepted the prompt; ``retries``: why each earlier attempt was abandoned.
    ``worker``/``node``: the Ray worker and Ray node id that produced the result (None without Ray).
    """

    index: int
    seed: int
    prompt_text: str | None
    host: str | None = None
    prompt_id: str | None = None
    status: str = "pending"
    seconds: float | None = None
    attempts: int = 0
    hosts_tried: list[str] = field(default_factory=list)
    retries: list[str] = field(default_factory=list)
    worker: int | None = None
    node: str | None = None
    kv_bytes_saved: int | None = None
    kv_summary: dict | None = None
    kv_by_node: dict | None = None
    outputs: list[str] = field(default_factory=list)
    error: str | None = None

    def summary(self) -> dict:
        return asdict(self)


def make_runs(count: int, seeds: Sequence[int], prompts: list[str] | None) -> list[Run]:
    """``count`` runs (at most :data:`MAX_COUNT`): run ``i`` has ``seeds[i]`` and prompt line ``i mod len(prompts)``
    (or no prompt). ``seeds`` may be a ``range``: nothing is made per run before the count is checked."""
    if not 1 <= count <= MAX_COUNT:
        raise ValueError(f"--count {count}: a batch holds 1 to {MAX_COUNT} runs")
    return [Run(i, seeds[i], prompts[i % len(prompts)] if prompts else None) for i in range(count)]


def vary(workflow: dict, seed: int, prompt_text: str | None) -> dict:
    """A copy of ``workflow`` with ``seed`` (and ``prompt_text``) on every UniCache task node."""
    graph = copy.deepcopy(workflow)
    found = False
    for node in graph.values():
        if not isinstance(node, dict) or node.get("class_type") not in SEEDED_NODES:
            continue
        found = True
        inputs = node.setdefault("inputs", {})
        if not isinstance(inputs.get("seed"), list):  # a linked seed stays linked
            inputs["seed"] = seed
        if prompt_text is not None and not isinstance(inputs.get("prompt"), list):
            inputs["prompt"] = prompt_text
    if not found:
        logger.warning("no %s node in the workflow: runs differ only by their number", "/".join(SEEDED_NODES))
    return graph


def report_node_ids(workflow: dict) -> list[str]:
    """Ids of the workflow's KV report nodes, in numeric order ("2" before "10")."""
    ids = (nid for nid, n in workflow.items() if isinstance(n, dict) and n.get("class_type") == REPORT_NODE)
    return sorted(ids, key=lambda x: (len(x), x))


def _read_text(path: Path, label: str, max_bytes: int, advice: str) -> str:
    """A regular UTF-8 file of at most ``max_bytes`` (a FIFO or /dev/zero refused, a byte-order mark dropped)."""
    return read_text_file(path, label=label, max_bytes=max_bytes, advice=advice)


def load_workflow(path: Path) -> dict:
    """The API-format graph of the workflow file (a regular file of at most :data:`MAX_WORKFLOW_BYTES`)."""
    text = _read_text(path, f"workflow {path}", MAX_WORKFLOW_BYTES, "pass an API-format workflow JSON file")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"workflow {path}: {e}") from e
    if isinstance(data, dict) and "nodes" in data and "links" in data:
        raise ValueError(f"workflow {path} is in the UI format; export it in the API format (workflows/api/)")
    if (
        not isinstance(data, dict)
        or not data
        or not all(isinstance(v, dict) and "class_type" in v for v in data.values())
    ):
        raise ValueError(f"workflow {path}: not an API-format graph ({{node_id: {{class_type, inputs}}}})")
    return data


def read_seeds(path: Path, count: int) -> list[int]:
    """The first ``count`` seeds of ``--seeds`` (one integer a line; ``#`` lines and blank lines skipped)."""
    seeds = []
    text = _read_text(path, f"--seeds {path}", MAX_LIST_BYTES, "pass a text file of one seed a line")
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            s = int(line, 0)
        except ValueError:
            raise ValueError(f"--seeds {path} line {n}: {line!r} is not an integer") from None
        if not 0 <= s <= SEED_MAX:
            raise ValueError(f"--seeds {path} line {n}: {s} is outside 0..2**64-1")
        seeds.append(s)
        if len(seeds) == count:
            break
    if len(seeds) < count:
        raise ValueError(f"--seeds {path} has {len(seeds)} seeds, --count asks for {count}")
    return seeds


def read_prompts(path: Path) -> list[str]:
    """The prompt lines of ``--prompts`` (UTF-8, a byte-order mark dropped; ``#`` lines and blank lines skipped)."""
    text = _read_text(path, f"--prompts {path}", MAX_LIST_BYTES, "pass a UTF-8 text file of one prompt a line")
    prompts = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not prompts:
        raise ValueError(f"--prompts {path} has no prompt lines")
    return prompts


# ------------------------------------------------------------------------------------------ KV figures


def _number(value) -> float | None:
    """``value`` when it is a finite JSON number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def find_number(obj, key: str, max_nodes: int = 100_000) -> float | None:
    """The first finite number stored under ``key`` in nested dicts/lists (breadth first, bounded)."""
    queue, seen = [obj], 0
    while queue and seen < max_nodes:
        item = queue.pop(0)
        seen += 1
        if isinstance(item, dict):
            found = _number(item.get(key))
            if found is not None:
                return found
            queue.extend(item.values())
        elif isinstance(item, list):
            queue.extend(item)
    return None


def _byte_count(value: float | None) -> int | None:
    return None if value is None or abs(value) >= 2**63 else int(value)


_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 1024, "mib": 1024**2, "gib": 1024**3}


def kv_saved(outputs: list[dict]) -> tuple[int | None, dict | None]:
    """KV bytes saved by the run, from the report node's ``ui`` output (chart data, else its text).

    ``outputs``: the ui dicts of the report nodes; returns (bytes saved by the first one that has a
    number, ``{"saved_bytes", "full_bytes", "steady_bytes", "reduction"}`` of that node or None)."""
    for out in outputs:
        data = out.get("unicache_kv")
        if data is None:
            continue
        saved = find_number(data, "saved_bytes")
        full = find_number(data, "full_bytes")
        if full is None:
            full = find_number(data, "full_managed_bytes")
        steady = find_number(data, "steady_bytes")
        if steady is None:
            steady = find_number(data, "steady_managed_bytes")
        if saved is None and full is not None and steady is not None:
            saved = max(0.0, full - steady)
        if _byte_count(saved) is not None:
            return _byte_count(saved), {
                "saved_bytes": _byte_count(saved),
                "full_bytes": _byte_count(full),
                "steady_bytes": _byte_count(steady),
                "reduction": find_number(data, "reduction"),
            }
    for out in outputs:
        for text in out.get("text", []):
            m = re.search(r"saved\D{0,20}?(\d[\d,]{0,15}(?:\.\d{1,6})?)\s*(GiB|MiB|KiB|GB|MB|KB|B)\b", str(text), re.I)
            if m:
                return int(float(m.group(1).replace(",", "")) * _UNITS[m.group(2).lower()]), None
    return None, None
