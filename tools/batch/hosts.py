"""The plain back end: one or a few ComfyUI hosts given by URL, no cluster machinery.

Every host gets ``depth`` threads, each with its own connection; a thread takes the next run from one shared
queue, runs it to the end on its host and takes the next, so a host always has up to ``depth`` prompts
queued and a faster host simply takes more runs. A host that stops answering loses its threads; the run it
had goes back to the queue for the others (at most ``retries`` times). A run that fails in a node or gets a
malformed answer is not retried: the graph, its inputs or that host are at fault.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path

from tools.batch.client import HostClient, HostGone, RunFailed, one_line
from tools.batch.outputs import record_outcome
from tools.batch.work import Run, report_node_ids, vary

logger = logging.getLogger("unicache.batch")


class _Batch:
    """State the host threads share: the run queue, the finished count, the hosts seen gone."""

    def __init__(self, workflow: dict, runs: list[Run], out: Path, retries: int, deadline: float, hosts: int):
        self.workflow, self.runs, self.out, self.hosts = workflow, runs, Path(out), hosts
        self.report_ids = report_node_ids(workflow)
        self.retries, self.deadline = retries, deadline
        self.pending: queue.Queue[Run | None] = queue.Queue()
        for run in runs:
            self.pending.put(run)
        self.lock = threading.Lock()
        self.finished = 0
        self.gone: dict[str, str] = {}  # host url -> why it is considered gone
        # set once every run has finished or every host is gone: the batch's thread waits on it, not on a clock
        self.settled = threading.Event()
        if not runs or not hosts:  # nothing to run, or nowhere to run it
            self.settled.set()

    def over(self) -> bool:
        return self.finished == len(self.runs) or time.monotonic() > self.deadline

    def host_gone(self, url: str, reason: str) -> None:
        with self.lock:
            self.gone.setdefault(url, reason)
            if len(self.gone) == self.hosts:  # with every host gone the queue has nowhere to go
                self.settled.set()

    def finish(self, run: Run) -> None:
        with self.lock:
            self.finished += 1
            if self.finished == len(self.runs):
                self.settled.set()
        logger.info(
            "run %d (seed %d) %s on %s%s",
            run.index,
            run.seed,
            run.status,
            run.host,
            f": {run.error}" if run.error else "",
        )


def _serve(host_url: str, batch: _Batch, poll: float) -> None:
    """One thread of one host: runs from the shared queue until the batch is over or the host is gone."""
    client = HostClient(host_url, poll=poll, deadline=batch.deadline)
    try:
        while not batch.over() and host_url not in batch.gone:
            try:
                run = batch.pending.get(timeout=0.2)
            except queue.Empty:
                continue
            if run is None:  # the batch has settled (run_on_hosts wakes each thread with one None)
                return
            _run_one(client, run, batch)
    finally:
        client.close_socket()


def _run_one(client: HostClient, run: Run, batch: _Batch) -> None:
    def on_event(event: dict) -> None:
        if event["event"] == "submitted":
            run.attempts += 1
            run.hosts_tried.append(client.url)
            run.host, run.prompt_id = client.url, event["prompt_id"]
        elif event["event"] == "progress":
            logger.debug("%s run %d: %s/%s", client.url, run.index, event["value"], event["max"])

    t0 = time.monotonic()
    try:
        outcome = client.execute(
            vary(batch.workflow, run.seed, run.prompt_text),
            on_event,
            timeout_s=max(batch.deadline - time.monotonic(), 0.0),
        )
    except HostGone as e:
        reason = one_line(e)
        batch.host_gone(client.url, reason)
        if run.attempts > batch.retries:
            run.status, run.error = "failed", f"host went away: {reason}; {run.attempts} attempts"
            batch.finish(run)
            return
        logger.warning("run %d: host %s went away (%s), retrying elsewhere", run.index, client.url, reason)
        if run.attempts:
            run.retries.append(f"{client.url} went away: {reason}")
        run.status, run.prompt_id = "pending", None
        batch.pending.put(run)
        return
    except RunFailed as e:
        run.status, run.error, run.host = "failed", one_line(e), client.url
        run.seconds = round(time.monotonic() - t0, 3)
        batch.finish(run)
        return
    run.seconds = round(time.monotonic() - t0, 3)
    record_outcome(run, outcome, batch.out, batch.report_ids)
    batch.finish(run)


def run_on_hosts(
    workflow: dict,
    runs: list[Run],
    out: Path,
    hosts: list[str],
    *,
    depth: int = 2,
    retries: int = 2,
    timeout: float = 3600.0,
    poll: float = 1.0,
) -> None:
    """Run every run of ``runs`` on ``hosts`` (URLs); each run ends success, error or failed."""
    urls = list(dict.fromkeys(h.rstrip("/") for h in hosts))
    batch = _Batch(workflow, runs, out, retries, time.monotonic() + timeout, len(urls))
    threads = [
        threading.Thread(target=_serve, args=(url, batch, poll), name=f"host {url} #{k}", daemon=True)
        for url in urls
        for k in range(depth)
    ]
    for t in threads:
        t.start()
    batch.settled.wait(timeout=max(batch.deadline - time.monotonic(), 0.0))
    for _ in threads:
        batch.pending.put(None)
    for t in threads:  # an exchange in flight ends by the deadline (HostClient's deadline): a short wait
        t.join(timeout=max(min(batch.deadline - time.monotonic(), 30.0), 0.0) + 2.0)
    last = "; ".join(f"{url}: {why}" for url, why in batch.gone.items()) or "no result"
    for run in runs:
        if run.status == "pending":
            run.status = "failed"
            run.error = (
                f"no result before the batch deadline ({timeout:.0f} s)"
                if time.monotonic() > batch.deadline
                else f"no host answers ({one_line(last, 200)})"
            )
