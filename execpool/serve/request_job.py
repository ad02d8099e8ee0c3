"""How the service runs a request's job: a slot, the pool, the files it
brought back, and an end whatever the client does.

Runs in the service's process, on its event loop; every route
(execpool/serve/routes.py) runs its jobs through one ``ServiceJobs``. A job
is a ``JobFuture`` of the pool's public ``submit`` (or, for a stream, the
pool's ``astream``) awaited on the loop: no thread per request. A client
that goes away -- waiting or running -- cancels its job, tree and all; at
shutdown ``stop_jobs`` cancels every job still running, and each request
still gets its answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import threading
from concurrent.futures import Future
from typing import Any, AsyncIterator, Dict, Iterator, Optional, Set, Tuple, Union

from starlette.requests import Request

from ..formats.request import Defaults, Job, JobRequest
from ..pool.future import JobFuture
from ..shared.errors import ExecPoolError
from ..shared.files import File
from ..shared.jobs import CodeJob, ShellJob
from ..shared.kernel.cgroups import MEMORY_NEEDS_CGROUP
from ..shared.result import Result, Status
from ..supervisor import ExecPool
from .admission import Admission, Reason, Rejected
from .metrics import ServiceMetrics
from .settings import DEFAULT_FETCH_MAX_BYTES, FETCH_FILE_MAX_BYTES
from .slots import OFF_LOOP_BYTES

logger = logging.getLogger("execpool")


class Route(str, enum.Enum):
    """Where a job came from: the ``route`` label of ``execpool_jobs_total``."""

    RUN_CODE = "run_code"
    V1_RUN = "v1_run"
    V1_STREAM = "v1_stream"
    V1_BATCH = "v1_batch"
    V1_EVAL = "v1_eval"

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the service's jobs run with."""

    defaults: Defaults
    heartbeat_s: float
    #: Bytes a request's fetched files may come to in all.
    fetch_bytes: int = DEFAULT_FETCH_MAX_BYTES

    def answered(self, fetch: Tuple[str, ...], found: Dict[str, File]) -> Dict[str, bytes]:
        """What an answer carries of the files a job brought back: those
        asked for, in the order asked, each at most FETCH_FILE_MAX_BYTES and
        together at most ``fetch_bytes``; what is past that is left out,
        as a missing file is."""
        answer: Dict[str, bytes] = {}
        left = self.fetch_bytes
        for path in fetch:
            file = found.get(path)
            if file is not None and len(file.data) <= min(FETCH_FILE_MAX_BYTES, left):
                answer[path] = file.data
                left -= len(file.data)
        return answer


def memory_cap_by_cgroup(pool: ExecPool) -> Optional[bool]:
    """Whether a job's memory cap can be a cgroup in ``pool``, asked of the
    pool itself: a job with the cap starts, or says it needs a memory
    controller. None when it cannot tell now -- the job could not start
    for want of a process or memory (a tenant may hold them all): taken
    for an answer, that would turn every later client's cap into a mere
    address-space limit for the service's life. The probe keeps the pool's
    other limits: its disk bound must fit the pool's disk budget."""
    limits = dataclasses.replace(pool.config.limits, memory=256 << 20)
    probe = pool.run(ShellJob("true", timeout=10, limits=limits))
    if probe.status is Status.OK:
        return True
    if MEMORY_NEEDS_CGROUP in (probe.error or ""):
        return False
    return None


