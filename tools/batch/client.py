"""One ComfyUI host, spoken to as an untrusted peer: submit a graph, follow it, fetch what it made.

Every answer is checked before use: HTTP bodies are capped (``MAX_JSON_BYTES``, ``MAX_FILE_BYTES``), redirects
are refused, JSON must have the shape ComfyUI documents, ids must be short plain tokens, and a websocket
message of any other shape is skipped. A host that answers but not as a ComfyUI host should ends the run in
:class:`RunFailed` with a one-line reason; a host that does not answer at all raises :class:`HostGone` (the
caller moves the run elsewhere). File names and node ids are returned as sent: :mod:`tools.batch.outputs`
turns them into safe names under ``--out``.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger("unicache.batch")

MAX_JSON_BYTES = 64 * 2**20
MAX_FILE_BYTES = 512 * 2**20
MAX_FILES = 256
REASON_CHARS = 400
_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_DONE_EVENTS = ("execution_success", "execution_error", "execution_interrupted")


class HostGone(Exception):
    """The host does not answer (refused, reset, timed out): its run goes to another host."""


class RunFailed(Exception):
    """The host answered, but gave no usable result; the message is the run's one-line reason."""


def one_line(text: object, limit: int = REASON_CHARS) -> str:
    """``text`` as one printable line of at most ``limit`` characters (host text can hold anything)."""
    flat = " ".join("".join(c if c.isprintable() else " " for c in str(text)).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


@dataclass
class Outcome:
    """What a finished prompt produced, checked: ``status`` success or error (a node failed on the host).

    ``images``: (node id, file name, bytes) as the host named them; ``texts``: (node id, text);
    ``kv``: node id -> the report node's ``unicache_kv`` data; ``history``: the host's history entry.
    """

    status: str
    error: str | None = None
    prompt_id: str | None = None
    host: str | None = None
    images: list[tuple[str, str, bytes]] = field(default_factory=list)
    texts: list[tuple[str, str]] = field(default_factory=list)
    kv: dict[str, object] = field(default_factory=dict)
    history: dict = field(default_factory=dict)


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: PLR0913  (urllib's signature)
        return None  # a 3xx then arrives as an HTTP error status: a host never sends us elsewhere


_OPENER = urllib.request.build_opener(_RefuseRedirects)


def _field(obj: dict, key: str, kind: type | tuple, what: str, default=None):
    value = obj.get(key, default)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise RunFailed(f"{what}: {key!r} is {one_line(repr(value), 80)}, not {getattr(kind, '__name__', kind)}")
    return value


class HostClient:
    """HTTP + websocket client of one ComfyUI host (``url``: e.g. ``http://127.0.0.1:8188``).

    ``request_timeout``: seconds for one HTTP exchange; ``poll``: seconds between ``/history`` checks (the
    websocket only hastens them); ``deadline``: a ``time.monotonic()`` past which no exchange waits (the batch's
    ``--timeout``: a host that accepts a request and never answers costs no more than the batch's time)."""

    def __init__(self, url: str, request_timeout: float = 60.0, poll: float = 1.0, deadline: float | None = None):
        self.url = url.rstrip("/")
        self.request_timeout = request_timeout
        self.deadline = deadline
        self.poll = poll
        self.client_id = uuid.uuid4().hex
        self._ws = None

    # http ---------------------------------------------------------------------------------------------
    def _http(self, path: str, body: dict | None = None, limit: int | None = None) -> tuple[int, bytes]:
        limit = MAX_JSON_BYTES if limit is None else limit
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path,
            data=data,
            headers={"Content-Type": "application/json"},
            method="GET" if body is None else "POST",
        )
        try:
            with _OPENER.open(req, timeout=self._exchange_timeout()) as r:
                return r.status, self._read(r, limit, path)
        except urllib.error.HTTPError as e:
            return e.code, self._read(e, limit, path)
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise HostGone(f"{self.url}{path}: {one_line(getattr(e, 'reason', e), 200)}") from e
        except (http.client.HTTPException, ValueError) as e:  # a status line or headers that are not HTTP
            raise RunFailed(f"{path}: malformed HTTP answer ({one_line(e, 120)})") from e
        except OSError as e:
            raise HostGone(f"{self.url}{path}: {one_line(e, 200)}") from e

    def _exchange_timeout(self) -> float:
        """Seconds one exchange may wait: ``request_timeout``, cut to what is left before ``deadline``."""
        if self.deadline is None:
            return self.request_timeout
        return max(min(self.request_timeout, self.deadline - time.monotonic()), 0.05)

    @staticmethod
    def _read(response, limit: int, path: str) -> bytes:
        raw = response.read(limit + 1)
        if len(raw) > limit:
            raise RunFailed(f"{path}: answer larger than {limit} bytes")
        announced = (response.headers.get("Content-Length") or "").strip()
        if announced.isdigit() and int(announced) != len(raw):
            raise RunFailed(f"{path}: answer cut short ({len(raw)} of {announced} bytes)")
        return raw

    def _json(self, path: str, body: dict | None = None) -> tuple[int, object]:
        status, raw = self._http(path, body)
        try:
            return status, json.loads(raw) if raw else None
        except (ValueError, RecursionError):
            if status != 200:
                return status, raw
            raise RunFailed(f"{path}: HTTP 200 answer is not JSON ({one_line(raw[:60])})") from None

    def answers(self) -> bool:
        """Whether the host still answers HTTP at all (any status counts)."""
        try:
            self._http("/system_stats")
            return True
        except HostGone:
            return False
        except RunFailed:
            return True

    # the prompt's life ---------------------------------------------------------------------------------
    def submit(self, graph: dict) -> str:
        """POST /prompt; the prompt id, or RunFailed with the host's refusal in one line."""
        status, body = self._json("/prompt", {"prompt": graph, "client_id": self.client_id})
        if status != 200:
            raise RunFailed(_refusal(status, body))
        prompt_id = body.get("prompt_id") if isinstance(body, dict) else None
        if not isinstance(prompt_id, str) or not _ID.fullmatch(prompt_id):
            raise RunFailed(f"/prompt accepted the graph but gave no usable prompt_id ({one_line(repr(body), 120)})")
        return prompt_id

    def history(self, prompt_id: str) -> dict | None:
        """The prompt's history entry once it has finished (checked), else None."""
        path = f"/history/{urllib.parse.quote(prompt_id, safe='')}"
        status, hist = self._json(path)
        if status != 200:
            raise RunFailed(f"{path} answered HTTP {status}")
        if not isinstance(hist, dict):
            raise RunFailed(f"{path}: not a JSON object ({one_line(repr(hist), 80)})")
        entry = hist.get(prompt_id)
        if entry is None:
            return None
        if not isinstance(entry, dict):
            raise RunFailed(f"{path}: the entry is {type(entry).__name__}, not an object")
        state = _field(entry, "status", dict, f"{path} entry", default={})
        done = state.get("status_str")
        if done is None:
            return None
        if done not in ("success", "error"):
            raise RunFailed(f"{path}: status_str {one_line(repr(done), 60)} (expected success or error)")
        return entry

    def view(self, image: dict) -> bytes:
        """The bytes of one output file (GET /view), or RunFailed."""
        query = urllib.parse.urlencode(
            {"filename": image["filename"], "subfolder": image["subfolder"], "type": image["type"]}
        )
        status, data = self._http(f"/view?{query}", limit=MAX_FILE_BYTES)
        if status != 200:
            raise RunFailed(f"/view {one_line(repr(image['filename']), 80)} answered HTTP {status}")
        return data

    def execute(
        self, graph: dict, on_event: Callable[[dict], None] | None = None, timeout_s: float = 3600.0
    ) -> Outcome:
        """Run ``graph`` to the end and fetch its outputs.

        ``on_event`` gets ``{"event": "submitted", "prompt_id"}`` once the host accepted the graph, then
        ``{"event": "progress", "value", "max"}`` (numbers, ``0 <= value <= max``) from the websocket.
        Raises HostGone (no answer), RunFailed (a malformed answer, or no result within ``timeout_s``)."""
        emit = on_event or (lambda event: None)
        deadline = time.monotonic() + timeout_s
        self._connect_socket()
        prompt_id = self.submit(graph)
        emit({"event": "submitted", "prompt_id": prompt_id})
        entry = self._wait(prompt_id, emit, deadline)
        return self._outcome(prompt_id, entry)

    def _wait(self, prompt_id: str, emit: Callable[[dict], None], deadline: float) -> dict:
        next_check = 0.0
        while True:
            now = time.monotonic()
            if now >= next_check:
                entry = self.history(prompt_id)
                if entry is not None:
                    return entry
                next_check = now + self.poll
            if now > deadline:
                raise RunFailed(f"no result from {self.url} before the batch deadline (--timeout)")
            event = self._next_event(min(next_check - now, 1.0))
            if event is None or event.get("prompt_id") != prompt_id:
                continue
            if event["type"] == "progress":
                emit({"event": "progress", "value": event["value"], "max": event["max"]})
            else:
                next_check = 0.0  # the prompt says it is over: /history tells how

    def _outcome(self, prompt_id: str, entry: dict) -> Outcome:
        state = entry["status"]
        if state["status_str"] != "success":
            return Outcome("error", _execution_error(state), prompt_id, self.url, history=entry)
        outcome = Outcome("success", None, prompt_id, self.url, history=entry)
        outputs = _field(entry, "outputs", dict, "history", default={})
        for nid, out in outputs.items():
            if not isinstance(out, dict):
                raise RunFailed(f"history: output of node {one_line(repr(nid), 40)} is not an object")
            for image in _field(out, "images", list, f"node {one_line(nid, 40)} output", default=[]):
                if len(outcome.images) >= MAX_FILES:
                    raise RunFailed(f"history lists more than {MAX_FILES} output files")
                checked = _image_ref(image, nid)
                outcome.images.append((nid, checked["filename"], self.view(checked)))
            for text in _field(out, "text", list, f"node {one_line(nid, 40)} output", default=[]):
                if not isinstance(text, str):
                    raise RunFailed(f"node {one_line(nid, 40)} output: a text item is {type(text).__name__}")
                outcome.texts.append((nid, text))
            if "unicache_kv" in out:
                outcome.kv[nid] = out["unicache_kv"]
        return outcome

    # websocket -----------------------------------------------------------------------------------------
    def _connect_socket(self) -> None:
        """Open the websocket if it is not open; a host without one is followed by /history alone."""
        if self._ws is not None:
            return
        import websocket  # websocket-client

        ws_url = self.url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)
        try:
            self._ws = websocket.create_connection(
                f"{ws_url}/ws?clientId={self.client_id}", timeout=min(10.0, self._exchange_timeout())
            )
        except (ConnectionError, TimeoutError) as e:
            raise HostGone(f"{self.url}: websocket: {one_line(e, 200)}") from e
        except (OSError, ValueError, websocket.WebSocketException) as e:
            logger.warning("%s: no websocket (%s); following /history only", self.url, one_line(e, 120))

    def _next_event(self, wait_s: float) -> dict | None:
        """The next websocket event that has the documented shape, or None (timeout, other shape, no socket).

        Returns ``{"type": "progress", "prompt_id", "value", "max"}`` or ``{"type": "done", "prompt_id"}``."""
        if self._ws is None:
            time.sleep(max(wait_s, 0.0))
            return None
        import websocket

        try:
            self._ws.settimeout(max(wait_s, 0.01))
            message = self._ws.recv()
        except websocket.WebSocketTimeoutException:
            return None
        except (OSError, ValueError, websocket.WebSocketException) as e:
            self.close_socket()
            if not self.answers():
                raise HostGone(f"{self.url}: websocket closed and the host no longer answers") from e
            logger.warning("%s: websocket ended (%s); following /history only", self.url, one_line(e, 120))
            return None
        return parse_event(message)

    def close_socket(self) -> None:
        if self._ws is not None:
            ws, self._ws = self._ws, None
            try:
                ws.close(timeout=1)
            except Exception as e:  # noqa: BLE001  (closing a socket the host may have broken in any way)
                logger.debug("%s: closing the websocket: %s", self.url, e)


