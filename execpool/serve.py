"""``execpool serve``: one pool behind HTTP (shared/SERVE.md).

::

    clients (RL trainers, eval harnesses, SandboxFusion clients, people)
       |  HTTP/1.1 on uvicorn
    ASGI app (Starlette)                         this process
       auth -> body limit -> route -> Admission (execpool/admission.py)
       -> ExecPool.submit / astream (the one pool) -> answer
       /metrics from prometheus-client and pool.stats()

Runs in the service's process, on uvicorn's event loop: one process, one
pool, one loop. The routes only await: a job is a ``JobFuture`` wrapped for
asyncio, a stream is ``pool.astream``; no thread per request.

Why Starlette (and not a framework that validates through its own models):
the service's answers to bad input are part of its contract -- 400 with a
message naming the field, in the words the library's own checks use, and
SandboxFusion's 200-with-``SandboxError`` on ``/run_code`` -- so the bodies
are checked by execpool/httpjobs.py, once, and the framework is only what
routes, streams and serves: Starlette does that, small and well kept, on
the ASGI server most Python services run (uvicorn).

What it guarantees, with the options of ``execpool serve``:
- at most ``--max-in-flight`` jobs run, up to ``--max-queue`` wait at most
  ``--queue-timeout`` s; overload is answered at once: 504 on ``/run_code``
  (SandboxFusion clients retry it), 503 + ``Retry-After`` elsewhere;
- a client that goes away -- waiting or running -- cancels its job, tree and
  all;
- off loopback only with a token; 401 runs nothing;
- SIGTERM/SIGINT: no new requests, running ones get ``--grace`` s, the rest
  are cancelled, the pool is closed, nothing survives.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hmac
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import tempfile
from typing import Any, AsyncIterator, Callable, Dict, Mapping, Optional, Tuple

import uvicorn
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import httpjobs
from .admission import DEFAULT_MAX_QUEUE, DEFAULT_QUEUE_TIMEOUT_S, Admission, ClientGone, Rejected
from .dirs import remove_tree
from .httpjobs import DEFAULT_HEARTBEAT_S, DEFAULT_MAX_BODY_MB, BadRequest, JobRequest, ServiceDefaults
from .jobfiles import JobFileError, read_files, write_files
from .jobs import Limits, ShellJob
from .result import Result, Status
from .stats import DURATION_BUCKETS_S
from .supervisor import ExecPool

#: Routes anyone may call, token or not: liveness, readiness, SandboxFusion's ping.
OPEN_PATHS = ("/healthz", "/readyz", "/v1/ping")


logger = logging.getLogger("execpool")


class _Metrics:
    """The service's Prometheus metrics (shared/SERVE.md §5), in a registry
    of its own so two apps in one process do not collide."""

    def __init__(self, pool: ExecPool, admission: Admission) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.jobs = Counter("execpool_jobs", "Jobs ended, by route, kind and status",
                            ["route", "kind", "status"], registry=r)
        self.duration = Histogram("execpool_job_duration_seconds", "Run time of jobs", ["kind"],
                                  buckets=DURATION_BUCKETS_S, registry=r)
        self.queue_wait = Histogram("execpool_queue_wait_seconds", "Time a request waited for a slot",
                                    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0), registry=r)
        Gauge("execpool_jobs_in_flight", "Jobs running now", registry=r).set_function(lambda: admission.in_flight)
        Gauge("execpool_queue_depth", "Requests waiting for a slot", registry=r).set_function(
            lambda: admission.queue_depth)
        self.rejected = Counter("execpool_rejected", "Requests refused, by reason", ["reason"], registry=r)
        r.register(_PoolCollector(pool))

    def job(self, route: str, kind: str, result: Result) -> None:
        self.jobs.labels(route, kind, result.status.value).inc()
        self.duration.labels(kind).observe(result.duration_s)


class _PoolCollector:
    """Figures the pool keeps itself (``pool.stats()``), read at scrape time."""

    def __init__(self, pool: ExecPool) -> None:
        self.pool = pool

    def collect(self):
        stats = self.pool.stats()
        restarts = CounterMetricFamily("execpool_worker_restarts", "Workers that died and were replaced")
        restarts.add_metric([], stats.worker_restarts)
        output = CounterMetricFamily("execpool_output_bytes", "Bytes of output the jobs produced")
        output.add_metric([], stats.output_bytes)
        return [restarts, output]


class _Service:
    """The app's state and routes: one pool, its admission, its metrics."""

    def __init__(self, pool: ExecPool, *, max_in_flight: int, max_queue: int, queue_timeout: float,
                 token: Optional[str], max_body_bytes: int, defaults: ServiceDefaults, heartbeat_s: float) -> None:
        self.pool = pool
        self.admission = Admission(max_in_flight, max_queue, queue_timeout)
        self.metrics = _Metrics(pool, self.admission)
        self.token = token
        self.max_body_bytes = max_body_bytes
        self.defaults = defaults
        self.heartbeat_s = heartbeat_s
        # Directories of jobs that bring or fetch files: made here, 0700.
        self.root = tempfile.mkdtemp(prefix="execpool-serve-")
        self._memory_by_cgroup: Optional[bool] = None

    def close(self) -> None:
        remove_tree(self.root)

    # -- the plumbing every route shares ---------------------------------------------

    def authorized(self, request: Request) -> bool:
        if self.token is None or request.url.path in OPEN_PATHS:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode())

    async def body(self, request: Request) -> bytes:
        """The body, or _TooLarge past the limit (read no further)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _TooLarge()
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _TooLarge()
            chunks.append(chunk)
        return b"".join(chunks)

    async def slot(self, request: Optional[Request], *, bounded: bool = True) -> None:
        waited = await self.admission.acquire(None if request is None else lambda: _disconnected(request),
                                              bounded=bounded)
        self.metrics.queue_wait.observe(waited)

    def memory_by_cgroup(self) -> bool:
        """Whether a job's memory cap can be a cgroup here; asked once, of
        the pool itself (a job with the cap either starts or is INFRA)."""
        if self._memory_by_cgroup is None:
            probe = self.pool.run(ShellJob("true", timeout=10, limits=Limits(memory=256 << 20)))
            self._memory_by_cgroup = probe.status is Status.OK
        return self._memory_by_cgroup

    @contextlib.contextmanager
    def placed(self, job_request: JobRequest):
        """The job, in a directory of its own holding its files when the
        request brings or fetches any (else where the pool puts it), and a
        function that reads back the files to fetch; the directory goes
        when the job is done with."""
        if not job_request.needs_directory:
            yield job_request.job, dict
            return
        directory = tempfile.mkdtemp(dir=self.root)
        try:
            try:
                write_files(directory, job_request.files)
            except JobFileError as exc:
                raise BadRequest(f'"files": {exc}') from None
            yield _with_cwd(job_request.job, directory), lambda: read_files(directory, job_request.fetch)
        finally:
            remove_tree(directory)

    async def run(self, job_request: JobRequest, route: str, request: Optional[Request]) -> Tuple[Result, dict]:
        """Run one admitted job (its slot is released here) and fetch its files."""
        try:
            with self.placed(job_request) as (job, fetch):
                result = await _until_done_or_gone(self.pool.submit(job), request)
                self.metrics.job(route, job.kind, result)
                return result, fetch()
        finally:
            self.admission.release()

    def rejected(self, reason: str) -> None:
        self.metrics.rejected.labels(reason).inc()

    # -- SandboxFusion ---------------------------------------------------------------------

    async def run_code(self, request: Request) -> Response:
        try:
            obj = httpjobs.parse_json(await self.body(request))
            job_request = httpjobs.sandbox_fusion_request(obj, self.defaults, await asyncio.to_thread(
                self.memory_by_cgroup) if _asks_memory(obj) else False)
        except BadRequest as exc:
            return JSONResponse(httpjobs.sandbox_error(str(exc)))
        try:
            await self.slot(request)
        except Rejected as exc:
            self.rejected(exc.reason)
            return JSONResponse({"detail": f"execpool is busy ({exc.reason}); retry"}, status_code=504)
        except ClientGone:
            return Response(status_code=499)
        try:
            result, files = await self.run(job_request, "run_code", request)
        except BadRequest as exc:
            return JSONResponse(httpjobs.sandbox_error(str(exc)))
        return JSONResponse(httpjobs.sandbox_fusion_answer(result, files))

    # -- execpool's own ---------------------------------------------------------------------

    async def v1_run(self, request: Request) -> Response:
        job_request = httpjobs.run_request(httpjobs.parse_json(await self.body(request)), self.defaults)
        await self.slot(request)
        result, files = await self.run(job_request, "v1_run", request)
        return JSONResponse(httpjobs.record(job_request, result, files))

    async def v1_stream(self, request: Request) -> Response:
        job_request = httpjobs.run_request(httpjobs.parse_json(await self.body(request)), self.defaults)
        await self.slot(request)
        held = _Held(self.admission)
        return _SlotResponse(held, self._events(job_request, held), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    async def _events(self, job_request: JobRequest, held: "_Held") -> AsyncIterator[str]:
        """The SSE body. A client that goes away makes Starlette cancel this
        generator: the stream's cleanup cancels the job (its tree dies)."""
        held.take()
        try:
            with self.placed(job_request) as (job, fetch):
                stream = self.pool.astream(job, tool_name=job.kind, heartbeat_interval_s=self.heartbeat_s)
                try:
                    async for event in stream:
                        if event["type"] == "heartbeat":
                            yield ": keep-alive\n\n"
                        else:
                            yield f"data: {json.dumps(event)}\n\n"
                finally:
                    await stream.aclose()
                result = stream.result
                assert result is not None
                self.metrics.job("v1_stream", job.kind, result)
                answer = httpjobs.record(job_request, result, fetch())
            yield f"event: result\ndata: {json.dumps(answer)}\n\n"
        finally:
            self.admission.release()

    async def v1_batch(self, request: Request) -> Response:
        body = await self.body(request)
        jobs = _batch_jobs(body, self.defaults)
        await self.slot(request)  # the first job's: a batch that cannot start is a 503, not a stream of them
        held = _Held(self.admission)
        return _SlotResponse(held, self._records(jobs, held), media_type="application/x-ndjson")

    async def _records(self, jobs: list, held: "_Held") -> AsyncIterator[str]:
        """NDJSON records as jobs finish. The first job runs on the slot the
        route took; each later one waits its turn, so a batch never runs
        more than the service's slots allow."""
        done: asyncio.Queue = asyncio.Queue()
        running = set()
        try:
            for item in jobs:
                if isinstance(item, dict):  # an invalid line's record
                    yield json.dumps(item) + "\n"
                    continue
                if held.held:
                    held.take()
                else:
                    await self.slot(None, bounded=False)
                running.add(asyncio.ensure_future(self._batch_one(item, done)))
                while not done.empty():
                    yield await self._next_record(done, running)
            while running:
                yield await self._next_record(done, running)
        finally:
            for task in running:
                task.cancel()

    async def _batch_one(self, item: Tuple[JobRequest, Optional[str], int], done: asyncio.Queue) -> None:
        job_request, expected, number = item
        try:
            result, files = await self.run(job_request, "v1_batch", None)
            answer = (httpjobs.record(job_request, result, files, number) if expected is None
                      else httpjobs.test_record(job_request, result, expected))
        except BadRequest as exc:  # its files could not be written: this job's record says so
            answer = httpjobs.invalid_record(job_request.ident, number, str(exc))
        await done.put((asyncio.current_task(), answer))

    @staticmethod
    async def _next_record(done: asyncio.Queue, running: set) -> str:
        task, answer = await done.get()
        running.discard(task)
        return json.dumps(answer) + "\n"

    # -- health and metrics -------------------------------------------------------------------

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        workers = len(self.pool.worker_pids)
        ready = workers > 0 and not self.pool.closed and not self.admission.full
        return JSONResponse({"ready": ready, "workers": workers, "in_flight": self.admission.in_flight,
                             "queue_depth": self.admission.queue_depth}, status_code=200 if ready else 503)

    async def ping(self, request: Request) -> Response:
        return JSONResponse("pong")

    async def metrics_text(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(OPENAPI)


class _TooLarge(Exception):
    """A body over the service's limit."""


class _Held:
    """A slot a route took for a streamed answer: the job that runs on it
    ``take``s it over (and releases it when done); if the answer never runs
    (the client left before it started), the response releases it."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.held = True

    def take(self) -> None:
        self.held = False

    def release(self) -> None:
        if self.held:
            self.held = False
            self.admission.release()


class _SlotResponse(StreamingResponse):
    """A streamed answer that returns its route's slot however it ends."""

    def __init__(self, held: _Held, content: AsyncIterator[str], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.held = held

    async def __call__(self, scope: Any, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.held.release()


def _with_cwd(job, directory: str):
    return dataclasses.replace(job, cwd=directory)


def _asks_memory(obj: object) -> bool:
    limit = obj.get("memory_limit_MB") if isinstance(obj, dict) else None
    return isinstance(limit, int) and not isinstance(limit, bool) and limit > 0


async def _disconnected(request: Request) -> None:
    """Completes when the client has gone (after its body was read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _until_done_or_gone(future, request: Optional[Request]) -> Result:
    """The job's Result; if the client goes away first, or this request's
    task is cancelled (server shutdown), the job is cancelled -- its tree
    killed -- and its (cancelled) Result returned."""
    job = asyncio.wrap_future(future)
    watcher = asyncio.ensure_future(_disconnected(request)) if request is not None else None
    try:
        await asyncio.wait({job} if watcher is None else {job, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        future.cancel()
        raise
    finally:
        if watcher is not None:
            watcher.cancel()
    if not job.done():
        future.cancel()
    return await asyncio.shield(job)


def _batch_jobs(body: bytes, defaults: ServiceDefaults) -> list:
    """What a ``/v1/batch`` body runs: ``(JobRequest, expected or None,
    line number)`` per job, and for a line that is no job its ``invalid``
    record, in order. A body that is one JSON object with ``tests`` (pretty
    printed or not) is a program against its tests; anything else is NDJSON."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        obj = None  # NDJSON has more than one value: each line is read below
    if isinstance(obj, dict) and "tests" in obj:
        requests = httpjobs.tests_requests(obj, defaults)
        return [(request, obj["tests"][request.ident]["expected"], request.ident + 1) for request in requests]
    items: list = []
    for number, line in enumerate(body.splitlines(), 1):
        if not line.strip():
            continue
        try:
            items.append((httpjobs.run_request(httpjobs.parse_json(line), defaults), None, number))
        except BadRequest as exc:
            items.append(httpjobs.invalid_record(None, number, str(exc)))
    if not items:
        raise BadRequest("the body has no jobs (NDJSON: one job object per line)")
    return items


def create_app(pool: ExecPool, *, max_in_flight: Optional[int] = None, max_queue: int = DEFAULT_MAX_QUEUE,
               queue_timeout: float = DEFAULT_QUEUE_TIMEOUT_S, token: Optional[str] = None,
               max_body_mb: int = DEFAULT_MAX_BODY_MB, defaults: ServiceDefaults = ServiceDefaults(),
               heartbeat_s: float = DEFAULT_HEARTBEAT_S) -> Starlette:
    """The ASGI app around ``pool``, for mounting in your own server. The
    pool stays yours: close it after the app is done."""
    service = _Service(pool, max_in_flight=max_in_flight or 2 * (os.cpu_count() or 2), max_queue=max_queue,
                       queue_timeout=queue_timeout, token=token, max_body_bytes=max_body_mb << 20,
                       defaults=defaults, heartbeat_s=heartbeat_s)
    routes = [
        Route("/healthz", service.healthz), Route("/readyz", service.readyz), Route("/metrics", service.metrics_text),
        Route("/v1/ping", service.ping), Route("/openapi.json", service.openapi),
        Route("/run_code", service.run_code, methods=["POST"]),
        Route("/v1/run", service.v1_run, methods=["POST"]), Route("/v1/stream", service.v1_stream, methods=["POST"]),
        Route("/v1/batch", service.v1_batch, methods=["POST"]),
    ]
    async def bad_request(request: Request, exc: Exception) -> Response:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    async def too_large(request: Request, exc: Exception) -> Response:
        return _refused(service, "too_large", 413, f"the body is over {max_body_mb} MiB")

    async def busy(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, Rejected)
        return _refused(service, exc.reason, 503, f"execpool is busy ({exc.reason}); retry",
                        {"Retry-After": str(exc.retry_after)})

    async def gone(request: Request, exc: Exception) -> Response:
        return Response(status_code=499)  # nobody reads it: the client left while waiting

    app = Starlette(routes=routes, exception_handlers={BadRequest: bad_request, _TooLarge: too_large,
                                                       Rejected: busy, ClientGone: gone})
    app.state.service = service
    app.add_middleware(_Auth, service=service)
    return app


def _refused(service: _Service, reason: str, status: int, detail: str,
             headers: Optional[Mapping[str, str]] = None) -> Response:
    service.rejected(reason)
    return JSONResponse({"detail": detail}, status_code=status, headers=dict(headers or {}))


class _Auth:
    """A missing or wrong token is a 401 before any route (or body) is read."""

    def __init__(self, app: Callable, service: _Service) -> None:
        self.app = app
        self.service = service

    async def __call__(self, scope: Dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and not self.service.authorized(Request(scope)):
            self.service.rejected("auth")
            await JSONResponse({"detail": "a valid 'Authorization: Bearer <token>' header is required"},
                               status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        await self.app(scope, receive, send)


OPENAPI: dict = {
    "openapi": "3.1.0",
    "info": {"title": "execpool serve", "version": "1",
             "description": "Run Python and shell code in isolated processes. See shared/SERVE.md."},
    "paths": {
        "/v1/run": {"post": {"summary": "Run one job; answer its record",
                             "requestBody": {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Job"}}}},
                             "responses": {"200": {"description": "the job's record (as execpool batch writes it)"},
                                           "400": {"description": "a field is wrong; the message names it"},
                                           "401": {"description": "token missing or wrong"},
                                           "413": {"description": "body too large"},
                                           "503": {"description": "overloaded; see Retry-After"}}}},
        "/v1/stream": {"post": {"summary": "Run one job; answer Server-Sent Events: data lines with tool_output "
                                           "events, ': keep-alive' comments, then 'event: result' with the record",
                                "requestBody": {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Job"}}}},
                                "responses": {"200": {"description": "text/event-stream"}}}},
        "/v1/batch": {"post": {"summary": "Run NDJSON jobs, or {code, tests: [{stdin, expected}]}; answer NDJSON "
                                          "records as jobs finish",
                               "responses": {"200": {"description": "application/x-ndjson"}}}},
        "/run_code": {"post": {"summary": "SandboxFusion's run_code (RunCodeRequest -> RunCodeResponse)",
                               "responses": {"200": {"description": "RunCodeResponse"},
                                             "504": {"description": "overloaded: retry"}}}},
        "/v1/ping": {"get": {"summary": "SandboxFusion's ping: \"pong\""}},
        "/healthz": {"get": {"summary": "the process answers"}},
        "/readyz": {"get": {"summary": "workers are alive and the queue is not full (else 503)"}},
        "/metrics": {"get": {"summary": "Prometheus metrics"}},
    },
    "components": {"schemas": {"Job": {
        "type": "object",
        "properties": {
            "id": {"type": ["string", "integer"]}, "python": {"type": "string"}, "shell": {"type": "string"},
            "timeout": {"type": "number"}, "stdin": {"type": "string"},
            "env": {"type": "object", "additionalProperties": {"type": "string"}},
            "files": {"type": "object", "additionalProperties": {"type": "string", "contentEncoding": "base64"}},
            "fetch_files": {"type": "array", "items": {"type": "string"}},
        },
        "additionalProperties": False,
    }}},
}


# -- the command ------------------------------------------------------------------------------


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


def main(args: argparse.Namespace) -> int:
    """``execpool serve``: exits 0 after a clean shutdown, 2 for bad usage."""
    token = _token(args)
    if token is None and not _loopback(args.host):
        print(f"execpool serve: refusing to bind {args.host} without a token: anyone who can reach it could run "
              "code here. Give --token-file PATH or set EXECPOOL_TOKEN.", file=sys.stderr)
        return 2
    preload = tuple(name.strip() for name in args.preload.split(",") if name.strip())
    defaults = ServiceDefaults(timeout=args.timeout, max_timeout=args.max_timeout, warm=args.warm,
                               network=args.network)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns TCP_NODELAY on only for sockets
    # that say they are TCP, and without it every answer on a kept-alive
    # connection waits ~40 ms for the client's delayed ACK.
    with socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
        # The token is in this process's memory and maybe its environment:
        # tools running as the same user must not read them through /proc.
        with ExecPool(workers=args.workers, preload=preload, non_dumpable=True) as pool:
            app = create_app(pool, max_in_flight=args.max_in_flight, max_queue=args.max_queue,
                             queue_timeout=args.queue_timeout, token=token, max_body_mb=args.max_body_mb,
                             defaults=defaults, heartbeat_s=args.heartbeat)
            try:
                server = _Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                                       timeout_graceful_shutdown=args.grace))
                asyncio.run(_serve(server, sock))
            finally:
                app.state.service.close()
    return 0


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


async def _serve(server: uvicorn.Server, sock: socket.socket) -> None:
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if server.started:
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"execpool serve: ready at http://{shown}:{port}", flush=True)
    await task
