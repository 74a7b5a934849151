"""The Ray back end: each worker is a Ray actor that owns one ComfyUI host on its node.

A worker starts its host with :mod:`tools.comfyhost` (the pack linked, ``--cpu`` unless Ray gave the actor
GPUs, ``CUDA_VISIBLE_DEVICES`` set to the actor's assigned GPU ids) or attaches to a host URL, then runs
the prompts the driver sends it as actor calls, one at a time. Progress goes to the driver through a
``ray.util.queue.Queue``. Fault tolerance is Ray's: when a worker's host stops answering, the worker ends
its own process, Ray restarts the actor (``max_restarts``: a fresh host) and runs the interrupted call
again (``max_task_retries``). A worker that cannot start its host says why and gets no runs.

Only the driver side (:func:`run_on_ray`) and the actor (:class:`HostWorker`) live here; ``ray`` is imported
by this module alone, and only when ``--ray`` is given.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.util.queue import Queue

from tools import comfyhost
from tools.batch import supervisor
from tools.batch.client import HostClient, HostGone, RunFailed, one_line
from tools.batch.outputs import record_outcome
from tools.batch.reachable import check_ray_address
from tools.batch.work import Run, report_node_ids, vary

logger = logging.getLogger("unicache.batch")


def _reason(error: BaseException) -> str:
    """One line from a host start failure: its first line and the last line of the log tail it carries."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    return one_line(lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}") if lines else type(error).__name__


def host_device_settings(gpu_ids: list[str]) -> tuple[dict[str, str], bool]:
    """(environment, ``--cpu``?) of a host whose worker Ray assigned ``gpu_ids``: those GPUs, else the CPU.

    The host also inherits the worker's OMP_NUM_THREADS, which Ray sets from the worker's CPUs (so a host
    computes with the threads its worker was given, and CPU results match a host run with as many threads)."""
    if gpu_ids:
        return {"CUDA_VISIBLE_DEVICES": ",".join(gpu_ids)}, False
    return {}, True


class HostWorker:
    """One ComfyUI host on the actor's node (``attach_url``: use that host instead of starting one)."""

    def __init__(self, index: int, attach_url: str | None = None, host_timeout: float = 180.0, poll: float = 1.0):
        context = ray.get_runtime_context()
        self.gpus = [str(g) for g in ray.get_gpu_ids()]
        self.info = {
            "worker": index,
            "node": context.get_node_id(),
            "actor": context.get_actor_id(),
            "gpus": self.gpus,
            "restarted": context.was_current_actor_reconstructed,
            "host": attach_url,
            "pid": None,
            "ready_s": None,
            "error": None,
        }
        self.host: comfyhost.Host | None = None
        self.base = Path(context.get_temp_dir()) / "unicache-batch" / self.info["actor"][:16]
        self.client: HostClient | None = None
        t0 = time.monotonic()
        try:
            self.client = HostClient(attach_url or self._start_host(host_timeout), poll=poll)
            if not self.client.answers():
                raise RuntimeError(f"host {self.client.url} does not answer")
        except RuntimeError as e:
            self.client, self.info["error"] = None, _reason(e)
        self.info["ready_s"] = round(time.monotonic() - t0, 2)

    def _start_host(self, timeout: float) -> str:
        env, cpu = host_device_settings(self.gpus)
        self.host = comfyhost.start(self.base, timeout=timeout, env=env, cpu=cpu, die_with_parent=True)
        self.info.update(host=self.host.url, pid=self.host.pid)
        return self.host.url

    def describe(self) -> dict:
        return dict(self.info)

    def run(self, run_index: int, graph: dict, timeout_s: float, events: Queue) -> dict:
        """Run one prompt on this worker's host; returns ``{"status", "error", "outcome", worker ids}``.

        Events on ``events``: start (worker, node, host), submitted, progress, host_gone."""
        ids = {key: self.info[key] for key in ("worker", "node", "host")}

        def emit(event: dict) -> None:
            events.put_nowait({"run": run_index, **ids, **event})

        emit({"event": "start"})
        if self.client is None:
            return {
                **ids,
                "status": "failed",
                "error": f"worker has no host: {self.info['error']}",
                "outcome": None,
            }
        try:
            outcome = self.client.execute(graph, emit, timeout_s)
        except RunFailed as e:
            return {**ids, "status": "failed", "error": one_line(e), "outcome": None}
        except HostGone as e:
            emit({"event": "host_gone", "reason": one_line(e, 200)})
            self.shutdown()
            os._exit(1)  # an unexpected death: Ray restarts this actor (a new host) and retries the call
        return {**ids, "status": outcome.status, "error": outcome.error, "outcome": outcome}

    def shutdown(self) -> None:
        """Stop the host this worker started (if any) and remove its folder."""
        if self.client is not None:
            self.client.close_socket()
        if self.host is not None:
            comfyhost.stop(self.host, grace=10.0)
            self.host = None
        shutil.rmtree(self.base, ignore_errors=True)
        with contextlib.suppress(OSError):  # the shared parent goes with the last worker of the node
            self.base.parent.rmdir()


