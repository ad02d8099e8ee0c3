"""The worker's deadlines: one heap of typed entries, its earliest due time
the selector's timeout.

Runs in the worker process, on its loop (execpool/worker/event_loop.py). An entry
whose job has ended meanwhile is stale; the loop skips it when it comes due,
which costs less than finding and removing it when the job ends.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import time
from typing import Iterator, List, NamedTuple, Optional


class Kind(enum.Enum):
    """What comes due."""

    #: A job's timeout: its tree is killed.
    TIMEOUT = "timeout"
    #: The grace a killed job's processes have to be reaped before its
    #: Result goes out anyway.
    REAP = "reap"
    #: The next count of a job whose process cap the worker keeps itself.
    COUNT = "count"
    #: The moment an idle worker has its parked spares rehearse (no job).
    REHEARSE = "rehearse"
    #: A session's running cell: its timeout (it is interrupted), then the
    #: grace after that (the session is killed).
    CELL = "cell"
    #: A session without a cell for its idle timeout ends.
    IDLE = "idle"


class Timer(NamedTuple):
    due: float
    order: int  # ties broken by arrival, never by comparing kinds
    kind: Kind
    job_id: int


class Timers:
    """The heap of deadlines."""

    def __init__(self) -> None:
        self._heap: List[Timer] = []
        self._order = itertools.count()

    def add(self, due: float, kind: Kind, job_id: int = 0) -> None:
        heapq.heappush(self._heap, Timer(due, next(self._order), kind, job_id))

    def timeout(self) -> Optional[float]:
        """Seconds until the earliest entry is due (None: no entry)."""
        if not self._heap:
            return None
        return max(0.0, self._heap[0].due - time.monotonic())

    def due(self) -> Iterator[Timer]:
        """The entries due by now, earliest first, each taken off the heap."""
        now = time.monotonic()
        while self._heap and self._heap[0].due <= now:
            yield heapq.heappop(self._heap)