def parse_event(message) -> dict | None:
    """A websocket message as a progress/done event for one prompt, or None for anything else."""
    if not isinstance(message, str) or len(message) > MAX_JSON_BYTES:
        return None  # binary frames are previews
    try:
        event = json.loads(message)
    except (ValueError, RecursionError):
        return None
    if not isinstance(event, dict) or not isinstance(event.get("data"), dict):
        return None
    kind, data = event.get("type"), event["data"]
    prompt_id = data.get("prompt_id")
    if not isinstance(prompt_id, str):
        return None
    if kind == "progress":
        value, top = data.get("value"), data.get("max")
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (value, top))
        if numbers and 0 <= value <= top and 0 < top < 2**53:
            return {"type": "progress", "prompt_id": prompt_id, "value": value, "max": top}
        return None
    if kind in _DONE_EVENTS or kind == "executing" and "node" in data and data["node"] is None:
        return {"type": "done", "prompt_id": prompt_id}
    return None


def _image_ref(image, nid: str) -> dict:
    where = f"node {one_line(nid, 40)} image"
    if not isinstance(image, dict):
        raise RunFailed(f"{where} is {type(image).__name__}, not an object")
    return {
        "filename": _field(image, "filename", str, where),
        "subfolder": _field(image, "subfolder", str, where, ""),
        "type": _field(image, "type", str, where, "output"),
    }


