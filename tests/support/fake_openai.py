"""A scripted OpenAI-compatible streaming server for the agent loop's tests.

A real HTTP server (stdlib ``ThreadingHTTPServer`` on 127.0.0.1, an ephemeral
port, one thread per connection) so the loop is tested through httpx, sockets
and chunked transfer encoding exactly as it meets llama-server or vLLM. Each
POST takes the next scripted ``Reply``; every request is recorded with its
parsed JSON body so a test can assert what the model was sent.

A reply's ``chunks`` are sent in order, each as one HTTP chunk:
- a dict: one ``data: {json}`` SSE event;
- a str: raw text, sent as is (``DONE``, a malformed line, an ``event:`` line);
- ``Delay(seconds)`` / ``Gate(event)``: pause (a Gate until the test sets it);
- ``DROP``: end the connection abruptly, without the closing chunk.

While paused the handler watches its socket, so a client that goes away is
seen at once (``Recorded.client_gone``), not at the next write.
"""

from __future__ import annotations

import itertools
import json
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional, Union

DONE = "data: [DONE]\n\n"
HANDLER_THREAD_PREFIX = "fake-openai-"


@dataclass(frozen=True)
class Delay:
    seconds: float


@dataclass(frozen=True)
class Gate:
    event: threading.Event


DROP = object()

Pause = Union[Delay, Gate]


@dataclass
class Reply:
    """One scripted answer. ``status`` other than 200 or a ``body`` sends a
    plain (non-SSE) response instead of ``chunks``."""

    chunks: list = field(default_factory=list)
    status: int = 200
    body: Optional[str] = None
    content_type: str = "application/json"
    before_headers: Optional[Pause] = None


@dataclass
class Recorded:
    path: str
    raw: bytes
    body: Any
    headers: dict
    client_gone: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)


# --------------------------------------------------------------------------- chunk builders


def chunk(delta: Optional[dict] = None, finish_reason: Optional[str] = None, **top: Any) -> dict:
    """A ``chat.completion.chunk`` with one choice."""
    return {
        "id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1, "model": "fake",
        "choices": [{"index": 0, "delta": delta if delta is not None else {}, "finish_reason": finish_reason}],
        **top,
    }


def text_reply(*parts: str, finish_reason: str = "stop") -> Reply:
    return Reply([chunk({"role": "assistant", "content": ""})]
                 + [chunk({"content": p}) for p in parts]
                 + [chunk({}, finish_reason), DONE])


def tool_fragments(index: int, call_id: Optional[str], name: str, arguments: str, pieces: int = 1) -> list[dict]:
    """One call's ``delta.tool_calls`` chunks: id and name first, then the
    arguments split into ``pieces`` fragments."""
    first: dict[str, Any] = {"index": index, "type": "function", "function": {"name": name, "arguments": ""}}
    if call_id is not None:
        first["id"] = call_id
    size = max(1, -(-len(arguments) // pieces))
    rest = [chunk({"tool_calls": [{"index": index, "function": {"arguments": arguments[i:i + size]}}]})
            for i in range(0, len(arguments), size)]
    return [chunk({"tool_calls": [first]})] + rest


def tool_reply(*calls: tuple, pieces: int = 1, text: str = "", finish_reason: str = "tool_calls") -> Reply:
    """Calls given as ``(call_id, name, arguments)``, at indexes 0, 1, ..."""
    chunks: list = [chunk({"role": "assistant", "content": text or None})]
    for index, (call_id, name, arguments) in enumerate(calls):
        chunks += tool_fragments(index, call_id, name, arguments, pieces)
    return Reply(chunks + [chunk({}, finish_reason), DONE])


# --------------------------------------------------------------------------- the server


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 10  # an idle keep-alive connection does not keep its thread forever
    server: "_Server"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw.decode("utf-8", "replace")
        record = Recorded(self.path, raw, body, dict(self.headers))
        fake = self.server.fake
        with fake.lock:
            fake.requests.append(record)
            reply = fake.replies.pop(0) if fake.replies else None
        try:
            if reply is None:
                reply = Reply(status=500, body='{"error": {"message": "no scripted reply left"}}')
            self._serve(reply, record)
        except (BrokenPipeError, ConnectionResetError):
            record.client_gone.set()
            self.close_connection = True
        finally:
            record.finished.set()

    def _serve(self, reply: Reply, record: Recorded) -> None:
        if reply.before_headers is not None and not self._pause(reply.before_headers, record):
            return
        if reply.status != 200 or reply.body is not None:
            payload = (reply.body or "").encode()
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        for item in reply.chunks:
            if isinstance(item, (Delay, Gate)):
                if not self._pause(item, record):
                    return
            elif item is DROP:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            else:
                text = item if isinstance(item, str) else f"data: {json.dumps(item)}\n\n"
                data = text.encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _pause(self, pause: Pause, record: Recorded) -> bool:
        """Wait out ``pause``; False (and the connection closed) if the
        client went away or the server is stopping meanwhile."""
        deadline = time.monotonic() + pause.seconds if isinstance(pause, Delay) else None
        while True:
            if deadline is not None and time.monotonic() >= deadline:
                return True
            if isinstance(pause, Gate) and pause.event.is_set():
                return True
            if self.server.fake.stopping.is_set():
                self.close_connection = True
                return False
            readable, _, _ = select.select([self.connection], [], [], 0.01)
            if readable and not self.connection.recv(1, socket.MSG_PEEK):
                record.client_gone.set()
                self.close_connection = True
                return False


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    fake: "FakeOpenAI"
    _names = itertools.count(1)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that resets its connection (a closed stream) is what many
        # tests do on purpose; anything else is still printed.
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)

    def process_request(self, request: Any, client_address: Any) -> None:
        # Named, so leak checks in the tests can tell the server's threads
        # from the loop's.
        threading.Thread(target=self.process_request_thread, args=(request, client_address),
                         name=f"{HANDLER_THREAD_PREFIX}{next(self._names)}", daemon=True).start()


class FakeOpenAI:
    """``with FakeOpenAI() as fake: fake.script(reply, ...)``, then point a
    client at ``fake.base_url``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.replies: list[Reply] = []
        self.requests: list[Recorded] = []
        self.stopping = threading.Event()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.fake = self
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"{HANDLER_THREAD_PREFIX}serve", daemon=True)
        self._thread.start()

    def script(self, *replies: Reply) -> None:
        with self.lock:
            self.replies.extend(replies)

    @property
    def bodies(self) -> list[Any]:
        with self.lock:
            return [r.body for r in self.requests]

    def close(self) -> None:
        self.stopping.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> "FakeOpenAI":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def closed_port() -> int:
    """A local port nothing listens on (connection refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
