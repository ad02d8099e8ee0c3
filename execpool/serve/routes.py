"""The service's routes (docs/service/index.md): execpool's own (``/v1/run``,
``/v1/stream``, ``/v1/batch``), SandboxFusion's ``/run_code``, health,
metrics, the OpenAPI document and the page.

Runs in the service's process, on its event loop. A route reads its body
(bounded in size and in time), turns it into jobs through the one parser
(execpool/formats/request.py), takes a slot, runs the jobs through
``ServiceJobs`` (execpool/serve/request_job.py) and answers in its dialect
(execpool/formats/records.py, sandbox_fusion.py), holding the slot until
the answer is sent (execpool/serve/slots.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.resources
import json
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple, Union

from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from ..formats import records, sandbox_fusion
from ..formats.request import (
    HTTP_JOB,
    MAX_BATCH_JOBS,
    RUN_CODE,
    BadField,
    Defaults,
    JobRequest,
    ident_of,
    parse,
    parse_tests,
)
from ..shared.result import Result, Status
from .admission import ClientGone, Rejected
from .openapi import document
from .request_job import Route, ServiceJobs
from .slots import Held, SlotStream, json_answer, off_loop, server_sent

#: The page may run only its own inline script and talk only to this
#: server: the output it shows is a tool's, so nothing else may load. The
#: images a cell showed come inline (``data:``), as the page draws them.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-store",
}

#: The page (docs/service/page.md): one file, no build step, no external assets.
_PAGE = importlib.resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8")


class TooLarge(Exception):
    """A body over the service's limit."""


class TooSlow(Exception):
    """A body that did not arrive within the read timeout."""


@dataclasses.dataclass(frozen=True)
class BatchJob:
    """One job of a ``/v1/batch``: its request, its number (the line, or
    the test's place + 1), and for a test the stdout it expects."""

    request: JobRequest
    number: int
    expected: Optional[str] = None


#: A ``/v1/batch`` body, in order: its jobs, and for a line that is no job
#: its ``invalid`` record.
BatchItems = List[Union[BatchJob, Dict[str, Any]]]


def parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise BadField(f"the body is not JSON: {exc}") from None


