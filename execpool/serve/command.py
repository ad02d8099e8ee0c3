"""``execpool serve``, the command: one pool, the app (execpool/serve/app.py)
on uvicorn, the sockets it listens on, and its shutdown.

Runs in the service's process. What it adds to the app is what only the
process that owns the listening sockets can do:

- refuse to listen beyond loopback without a token, and to start where
  the kernel lacks the sandbox it runs every job in (unless told ``--sandbox
  off``);
- hold the port on both address families (127.0.0.1 and ::1, or 0.0.0.0
  and ::), so that no job can take the other one and answer the clients
  that say ``localhost``;
- on loopback, answer only requests whose ``Host`` is a loopback name (a web
  page that rebinds its own name to 127.0.0.1 is refused);
- take as many descriptors as the machine allows, and close connections
  past ``--max-connections`` at once: a job that opens thousands of
  connections to the server must not leave it without descriptors;
- give up on connections that do not send their request headers in time,
  and on those that take none of their answer in time (uvicorn has neither
  limit: a client that trickles a header byte every few seconds, or that
  asks for a big answer and never reads it, would hold its connection --
  and the answer's slot -- for ever);
- SIGTERM / SIGINT: stop listening, give running jobs ``--grace`` seconds,
  then cancel what still runs (each request is answered with its
  ``cancelled`` record), close the pool, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import ipaddress
import logging
import os
import resource
import signal
import socket
import struct
import sys
from typing import TYPE_CHECKING, Iterator, List, Optional, Tuple

import uvicorn
import uvloop
from prometheus_client import Counter
from starlette.applications import Starlette
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..eval.harness import JUDGE_MODULE
from ..formats.request import Defaults
from ..pool.config import disk_options
from ..shared.jobs import Limits
from ..shared.kernel.sandbox import sandbox_support
from ..supervisor import ExecPool
from .admission import Reason
from .app import LOOPBACK_NAMES, Place, create_app
from .request_job import ServiceJobs, memory_cap_by_cgroup
from .settings import DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_TIMEOUT_S, DEFAULT_WRITE_TIMEOUT_S, default_max_in_flight

if TYPE_CHECKING:
    from ..mcp.http import Endpoint

logger = logging.getLogger("execpool")

#: After the grace, cancelled jobs still answer their requests: this long.
ANSWER_CANCELLED_S = 5.0
#: Ports tried for a service on port 0 whose other-family twin was taken.
_PORT_TRIES = 16
#: Each address's twin in the other family.
_TWINS = {"127.0.0.1": "::1", "::1": "127.0.0.1", "0.0.0.0": "::", "::": "0.0.0.0"}
#: Descriptors kept for everything but connections: the pool, its jobs'
#: pipes, files being written and read.
_SPARE_FDS = 512


class UsageError(Exception):
    """Options ``execpool serve`` refuses (it exits 2 with the message)."""


def main(args: argparse.Namespace) -> int:
    """``execpool serve``: exits 0 after a clean shutdown, 2 for bad usage."""
    try:
        token = checked(args)
        max_connections = _connection_room(args.max_connections)
        try:
            sockets = _listen(args.host, args.port)
        except OSError as exc:
            raise UsageError(f"cannot listen on {args.host}:{args.port}: {exc.strerror}") from None
    except UsageError as exc:
        print(f"execpool serve: {exc}", file=sys.stderr)
        return 2
    try:
        with service(args, token) as app:
            _InTime.timeout = args.read_timeout
            _InTime.write_timeout = args.write_timeout
            _InTime.dropped = app.state.jobs.metrics.rejected.labels(Reason.WRITE_TIMEOUT)
            _InTime.max_connections = max_connections
            config = uvicorn.Config(app, http=_InTime, log_level="warning", lifespan="off",
                                    timeout_graceful_shutdown=args.grace + ANSWER_CANCELLED_S)
            # uvloop: the event loop's own share of each request's CPU.
            uvloop.run(_serve(_Server(config), sockets, app, args.grace))
    except UsageError as exc:
        print(f"execpool serve: {exc}", file=sys.stderr)
        return 2
    finally:
        for sock in sockets:
            sock.close()
    return 0


def checked(args: argparse.Namespace) -> Optional[str]:
    """The token, once the options are ones the service can run with; else
    UsageError saying why."""
    try:
        token = _token(args)
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    if token is None and not _loopback(args.host):
        raise UsageError(f"refusing to bind {args.host} without a token: anyone who can reach it could run "
                         "code here. Give --token-file PATH or set EXECPOOL_TOKEN.")
    if args.timeout > args.max_timeout:
        raise UsageError(f"--timeout {args.timeout:g} is over --max-timeout {args.max_timeout:g}")
    return token


@contextlib.contextmanager
def service(args: argparse.Namespace, token: Optional[str], place: Optional[Place] = None,
            niceness: Optional[int] = None) -> Iterator[Starlette]:
    """The app of ``execpool serve`` with these options, over a pool of its
    own that is closed as the block ends: the command's one, and each Ray
    replica's (execpool/ray/serve.py). UsageError where the kernel lacks
    the sandbox the service runs every job in. ``niceness``: the
    workers' (and so the tools'), None for this process's own."""
    sandbox = None if args.sandbox == "off" else "strict"
    if sandbox is not None and not sandbox_support().available:
        # Failing every job would be a service that answers nothing but
        # errors; running them unsandboxed, one that says it sandboxes.
        raise UsageError(f"{sandbox_support().missing}. Give --sandbox off to serve without it.")
    # The token is in this process's memory and maybe its environment:
    # tools running as the same user must not read them through /proc.
    # Every job in the sandbox (execpool/shared/kernel/sandbox.py).
    # /v1/eval's judge is in the warm interpreters of the pool's own
    # Python (another --python may lack execpool: it is imported per job).
    preload = args.preload if args.python else (*args.preload, JUDGE_MODULE)
    disk = disk_options(args.disk_mb, args.disk_budget_mb, Limits(processes=args.processes),
                        jobs_at_once=args.max_in_flight or default_max_in_flight())
    with ExecPool(workers=args.workers, python=args.python, preload=preload, non_dumpable=True,
                  sandbox=sandbox, niceness=niceness, **disk) as pool:
        limits, by_cgroup = _tenant_limits(pool, args.memory_mb)
        defaults = Defaults(timeout=args.timeout, max_timeout=args.max_timeout, warm=args.warm,
                            network=args.network, limits=limits, memory_by_cgroup=by_cgroup)
        _say_what_fits(pool, args.max_sessions)
        # Which languages run in this sandbox: checked from now on, in
        # the background (execpool/pool/toolchains.py); no request waits.
        pool.languages()
        yield create_app(pool, max_in_flight=args.max_in_flight, max_queue=args.max_queue,
                         queue_timeout=args.queue_timeout, token=token, max_body_mb=args.max_body_mb,
                         defaults=defaults, heartbeat_s=args.heartbeat, read_timeout=args.read_timeout,
                         allowed_hosts=LOOPBACK_NAMES if _loopback(args.host) else None,
                         max_sessions=args.max_sessions, session_idle_timeout=args.session_idle_timeout,
                         place=place)


