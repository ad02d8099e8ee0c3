"""The real ``execpool serve`` in a process of its own, and what tests of it
share: a raw socket to it, its metrics, how a tool process is told apart."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile

import httpx
import psutil

from tests.support.helpers import REPO

#: How long a test waits for the server's answers.
DEADLINE_S = 20.0


class Server:
    """``python -m execpool serve ARGS`` on a free loopback port."""

    def __init__(self, *args: str, env: dict | None = None) -> None:
        # Its log goes to a file: a pipe nobody reads would stop a server
        # that logs much.
        self.stderr = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "execpool", "serve", "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True, cwd=REPO,
                                     env={**os.environ, **(env or {})})
        line = self.proc.stdout.readline()
        if "ready at " not in line:
            self.proc.kill()
            self.proc.wait()
            log = self.log()
            self.proc.stdout.close()
            self.stderr.close()
            raise AssertionError(f"the server did not start: {line!r} {log[-2000:]}")
        self.url = line.split("ready at ", 1)[1].strip()
        self.client = httpx.Client(base_url=self.url, timeout=DEADLINE_S)

    def log(self) -> str:
        """What the server wrote to stderr so far (all of it, once stopped)."""
        if self.stderr.closed:
            return self.logged
        self.stderr.seek(0)
        return self.stderr.read()

    def descendants(self) -> list:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> int:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(DEADLINE_S)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.proc.stdout.close()
            self.logged = self.log()
            self.stderr.close()


def sessionless_call(url: str, code: str, session_id: str, token: str | None = None,
                     headers: dict | None = None) -> dict:
    """A tools/call to ``url``'s ``/mcp`` of the sessionless protocol
    revision (2026-07-28): no handshake, and a ``Mcp-Session-Id`` header
    the client made up; its result."""
    version = "2026-07-28"
    sent = {"Accept": "application/json, text/event-stream", "mcp-protocol-version": version,
            "mcp-method": "tools/call", "mcp-name": "python", "mcp-session-id": session_id, **(headers or {})}
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
            "params": {"name": "python", "arguments": {"code": code},
                       "_meta": {"io.modelcontextprotocol/protocolVersion": version,
                                 "io.modelcontextprotocol/clientCapabilities": {}}}}
    answer = httpx.post(url + "/mcp", json=body, headers=sent, timeout=DEADLINE_S * 3)
    assert answer.status_code == 200, answer.text
    lines = [line[5:] for line in answer.text.splitlines() if line.startswith("data:")]
    messages = [json.loads(line) for line in lines] if lines else [answer.json()]
    (result,) = [message["result"] for message in messages if "result" in message]
    return result


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def metric(server: Server, name: str) -> float:
    """The value of one of the server's metrics (0 while it has none)."""
    answer = server.client.get("/metrics")
    answer.raise_for_status()  # a refusal is no metric of 0
    found = re.search(rf"^{re.escape(name)} (\S+)$", answer.text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def runs_a_job(proc: psutil.Process) -> bool:
    """A tool process: it carries a job's marker (workers carry it blank)."""
    try:
        return bool(proc.environ().get("EXECPOOL_JOB", "").strip())
    except psutil.Error:
        return False


def address(server: Server) -> tuple:
    url = httpx.URL(server.url)
    return url.host, url.port


def raw(server: Server, data: bytes) -> socket.socket:
    """A connection to the server that has sent ``data`` as it is."""
    sock = socket.create_connection(address(server), timeout=DEADLINE_S)
    sock.sendall(data)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
