"""``execpool serve`` against clients that ask for a big answer and then do
not read it. Red team: ``--max-in-flight`` such clients held every slot for
as long as they liked (60 s and more, long after their jobs and the read
timeout), and everyone else got 503. Each test was red before the write
timeout; each server is the real command on a loopback port, and each
answer is larger than the kernel's socket buffers can hold, so that a
client that does not read really blocks the server's writes."""

from __future__ import annotations

import json
import socket
import time

import h11
import psutil
import pytest

from tests.support.helpers import wait_for
from tests.support.servers import DEADLINE_S, Server, address, runs_a_job

WRITE_TIMEOUT_S = 1.0

#: A fetched file of this size makes an answer of its base64, ~21 MB.
FETCHED_BYTES = 16_000_000
FETCHED_ANSWER_BYTES = 4 * (FETCHED_BYTES // 3 + 1)
#: A job that prints past the stream's live cap (400,000 characters) in
#: characters JSON spells in 12 bytes, then runs on: its stream is blocked
#: while the job still runs, and dropping the answer must end the job.
FLOOD_THEN_SLEEP = ("import sys, time\nsys.stdout.buffer.write('\\U0001F600'.encode() * 500_000)\n"
                    "sys.stdout.flush()\ntime.sleep(60)")
STREAMED_BYTES = 400_000 * len(json.dumps("\U0001F600")[1:-1])
#: A client's receive buffer: fixed, so the kernel does not grow it.
RECEIVE_BUFFER = 64 << 10


@pytest.fixture(autouse=True)
def _answers_exceed_socket_buffers():
    """What the tests rely on: every answer here is more than the kernel
    can hold between the server's transport and a client that reads
    nothing (the server's send buffer grows at most to tcp_wmem's maximum)."""
    with open("/proc/sys/net/ipv4/tcp_wmem", encoding="ascii") as f:
        send_max = int(f.read().split()[2])
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        receive = probe.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    assert min(FETCHED_ANSWER_BYTES, STREAMED_BYTES) > send_max + receive


def _connect(server: Server) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
    sock.settimeout(DEADLINE_S)
    sock.connect(address(server))
    return sock


def _request(path: str, body: bytes) -> tuple[h11.Connection, bytes]:
    """A client's side of one POST, and the bytes that send it."""
    client = h11.Connection(h11.CLIENT)
    head = h11.Request(method="POST", target=path, headers=[
        ("Host", "127.0.0.1"), ("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return client, client.send(head) + client.send(h11.Data(data=body)) + client.send(h11.EndOfMessage())


def _hog(server: Server, path: str, body: dict) -> socket.socket:
    """A client that asks and never reads."""
    sock = _connect(server)
    sock.sendall(_request(path, json.dumps(body).encode())[1])
    return sock


def _fetch_big(code_key: str = "shell") -> dict:
    return {code_key: f"head -c {FETCHED_BYTES} /dev/zero > big", "fetch_files": ["big"]}


def _served(server: Server) -> bool:
    answer = server.client.post("/v1/run", json={"shell": "echo served"})
    return answer.status_code == 200 and answer.json()["output"] == "served\n"


def _dropped(server: Server) -> float:
    for line in server.client.get("/metrics").text.splitlines():
        if line.startswith('execpool_rejected_total{reason="write_timeout"}'):
            return float(line.split()[-1])
    return 0.0


def _held_by_server(server: Server, client: socket.socket) -> bool:
    """Whether the kernel still has the server's end of ``client``'s
    connection (an orphan closed with unsent data stays there, buffers and
    all, for as long as its peer does not read)."""
    port, mine = address(server)[1], client.getsockname()[1]
    return any(c.laddr and c.raddr and c.laddr.port == port and c.raddr.port == mine
               for c in psutil.net_connections("tcp4"))


def _take_the_rest(sock: socket.socket) -> tuple:
    """What the client can still read, and whether its connection was reset."""
    received = 0
    try:
        while chunk := sock.recv(1 << 20):
            received += len(chunk)
    except ConnectionResetError:
        return received, True
    return received, False


def test_answers_nobody_reads_are_dropped_and_their_slots_serve_others():
    s = Server("--workers", "2", "--max-in-flight", "2", "--queue-timeout", "0.5",
               "--write-timeout", str(WRITE_TIMEOUT_S))
    hogs = []
    try:
        hogs.append(_hog(s, "/v1/run", _fetch_big()))
        hogs.append(_hog(s, "/v1/stream", {"python": FLOOD_THEN_SLEEP, "timeout": 120}))
        assert wait_for(lambda: s.client.get("/readyz").json()["in_flight"] == 2, DEADLINE_S)
        assert wait_for(lambda: _served(s), DEADLINE_S), "the answers nobody reads still hold every slot"
        assert wait_for(lambda: _dropped(s) == 2, DEADLINE_S), s.client.get("/metrics").text
        # Dropped for real: the server's end is gone, buffers and all, and
        # the client sees a reset, having had only part of its answer.
        for hog, size in zip(hogs, (FETCHED_ANSWER_BYTES, STREAMED_BYTES), strict=True):
            assert wait_for(lambda hog=hog: not _held_by_server(s, hog), DEADLINE_S)
            received, reset = _take_the_rest(hog)
            assert reset and 0 < received < size, (received, reset)
        # The stream's job, which would have run for a minute, is cancelled;
        # no slot stays taken.
        assert wait_for(lambda: not any(map(runs_a_job, s.descendants())), DEADLINE_S)
        assert s.client.get("/readyz").json()["in_flight"] == 0
        assert _served(s)
    finally:
        for hog in hogs:
            hog.close()
        assert s.stop() == 0
    log = s.log()
    assert "Traceback" not in log, log[-3000:]
    assert log.count("--write-timeout") == 2, log[-3000:]


@pytest.mark.slow
def test_a_slow_reader_keeps_its_answer_while_one_that_stopped_loses_its_own():
    """The timeout is about progress: a client that reads its long answer
    slowly but steadily (several write timeouts in all, each record
    several MB written at once) gets all of it, while the one beside it
    that reads nothing loses its answer."""
    s = Server("--workers", "2", "--max-in-flight", "2", "--write-timeout", str(WRITE_TIMEOUT_S))
    code = "import sys\nsys.stdout.buffer.write('\\U0001F600'.encode() * 1_000_000)"
    lines = "".join(json.dumps({"id": i, "python": code}) + "\n" for i in range(2)).encode()
    hog = reader = None
    try:
        hog = _hog(s, "/run_code", {**_fetch_big("code"), "language": "bash"})
        assert wait_for(lambda: s.client.get("/readyz").json()["in_flight"] == 1, DEADLINE_S)
        reader = _connect(s)
        client, request = _request("/v1/batch", lines)
        reader.sendall(request)
        started, body, status = time.monotonic(), [], None
        while True:
            event = client.next_event()
            if event is h11.NEED_DATA:
                time.sleep(0.01)  # at most ~6 MB/s
                client.receive_data(reader.recv(64 << 10))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                break
        took = time.monotonic() - started
        records = [json.loads(line) for line in b"".join(body).splitlines()]
        assert status == 200 and sorted(r["id"] for r in records) == [0, 1]
        assert all(r["status"] == "ok" and r["output"] == "\U0001F600" * 1_000_000 for r in records)
        assert len(b"".join(body)) > 2 * 12_000_000 and took > 3 * WRITE_TIMEOUT_S, took
        assert wait_for(lambda: _dropped(s) == 1, DEADLINE_S), "the client that read nothing kept its answer"
        assert _take_the_rest(hog)[1]
        assert _dropped(s) == 1
    finally:
        for sock in (hog, reader):
            if sock is not None:
                sock.close()
        assert s.stop() == 0