def _token(args: argparse.Namespace) -> Optional[str]:
    if args.token_file:
        with open(args.token_file, encoding="utf-8") as f:
            token = f.read().strip()
        if not token:
            raise ValueError(f"the token file {args.token_file} is empty")
        return token
    return os.environ.get("EXECPOOL_TOKEN") or None


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _connection_room(wanted: int) -> int:
    """Raise this process's descriptor limit as far as it may go; the
    connections it leaves room for (at most ``wanted``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return max(16, min(wanted, soft - _SPARE_FDS))


def _listen(host: str, port: int) -> List[socket.socket]:
    """The listening sockets: ``host``'s, and its twin's in the other
    family on the same port, where this machine has that family."""
    first = "127.0.0.1" if host == "localhost" else host
    twin = _TWINS.get(first)
    if twin is not None:
        for _ in range(_PORT_TRIES if port == 0 else 1):
            main_socket = _bound(first, port)
            try:
                return [main_socket, _bound(twin, main_socket.getsockname()[1])]
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL or (exc.errno == errno.EAFNOSUPPORT):
                    return [main_socket]  # no such loopback here: nobody can squat on it either
                main_socket.close()
                if exc.errno != errno.EADDRINUSE or port != 0:
                    raise
        raise OSError(errno.EADDRINUSE, "no free port on both 127.0.0.1 and ::1")
    return [_bound(host, port)]


def _bound(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns TCP_NODELAY on only for sockets
    # that say they are TCP, and without it every answer on a kept-alive
    # connection waits ~40 ms for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class _InTime(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol (httptools' parser: a third of the server's CPU per
    request went to h11's), with deadlines for both halves of a
    request. Its headers: ``timeout`` seconds from the connection, or from
    the end of the answer before (the body has its own, in the app). Its
    answer: once the connection's buffer is past its high-water mark --
    the kernel's buffers are full, and uvicorn's ``send`` waits for it to
    drain before writing more -- the client must take some of it every
    ``write_timeout`` seconds, or the connection is reset. Progress is what
    counts, not how long the buffer takes to drain: one write of a big
    record may take a slow client many timeouts to read, and it keeps its
    answer as long as it reads. A reset connection is a client gone to the
    app: its answer's slot is freed and a stream's job cancelled. The idle
    test is the protocol's own, the one its ``shutdown`` uses."""

    timeout: float = DEFAULT_READ_TIMEOUT_S
    write_timeout: float = DEFAULT_WRITE_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    #: The app's count of answers dropped (``execpool_rejected_total``).
    dropped: Counter

    def connection_made(self, transport) -> None:
        self._headers_due: Optional[asyncio.TimerHandle] = None
        self._answer_due: Optional[asyncio.TimerHandle] = None
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.abort()  # past the cap: its descriptor back at once, no answer
            return
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        _cancel(self._headers_due)
        _cancel(self._answer_due)
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._watch_answer(self.transport.get_write_buffer_size())

    def resume_writing(self) -> None:
        _cancel(self._answer_due)
        super().resume_writing()

    def _arm(self) -> None:
        _cancel(self._headers_due)
        self._headers_due = self.loop.call_later(self.timeout, self._headers_late)

    def _headers_late(self) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self.timeout_keep_alive_handler()  # closes the connection, as an idle one's end

    def _watch_answer(self, unsent: int) -> None:
        _cancel(self._answer_due)
        self._answer_due = self.loop.call_later(self.write_timeout, self._answer_late, unsent)

    def _answer_late(self, unsent: int) -> None:
        """``unsent`` bytes were waiting ``write_timeout`` seconds ago (and
        next to nothing can have joined them: ``send`` waits while writing
        is paused)."""
        left = self.transport.get_write_buffer_size()
        if left < unsent:
            self._watch_answer(left)  # the client took some: it reads, however slowly
            return
        peer = "%s:%s" % self.client if self.client else "a client"
        asked = f"{self.scope['method']} {self.scope['path']!r}" if self.scope else "a request"
        logger.warning("execpool serve: %s took none of its answer to %s for %g s (--write-timeout): "
                       "connection reset", peer, asked, self.write_timeout)
        self.dropped.inc()
        # A reset, not a close: closed, the socket would stay in the kernel
        # with its unsent megabytes for as long as the client keeps quiet.
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()