class ServiceJobs:
    """The jobs of one app: its pool, admission and metrics."""

    def __init__(self, pool: ExecPool, admission: Admission, settings: Settings) -> None:
        self.pool = pool
        self.admission = admission
        self.metrics = ServiceMetrics(pool, admission)
        self.settings = settings
        self._memory_by_cgroup: Optional[bool] = None
        # For stop_jobs(), on the loop: the jobs that run now, and for the
        # streams (their jobs are pool.astream's) an event apiece that
        # cancels one -- apiece, as a stream whose client leaves sets its own.
        self._jobs: Set[Future] = set()
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

    async def slot(self, request: Optional[Request], *, bounded: bool = True) -> None:
        """A slot to run one job in, waiting in the queue if need be; the
        queue's timeout counts from the request's arrival."""
        arrived = None if request is None else request.scope.get("state", {}).get("arrived")
        waited = await self.admission.acquire(None if request is None else lambda: disconnected(request),
                                              bounded=bounded, since=arrived)
        self.metrics.queue_wait.observe(waited)

    def memory_by_cgroup(self) -> bool:
        """Whether a job's memory cap can be a cgroup here, remembered once
        the pool has said (:func:`memory_cap_by_cgroup`); until then, not."""
        if self._memory_by_cgroup is None:
            self._memory_by_cgroup = memory_cap_by_cgroup(self.pool)
        return bool(self._memory_by_cgroup)

    async def submit(self, job_request: JobRequest) -> JobFuture:
        """Start the job -- on a thread when it is big, since submitting
        checks and pickles it -- or Rejected when the pool has no worker
        to run it right now (one is being replaced)."""
        job = job_request.job
        try:
            if job_request.size > OFF_LOOP_BYTES:
                future = await asyncio.to_thread(self.pool.submit, job)
            else:
                future = self.pool.submit(job)
        except ExecPoolError as exc:
            logger.warning("execpool serve: cannot start a job: %s", exc)
            raise Rejected(Reason.NO_WORKERS, 1) from None
        self.running_add(future)
        return future

    def running_add(self, future: Future) -> None:
        """A future of the pool's running for a request (a job, a session's
        cell): cancelled by ``stop_jobs``, at once if it is already under way."""
        self._jobs.add(future)
        if self._stopping:
            future.cancel()

    def running_discard(self, future: Future) -> None:
        self._jobs.discard(future)

    @contextlib.contextmanager
    def running(self, future: Future) -> Iterator[None]:
        self.running_add(future)
        try:
            yield
        finally:
            self.running_discard(future)

    async def run(self, job_request: JobRequest, route: Route, request: Optional[Request]
                  ) -> Tuple[Result, Dict[str, bytes]]:
        """Run one admitted job; its Result and the files it brought back
        (the slot stays the caller's to release)."""
        future = await self.submit(job_request)
        try:
            result = await until_done_or_gone(future, request)
        finally:
            self.running_discard(future)
        self.metrics.job(route, kind_of(job_request.job), result)
        return result, self.settings.answered(job_request.fetch, result.files)

    async def stream(self, job_request: JobRequest) -> AsyncIterator[Union[dict, Tuple[Result, Dict[str, bytes]]]]:
        """The job's events as the pool streams them (``pool.astream``), then
        the job's Result and its fetched files as the last item. Closing the
        generator (the client left) cancels the job."""
        job = job_request.job
        stop = threading.Event()
        if self._stopping:
            stop.set()
        self._streams.add(stop)
        stream = self.pool.astream(job, tool_name=kind_of(job), heartbeat_interval_s=self.settings.heartbeat_s,
                                   cancel_event=stop)
        try:
            async for event in stream:
                yield event
        finally:
            self._streams.discard(stop)
            await stream.aclose()
        result = stream.result
        assert result is not None
        self.metrics.job(Route.V1_STREAM, kind_of(job), result)
        yield result, self.settings.answered(job_request.fetch, result.files)


def kind_of(job: Job) -> str:
    """What the metrics and events call a job: python, shell, or its language."""
    return job.language if isinstance(job, CodeJob) else job.kind


async def disconnected(request: Request) -> None:
    """Completes when the client has gone (after its body was read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_done_or_gone(future: Future, request: Optional[Request]) -> Any:
    """The job's Result; if the client goes away first, or this request's
    task is cancelled (server shutdown), the job is cancelled -- its tree
    killed -- and its (cancelled) Result returned."""
    job = asyncio.wrap_future(future)
    watcher = asyncio.ensure_future(disconnected(request)) if request is not None else None
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