def _refusal(status: int, body) -> str:
    """One line for a /prompt refusal: the host's message and its first node error, whatever their shape."""
    head = f"host refused the graph (HTTP {status})"
    if not isinstance(body, dict):
        text = body.decode(errors="replace") if isinstance(body, bytes) else repr(body)
        return f"{head}: {one_line(text, 200)}"
    error = body.get("error")
    message = error.get("message") if isinstance(error, dict) else error
    parts = [one_line(message, 160)] if isinstance(message, str) and message.strip() else []
    node_errors = body.get("node_errors")
    if isinstance(node_errors, dict):
        for nid, detail in list(node_errors.items())[:1]:
            errors = detail.get("errors") if isinstance(detail, dict) else None
            first = errors[0] if isinstance(errors, list) and errors and isinstance(errors[0], dict) else {}
            text = " ".join(str(first.get(k, "")) for k in ("message", "details") if isinstance(first.get(k), str))
            kind = detail.get("class_type") if isinstance(detail, dict) else None
            parts.append(f"node {one_line(nid, 40)} ({one_line(kind, 60)}): {one_line(text or repr(detail), 200)}")
    return f"{head}: {'; '.join(parts)}" if parts else f"{head}: {one_line(repr(body), 200)}"


def _execution_error(state: dict) -> str:
    """One line from an ``execution_error`` (or ``execution_interrupted``) history message, of any shape."""
    messages = state.get("messages")
    for message in messages if isinstance(messages, list) else []:
        if (
            isinstance(message, list)
            and len(message) == 2
            and isinstance(message[1], dict)
            and message[0] in ("execution_error", "execution_interrupted")
        ):
            err = message[1]
            if message[0] == "execution_interrupted":
                return f"interrupted (node {one_line(err.get('node_id', '?'), 40)})"
            return one_line(
                f"{err.get('node_type', '?')} (node {err.get('node_id', '?')}): "
                f"{err.get('exception_type', '?')}: {err.get('exception_message', '')}"
            )
    return "the host reports an error without details"
