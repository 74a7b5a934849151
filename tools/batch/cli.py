"""``python -m tools.batch``: arguments, the chosen back end, the summary JSON and the exit status."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import urllib.parse
from pathlib import Path

from tools.batch import __doc__ as USAGE
from tools.batch.reachable import check_hosts
from tools.batch.work import MAX_COUNT, SEED_MAX, Run, load_workflow, make_runs, read_prompts, read_seeds

# one-line errors; a single-value flag given twice is refused; an empty path is refused
from unicache_commands.flags import OneLineParser, path_arg
from unicache_commands.output_files import check_output_file, write_atomically

logger = logging.getLogger("unicache.batch")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = OneLineParser(prog="python -m tools.batch", description=USAGE.split("\n\n")[0])
    ap.add_argument("workflow", type=path_arg, help="API-format workflow JSON (workflows/api/*.json)")
    ap.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="URL",
        help="ComfyUI base URL, e.g. http://127.0.0.1:8188 (repeat for several hosts; with --ray: one "
        "worker attaches to each instead of starting its own host)",
    )
    ap.add_argument("--count", type=int, required=True, help="number of runs (>= 1)")
    seeds = ap.add_mutually_exclusive_group()
    seeds.add_argument("--seeds", type=path_arg, help="file with one seed a line (at least --count of them)")
    seeds.add_argument("--seed-start", type=int, default=0, help="run i gets seed S+i (default 0)")
    ap.add_argument("--prompts", type=path_arg, help="file with one prompt a line; run i gets line i mod lines")
    ap.add_argument("--out", type=path_arg, required=True, help="folder for the outputs (DIR/<run>/...)")
    ap.add_argument("--summary", type=path_arg, help="summary JSON (default DIR/summary.json)")
    ap.add_argument("--depth", type=int, default=2, help="without --ray: runs kept queued per host (default 2)")
    ap.add_argument(
        "--retries",
        type=int,
        default=2,
        help="retries of a run whose host went away (with --ray: Ray's max_restarts and "
        "max_task_retries of each worker; default 2)",
    )
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole batch (default 3600)")
    ap.add_argument(
        "--poll",
        type=float,
        default=1.0,
        help="seconds between /history checks of a running prompt (default 1; the websocket's "
        "completion message triggers one at once)",
    )
    ray_group = ap.add_argument_group("Ray (pip install '.[ray]')")
    ray_group.add_argument("--ray", action="store_true", help="run on Ray workers, each owning one ComfyUI host")
    ray_group.add_argument("--address", help="Ray cluster to join (e.g. 10.0.0.5:6379; default: a local one)")
    ray_group.add_argument("--workers", type=int, help="workers (default: one per GPU of the cluster, else 1)")
    ray_group.add_argument(
        "--gpus-per-worker",
        type=float,
        help="GPUs each worker's host gets (default 1 on a cluster with GPUs, else 0: --cpu)",
    )
    ray_group.add_argument(
        "--cpus-per-worker",
        type=float,
        help="CPUs each worker takes; its host computes with that many threads (default 1)",
    )
    ray_group.add_argument(
        "--ray-timeout",
        type=float,
        help="seconds Ray may take to start or join the cluster before the batch gives up (default 120)",
    )
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    _check(ap, a)
    return a


def _check(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if not 1 <= a.count <= MAX_COUNT:
        ap.error(
            f"--count must be within 1..{MAX_COUNT} (the summary keeps a record of every run), got {a.count}; "
            f"split a larger batch with --seed-start"
        )
    if a.depth < 1:
        ap.error(f"--depth must be >= 1, got {a.depth}")
    if a.retries < 0:
        ap.error(f"--retries must be >= 0, got {a.retries}")
    if not a.timeout > 0:
        ap.error(f"--timeout must be > 0 seconds, got {a.timeout}")
    if not 0.01 <= a.poll <= 60:
        ap.error(f"--poll must be within 0.01..60 seconds, got {a.poll}")
    if a.seeds is None and not 0 <= a.seed_start <= SEED_MAX - (a.count - 1):
        ap.error(f"--seed-start {a.seed_start}: seeds must stay within 0..2**64-1")
    for h in a.host:
        url = urllib.parse.urlparse(h)
        if url.scheme not in ("http", "https") or not url.hostname:
            ap.error(f"--host {h!r}: give a URL such as http://127.0.0.1:8188")
    if not a.ray:
        given = [
            flag
            for flag, value in (
                ("--address", a.address),
                ("--workers", a.workers),
                ("--gpus-per-worker", a.gpus_per_worker),
                ("--cpus-per-worker", a.cpus_per_worker),
                ("--ray-timeout", a.ray_timeout),
            )
            if value is not None
        ]
        if given:
            ap.error(f"{', '.join(given)} only apply with --ray")
        if not a.host:
            ap.error("give at least one --host URL (or --ray to start hosts on Ray workers)")
    if a.workers is not None and a.workers < 1:
        ap.error(f"--workers must be >= 1, got {a.workers}")
    if a.gpus_per_worker is not None and not 0 <= a.gpus_per_worker <= 64:
        ap.error(f"--gpus-per-worker must be within 0..64, got {a.gpus_per_worker}")
    if a.ray_timeout is not None and not 0 < a.ray_timeout <= 3600:
        ap.error(f"--ray-timeout must be within 0..3600 seconds, got {a.ray_timeout}")
    if a.cpus_per_worker is not None and not 0.01 <= a.cpus_per_worker <= 1024:
        ap.error(f"--cpus-per-worker must be within 0.01..1024, got {a.cpus_per_worker}")


def _writable_paths(a: argparse.Namespace, summary: Path) -> None:
    """Create ``--out`` and check that ``summary`` can be written (the library's output guard: never a device, a
    FIFO, an input file, a weights or checkpoint file), before any run starts."""
    if a.out.exists() and not a.out.is_dir():
        raise ValueError(f"--out {a.out} is not a folder; give the folder the outputs go to (DIR/<run>/...)")
    try:
        a.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot write under --out {a.out}: {e.strerror or e}") from e
    inputs = [("the workflow", a.workflow), ("--seeds", a.seeds), ("--prompts", a.prompts)]
    check_output_file("--summary", summary, "summary JSON", inputs=inputs)


def write_summary(path: Path, summary: dict) -> None:
    """Write ``summary`` as strict JSON via a temp file and a rename (never a partial file)."""

    def write(tmp: Path) -> None:
        with open(tmp, "w") as fh:
            json.dump(summary, fh, indent=1, allow_nan=False)

    write_atomically("--summary", path, write)


def _run(a: argparse.Namespace, workflow: dict, runs: list[Run]) -> dict:
    """Run the batch on the chosen back end; returns the back end's part of the summary."""
    if not a.ray:
        from tools.batch.hosts import run_on_hosts

        run_on_hosts(workflow, runs, a.out, a.host, depth=a.depth, retries=a.retries, timeout=a.timeout, poll=a.poll)
        return {"backend": "hosts", "hosts": a.host}
    try:
        from tools.batch.ray_backend import RayOptions, run_on_ray
    except ImportError as e:
        raise ValueError(f"--ray needs the ray extra: pip install '.[ray]' ({e})") from e
    options = RayOptions(
        address=a.address,
        workers=a.workers,
        gpus_per_worker=a.gpus_per_worker,
        cpus_per_worker=a.cpus_per_worker or 1.0,
        attach=a.host,
        retries=a.retries,
        poll=a.poll,
        connect_timeout=120.0 if a.ray_timeout is None else a.ray_timeout,
    )
    ray_info = run_on_ray(workflow, runs, a.out, options, timeout=a.timeout)
    hosts = sorted({h for r in runs for h in r.hosts_tried})
    return {"backend": "ray", "hosts": hosts, "ray": ray_info}


