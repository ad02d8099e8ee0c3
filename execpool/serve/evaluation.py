"""``POST /v1/eval``: samples judged against problems' tests, as ``execpool
eval`` judges them, answered as NDJSON -- one record per sample as its
judging ends, then ``{"summary": ...}`` with pass@k.

Runs in the service's process. The judging (``judge_samples``,
execpool/eval/run.py) blocks, so it runs on a thread of its own; each job
it submits first takes one of the service's slots on the loop -- an
evaluation runs no more jobs at once than ``--max-in-flight`` lets the
whole service -- and gives it back when the job ends. A client that goes
away stops the judging: the jobs running are cancelled, trees and all.
"""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import Future
from typing import Any, AsyncIterator, Dict, List, Optional, Set

from starlette.requests import Request
from starlette.responses import Response

from ..eval.harness import EvalOptions
from ..eval.request import EvalRequest, parse_request
from ..eval.run import judge_samples, sample_record, summarize
from ..eval.verdicts import ProblemsError
from ..formats.request import BadField
from ..pool.future import OnEvent
from ..shared.jobs import Job
from ..shared.result import Result
from .request_job import Route, ServiceJobs, kind_of
from .slots import Held, SlotStream, off_loop

#: What ends the records' queue: the summary (or the judging's failure) follows.
_END = object()


class Evaluations:
    """The ``/v1/eval`` route of one app, over its ``ServiceJobs``."""

    def __init__(self, jobs: ServiceJobs, body: Any) -> None:
        self.jobs = jobs
        self.body = body

    async def v1_eval(self, request: Request) -> Response:
        raw = await self.body(request)
        asked = await off_loop(len(raw), self._parse, raw)
        await self.jobs.slot(request)  # the first job's: an evaluation that cannot start is a 503
        held = Held(self.jobs.admission)
        return SlotStream(held, self._records(asked, held), media_type="application/x-ndjson")

    def _parse(self, raw: bytes) -> EvalRequest:
        try:
            return parse_request(json.loads(raw), self.jobs.settings.defaults.max_timeout)
        except (ValueError, RecursionError) as exc:
            if isinstance(exc, ProblemsError):
                raise BadField(str(exc)) from None
            raise BadField(f"the body is not JSON: {exc}") from None

    async def _records(self, asked: EvalRequest, held: Held) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        lines: asyncio.Queue = asyncio.Queue()
        judging = _Judging(self.jobs, loop, held)
        options = EvalOptions(timeout=asked.timeout, all_tests=asked.all_tests, warm=self.jobs.settings.defaults.warm)

        def run() -> None:
            records: List[Dict[str, Any]] = []
            try:
                judged = judge_samples(judging.submit, enumerate(asked.samples, 1), asked.problems, options,
                                       self.jobs.admission.max_in_flight)
                try:
                    for line, verdict in judged:
                        record = sample_record(asked.samples[line - 1], line, verdict)
                        records.append(record)
                        loop.call_soon_threadsafe(lines.put_nowait, json.dumps(record) + "\n")
                        if judging.stopped.is_set():
                            return
                finally:
                    judged.close()
                ordered = sorted(records, key=lambda record: record["line"])
                summary = json.dumps({"summary": summarize(ordered, asked.ks)}) + "\n"
                loop.call_soon_threadsafe(lines.put_nowait, summary)
            except Exception as exc:  # noqa: BLE001 - the stream is under way: its last line says what failed
                failed = json.dumps({"error": f"execpool failed: {type(exc).__name__}: {exc}"}) + "\n"
                loop.call_soon_threadsafe(lines.put_nowait, failed)
            finally:
                loop.call_soon_threadsafe(lines.put_nowait, _END)

        thread = threading.Thread(target=run, name="execpool-eval", daemon=True)
        thread.start()
        try:
            while True:
                line = await lines.get()
                if line is _END:
                    break
                yield line
        finally:
            judging.stop()


class _Judging:
    """The submit of one evaluation: each job on a slot of the service's."""

    def __init__(self, jobs: ServiceJobs, loop: asyncio.AbstractEventLoop, held: Held) -> None:
        self.jobs = jobs
        self.loop = loop
        self.held = held
        self.stopped = threading.Event()
        self.running: Set[Future] = set()
        self._lock = threading.Lock()

    def submit(self, job: Job, on_event: Optional[OnEvent] = None) -> "Future[Result]":
        """On the judging's thread: wait for a slot, then submit."""
        return asyncio.run_coroutine_threadsafe(self._start(job, on_event), self.loop).result()

    async def _start(self, job: Job, on_event: Optional[OnEvent]) -> "Future[Result]":
        if self.held.held:
            self.held.take()  # the slot the route took is the first job's
        else:
            await self.jobs.slot(None, bounded=False)
        try:
            future: Future = self.jobs.pool.submit(job, on_event=on_event)
        except BaseException:
            self.jobs.admission.release()
            raise
        self.jobs.running_add(future)
        with self._lock:
            self.running.add(future)
        if self.stopped.is_set():
            future.cancel()
        future.add_done_callback(lambda done: self.loop.call_soon_threadsafe(self._ended, job, done))
        return future

    def _ended(self, job: Job, future: Future) -> None:
        self.jobs.admission.release()
        self.jobs.running_discard(future)
        with self._lock:
            self.running.discard(future)
        if not future.cancelled() and future.exception() is None:
            self.jobs.metrics.job(Route.V1_EVAL, kind_of(job), future.result())

    def stop(self) -> None:
        """The client left (or the answer ended): cancel what runs."""
        self.stopped.set()
        with self._lock:
            running = list(self.running)
        for future in running:
            future.cancel()