def _cancel(timer: Optional[asyncio.TimerHandle]) -> None:
    if timer is not None:
        timer.cancel()


class _Server(uvicorn.Server):
    """uvicorn, but a SIGTERM or SIGINT only starts its graceful shutdown:
    uvicorn raises the signal again once it has stopped, which would end
    this process before it closed its pool."""

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


async def _serve(server: uvicorn.Server, sockets: List[socket.socket], app: Starlette, grace: float) -> None:
    """Serve until told to stop; then the grace, then cancel what runs. The
    pool's messages are read on this loop meanwhile (``pool.on_loop``), and
    the app's lifespan (the MCP endpoint's sessions) runs around it all."""
    jobs: ServiceJobs = app.state.jobs
    with jobs.pool.on_loop():
        async with app.router.lifespan_context(app):
            await _until_stopped(server, sockets, jobs, app.state.mcp, grace)


async def _until_stopped(server: uvicorn.Server, sockets: List[socket.socket], jobs: ServiceJobs,
                         mcp: Optional[Endpoint], grace: float) -> None:
    task = asyncio.ensure_future(server.serve(sockets=sockets))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if server.started:
        host, port = sockets[0].getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"execpool serve: ready at http://{shown}:{port}", flush=True)
    while not server.should_exit and not task.done():
        await asyncio.sleep(0.05)  # uvicorn itself looks at should_exit every 0.1 s
    deadline = asyncio.get_running_loop().time() + grace
    if mcp is not None:
        await mcp.close(grace)  # its calls get the grace; then its open streams end, as clients leaving
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), max(0.0, deadline - asyncio.get_running_loop().time()))
    jobs.stop_jobs()
    await task


def _tenant_limits(pool: ExecPool, memory_mb: int) -> Tuple[Limits, bool]:
    """Every request's limits, which it may lower and never raise: the
    pool's (its --processes among them) and --memory-mb as a cgroup cap
    where the pool can give one; whether it can."""
    by_cgroup = bool(memory_cap_by_cgroup(pool))
    if not by_cgroup:
        print("execpool serve: no cgroup memory controller here: --memory-mb cannot bound a job's memory, only each "
              "process's address space does (Limits.address_space)", file=sys.stderr)
        return pool.config.limits, False
    return dataclasses.replace(pool.config.limits, memory=memory_mb << 20), True


def _say_what_fits(pool: ExecPool, max_sessions: int) -> None:
    """A note when --max-sessions sessions at --disk-mb each would not fit
    the disk budget: past what fits, a session is answered 503."""
    disk = pool.config.limits.disk
    budget = pool.disk_budget
    room = budget.total - budget.kept
    if pool.config.sandbox is None or disk is None or max_sessions * disk <= room:
        return
    print(f"execpool serve: {max_sessions} sessions (--max-sessions) of {disk >> 20} MiB each (--disk-mb) do not fit "
          f"the disk budget of {budget.total >> 20} MiB (--disk-budget-mb) less the {budget.kept >> 20} MiB kept for "
          f"the jobs running at once (--max-in-flight): past {room // disk} at once, sessions are answered 503",
          file=sys.stderr)
