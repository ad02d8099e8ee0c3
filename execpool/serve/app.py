"""``execpool serve``: one pool behind HTTP (docs/service/index.md).

::

    clients (RL trainers, eval harnesses, SandboxFusion clients, people)
       |  HTTP/1.1 on uvicorn
    ASGI app (Starlette)                         this process
       auth -> body limit -> route -> Admission (execpool/serve/admission.py)
       -> ExecPool.submit / astream (the one pool) -> answer
       /metrics from prometheus-client and pool.stats()

Runs in the service's process, on uvicorn's event loop: one process, one
pool, one loop (execpool/serve/command.py is the command that starts it,
listens and shuts it down). This module puts the app together: the routes
(execpool/serve/routes.py), which run their jobs through ``ServiceJobs``
(execpool/serve/request_job.py), behind a guard that refuses foreign origins,
foreign hosts and missing tokens before any body is read.

Why Starlette (and not a framework that validates through its own models):
the service's answers to bad input are part of its contract -- 400 with a
message naming the field, in the words the library's own checks use, and
SandboxFusion's 200-with-``SandboxError`` on ``/run_code`` -- so the bodies
are checked by execpool/formats/request.py, once, and the framework is only what
routes, streams and serves: Starlette does that, small and well kept, on
the ASGI server most Python services run (uvicorn).

What it guarantees, with the options of ``execpool serve``:
- at most ``--max-in-flight`` jobs run, up to ``--max-queue`` wait at most
  ``--queue-timeout`` s; overload is answered at once: 504 on ``/run_code``
  (SandboxFusion clients retry it), 503 + ``Retry-After`` elsewhere;
- a client that goes away -- waiting or running -- cancels its job, tree and
  all;
- off loopback only with a token; 401 runs nothing;
- what a request may cost is bounded: body size, the time its body takes
  to arrive, jobs per batch, files per job, bytes fetched; parsing big
  bodies and file I/O run on threads;
- at shutdown (``stop_jobs``) every job still running is cancelled and its
  request answered with the ``cancelled`` record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import time
from typing import Any, AsyncIterator, Callable, Dict, Mapping, Optional, Sequence

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..formats.request import BadField, Defaults
from ..mcp import settings as mcp_settings
from ..supervisor import ExecPool
from .admission import Admission, ClientGone, Reason, Rejected
from .evaluation import Evaluations
from .metrics import ServiceMetrics
from .request_job import ServiceJobs, Settings
from .routes import Routes, TooLarge, TooSlow
from .sessions import CannotFork, NoSuchSession, ServiceSessions, SessionRoutes
from .settings import (
    DEFAULT_FETCH_MAX_BYTES,
    DEFAULT_HEARTBEAT_S,
    DEFAULT_MAX_BODY_MB,
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_MAX_TIMEOUT_S,
    DEFAULT_QUEUE_TIMEOUT_S,
    DEFAULT_READ_TIMEOUT_S,
    DEFAULT_SESSION_IDLE_S,
    DEFAULT_TIMEOUT_S,
    default_max_in_flight,
)

#: Routes anyone may call, token or not: liveness, readiness, SandboxFusion's
#: ping, and the page (static: it runs nothing itself, and its requests to
#: /v1/stream carry the token the person types in) with the icon browsers
#: ask for beside it (else every visit would count as a refused token).
OPEN_PATHS = ("/", "/favicon.ico", "/healthz", "/readyz", "/v1/ping")

#: What a ``Host`` header may say to a server that listens on loopback.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")

#: What a request says nothing of, unless the app is told otherwise: a
#: service's jobs always have a timeout, and a bounded one.
SERVICE_DEFAULTS = Defaults(timeout=DEFAULT_TIMEOUT_S, max_timeout=DEFAULT_MAX_TIMEOUT_S)


@dataclasses.dataclass(frozen=True)
class Place:
    """Where an app serves as one of several behind a router (the replicas
    of execpool/ray/serve.py). ``name`` fills SandboxFusion's
    ``executor_pod_name`` and begins every session id the app gives
    (``NAME.<the pool's id>``), which is how a request for a session finds
    the app that holds it; ``middleware`` runs after the guard (host,
    origin, token) and before the routes: a request is never passed on
    for someone the guard would refuse."""

    name: str
    middleware: Sequence[Middleware] = ()


def create_app(pool: ExecPool, *, max_in_flight: Optional[int] = None, max_queue: int = DEFAULT_MAX_QUEUE,
               queue_timeout: float = DEFAULT_QUEUE_TIMEOUT_S, token: Optional[str] = None,
               max_body_mb: int = DEFAULT_MAX_BODY_MB, defaults: Defaults = SERVICE_DEFAULTS,
               heartbeat_s: float = DEFAULT_HEARTBEAT_S, read_timeout: float = DEFAULT_READ_TIMEOUT_S,
               allowed_hosts: Optional[Sequence[str]] = None, max_sessions: int = DEFAULT_MAX_SESSIONS,
               session_idle_timeout: float = DEFAULT_SESSION_IDLE_S, place: Optional[Place] = None) -> Starlette:
    """The ASGI app around ``pool``, for mounting in your own server. The
    pool stays yours: close it after the app is done (that also removes
    the app's directories). ``defaults`` is what a request does not say
    (``execpool.formats.request.Defaults``: its timeout, the largest it may
    ask, warm Python, the network, limits). ``read_timeout`` bounds the
    time a request's body may take to arrive. Headers, and how long an
    answer may wait for a client that does not read it, are the server's
    business, as only the server holds the connection: ``execpool serve``
    gives headers the same limit, and resets a connection whose answer
    makes no progress for ``--write-timeout`` seconds.
    ``allowed_hosts``: the names (no port) a request's ``Host`` may say;
    ``LOOPBACK_NAMES`` for a server on loopback, None for any.
    ``max_sessions`` and ``session_idle_timeout``: how many sessions may be
    open at once, and the longest (and default) idle timeout of one.
    ``place``: where the app serves, when it is one of several (``Place``)."""
    max_body_bytes = max_body_mb << 20
    admission = Admission(max_in_flight or default_max_in_flight(), max_queue, queue_timeout)
    jobs = ServiceJobs(pool, admission, Settings(defaults, heartbeat_s, min(max_body_bytes, DEFAULT_FETCH_MAX_BYTES)))
    name = None if place is None else place.name
    routes = Routes(jobs, max_body_bytes=max_body_bytes, read_timeout=read_timeout, pod_name=name)
    kept = ServiceSessions(jobs, max_sessions, session_idle_timeout, prefix="" if name is None else f"{name}.")
    sessions = SessionRoutes(kept, routes.body)
    metrics = jobs.metrics

    async def bad_request(request: Request, exc: Exception) -> Response:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    async def too_large(request: Request, exc: Exception) -> Response:
        return _refused(metrics, Reason.TOO_LARGE, 413, f"the body is over {max_body_mb} MiB")

    async def busy(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, Rejected)
        return _refused(metrics, exc.reason, 503, f"execpool is busy ({exc.reason}); retry",
                        {"Retry-After": str(exc.retry_after)})

    async def too_slow(request: Request, exc: Exception) -> Response:
        return _refused(metrics, Reason.READ_TIMEOUT, 408, f"the body did not arrive within {read_timeout:g} s",
                        {"Connection": "close"})

    async def no_session(request: Request, exc: Exception) -> Response:
        return JSONResponse({"detail": "no such session (closed, expired, or never opened)"}, status_code=404)

    async def cannot_fork(request: Request, exc: Exception) -> Response:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    async def gone(request: Request, exc: Exception) -> Response:
        return Response(status_code=499)  # nobody reads it: the client left while waiting or sending

    mcp = _mcp_endpoint(jobs, defaults, kept, max_body_bytes)
    app = Starlette(routes=[
        Route("/", routes.page), Route("/favicon.ico", routes.no_icon),
        Route("/healthz", routes.healthz), Route("/readyz", routes.readyz), Route("/metrics", routes.metrics),
        Route("/v1/ping", routes.ping), Route("/openapi.json", routes.openapi),
        Route("/v1/languages", routes.languages),
        Route("/run_code", routes.run_code, methods=["POST"]),
        Route("/v1/run", routes.v1_run, methods=["POST"]), Route("/v1/stream", routes.v1_stream, methods=["POST"]),
        Route("/v1/batch", routes.v1_batch, methods=["POST"]),
        Route("/v1/eval", Evaluations(jobs, routes.body).v1_eval, methods=["POST"]),
        Route("/v1/sessions", sessions.create, methods=["POST"]), Route("/v1/sessions", sessions.listed),
        Route("/v1/sessions/{ident}", sessions.delete, methods=["DELETE"]),
        Route("/v1/sessions/{ident}/run", sessions.run, methods=["POST"]),
        Route("/v1/sessions/{ident}/stream", sessions.stream, methods=["POST"]),
        Route("/v1/sessions/{ident}/fork", sessions.fork, methods=["POST"]),
        Route("/run_jupyter", sessions.run_jupyter, methods=["POST"]),
        Route("/mcp", _Bodied(mcp, routes) if mcp is not None else _no_mcp),
    ], exception_handlers={BadField: bad_request, TooLarge: too_large, TooSlow: too_slow, Rejected: busy,
                           ClientGone: gone, ClientDisconnect: gone, NoSuchSession: no_session,
                           CannotFork: cannot_fork},
       lifespan=None if mcp is None else lambda app: mcp.running())
    app.state.jobs = jobs
    app.state.mcp = mcp
    app.state.sessions = kept
    for layer in reversed(() if place is None else place.middleware):
        app.add_middleware(layer.cls, *layer.args, **layer.kwargs)
    app.add_middleware(_Guard, metrics=metrics, token=token, allowed_hosts=allowed_hosts)
    return app


def _mcp_endpoint(jobs: ServiceJobs, defaults: Defaults, kept: ServiceSessions, max_body_bytes: int) -> Any:
    """The MCP server at ``/mcp`` (execpool/mcp/http.py), its calls in the
    service's slots, its interpreters counted with the service's sessions
    against ``--max-sessions``; None without the ``mcp`` extra."""
    try:
        from ..mcp.http import Endpoint
        from ..mcp.server import Busy
    except ImportError as exc:
        if not mcp_settings.stack_missing(exc):
            raise
        return None

    def busy(exc: Rejected) -> Busy:
        jobs.metrics.rejected.labels(exc.reason).inc()
        return Busy(f"Execution error: execpool is busy ({exc.reason}); retry in {exc.retry_after} s.")

    @contextlib.asynccontextmanager
    async def slot(arrived: Optional[float]) -> AsyncIterator[None]:
        try:
            waited = await jobs.admission.acquire(since=arrived)
        except Rejected as exc:
            raise busy(exc) from None
        jobs.metrics.queue_wait.observe(waited)
        try:
            yield
        finally:
            jobs.admission.release()

    def seat() -> Callable[[], None]:
        try:
            return kept.lend()
        except Rejected as exc:
            raise busy(exc) from None

    return Endpoint(jobs.pool, timeout=defaults.timeout or DEFAULT_TIMEOUT_S,
                    max_timeout=defaults.max_timeout or DEFAULT_MAX_TIMEOUT_S, idle_timeout=kept.idle_timeout,
                    max_sessions=kept.max_sessions, gate=slot, claim=seat, max_body_bytes=max_body_bytes)


class _Bodied:
    """``/mcp`` with the service's rules for a body (``--max-body-mb``,
    ``--read-timeout``: 413, 408) before the SDK reads it, which would wait
    for a trickled one for ever. A class, not a function: Starlette's
    ``Route`` takes a function for a request handler, not an ASGI app."""

    def __init__(self, app: Any, routes: Routes) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        body = await self.routes.body(Request(scope, receive))
        given = False

        async def replayed() -> Dict[str, Any]:
            nonlocal given
            if given:
                return await receive()
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await self.app(scope, replayed, send)


async def _no_mcp(request: Request) -> Response:
    return JSONResponse({"detail": mcp_settings.INSTALL_HINT}, status_code=501)


def _refused(metrics: ServiceMetrics, reason: Reason, status: int, detail: str,
             headers: Optional[Mapping[str, str]] = None) -> Response:
    metrics.rejected.labels(reason).inc()
    return JSONResponse({"detail": detail}, status_code=status, headers=dict(headers or {}))


class _Guard:
    """Before any route (or body) is read: requests from web pages of other
    origins are refused (a page anywhere could otherwise POST code to a
    tokenless server on the visitor's loopback: browsers send such a
    request without asking), so are requests for a host this server is not
    (``allowed_hosts``: a page that rebinds its name to 127.0.0.1 is
    same-origin with itself, but says its own name), and a missing or
    wrong token is a 401."""

    def __init__(self, app: Callable, metrics: ServiceMetrics, token: Optional[str],
                 allowed_hosts: Optional[Sequence[str]]) -> None:
        self.app = app
        self.metrics = metrics
        self.token = token
        self.allowed_hosts = None if allowed_hosts is None else frozenset(allowed_hosts)

    def authorized(self, request: Request) -> bool:
        if self.token is None or request.url.path in OPEN_PATHS:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode())

    async def __call__(self, scope: Dict[str, Any], receive: Callable, send: Callable) -> None:
        scope.setdefault("state", {})["arrived"] = time.monotonic()  # the queue timeout counts from here
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        host = request.headers.get("host", "")
        if self.allowed_hosts is not None and _hostname(host) not in self.allowed_hosts:
            refusal = _refused(self.metrics, Reason.HOST, 421, f"this server does not answer for the host {host!r}")
        elif not _same_origin(request.headers.get("origin"), host):
            refusal = _refused(self.metrics, Reason.CROSS_ORIGIN, 403,
                               "requests from web pages of other origins are refused")
        elif not self.authorized(request):
            refusal = _refused(self.metrics, Reason.AUTH, 401,
                               "a valid 'Authorization: Bearer <token>' header is required",
                               {"WWW-Authenticate": "Bearer"})
        else:
            await self.app(scope, receive, send)
            return
        await refusal(scope, receive, send)


def _hostname(host: str) -> str:
    """The name in a ``Host`` header, without its port (IPv6 in brackets kept)."""
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _same_origin(origin: Optional[str], host: str) -> bool:
    """No ``Origin`` (a program, not a page) or the page's own origin."""
    if origin is None:
        return True
    return origin in (f"http://{host}", f"https://{host}")
