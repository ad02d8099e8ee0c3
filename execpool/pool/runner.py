"""What every pool offers on top of its ``submit``: ``run``, ``stream``,
``astream``, ``map``, ``imap_unordered`` and ``with``.

Caller side. ExecPool (execpool/supervisor.py) and RayPool
(execpool/ray/pool.py) differ only in where a job runs; written once here on
their public ``submit``, the events, heartbeats, cancellation and ordering
are the same code for both, which is what lets RayPool promise ExecPool's
behaviour.
"""

from __future__ import annotations

import abc
import threading
from typing import Iterable, Iterator, Optional, TypeVar

from .. import drain
from ..shared.jobs import Job
from ..shared.result import Result
from .future import JobFuture, OnEvent
from .mapping import check_max_in_flight, imap_unordered_jobs, map_jobs

Runner = TypeVar("Runner", bound="JobRunner")


class JobRunner(abc.ABC):
    """The methods built on ``submit``, for a pool that provides it,
    ``close``, ``_check_open`` (raising on a closed pool) and
    ``default_max_in_flight``."""

    @abc.abstractmethod
    def submit(self, job: Job, *, on_event: Optional[OnEvent] = None,
               cancel_event: Optional[threading.Event] = None) -> JobFuture:
        """Start ``job``; its future."""

    @abc.abstractmethod
    def close(self, timeout: float = 5.0) -> None:
        """End the pool and what runs in it."""

    @abc.abstractmethod
    def _check_open(self) -> None:
        """Raise PoolClosedError on a closed pool."""

    @property
    @abc.abstractmethod
    def default_max_in_flight(self) -> int:
        """How many jobs ``map`` runs at once when not told."""

    def run(self, job: Job, *, cancel_event: Optional[threading.Event] = None) -> Result:
        """Run ``job`` to its end and return its Result (never raises for the
        tool's own failures: non-zero exit, timeout, cancellation). If the
        wait is interrupted (Ctrl-C), the job is cancelled."""
        future = self.submit(job, cancel_event=cancel_event)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def stream(self, job: Job, *, tool_name: str = "", tool_call_id: str = "",
               cancel_event: Optional[threading.Event] = None,
               heartbeat_interval_s: float = 10.0) -> drain.EventStream:
        """A generator of ``tool_output`` / ``heartbeat`` events that returns
        the job's Result; ``close()`` cancels the job."""
        self._check_open()
        return drain.stream_job(self.submit, job, tool_name=tool_name, tool_call_id=tool_call_id,
                                cancel_event=cancel_event, heartbeat_interval_s=heartbeat_interval_s)

    def astream(self, job: Job, *, tool_name: str = "", tool_call_id: str = "",
                cancel_event: Optional[threading.Event] = None,
                heartbeat_interval_s: float = 10.0) -> drain.AsyncJobStream:
        """The asyncio form of :meth:`stream`: ``async for event in ...``, then
        ``.result``. Cancelling the consuming task cancels the job."""
        self._check_open()
        return drain.AsyncJobStream(self.submit, job, tool_name=tool_name, tool_call_id=tool_call_id,
                                    cancel_event=cancel_event, heartbeat_interval_s=heartbeat_interval_s)

    def map(self, jobs: Iterable[Job], *,
            max_in_flight: Optional[int] = None) -> Iterator[Result]:
        """Results of ``jobs`` in input order, as an iterator. Jobs are taken
        from the iterable lazily and at most ``max_in_flight`` run at once
        (default: :attr:`default_max_in_flight`), so a million-job generator
        is fine; closing the iterator early cancels what is still running."""
        self._check_open()
        return map_jobs(self.submit, jobs, self._in_flight(max_in_flight))

    def imap_unordered(self, jobs: Iterable[Job], *,
                       max_in_flight: Optional[int] = None) -> Iterator[tuple[int, Result]]:
        """``(index, Result)`` pairs as jobs finish, ``index`` being the job's
        position in ``jobs``; otherwise like :meth:`map`."""
        self._check_open()
        return imap_unordered_jobs(self.submit, jobs, self._in_flight(max_in_flight))

    def _in_flight(self, max_in_flight: Optional[int]) -> int:
        if max_in_flight is None:
            return self.default_max_in_flight
        return check_max_in_flight(max_in_flight)

    def __enter__(self: Runner) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
