"""Many runs of one API workflow on ComfyUI hosts: one host, a few hosts, or a Ray cluster.

    python -m tools.batch WORKFLOW_API.json --host URL [--host URL ...] --count N
        [--seeds FILE | --seed-start S] [--prompts FILE] --out DIR [--summary out.json]
    python -m tools.batch WORKFLOW_API.json --ray [--address ADDR] [--workers N] [--gpus-per-worker G]
        [--host URL ...] --count N ... --out DIR

Run ``i`` (0-based) gets seed ``S + i`` (or line ``i`` of ``--seeds``, one integer a line) on every seed input
of the UniCache generation/understanding nodes, and, with ``--prompts`` (one prompt a line; ``#`` lines and
blank lines skipped), line ``i mod len`` as the ``prompt`` of those nodes. Every output (images from
``/view``, texts, the KV report node's data, the history entry) is written under ``DIR/<run>/`` with names
made safe (nothing a host sends can place a file outside ``DIR``).

Without ``--ray`` (:mod:`tools.batch.hosts`): each ``--host`` keeps ``--depth`` runs (default 2) queued; a run
whose host went away is retried on another host (at most ``--retries`` times, default 2). With ``--ray``
(:mod:`tools.batch.ray_backend`): each Ray worker owns one ComfyUI host on its node (started there, or one
``--host`` each), Ray places the workers on GPUs and restarts a worker whose host died, retrying its run.
A run that ends in ``execution_error`` is never retried (the graph or its inputs are at fault), nor is one
that got a malformed answer from its host (the run fails with a one-line reason, the batch goes on).

The summary lists, per run: host, Ray worker and node, status (success, error, failed), seconds, seed,
prompt, attempts and why earlier attempts were abandoned, KV bytes saved (``full_managed_bytes -
steady_managed_bytes`` from the report node's ui output, else the first byte count in its text), outputs and
error. Exit status: 0 when every run succeeded, 1 otherwise, 2 for bad arguments.

Before any run, every input file is read only if it is a regular file of bounded size (a FIFO or ``/dev/zero`` is
refused), ``--summary`` passes the library's output guard (never a device, an input or a checkpoint file; written
atomically), ``--count`` is at most 100000, and each ``--host`` (or the Ray ``--address``) must accept a connection
within 5 s (:mod:`tools.batch.reachable`); ``ray.init`` may take ``--ray-timeout`` seconds (default 120).

The plain path needs only the standard library, the project's command helpers (:mod:`unicache_commands`: the
argument parser, the input and output file guards; standard library only) and ``websocket-client`` (the ``batch``
extra); ``--ray`` needs the ``ray`` extra. Nothing here imports ComfyUI, torch or the library, and the node pack
never imports this.
"""
