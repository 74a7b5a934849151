"""``python -m tools.batch --ray`` runs under a supervising parent process, which ends a ``ray.init`` that outlives
``--ray-timeout`` with one line and exit status 2.

``ray.init`` has no timeout of its own, and it can block inside Ray's C++ code while holding the interpreter's lock
(a local start whose raylet died, e.g. of a virtual-memory limit, leaves its core worker waiting for it): then no
Python thread of the process runs, and a watchdog thread (:func:`tools.batch.ray_backend._connect`'s, which serves
in-process callers) never fires. The parent is a second process, so it always can: the batch runs in a forked child,
which tells the parent through a pipe when ``ray.init`` begins (:func:`note_connecting`) and when it returned
(:func:`note_connected`). If the deadline passes in between, the parent writes the line, kills the child's processes
(the part of a local cluster it started) and the child, and exits 2; else it exits with the child's status. A Ctrl-C
from the terminal reaches the child itself (same process group), so the parent ignores SIGINT; SIGTERM and SIGHUP
are passed on to the child. Standard library only.
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Callable

#: Seconds the parent waits past the deadline, so that the child's watchdog thread, when it can run, ends the init.
GRACE_S = 1.0
#: The write end of the pipe to the supervising parent, in the supervised child (``None``: not supervised).
_channel: int | None = None


def _send(message: str) -> None:
    if _channel is not None:
        with contextlib.suppress(OSError):
            os.write(_channel, (message + "\n").encode())


def note_connecting(timeout: float, where: str) -> None:
    """``ray.init`` begins now; ``where`` names what it starts or joins (``--address HOST:PORT``)."""
    _send(f"connecting {timeout!r} {where}")


def note_connected() -> None:
    """``ray.init`` returned (or failed with an exception, which the child reports itself)."""
    _send("connected")


def descendants(root: int) -> list[int]:
    """Every process below ``root`` (read from ``/proc``; none where there is no ``/proc``)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                if entry.isdigit():
                    with open(f"/proc/{entry}/stat") as fh:  # "pid (comm) state ppid ..."
                        children[int(fh.read().rsplit(")", 1)[1].split()[1])].append(int(entry))
    found, queue = [], [root]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def give_up_line(timeout: float, where: str) -> str:
    """The one line of a ``ray.init`` that did not return in time."""
    return (
        f"tools.batch: {where}: Ray did not start or connect within {timeout:g} s (--ray-timeout); check `ray status` "
        "and the machine's free memory (a local start needs about 2 GB), or raise --ray-timeout\n"
    )


def kill_tree(root: int, *, include_root: bool) -> None:
    """SIGKILL every process below ``root`` (and ``root`` itself when ``include_root``)."""
    for pid in [*descendants(root), *([root] if include_root else [])]:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code  # killed by a signal: the shell's 128 + N


def _watch(child: int, read_fd: int) -> int:
    """The parent's loop: the child's exit status, or 2 after a ``ray.init`` outlived its deadline. The child's
    status is polled too: a process it forked without exec may hold the pipe open after it ended."""
    deadline: float | None = None
    pending, timeout, where, open_pipe = b"", 0.0, "", True
    while True:
        ended, status = os.waitpid(child, os.WNOHANG)
        if ended:
            return _exit_code(status)
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:  # the deadline passed while ray.init ran
            sys.stderr.write(give_up_line(timeout, where))
            sys.stderr.flush()
            kill_tree(child, include_root=True)
            os.waitpid(child, 0)
            return 2
        ready, _, _ = select.select([read_fd] if open_pipe else [], [], [], 0.5 if left is None else min(left, 0.5))
        if ready:
            data = os.read(read_fd, 4096)
            open_pipe = bool(data)
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                word, _, rest = line.decode(errors="replace").partition(" ")
                if word == "connecting":
                    seconds, _, where = rest.partition(" ")
                    timeout = float(seconds)  # the child's own watchdog thread goes first when it can run
                    deadline = time.monotonic() + timeout + GRACE_S
                elif word == "connected":
                    deadline = None


def supervise(main: Callable[[list[str]], int], argv: list[str]) -> int:
    """``main(argv)``'s exit status, run in a supervised child (see the module docstring); in the child it returns
    ``main``'s status itself, so the caller's ``sys.exit`` ends each process."""
    global _channel
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:
        os.close(read_fd)
        _channel = write_fd
        return main(argv)
    os.close(write_fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C reaches the child too: it says so itself
    for forwarded in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(forwarded, lambda signum, _frame: os.kill(child, signum))
    try:
        return _watch(child, read_fd)
    finally:
        os.close(read_fd)


__all__ = ["descendants", "give_up_line", "kill_tree", "note_connected", "note_connecting", "supervise"]