@dataclass
class RayOptions:
    """``--ray`` settings: cluster ``address`` (None: start or find a local one), ``workers`` (None: one per
    GPU, or one), ``gpus_per_worker`` (None: 1 on a cluster with GPUs, else 0), ``cpus_per_worker`` (Ray sets
    the host's OMP_NUM_THREADS from it), ``attach`` (host URLs, one worker each, instead of starting hosts),
    ``retries`` (Ray's max_restarts and max_task_retries), ``connect_timeout`` (seconds ``ray.init`` may take)."""

    address: str | None = None
    workers: int | None = None
    gpus_per_worker: float | None = None
    cpus_per_worker: float = 1.0
    attach: list[str] = field(default_factory=list)
    retries: int = 2
    host_timeout: float = 180.0
    poll: float = 1.0
    connect_timeout: float = 120.0


#: The object store of a local cluster the batch starts: the batch moves only run records and their outputs
#: through it, and Ray's default (30% of the machine's memory) is reserved up front, so a start under a virtual-memory
#: limit (``ulimit -v 8000000``) killed its raylet and left ``ray.init`` waiting for it for good.
LOCAL_OBJECT_STORE_BYTES = 512 << 20


def _connect(options: RayOptions) -> None:
    """Join the cluster at ``options.address`` (its port checked first: one line at once when nothing answers), or
    start a local one (its GPUs checked against the workers' first, :func:`_local_gpus`); ``ray.init`` has no
    timeout of its own, so a watchdog ends the process with one line after ``options.connect_timeout`` seconds (a
    local start stuck for memory, a cluster that never answers): a thread here, and under ``python -m tools.batch``
    the supervising parent (:mod:`tools.batch.supervisor`), which also ends an init that holds the interpreter."""
    check_ray_address(options.address)
    if not options.address and (gpus := _local_gpus()) is not None:
        _plan(options, {"GPU": gpus, "CPU": float("inf")}, where="this machine (a local cluster)")
    quiet = {"log_to_driver": False, "logging_level": logging.WARNING}
    watchdog = threading.Timer(options.connect_timeout, _give_up, args=(options,))
    watchdog.daemon = True
    watchdog.start()
    supervisor.note_connecting(options.connect_timeout, _where(options))
    try:
        if options.address:
            ray.init(address=options.address, **quiet)
        else:
            ray.init(include_dashboard=False, object_store_memory=LOCAL_OBJECT_STORE_BYTES, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ValueError(f"--address {options.address or '(local)'}: cannot start or reach Ray: {one_line(e)}") from e
    finally:
        watchdog.cancel()
        supervisor.note_connected()


def _local_gpus() -> float | None:
    """The GPUs a local cluster started here would have, read as Ray reads them (each GPU accelerator's count, within
    the visible devices), before starting it; ``None`` when Ray's private accelerator API cannot be read (then the
    check after connecting, :func:`_plan`, still refuses a request the cluster cannot hold)."""
    try:
        from ray._private.accelerators import get_all_accelerator_managers

        total = 0
        for manager in get_all_accelerator_managers():
            if manager.get_resource_name() != "GPU":
                continue
            count = manager.get_current_node_num_accelerators()
            visible = manager.get_current_process_visible_accelerator_ids()
            total += count if visible is None else min(count, len(visible))
        return float(total)
    except Exception:  # noqa: BLE001 - a private API that may change between Ray versions: no pre-check then
        return None


def _where(options: RayOptions) -> str:
    return f"--address {options.address}" if options.address else "--ray (a local cluster)"


def _give_up(options: RayOptions) -> None:
    """The watchdog thread of :func:`_connect`: ``ray.init`` cannot be interrupted, so the process ends here (status
    2) with the part of a local cluster already started (GCS, raylet, agents)."""
    sys.stderr.write(supervisor.give_up_line(options.connect_timeout, _where(options)))
    sys.stderr.flush()
    supervisor.kill_tree(os.getpid(), include_root=False)
    os._exit(2)


def _plan(options: RayOptions, have: dict | None = None, where: str = "the cluster") -> tuple[int, float]:
    """(workers, GPUs per worker), checked against what the cluster has (``have``: these resources instead, e.g. the
    local machine's before a local cluster starts, named ``where``)."""
    have = ray.cluster_resources() if have is None else have
    gpus, cpus = have.get("GPU", 0.0), have.get("CPU", 0.0)
    per = options.gpus_per_worker
    if per is None:
        per = 1.0 if gpus and not options.attach else 0.0
    if options.attach:
        if options.workers not in (None, len(options.attach)):
            raise ValueError(f"--workers {options.workers} with {len(options.attach)} --host: give one or the other")
        count = len(options.attach)
    else:
        count = options.workers or (int(gpus // per) if per else 1)
    if count < 1 and per > gpus + 1e-9:  # not even one worker's GPUs: say so, not "--workers 0 ... needs 0 GPUs"
        raise ValueError(
            f"--gpus-per-worker {per:g}: {where} has {gpus:g} GPUs, fewer than one worker needs; give "
            f"--gpus-per-worker {gpus:g}" + (" (hosts on the CPU)" if not gpus else "")
        )
    if count < 1 or count * per > gpus + 1e-9:
        raise ValueError(
            f"--workers {count} x --gpus-per-worker {per:g} needs {count * per:g} GPUs; {where} "
            f"has {gpus:g} (lower --workers or --gpus-per-worker)"
        )
    if count * options.cpus_per_worker > cpus + 1e-9:
        raise ValueError(
            f"--workers {count} x --cpus-per-worker {options.cpus_per_worker:g} needs "
            f"{count * options.cpus_per_worker:g} CPUs; {where} has {cpus:g}"
        )
    return count, per


def _start_workers(options: RayOptions, count: int, per_worker_gpus: float) -> tuple[dict, dict, list[dict]]:
    """Start ``count`` actors; returns ({index: actor} of those with a host, {index: actor} of all, every
    worker's description). A worker without a host stays idle until the end, holding its resources."""
    actor_class = ray.remote(HostWorker).options(
        num_cpus=options.cpus_per_worker,
        num_gpus=per_worker_gpus,
        max_restarts=options.retries,
        max_task_retries=options.retries,
    )
    actors = {
        i: actor_class.remote(i, options.attach[i] if options.attach else None, options.host_timeout, options.poll)
        for i in range(count)
    }
    refs = {actors[i].describe.remote(): i for i in actors}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=options.host_timeout + 60)
    infos, live = [], {}
    for ref, i in refs.items():
        try:
            info = (
                ray.get(ref)
                if ref in ready
                else {
                    "worker": i,
                    "error": "not started in time (no node with a free CPU and the GPUs it needs?)",
                }
            )
        except ray.exceptions.RayError as e:
            info = {"worker": i, "error": one_line(str(e).splitlines()[0] if str(e) else e)}
        infos.append(info)
        where = f"worker {i} (node {str(info.get('node'))[:8]})"
        if info.get("error"):  # it keeps its slot, so that Ray places no restarted worker on that node
            logger.warning("%s cannot start its host: %s; the batch goes on without it", where, info["error"])
        else:
            logger.info(
                "%s: ComfyUI host %s (pid %s, GPUs %s), ready in %.1f s",
                where,
                info["host"],
                info["pid"],
                ",".join(info["gpus"]) or "none",
                info["ready_s"],
            )
            live[i] = actors[i]
    return live, actors, infos


def _apply_event(event: dict, runs: dict[int, Run], progress: dict[int, float]) -> None:
    run = runs[event["run"]]
    kind = event["event"]
    if kind == "start":
        run.worker, run.node, run.host = event["worker"], event["node"], event["host"]
    elif kind == "submitted":
        run.attempts += 1
        run.prompt_id = event["prompt_id"]
        run.hosts_tried.append(event["host"])
    elif kind == "progress":
        progress[run.index] = event["value"] / event["max"]
    elif kind == "host_gone":
        run.retries.append(
            f"worker {event['worker']} (node {str(event['node'])[:8]}): host {event['host']} went "
            f"away ({event['reason']}); Ray restarts the worker and retries the run"
        )
        logger.warning("run %d: %s", run.index, run.retries[-1])


def _finish(run: Run, result: dict, out: Path, report_ids: list[str]) -> None:
    run.worker, run.node, run.host = result["worker"], result["node"], result["host"]
    if result["outcome"] is None:
        run.status, run.error = "failed", result["error"]
    else:
        record_outcome(run, result["outcome"], out, report_ids)


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="run",
        file=sys.stderr,
        dynamic_ncols=True,
        disable=None,  # off without a TTY
        bar_format="{l_bar}{bar}| {n:.1f}/{total} runs [{elapsed}<{remaining}{postfix}]",
    )


class _Dispatch:
    """The driver's loop: give each idle worker the next run until every run has a result."""

    def __init__(self, workflow: dict, runs: list[Run], out: Path, live: dict):
        self.workflow, self.runs, self.out, self.live = workflow, runs, out, live
        self.by_index, self.report_ids = {r.index: r for r in runs}, report_node_ids(workflow)
        self.pending, self.idle, self.busy = collections.deque(runs), list(live), {}
        self.progress: dict[int, float] = {}
        self.events = Queue(actor_options={"num_cpus": 0})

    def run(self, deadline: float) -> None:
        from tqdm.contrib.logging import logging_redirect_tqdm

        try:
            with _progress_bar(len(self.runs)) as bar, logging_redirect_tqdm():
                while (self.pending and self.idle or self.busy) and time.monotonic() < deadline + 30:
                    self._step(deadline)
                    bar.n = sum(r.status != "pending" for r in self.runs) + sum(self.progress.values())
                    bar.set_postfix_str(
                        f"{len(self.live)} workers, {sum(len(r.retries) for r in self.runs)} retries",
                        refresh=True,
                    )
        finally:
            self.events.shutdown()
        late = time.monotonic() > deadline
        for run in self.runs:
            if run.status == "pending":
                run.status = "failed"
                run.error = "no result before the batch deadline" if late else "every worker died (see the log)"

    def _step(self, deadline: float) -> None:
        while self.idle and self.pending:
            w, run = self.idle.pop(0), self.pending.popleft()
            graph = vary(self.workflow, run.seed, run.prompt_text)
            ref = self.live[w].run.remote(run.index, graph, max(deadline - time.monotonic(), 0.0), self.events)
            self.busy[ref] = (w, run, time.monotonic())
        ready, _ = ray.wait(list(self.busy), num_returns=1, timeout=0.5)
        for event in self.events.get_nowait_batch(self.events.qsize()):
            _apply_event(event, self.by_index, self.progress)
        for ref in ready:
            w, run, t0 = self.busy.pop(ref)
            run.seconds = round(time.monotonic() - t0, 3)
            try:
                _finish(run, ray.get(ref), self.out, self.report_ids)
                self.idle.append(w)
            except ray.exceptions.RayError as e:  # Ray's restarts and retries are used up
                run.status, run.error = "failed", f"worker {w} died: {one_line(str(e).splitlines()[0])}"
            self.progress.pop(run.index, None)
            logger.info(
                "run %d (seed %d) %s on worker %s (node %s)%s",
                run.index,
                run.seed,
                run.status,
                run.worker,
                str(run.node)[:8],
                f": {run.error}" if run.error else "",
            )


def run_on_ray(workflow: dict, runs: list[Run], out: Path, options: RayOptions, timeout: float = 3600.0) -> dict:
    """Run ``runs`` on Ray workers; returns the summary's ``ray`` section (address, startup, workers)."""
    t0 = time.monotonic()
    _connect(options)
    try:
        startup_s = round(time.monotonic() - t0, 2)
        count, per_worker_gpus = _plan(options)
        logger.info(
            "Ray %s: %d worker(s), %g GPU(s) each; connected in %.1f s",
            ray.__version__,
            count,
            per_worker_gpus,
            startup_s,
        )
        live, every, infos = _start_workers(options, count, per_worker_gpus)
        deadline = t0 + timeout
        try:
            if live:
                _Dispatch(workflow, runs, out, live).run(deadline)
        finally:
            _stop_workers(every)
        reasons = "; ".join(f"worker {i['worker']}: {i['error']}" for i in infos if i.get("error"))
        for run in runs:
            if run.status == "pending":
                run.status, run.error = "failed", f"no Ray worker has a host ({one_line(reasons, 300)})"
        return {
            "address": options.address,
            "version": ray.__version__,
            "startup_s": startup_s,
            "gpus_per_worker": per_worker_gpus,
            "workers": infos,
        }
    finally:
        ray.shutdown()


def _stop_workers(actors: dict) -> None:
    """Ask every worker to stop its host, then end the actors (a host also dies with its worker's process)."""
    refs = [actor.shutdown.remote() for actor in actors.values()]
    ray.wait(refs, num_returns=len(refs), timeout=60)
    for actor in actors.values():
        ray.kill(actor, no_restart=True)