def batch_items(body: bytes, defaults: Defaults) -> BatchItems:
    """What a ``/v1/batch`` body runs. A body that is one JSON object with
    ``tests`` (pretty printed or not) is a program against its tests;
    anything else is NDJSON, of at most ``MAX_BATCH_JOBS`` lines (counted
    before any is read: a body of newlines must not become millions of
    records)."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        obj = None  # NDJSON has more than one value: each line is read below
    if isinstance(obj, dict) and "tests" in obj:
        return [BatchJob(request, request.ident + 1, expected) for request, expected in parse_tests(obj, defaults)]
    if body.count(b"\n") >= MAX_BATCH_JOBS:
        raise BadField(f"the batch has more than {MAX_BATCH_JOBS} lines; split it")
    items: BatchItems = []
    for number, line in enumerate(body.split(b"\n"), 1):
        if not line.strip():
            continue
        obj = None
        try:
            obj = parse_json(line)
            items.append(BatchJob(parse(obj, HTTP_JOB, defaults), number))
        except BadField as exc:
            items.append(records.invalid_record(ident_of(obj), number, str(exc)))
    if not items:
        raise BadField("the body has no jobs (NDJSON: one job object per line)")
    return items


def _record(job_request: JobRequest, result: Result, files: Dict[str, bytes], number: int = 1) -> Dict[str, Any]:
    """execpool's answer to one job: its record, with ``files`` when the
    request fetched any."""
    record = records.result_record(job_request.ident, number, result)
    if job_request.fetch:
        record["files"] = sandbox_fusion.encoded(files)
    return record


class Routes:
    """The route handlers of one app, over its ``ServiceJobs``."""

    def __init__(self, jobs: ServiceJobs, *, max_body_bytes: int, read_timeout: float,
                 pod_name: Optional[str] = None) -> None:
        self.jobs = jobs
        self.pod_name = pod_name
        self.defaults = jobs.settings.defaults
        self.max_body_bytes = max_body_bytes
        self.read_timeout = read_timeout
        self._openapi = document()

    async def body(self, request: Request) -> bytes:
        """The body, or TooLarge past the limit (read no further), or
        TooSlow when it does not arrive within the read timeout."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise TooLarge()
        try:
            return await asyncio.wait_for(self._read(request), self.read_timeout)
        except asyncio.TimeoutError:
            raise TooSlow() from None

    async def _read(self, request: Request) -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise TooLarge()
            chunks.append(chunk)
        return b"".join(chunks)

    async def _answer(self, job_request: JobRequest, route: Route, request: Request) -> Response:
        """Run a job on the slot the route took and answer it: its record, or
        for ``/run_code`` SandboxFusion's answer. The answer is built on a
        thread when it carries big files."""
        held = Held(self.jobs.admission)
        try:
            result, files = await self.jobs.run(job_request, route, request)

            def render() -> tuple:
                if route is not Route.RUN_CODE:
                    return 200, json.dumps(_record(job_request, result, files)).encode()
                if result.status is Status.CANCELLED:
                    # The server's shutdown cancelled it: a 504, which its
                    # clients retry, rather than a run that looks killed.
                    return 504, json.dumps({"detail": "execpool is stopping; retry"}).encode()
                return 200, json.dumps(sandbox_fusion.answer(result, files, self.pod_name)).encode()

            status, content = await off_loop(sum(map(len, files.values())), render)
        except BaseException:
            held.release()
            raise
        return json_answer(held, content, status)

    # -- SandboxFusion ---------------------------------------------------------------------

    async def run_code(self, request: Request) -> Response:
        try:
            body = await self.body(request)
            obj = await off_loop(len(body), parse_json, body)
            defaults = self.defaults
            if _asks_memory(obj):
                defaults = dataclasses.replace(defaults, memory_by_cgroup=await asyncio.to_thread(
                    self.jobs.memory_by_cgroup))
            job_request = await off_loop(len(body), parse, obj, RUN_CODE, defaults)
        except BadField as exc:
            return JSONResponse(sandbox_fusion.sandbox_error(str(exc)))
        try:
            await self.jobs.slot(request)
            return await self._answer(job_request, Route.RUN_CODE, request)
        except Rejected as exc:
            self.jobs.metrics.rejected.labels(exc.reason).inc()
            return JSONResponse({"detail": f"execpool is busy ({exc.reason}); retry"}, status_code=504)
        except ClientGone:
            return Response(status_code=499)
        except BadField as exc:
            return JSONResponse(sandbox_fusion.sandbox_error(str(exc)))

    # -- execpool's own ---------------------------------------------------------------------

    async def _job_request(self, request: Request) -> JobRequest:
        body = await self.body(request)
        return await off_loop(len(body), lambda: parse(parse_json(body), HTTP_JOB, self.defaults))

    async def v1_run(self, request: Request) -> Response:
        job_request = await self._job_request(request)
        await self.jobs.slot(request)
        return await self._answer(job_request, Route.V1_RUN, request)

    async def v1_stream(self, request: Request) -> Response:
        job_request = await self._job_request(request)
        await self.jobs.slot(request)
        held = Held(self.jobs.admission)
        return SlotStream(held, self._events(job_request, held), media_type="text/event-stream",
                          headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    async def _events(self, job_request: JobRequest, held: Held) -> AsyncIterator[str]:
        """The SSE body. A client that goes away makes Starlette cancel this
        generator: the stream's cleanup cancels the job (its tree dies)."""
        async def record(outcome: Tuple[Result, Dict[str, bytes]]) -> Dict[str, Any]:
            result, files = outcome
            return await off_loop(sum(map(len, files.values())), _record, job_request, result, files)

        held.take()
        try:
            async for line in server_sent(self.jobs.stream(job_request), record):
                yield line
        finally:
            self.jobs.admission.release()

    async def v1_batch(self, request: Request) -> Response:
        body = await self.body(request)
        items = await off_loop(len(body), batch_items, body, self.defaults)
        await self.jobs.slot(request)  # the first job's: a batch that cannot start is a 503, not a stream of them
        held = Held(self.jobs.admission)
        return SlotStream(held, self._records(items, held), media_type="application/x-ndjson")

    async def _records(self, items: BatchItems, held: Held) -> AsyncIterator[str]:
        """NDJSON records as jobs finish. The first job runs on the slot the
        route took; each later one waits its turn, so a batch never runs
        more than the service's slots allow."""
        done: asyncio.Queue = asyncio.Queue()
        running: set = set()
        try:
            for item in items:
                if not isinstance(item, BatchJob):  # an invalid line's record
                    yield json.dumps(item) + "\n"
                    continue
                if held.held:
                    held.take()
                else:
                    await self.jobs.slot(None, bounded=False)
                running.add(asyncio.ensure_future(self._batch_one(item, done)))
                while not done.empty():
                    yield await _next_record(done, running)
            while running:
                yield await _next_record(done, running)
        finally:
            for task in running:
                task.cancel()

    async def _batch_one(self, item: BatchJob, done: asyncio.Queue) -> None:
        try:
            result, files = await self.jobs.run(item.request, Route.V1_BATCH, None)
            record = (_record(item.request, result, files, item.number) if item.expected is None
                      else records.test_record(item.request.ident, result, item.expected))
        except BadField as exc:  # its files could not be written: this job's record says so
            record = records.invalid_record(item.request.ident, item.number, str(exc))
        except Rejected as exc:  # no worker, or no directory, for it now
            record = records.invalid_record(item.request.ident, item.number, f"execpool is busy ({exc.reason})")
        finally:
            self.jobs.admission.release()
        await done.put((asyncio.current_task(), record))

    # -- health, metrics, the description and the page --------------------------------------

    async def page(self, request: Request) -> Response:
        return HTMLResponse(_PAGE, headers=PAGE_HEADERS)

    async def no_icon(self, request: Request) -> Response:
        return Response(status_code=204)

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request) -> Response:
        pool, admission = self.jobs.pool, self.jobs.admission
        workers = len(pool.worker_pids)
        ready = workers > 0 and not pool.closed and not admission.full
        return JSONResponse({"ready": ready, "workers": workers, "in_flight": admission.in_flight,
                             "queue_depth": admission.queue_depth}, status_code=200 if ready else 503)

    async def languages(self, request: Request) -> Response:
        """Each language of the table as the pool's checks know it now:
        whether its hello-world ran in the service's sandbox, with which
        toolchain, or why not -- ``checking`` while that is under way
        (on a thread: the pool's first listing makes its CodeJobs)."""
        found = await asyncio.to_thread(self.jobs.pool.languages)
        return JSONResponse([{"name": t.name, "runs": t.runs, "toolchain": t.toolchain, "compiles": t.compiles,
                              "why_not": t.why_not, "checking": t.checking} for t in found])

    async def ping(self, request: Request) -> Response:
        return JSONResponse("pong")

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.jobs.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(self._openapi)


async def _next_record(done: asyncio.Queue, running: set) -> str:
    task, record = await done.get()
    running.discard(task)
    return json.dumps(record) + "\n"


def _asks_memory(obj: object) -> bool:
    limit = obj.get("memory_limit_MB") if isinstance(obj, dict) else None
    return isinstance(limit, int) and not isinstance(limit, bool) and limit > 0
