"""Queue runner: many runs of one API workflow spread over one or more ComfyUI hosts.

    python -m tools.batch WORKFLOW_API.json --host URL [--host URL ...] --count N
        [--seeds FILE | --seed-start S] [--prompts FILE] --out DIR [--summary out.json]

Run ``i`` (0-based) gets seed ``S + i`` (or line ``i`` of ``--seeds``, one integer a line) on every seed input
of the UniCache generation/understanding nodes, and, with ``--prompts`` (one prompt a line; ``#`` lines and
blank lines skipped), line ``i mod len`` as the ``prompt`` of those nodes. Each host keeps ``--depth`` runs
(default 2) queued so it never idles between runs; a host is followed over its websocket
(``/ws?clientId=``) for progress and completion, with ``/history`` as the source of truth. Every output
(images from ``/view``, texts, the KV report node's summary) is written under ``DIR/<run>/``. A run whose
host went away (connection refused or the websocket closed and the host no longer answers) is retried on
another host (at most ``--retries`` times, default 2); a run that ends in ``execution_error`` is not retried
(the graph or its inputs are at fault). The summary lists, per run: host, status, seconds, seed, prompt,
KV bytes saved (``full_managed_bytes - steady_managed_bytes`` from the report node's ui output, else the
first byte count in its text), outputs and error. Exit status: 0 when every run succeeded, 1 otherwise,
2 for bad arguments.

Only the standard library and ``websocket-client`` (pinned in pyproject's ``batch`` extra and in
tools/requirements-comfyhost.txt) are used: nothing here imports ComfyUI or torch.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import re
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

logger = logging.getLogger("unicache.batch")

#: Nodes whose ``seed``/``prompt`` inputs a run varies.
SEEDED_NODES = ("UniCacheTextToImage", "UniCacheImageEdit", "UniCacheUnderstand")
REPORT_NODE = "UniCacheKVReport"
SEED_MAX = 2**64 - 1


class HostGone(Exception):
    """The host does not answer (refused, reset, timed out): its runs go to another host."""


@dataclass
class Run:
    index: int
    seed: int
    prompt_text: str | None
    host: str | None = None
    prompt_id: str | None = None
    status: str = "pending"  # pending, queued, success, error, failed
    seconds: float | None = None
    attempts: int = 0
    hosts_tried: list[str] = field(default_factory=list)
    kv_bytes_saved: int | None = None
    kv_summary: dict | None = None
    kv_by_node: dict | None = None
    outputs: list[str] = field(default_factory=list)
    error: str | None = None
    _t0: float = 0.0

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("_t0")
        return d


# ---------------------------------------------------------------------------------------------- graph


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


def load_workflow(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"workflow {path}: {e}") from e
    if isinstance(data, dict) and "nodes" in data and "links" in data:
        raise ValueError(f"workflow {path} is in the UI format; export it in the API format (workflows/api/)")
    if not isinstance(data, dict) or not all(isinstance(v, dict) and "class_type" in v for v in data.values()):
        raise ValueError(f"workflow {path}: not an API-format graph ({{node_id: {{class_type, inputs}}}})")
    return data


def read_seeds(path: Path, count: int) -> list[int]:
    seeds = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
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
    if len(seeds) < count:
        raise ValueError(f"--seeds {path} has {len(seeds)} seeds, --count asks for {count}")
    return seeds[:count]


def read_prompts(path: Path) -> list[str]:
    lines = [ln.rstrip("\n") for ln in Path(path).read_text().splitlines()]
    prompts = [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    if not prompts:
        raise ValueError(f"--prompts {path} has no prompt lines")
    return prompts


# ----------------------------------------------------------------------------------------------- http


def _request(url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
        raise HostGone(f"{url}: {getattr(e, 'reason', e)}") from e
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw


def _get_bytes(url: str, timeout: float = 60.0) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read()
    except urllib.error.HTTPError:
        raise
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
        raise HostGone(f"{url}: {getattr(e, 'reason', e)}") from e


# ----------------------------------------------------------------------------------------------- host


class HostWorker:
    """One ComfyUI host: a websocket listener thread and the runs queued there."""

    def __init__(self, url: str, runner: "BatchRunner"):
        self.url = url.rstrip("/")
        self.runner = runner
        self.client_id = uuid.uuid4().hex
        self.inflight: dict[str, Run] = {}  # prompt_id -> run
        self.alive = True
        self.done = threading.Event()  # set by the websocket on every finished prompt
        self._ws = None
        self._thread: threading.Thread | None = None

    # websocket ---------------------------------------------------------------------------------
    def connect(self) -> None:
        import websocket  # websocket-client

        ws_url = self.url.replace("http://", "ws://").replace("https://", "wss://")
        try:
            self._ws = websocket.create_connection(f"{ws_url}/ws?clientId={self.client_id}", timeout=10)
        except (OSError, websocket.WebSocketException) as e:
            raise HostGone(f"{self.url}: websocket: {e}") from e
        self._ws.settimeout(1.0)
        self._thread = threading.Thread(target=self._listen, name=f"ws {self.url}", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        import websocket

        while self.alive and not self.runner.stopping:
            try:
                msg = self._ws.recv()
            except websocket.WebSocketTimeoutException:
                continue
            except (OSError, websocket.WebSocketException):
                logger.warning("%s: websocket closed", self.url)
                self.alive = self._answers()
                self.done.set()
                return
            if not isinstance(msg, str):  # binary preview frames
                continue
            try:
                event = json.loads(msg)
            except ValueError:
                continue
            kind, data = event.get("type"), event.get("data") or {}
            pid = data.get("prompt_id")
            if kind == "progress" and pid in self.inflight:
                logger.debug("%s run %d: %s/%s", self.url, self.inflight[pid].index, data.get("value"),
                             data.get("max"))
            elif kind in ("execution_success", "execution_error", "execution_interrupted") or (
                kind == "executing" and data.get("node") is None and pid
            ):
                self.done.set()

    def _answers(self) -> bool:
        try:
            _request(self.url + "/system_stats", timeout=5)
            return True
        except HostGone:
            return False

    def close(self) -> None:
        self.alive = False
        if self._ws is not None:
            try:
                self._ws.close()
            except Exception:  # noqa: BLE001  (closing a dead socket)
                pass

    # http --------------------------------------------------------------------------------------
    def submit(self, run: Run, graph: dict) -> None:
        status, body = _request(self.url + "/prompt", {"prompt": graph, "client_id": self.client_id})
        if status != 200:
            err = body.get("error", {}) if isinstance(body, dict) else {}
            detail = json.dumps(body.get("node_errors", {}) if isinstance(body, dict) else body)[:2000]
            raise ValueError(f"{self.url} refused the graph (HTTP {status}): {err.get('message', '')} {detail}")
        run.prompt_id = body["prompt_id"]
        run.host = self.url
        run.status = "queued"
        run.attempts += 1
        run.hosts_tried.append(self.url)
        run._t0 = time.monotonic()
        self.inflight[run.prompt_id] = run

    def history(self, prompt_id: str) -> dict | None:
        _, hist = _request(f"{self.url}/history/{prompt_id}")
        entry = hist.get(prompt_id) if isinstance(hist, dict) else None
        if entry and entry.get("status", {}).get("status_str") in ("success", "error"):
            return entry
        return None


# --------------------------------------------------------------------------------------------- runner


class BatchRunner:
    def __init__(self, workflow: dict, hosts: list[str], runs: list[Run], out: Path, depth: int = 2,
                 retries: int = 2, timeout: float = 3600.0, poll: float = 2.0):
        self.workflow = workflow
        self.workers = [HostWorker(h, self) for h in hosts]
        self.runs = runs
        self.out = Path(out)
        self.depth = depth
        self.retries = retries
        self.timeout = timeout
        self.poll = poll
        self.stopping = False

    def run(self) -> list[Run]:
        for w in self.workers:
            try:
                w.connect()
            except HostGone as e:
                logger.warning("host unusable: %s", e)
                w.alive = False
        pending = list(self.runs)
        deadline = time.monotonic() + self.timeout
        try:
            while pending or any(w.inflight for w in self.workers):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"batch not done after {self.timeout:.0f} s")
                live = [w for w in self.workers if w.alive]
                if not live:
                    for w in self.workers:
                        pending.extend(self._requeue(w))
                    for r in pending:
                        r.status, r.error = "failed", r.error or "no host answers"
                    break
                # keep every live host `depth` deep, least loaded first
                while pending:
                    w = min(live, key=lambda x: len(x.inflight))
                    if len(w.inflight) >= self.depth:
                        break
                    r = pending.pop(0)
                    try:
                        w.submit(r, vary(self.workflow, r.seed, r.prompt_text))
                        logger.info("run %d (seed %d) -> %s", r.index, r.seed, w.url)
                    except HostGone as e:
                        logger.warning("%s gone at submit: %s", w.url, e)
                        w.alive = False
                        pending.insert(0, r)
                        live = [x for x in self.workers if x.alive]
                        if not live:
                            break
                    except ValueError as e:
                        r.status, r.error, r.host = "error", str(e), w.url
                        r.hosts_tried.append(w.url)
                for w in self.workers:
                    if w.inflight and w.alive:
                        w.done.wait(self.poll)
                    w.done.clear()
                    pending[:0] = self._collect(w)
        finally:
            self.stopping = True
            for w in self.workers:
                w.close()
        return self.runs

    def _collect(self, w: HostWorker) -> list[Run]:
        """Finish the runs of ``w`` that are done; return the runs to retry elsewhere."""
        if not w.inflight:
            return []
        if not w.alive:
            return self._requeue(w)
        for pid, r in list(w.inflight.items()):
            try:
                entry = w.history(pid)
            except HostGone:
                w.alive = False
                return self._requeue(w)
            if entry is None:
                continue
            del w.inflight[pid]
            r.seconds = round(time.monotonic() - r._t0, 3)
            try:
                self._finish(w, r, entry)
            except HostGone:
                w.alive = False
                r.status, r.error = "pending", "host went away while downloading outputs"
                return [r] + self._requeue(w)
        return []

    def _requeue(self, w: HostWorker) -> list[Run]:
        back = []
        for r in w.inflight.values():
            if r.attempts > self.retries:
                r.status, r.error = "failed", f"host {w.url} went away; {r.attempts} attempts"
            else:
                logger.warning("run %d: host %s went away, retrying elsewhere", r.index, w.url)
                r.status, r.prompt_id = "pending", None
                back.append(r)
        w.inflight.clear()
        return back

    def _finish(self, w: HostWorker, r: Run, entry: dict) -> None:
        status = entry["status"]["status_str"]
        msgs = entry["status"].get("messages", [])
        run_dir = self.out / f"{r.index:04d}"
        run_dir.mkdir(parents=True, exist_ok=True)
        if status != "success":
            err = next((m[1] for m in msgs if m[0] in ("execution_error", "execution_interrupted")), {})
            r.status = "error"
            r.error = (f"{err.get('node_type', '?')} (node {err.get('node_id', '?')}): "
                       f"{err.get('exception_type', 'interrupted')}: {err.get('exception_message', '')}").strip()
            return
        r.status, r.error = "success", None
        texts = []
        for nid, out in entry.get("outputs", {}).items():
            for k, img in enumerate(out.get("images", [])):
                q = urllib.parse.urlencode({"filename": img["filename"], "subfolder": img.get("subfolder", ""),
                                            "type": img.get("type", "output")})
                data = _get_bytes(f"{w.url}/view?{q}")
                name = f"node{nid}_{k}_{Path(img['filename']).name}"
                (run_dir / name).write_bytes(data)
                r.outputs.append(str(run_dir / name))
            for k, text in enumerate(out.get("text", [])):
                name = f"node{nid}_{k}.txt"
                (run_dir / name).write_text(str(text))
                r.outputs.append(str(run_dir / name))
                texts.append(str(text))
            if "unicache_kv" in out:
                (run_dir / f"node{nid}_unicache_kv.json").write_text(json.dumps(out["unicache_kv"], indent=1))
                r.outputs.append(str(run_dir / f"node{nid}_unicache_kv.json"))
        report_ids = sorted((nid for nid, n in self.workflow.items() if n.get("class_type") == REPORT_NODE),
                            key=lambda x: (len(x), x))
        r.kv_bytes_saved, r.kv_summary = kv_saved(
            [entry["outputs"].get(nid, {}) for nid in report_ids] or list(entry.get("outputs", {}).values()))
        if len(report_ids) > 1:  # e.g. an A/B workflow: every report node's numbers, by node id
            r.kv_by_node = {nid: kv_saved([entry["outputs"].get(nid, {})])[1] for nid in report_ids}
        (run_dir / "history.json").write_text(json.dumps(entry, indent=1))


def _find_key(obj, key):
    if isinstance(obj, dict):
        if key in obj and isinstance(obj[key], (int, float)):
            return obj[key]
        for v in obj.values():
            found = _find_key(v, key)
            if found is not None:
                return found
    elif isinstance(obj, list):
        for v in obj:
            found = _find_key(v, key)
            if found is not None:
                return found
    return None


_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 1024, "mib": 1024**2, "gib": 1024**3}


def kv_saved(outputs: list[dict]) -> tuple[int | None, dict | None]:
    """KV bytes saved by the run, from the report node's ``ui`` output (chart data, else its text).

    ``outputs``: the ui dicts of the report nodes; returns (bytes saved by the first one that has a
    number, ``{"saved_bytes", "full_bytes", "steady_bytes", "reduction"}`` of that node or None)."""
    for out in outputs:
        data = out.get("unicache_kv")
        if data is None:
            continue
        saved = _find_key(data, "saved_bytes")
        full = _find_key(data, "full_bytes")
        if full is None:
            full = _find_key(data, "full_managed_bytes")
        steady = _find_key(data, "steady_bytes")
        if steady is None:
            steady = _find_key(data, "steady_managed_bytes")
        if saved is None and full is not None and steady is not None:
            saved = max(0, full - steady)
        if saved is not None:
            return int(saved), {"saved_bytes": int(saved), "full_bytes": full, "steady_bytes": steady,
                                "reduction": _find_key(data, "reduction")}
    for out in outputs:
        for text in out.get("text", []):
            m = re.search(r"saved\D{0,20}?([\d.,]+)\s*(GiB|MiB|KiB|GB|MB|KB|B)\b", str(text), re.I)
            if m:
                return int(float(m.group(1).replace(",", "")) * _UNITS[m.group(2).lower()]), None
    return None, None


# ------------------------------------------------------------------------------------------------ cli


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.batch", description=__doc__.split("\n\n")[0])
    ap.add_argument("workflow", type=Path, help="API-format workflow JSON (workflows/api/*.json)")
    ap.add_argument("--host", action="append", required=True, metavar="URL",
                    help="ComfyUI base URL, e.g. http://127.0.0.1:8188 (repeat for several hosts)")
    ap.add_argument("--count", type=int, required=True, help="number of runs (>= 1)")
    seeds = ap.add_mutually_exclusive_group()
    seeds.add_argument("--seeds", type=Path, help="file with one seed a line (at least --count of them)")
    seeds.add_argument("--seed-start", type=int, default=0, help="run i gets seed S+i (default 0)")
    ap.add_argument("--prompts", type=Path, help="file with one prompt a line; run i gets line i mod lines")
    ap.add_argument("--out", type=Path, required=True, help="folder for the outputs (DIR/<run>/...)")
    ap.add_argument("--summary", type=Path, help="summary JSON (default DIR/summary.json)")
    ap.add_argument("--depth", type=int, default=2, help="runs kept queued per host (default 2)")
    ap.add_argument("--retries", type=int, default=2, help="retries of a run whose host went away (default 2)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole batch (default 3600)")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    if a.count < 1:
        ap.error(f"--count must be >= 1, got {a.count}")
    if a.depth < 1:
        ap.error(f"--depth must be >= 1, got {a.depth}")
    if a.retries < 0:
        ap.error(f"--retries must be >= 0, got {a.retries}")
    if a.seeds is None and not 0 <= a.seed_start <= SEED_MAX - (a.count - 1):
        ap.error(f"--seed-start {a.seed_start}: seeds must stay within 0..2**64-1")
    for h in a.host:
        if urllib.parse.urlparse(h).scheme not in ("http", "https"):
            ap.error(f"--host {h!r}: give a URL such as http://127.0.0.1:8188")
    return a


def main(argv: list[str] | None = None) -> int:
    try:
        a = parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S")
    try:
        workflow = load_workflow(a.workflow)
        seeds = read_seeds(a.seeds, a.count) if a.seeds else [a.seed_start + i for i in range(a.count)]
        prompts = read_prompts(a.prompts) if a.prompts else None
    except (OSError, ValueError) as e:
        print(f"tools.batch: {e}", file=sys.stderr)
        return 2
    runs = [Run(i, seeds[i], prompts[i % len(prompts)] if prompts else None) for i in range(a.count)]
    a.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        BatchRunner(workflow, a.host, runs, a.out, a.depth, a.retries, a.timeout).run()
    except KeyboardInterrupt:
        print("tools.batch: interrupted", file=sys.stderr)
        return 130
    except TimeoutError as e:
        logger.error("%s", e)
    ok = sum(r.status == "success" for r in runs)
    for r in runs:
        if r.status != "success":
            print(f"tools.batch: run {r.index} (seed {r.seed}) {r.status}: {r.error}", file=sys.stderr)
    summary = {
        "format": "unicache-batch-summary", "version": 1, "workflow": str(a.workflow), "hosts": a.host,
        "count": a.count, "succeeded": ok, "seconds": round(time.monotonic() - t0, 3),
        "runs": [r.summary() for r in runs],
    }  # fmt: skip
    path = a.summary or a.out / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1))
    print(f"tools.batch: {ok}/{a.count} runs succeeded on {len({r.host for r in runs if r.host})} host(s) "
          f"in {summary['seconds']:.1f} s; summary {path}")
    return 0 if ok == a.count else 1


if __name__ == "__main__":
    sys.exit(main())
