"""``execpool serve``: one pool behind HTTP (shared/SERVE.md).

::

    clients (RL trainers, eval harnesses, SandboxFusion clients, people)
       |  HTTP/1.1 on uvicorn
    ASGI app (Starlette)                         this process
       auth -> body limit -> route -> Admission (execpool/admission.py)
       -> ExecPool.submit / astream (the one pool) -> answer
       /metrics from prometheus-client and pool.stats()

Runs in the service's process, on uvicorn's event loop: one process, one
pool, one loop (execpool/server.py is the command that starts it, listens
and shuts it down). The routes only await: a job is a ``JobFuture`` wrapped for
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
- what a request may cost is bounded: body size, the time its body takes
  to arrive, jobs per batch, files per job, bytes fetched; parsing big
  bodies and file I/O run on threads;
- at shutdown (``stop_jobs``) every job still running is cancelled and its
  request answered with the ``cancelled`` record.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import importlib.resources
import json
import logging
import os
import tempfile
import threading
import time
from typing import Any, AsyncIterator, Callable, Dict, Mapping, Optional, Sequence, Set, Tuple

from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from . import httpjobs
from .admission import DEFAULT_MAX_QUEUE, DEFAULT_QUEUE_TIMEOUT_S, Admission, ClientGone, Rejected
from .dirs import remove_tree
from .future import JobFuture
from .httpjobs import (DEFAULT_HEARTBEAT_S, DEFAULT_MAX_BODY_MB, DEFAULT_READ_TIMEOUT_S, BadRequest, JobRequest,
                       ServiceDefaults)
from .jobfiles import DEFAULT_FETCH_MAX_BYTES, JobFileError, read_files, write_files
from .jobs import Limits, ShellJob
from .metrics import ServiceMetrics
from .records import invalid_record
from .result import Result, Status
from .supervisor import ExecPool

#: Routes anyone may call, token or not: liveness, readiness, SandboxFusion's
#: ping, and the page (static: it runs nothing itself, and its requests to
#: /v1/stream carry the token the person types in) with the icon browsers
#: ask for beside it (else every visit would count as a refused token).
OPEN_PATHS = ("/", "/favicon.ico", "/healthz", "/readyz", "/v1/ping")

#: What a ``Host`` header may say to a server that listens on loopback.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")

#: The page may run only its own inline script and talk only to this
#: server: the output it shows is a tool's, so nothing else may load.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-store",
}


logger = logging.getLogger("execpool")

#: shared/SERVE.md §6: one file, no build step, no external assets.
_PAGE = importlib.resources.files("execpool").joinpath("page.html").read_text(encoding="utf-8")


class _Service:
    """The app's state and routes: one pool, its admission, its metrics."""

    def __init__(self, pool: ExecPool, *, max_in_flight: int, max_queue: int, queue_timeout: float,
                 token: Optional[str], max_body_bytes: int, defaults: ServiceDefaults, heartbeat_s: float,
                 read_timeout: float) -> None:
        self.pool = pool
        self.admission = Admission(max_in_flight, max_queue, queue_timeout)
        self.metrics = ServiceMetrics(pool, self.admission)
        self.token = token
        self.max_body_bytes = max_body_bytes
        self.defaults = defaults
        self.heartbeat_s = heartbeat_s
        self.read_timeout = read_timeout
        # Directories of jobs that bring or fetch files: the pool's, so that
        # they go with it even when this process is SIGKILLed.
        self.root = pool.scratch_dir()
        self._memory_by_cgroup: Optional[bool] = None
        # For stop_jobs(), on the loop: the jobs that run now, and for the
        # streams (their jobs are pool.astream's) an event apiece that
        # cancels one -- apiece, as a stream whose client leaves sets its own.
        self._jobs: Set[JobFuture] = set()
        self._streams: Set[threading.Event] = set()
        self._stopping = False

    def stop_jobs(self) -> None:
        """Cancel every job running or about to: the service is stopping
        and the grace is over. Each request still gets its answer -- the
        ``cancelled`` record -- and later ones are cancelled as they start."""
        self._stopping = True
        for future in list(self._jobs):
            future.cancel()
        for event in self._streams:
            event.set()

    # -- the plumbing every route shares ---------------------------------------------

    def authorized(self, request: Request) -> bool:
        if self.token is None or request.url.path in OPEN_PATHS:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode())

    async def body(self, request: Request) -> bytes:
        """The body, or _TooLarge past the limit (read no further), or
        _TooSlow when it does not arrive within the read timeout."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise _TooLarge()
        try:
            return await asyncio.wait_for(self._read(request), self.read_timeout)
        except asyncio.TimeoutError:
            raise _TooSlow() from None

    async def _read(self, request: Request) -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _TooLarge()
            chunks.append(chunk)
        return b"".join(chunks)

    async def slot(self, request: Optional[Request], *, bounded: bool = True) -> None:
        """A slot to run one job in, waiting in the queue if need be; the
        queue's timeout counts from the request's arrival."""
        arrived = None if request is None else request.scope.get("state", {}).get("arrived")
        waited = await self.admission.acquire(None if request is None else lambda: _disconnected(request),
                                              bounded=bounded, since=arrived)
        self.metrics.queue_wait.observe(waited)

    def memory_by_cgroup(self) -> bool:
        """Whether a job's memory cap can be a cgroup here; asked of the
        pool itself (a job with the cap either starts or is INFRA), and
        remembered unless the probe's worker died under it."""
        if self._memory_by_cgroup is None:
            probe = self.pool.run(ShellJob("true", timeout=10, limits=Limits(memory=256 << 20)))
            if probe.status is not Status.INFRA or probe.worker_pid is None:
                self._memory_by_cgroup = probe.status is Status.OK
            return probe.status is Status.OK
        return self._memory_by_cgroup

    @contextlib.asynccontextmanager
    async def placed(self, job_request: JobRequest):
        """The job, in a directory of its own holding its files when the
        request brings or fetches any (else where the pool puts it), and the
        directory (or None). The directory goes when the job is done with.
        Files are written, read and removed on threads: a job can leave a
        tree that takes long to remove, and the loop serves everyone."""
        if not job_request.needs_directory:
            yield job_request.job, None
            return
        directory = self._new_directory()
        try:
            try:
                await asyncio.to_thread(write_files, directory, job_request.files)
            except JobFileError as exc:
                raise BadRequest(f'"files": {exc}') from None
            yield _with_cwd(job_request.job, directory), directory
        finally:
            # Shielded: a cancelled request still has its directory removed.
            await asyncio.shield(asyncio.to_thread(remove_tree, directory))

    def _new_directory(self) -> str:
        """A job's directory under the root; a job that ran as this
        process's user may have moved the root away: it is made again (the
        lifeline knows its path), and failing that the request is refused."""
        for _ in range(2):
            try:
                return tempfile.mkdtemp(dir=self.root)
            except FileNotFoundError:
                with contextlib.suppress(OSError):
                    os.mkdir(self.root, 0o700)
            except OSError as exc:
                logger.error("execpool serve: cannot make a job directory in %s: %s", self.root, exc)
                break
        raise Rejected("no_directory", 1)

    async def fetched(self, job_request: JobRequest, directory: Optional[str]) -> Dict[str, bytes]:
        if directory is None or not job_request.fetch:
            return {}
        return await asyncio.to_thread(read_files, directory, job_request.fetch,
                                       max_total_bytes=min(self.max_body_bytes, DEFAULT_FETCH_MAX_BYTES))

    async def submit(self, job_request: JobRequest, job) -> JobFuture:  # type: ignore[no-untyped-def]
        """Start the job -- on a thread when it is big, since submitting
        checks and pickles it -- or Rejected when the pool has no worker
        to run it right now (one is being replaced)."""
        try:
            if job_request.size > _OFF_LOOP_BYTES:
                future = await asyncio.to_thread(self.pool.submit, job)
            else:
                future = self.pool.submit(job)
        except RuntimeError as exc:
            logger.warning("execpool serve: cannot start a job: %s", exc)
            raise Rejected("no_workers", 1) from None
        self._jobs.add(future)
        if self._stopping:
            future.cancel()
        return future

    async def run(self, job_request: JobRequest, route: str, request: Optional[Request]
                  ) -> Tuple[Result, Dict[str, bytes]]:
        """Run one admitted job and fetch its files (the slot stays the
        caller's to release)."""
        async with self.placed(job_request) as (job, directory):
            future = await self.submit(job_request, job)
            try:
                result = await _until_done_or_gone(future, request)
            finally:
                self._jobs.discard(future)
            self.metrics.job(route, job.kind, result)
            return result, await self.fetched(job_request, directory)

    async def answer(self, job_request: JobRequest, route: str, request: Request,
                     build: Callable[[Result, Dict[str, bytes]], Tuple[int, dict]]) -> Response:
        """Run a job on the slot the route took and answer ``build(result,
        files)``. The slot is released once the answer is sent -- a client
        that does not read holds its slot, not a pile of answers -- and an
        answer carrying big files is built on a thread."""
        held = _Held(self.admission)
        try:
            result, files = await self.run(job_request, route, request)
            big = sum(map(len, files.values())) > _OFF_LOOP_BYTES

            def render() -> Tuple[int, bytes]:
                status, content = build(result, files)
                return status, json.dumps(content).encode()

            status, content = await asyncio.to_thread(render) if big else render()
        except BaseException:
            held.release()
            raise
        if len(content) <= _OFF_LOOP_BYTES:
            response: Response = _SlotAnswer(content, status_code=status, media_type="application/json")
            response.held = held  # type: ignore[attr-defined]
            return response
        # In pieces: each waits until the client has taken the one before,
        # so the slot is held until the answer is nearly all sent (in one
        # piece, it would sit in the connection's buffer, slot released).
        return _SlotResponse(held, _pieces(content), status_code=status, media_type="application/json",
                             headers={"Content-Length": str(len(content))})

    def rejected(self, reason: str) -> None:
        self.metrics.rejected.labels(reason).inc()

    # -- SandboxFusion ---------------------------------------------------------------------

    async def run_code(self, request: Request) -> Response:
        try:
            body = await self.body(request)
            obj = await _off_loop(body, httpjobs.parse_json, body)
            memory_by_cgroup = await asyncio.to_thread(self.memory_by_cgroup) if _asks_memory(obj) else False
            job_request = await _off_loop(body, httpjobs.sandbox_fusion_request, obj, self.defaults,
                                          memory_by_cgroup)
        except BadRequest as exc:
            return JSONResponse(httpjobs.sandbox_error(str(exc)))
        try:
            await self.slot(request)
            return await self.answer(job_request, "run_code", request, _sandbox_fusion_answer)
        except Rejected as exc:
            self.rejected(exc.reason)
            return JSONResponse({"detail": f"execpool is busy ({exc.reason}); retry"}, status_code=504)
        except ClientGone:
            return Response(status_code=499)
        except BadRequest as exc:
            return JSONResponse(httpjobs.sandbox_error(str(exc)))

    # -- execpool's own ---------------------------------------------------------------------

    async def job_request(self, request: Request) -> JobRequest:
        body = await self.body(request)
        return await _off_loop(body, lambda: httpjobs.run_request(httpjobs.parse_json(body), self.defaults))

    async def v1_run(self, request: Request) -> Response:
        job_request = await self.job_request(request)
        await self.slot(request)
        return await self.answer(job_request, "v1_run", request,
                                 lambda result, files: (200, httpjobs.record(job_request, result, files)))

    async def v1_stream(self, request: Request) -> Response:
        job_request = await self.job_request(request)
        await self.slot(request)
        held = _Held(self.admission)
        return _SlotResponse(held, self._events(job_request, held), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    async def _events(self, job_request: JobRequest, held: "_Held") -> AsyncIterator[str]:
        """The SSE body. A client that goes away makes Starlette cancel this
        generator: the stream's cleanup cancels the job (its tree dies)."""
        held.take()
        try:
            async with self.placed(job_request) as (job, directory):
                stop = threading.Event()
                if self._stopping:
                    stop.set()
                self._streams.add(stop)
                stream = self.pool.astream(job, tool_name=job.kind, heartbeat_interval_s=self.heartbeat_s,
                                           cancel_event=stop)
                try:
                    async for event in stream:
                        if event["type"] == "heartbeat":
                            yield ": keep-alive\n\n"
                        else:
                            yield f"data: {json.dumps(event)}\n\n"
                finally:
                    self._streams.discard(stop)
                    await stream.aclose()
                result = stream.result
                assert result is not None
                self.metrics.job("v1_stream", job.kind, result)
                files = await self.fetched(job_request, directory)
                answer = await asyncio.to_thread(httpjobs.record, job_request, result, files) if files else \
                    httpjobs.record(job_request, result, files)
            yield f"event: result\ndata: {json.dumps(answer)}\n\n"
        finally:
            self.admission.release()

    async def v1_batch(self, request: Request) -> Response:
        body = await self.body(request)
        jobs = await _off_loop(body, _batch_jobs, body, self.defaults)
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
            answer = invalid_record(job_request.ident, number, str(exc))
        except Rejected as exc:  # no worker, or no directory, for it now
            answer = invalid_record(job_request.ident, number, f"execpool is busy ({exc.reason})")
        finally:
            self.admission.release()
        await done.put((asyncio.current_task(), answer))

    @staticmethod
    async def _next_record(done: asyncio.Queue, running: set) -> str:
        task, answer = await done.get()
        running.discard(task)
        return json.dumps(answer) + "\n"

    # -- health and metrics -------------------------------------------------------------------

    async def page(self, request: Request) -> Response:
        return HTMLResponse(_PAGE, headers=PAGE_HEADERS)

    async def no_icon(self, request: Request) -> Response:
        return Response(status_code=204)

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
        return JSONResponse(httpjobs.OPENAPI)


class _TooLarge(Exception):
    """A body over the service's limit."""


class _TooSlow(Exception):
    """A body that did not arrive within the read timeout."""


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


class _ReleasesSlot:
    """An answer that returns its route's slot once sent, however that ends."""

    held: _Held

    async def __call__(self, scope: Any, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)  # type: ignore[misc]
        finally:
            self.held.release()


class _SlotResponse(_ReleasesSlot, StreamingResponse):
    """A streamed answer (SSE, NDJSON) on a slot."""

    def __init__(self, held: _Held, content: AsyncIterator[Any], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.held = held


class _SlotAnswer(_ReleasesSlot, Response):
    """A JSON answer on a slot."""


async def _pieces(content: bytes) -> AsyncIterator[bytes]:
    view = memoryview(content)
    for start in range(0, len(view), _OFF_LOOP_BYTES):
        yield view[start:start + _OFF_LOOP_BYTES]


def _sandbox_fusion_answer(result: Result, files: Dict[str, bytes]) -> Tuple[int, dict]:
    """SandboxFusion's answer; a job cancelled by the server's shutdown is
    a 504 (its clients retry that) rather than a run that looks killed."""
    if result.status is Status.CANCELLED:
        return 504, {"detail": "execpool is stopping; retry"}
    return 200, httpjobs.sandbox_fusion_answer(result, files)


def _with_cwd(job, directory: str):
    return dataclasses.replace(job, cwd=directory)


#: Bodies (and answers) larger than this are parsed (built) on a thread:
#: the loop serves everyone.
_OFF_LOOP_BYTES = 64 << 10


async def _off_loop(body: bytes, function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``, on a thread when ``body`` is big enough that
    parsing it would hold up the loop."""
    if len(body) > _OFF_LOOP_BYTES:
        return await asyncio.to_thread(function, *args)
    return function(*args)


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
    printed or not) is a program against its tests; anything else is NDJSON,
    of at most ``MAX_BATCH_JOBS`` lines (counted before any is read: a
    body of newlines must not become millions of records)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        obj = None  # NDJSON has more than one value: each line is read below
    if isinstance(obj, dict) and "tests" in obj:
        requests = httpjobs.tests_requests(obj, defaults)
        return [(request, obj["tests"][request.ident]["expected"], request.ident + 1) for request in requests]
    if body.count(b"\n") >= httpjobs.MAX_BATCH_JOBS:
        raise BadRequest(f"the batch has more than {httpjobs.MAX_BATCH_JOBS} lines; split it")
    items: list = []
    for number, line in enumerate(body.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            items.append((httpjobs.run_request(httpjobs.parse_json(line), defaults), None, number))
        except BadRequest as exc:
            items.append(invalid_record(None, number, str(exc)))
    if not items:
        raise BadRequest("the body has no jobs (NDJSON: one job object per line)")
    return items


def create_app(pool: ExecPool, *, max_in_flight: Optional[int] = None, max_queue: int = DEFAULT_MAX_QUEUE,
               queue_timeout: float = DEFAULT_QUEUE_TIMEOUT_S, token: Optional[str] = None,
               max_body_mb: int = DEFAULT_MAX_BODY_MB, defaults: ServiceDefaults = ServiceDefaults(),
               heartbeat_s: float = DEFAULT_HEARTBEAT_S, read_timeout: float = DEFAULT_READ_TIMEOUT_S,
               allowed_hosts: Optional[Sequence[str]] = None) -> Starlette:
    """The ASGI app around ``pool``, for mounting in your own server. The
    pool stays yours: close it after the app is done (that also removes
    the app's directories). ``read_timeout`` bounds the time a request's
    body may take to arrive (headers are the server's business: ``execpool
    serve`` gives them the same limit). ``allowed_hosts``: the names (no
    port) a request's ``Host`` may say; ``LOOPBACK_NAMES`` for a server on
    loopback, None for any."""
    service = _Service(pool, max_in_flight=max_in_flight or 2 * (os.cpu_count() or 2), max_queue=max_queue,
                       queue_timeout=queue_timeout, token=token, max_body_bytes=max_body_mb << 20,
                       defaults=defaults, heartbeat_s=heartbeat_s, read_timeout=read_timeout)
    routes = [
        Route("/", service.page), Route("/favicon.ico", service.no_icon),
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

    async def too_slow(request: Request, exc: Exception) -> Response:
        return _refused(service, "read_timeout", 408, f"the body did not arrive within {read_timeout:g} s",
                        {"Connection": "close"})

    async def gone(request: Request, exc: Exception) -> Response:
        return Response(status_code=499)  # nobody reads it: the client left while waiting or sending

    app = Starlette(routes=routes, exception_handlers={
        BadRequest: bad_request, _TooLarge: too_large, _TooSlow: too_slow, Rejected: busy, ClientGone: gone,
        ClientDisconnect: gone})
    app.state.service = service
    app.add_middleware(_Guard, service=service, allowed_hosts=allowed_hosts)
    return app


def _refused(service: _Service, reason: str, status: int, detail: str,
             headers: Optional[Mapping[str, str]] = None) -> Response:
    service.rejected(reason)
    return JSONResponse({"detail": detail}, status_code=status, headers=dict(headers or {}))


class _Guard:
    """Before any route (or body) is read: requests from web pages of other
    origins are refused (a page anywhere could otherwise POST code to a
    tokenless server on the visitor's loopback: browsers send such a
    request without asking), so are requests for a host this server is not
    (``allowed_hosts``: a page that rebinds its name to 127.0.0.1 is
    same-origin with itself, but says its own name), and a missing or
    wrong token is a 401."""

    def __init__(self, app: Callable, service: _Service, allowed_hosts: Optional[Sequence[str]]) -> None:
        self.app = app
        self.service = service
        self.allowed_hosts = None if allowed_hosts is None else frozenset(allowed_hosts)

    async def __call__(self, scope: Dict[str, Any], receive: Callable, send: Callable) -> None:
        scope.setdefault("state", {})["arrived"] = time.monotonic()  # the queue timeout counts from here
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        host = request.headers.get("host", "")
        if self.allowed_hosts is not None and _hostname(host) not in self.allowed_hosts:
            refusal = _refused(self.service, "host", 421, f"this server does not answer for the host {host!r}")
        elif not _same_origin(request.headers.get("origin"), host):
            refusal = _refused(self.service, "cross_origin", 403,
                               "requests from web pages of other origins are refused")
        elif not self.service.authorized(request):
            refusal = _refused(self.service, "auth", 401, "a valid 'Authorization: Bearer <token>' header is required",
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
