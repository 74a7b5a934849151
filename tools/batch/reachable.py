"""Whether the addresses a batch is given answer at all, checked before any run is made: a mistyped ``--host`` or
``--address`` ends in one line within seconds, instead of retries until the batch's deadline or Ray's own
minutes-long wait for a cluster that is not there.

A TCP connection is tried to each address (at most :data:`CONNECT_TIMEOUT` seconds each, all at once); only that a
port accepts connections is checked, not what answers there (the batch's runs find that out).
"""

from __future__ import annotations

import socket
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

#: Seconds a connection to one address may take before that address counts as not answering.
CONNECT_TIMEOUT = 5.0


def connect_error(host: str, port: int, timeout: float = CONNECT_TIMEOUT) -> str | None:
    """``None`` when ``host:port`` accepts a TCP connection within ``timeout`` seconds, else why not (one line)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except socket.gaierror as exc:
        return f"unknown host ({exc.strerror or exc})"
    except OSError as exc:
        return exc.strerror or str(exc)


def url_address(url: str) -> tuple[str, int]:
    """``(host, port)`` of an http(s) URL (port 80 / 443 when none is given)."""
    parts = urllib.parse.urlparse(url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


def ray_address(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a Ray ``--address`` (``10.0.0.5:6379``, ``ray://host:10001``, ``[::1]:6379``), or ``None``
    for one Ray resolves itself (``auto``, ``local``) or that names no port."""
    if address in ("auto", "local") or not address:
        return None
    parts = urllib.parse.urlsplit(address if "://" in address else f"//{address}")
    try:
        port = parts.port
    except ValueError:
        return None
    return (parts.hostname, port) if parts.hostname and port else None


def unanswered(addresses: dict[str, tuple[str, int]], timeout: float = CONNECT_TIMEOUT) -> dict[str, str]:
    """``{name: why}`` of the ``{name: (host, port)}`` that do not accept a connection (tried in parallel)."""
    if not addresses:
        return {}
    with ThreadPoolExecutor(max_workers=min(16, len(addresses))) as pool:
        results = {name: pool.submit(connect_error, host, port, timeout) for name, (host, port) in addresses.items()}
        return {name: why for name, future in results.items() if (why := future.result()) is not None}


def check_hosts(urls: list[str], timeout: float = CONNECT_TIMEOUT) -> None:
    """Refuse in one line the ``--host`` URLs nothing answers at (``ValueError``)."""
    missing = unanswered({url: url_address(url) for url in dict.fromkeys(urls)}, timeout)
    if missing:
        listed = "; ".join(f"--host {url}: {why}" for url, why in missing.items())
        raise ValueError(
            f"{listed}; start ComfyUI there (python -m tools.comfyhost) or fix or drop that --host (nothing was run)"
        )


def check_ray_address(address: str | None, timeout: float = CONNECT_TIMEOUT) -> None:
    """Refuse in one line a Ray ``--address`` whose port does not accept connections (``ValueError``)."""
    where = ray_address(address) if address else None
    if where is None:
        return
    why = connect_error(*where, timeout=timeout)
    if why is not None:
        raise ValueError(
            f"--address {address}: no Ray cluster answers there ({why}); start one with `ray start --head` and give "
            f"the address it prints, or leave --address out to start a local one"
        )


__all__ = ["CONNECT_TIMEOUT", "check_hosts", "check_ray_address", "connect_error", "ray_address", "url_address"]