def main(argv: list[str] | None = None) -> int:
    try:
        a = parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    logging.basicConfig(
        level=logging.DEBUG if a.verbose else logging.INFO,
        format="%(asctime)s %(message)s",
        datefmt="%H:%M:%S",
    )
    summary_path = a.summary or a.out / "summary.json"
    t0 = time.monotonic()
    try:
        workflow = load_workflow(a.workflow)
        seeds = read_seeds(a.seeds, a.count) if a.seeds else range(a.seed_start, a.seed_start + a.count)
        prompts = read_prompts(a.prompts) if a.prompts else None
        _writable_paths(a, summary_path)
        if not a.ray:  # a mistyped URL ends here, in seconds (with --ray the workers reach their hosts)
            check_hosts(a.host)
        runs = make_runs(a.count, seeds, prompts)
        backend = _run(a, workflow, runs)
    except (OSError, ValueError) as e:
        print(f"tools.batch: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tools.batch: interrupted", file=sys.stderr)
        return 130
    ok = sum(r.status == "success" for r in runs)
    for r in runs:
        if r.status != "success":
            print(f"tools.batch: run {r.index} (seed {r.seed}) {r.status}: {r.error}", file=sys.stderr)
    summary = {
        "format": "unicache-batch-summary",
        "version": 1,
        "workflow": str(a.workflow),
        **backend,
        "count": a.count,
        "succeeded": ok,
        "seconds": round(time.monotonic() - t0, 3),
        "runs": [r.summary() for r in runs],
    }
    try:
        write_summary(summary_path, summary)
    except (OSError, ValueError) as e:
        print(f"tools.batch: {e}", file=sys.stderr)
        return 2
    where = (
        f"{len(backend['ray']['workers'])} Ray worker(s)"
        if a.ray
        else f"{len({r.host for r in runs if r.host})} host(s)"
    )
    print(
        f"tools.batch: {ok}/{a.count} runs succeeded on {where} in {summary['seconds']:.1f} s; summary {summary_path}"
    )
    return 0 if ok == a.count else 1
