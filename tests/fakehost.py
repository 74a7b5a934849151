"""A fake ComfyUI host on 127.0.0.1 for the batch client's tests: HTTP (``/prompt``, ``/history/<id>``,
``/view``, ``/system_stats``) and a websocket (``/ws``), answering like ComfyUI 0.3.75 or as badly as a test
asks (any status, body, raw bytes, websocket frame).

A test overrides an answer with a function of the prompt number (0 for the first ``/prompt`` received):
``FakeHost(prompt=..., history=..., view=..., ws=...)``; each returns an :class:`Answer` (or, for ``ws``, a
list of frames). Nothing here talks to anything but 127.0.0.1.
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PNG = bytes.fromhex(
    "89504e470d0a1a0a0000000d4948445200000001000000010802000000907753de0000000c4944415478"
    "9c63f8cfc0000003010100c9fe92ef0000000049454e44ae426082"
)  # a 1x1 RGB PNG
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


@dataclass
class Answer:
    """An HTTP answer: ``status`` and ``body`` (bytes, or JSON-encoded), or ``raw`` bytes written as they are
    (no status line: for answers that are not HTTP), then the connection is closed."""

    status: int = 200
    body: object = None
    raw: bytes | None = None
    headers: dict = field(default_factory=dict)


def text_frame(text: str | bytes, opcode: int = 1) -> bytes:
    """A server websocket frame (unmasked) carrying ``text``."""
    payload = text.encode() if isinstance(text, str) else text
    n = len(payload)
    size = (
        bytes([n])
        if n < 126
        else bytes([126]) + n.to_bytes(2, "big")
        if n < 65536
        else bytes([127]) + n.to_bytes(8, "big")
    )
    return bytes([0x80 | opcode]) + size + payload


def ok_history(prompt_id: str, outputs: dict | None = None) -> dict:
    """The history ComfyUI writes for a successful prompt (one image, one text, one KV report)."""
    outputs = (
        outputs
        if outputs is not None
        else {
            "9": {"images": [{"filename": "unicache_00001_.png", "subfolder": "", "type": "output"}]},
            "5": {
                "text": ["unicache: saved 600 B"],
                "unicache_kv": [{"full_bytes": 1000, "steady_bytes": 400}],
            },
        }
    )
    return {
        prompt_id: {
            "prompt": [0, prompt_id, {}, {}, ["9"]],
            "outputs": outputs,
            "status": {
                "status_str": "success",
                "completed": True,
                "messages": [["execution_start", {"prompt_id": prompt_id}]],
            },
        }
    }


def _client_closes(data: bytes) -> bool:
    """Whether the client frames in ``data`` (masked, RFC 6455 §5.2) include a close frame (opcode 8)."""
    at = 0
    while at + 2 <= len(data):
        opcode, size = data[at] & 0x0F, data[at + 1] & 0x7F
        header = 2 + {126: 2, 127: 8}.get(size, 0)
        if at + header > len(data):
            return False
        if size >= 126:
            size = int.from_bytes(data[at + 2 : at + header], "big")
        if opcode == 8:
            return True
        at += header + (4 if data[at + 1] & 0x80 else 0) + size
    return False


def ok_ws(prompt_id: str) -> list[bytes]:
    """The websocket messages ComfyUI sends for a prompt: progress, then ``executing`` with node None."""
    events = [
        {"type": "progress", "data": {"value": v, "max": 3, "prompt_id": prompt_id, "node": "3"}} for v in (1, 2, 3)
    ]
    events.append({"type": "executing", "data": {"node": None, "prompt_id": prompt_id}})
    return [text_frame(json.dumps(e)) for e in events]


class FakeHost:
    """``with FakeHost(...) as host: host.url``; ``host.prompts`` counts the prompts received."""

    def __init__(
        self,
        prompt: Callable[[int], Answer] | None = None,
        history: Callable[[int, str], Answer] | None = None,
        view: Callable[[int, dict], Answer] | None = None,
        ws: Callable[[int, str], list[bytes]] | None = None,
        websocket: bool = True,
    ):
        self.prompt = prompt or (lambda n: Answer(200, {"prompt_id": f"p{n}", "number": n, "node_errors": {}}))
        self.history = history or (lambda n, pid: Answer(200, ok_history(pid)))
        self.view = view or (lambda n, query: Answer(200, PNG, headers={"Content-Type": "image/png"}))
        self.ws = ws or (lambda n, pid: ok_ws(pid))
        self.websocket = websocket
        self.prompts = 0
        self.ids: dict[str, int] = {}  # prompt id -> prompt number
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeHost:
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        for s in self.sockets:
            s.close()

    def _push(self, frames: list[bytes]) -> None:
        for s in list(self.sockets):
            try:
                s.sendall(b"".join(frames))
            except OSError:
                self.sockets.remove(s)

    def _handler(self):
        host = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep the test output quiet
                pass

            def _send(self, answer: Answer) -> None:
                if answer.raw is not None:
                    self.wfile.write(answer.raw)
                    self.close_connection = True
                    return
                body = (
                    answer.body
                    if isinstance(answer.body, bytes)
                    else b""
                    if answer.body is None
                    else json.dumps(answer.body).encode()
                )
                self.send_response(answer.status)
                headers = {
                    "Content-Type": "application/json",
                    "Content-Length": str(len(body)),
                    **answer.headers,
                }
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802  (http.server's name)
                url = urllib.parse.urlsplit(self.path)
                if url.path == "/ws":
                    return self._websocket()
                if url.path == "/system_stats":
                    return self._send(Answer(200, {"system": {"comfyui_version": "0.3.75"}}))
                if url.path.startswith("/history/"):
                    pid = urllib.parse.unquote(url.path[len("/history/") :])
                    return self._send(host.history(host.ids.get(pid, -1), pid))
                if url.path == "/view":
                    query = dict(urllib.parse.parse_qsl(url.query, keep_blank_values=True))
                    return self._send(host.view(host.prompts - 1, query))
                self._send(Answer(404, b"404: Not Found"))

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length", 0))
                self.rfile.read(length)
                if self.path != "/prompt":
                    return self._send(Answer(404, b""))
                with host.lock:
                    n = host.prompts
                    host.prompts += 1
                answer = host.prompt(n)
                if isinstance(answer.body, dict) and isinstance(answer.body.get("prompt_id"), str):
                    host.ids[answer.body["prompt_id"]] = n
                self._send(answer)
                self.wfile.flush()
                if answer.status == 200 and isinstance(answer.body, dict):
                    host._push(host.ws(n, str(answer.body.get("prompt_id"))))

            def _websocket(self) -> None:
                if not host.websocket:
                    return self._send(Answer(404, b"no websocket here"))
                key = self.headers.get("Sec-WebSocket-Key", "")
                accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
                self.send_response(101)
                self.send_header("Upgrade", "websocket")
                self.send_header("Connection", "Upgrade")
                self.send_header("Sec-WebSocket-Accept", accept)
                self.end_headers()
                self.wfile.flush()
                self.connection.sendall(text_frame(json.dumps({"type": "status", "data": {"sid": "x"}})))
                host.sockets.append(self.connection)
                self.connection.settimeout(None)
                try:
                    # the client's frames are ignored until its close frame, which is answered as a real server
                    # (ComfyUI's aiohttp) answers it: the client's close() would otherwise wait for its timeout
                    pending = b""
                    while chunk := self.connection.recv(4096):
                        pending += chunk
                        if _client_closes(pending):
                            self.connection.sendall(bytes([0x88, 0x00]))
                            break
                except OSError:
                    pass
                self.close_connection = True

        return Handler
