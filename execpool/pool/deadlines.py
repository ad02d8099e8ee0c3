"""Deadlines in the caller: a callback once a number of seconds has passed,
for as many waits as there are, on one thread.

Runs in the caller. A CodeJob waiting for another job's compile of the
same program (execpool/pool/code.py) gives up at its own compile_timeout;
no job's step can carry that deadline for it, and a thread per waiting job
would grow the caller's threads with its load. The thread exists only
while a deadline is pending.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from typing import Callable, List, Tuple

from .ondemand import OnDemandThread

logger = logging.getLogger("execpool")


class Deadlines(OnDemandThread):
    _name = "execpool-deadlines"

    def __init__(self) -> None:
        super().__init__()
        self._heap: List[Tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def add(self, seconds: float, then: Callable[[], None]) -> None:
        """Call ``then`` (on the deadlines' thread) in ``seconds``; a
        callback whose wait ended meanwhile finds that out itself."""
        with self._cond:
            if self._closed:
                return
            heapq.heappush(self._heap, (time.monotonic() + seconds, next(self._order), then))
            self._wake()

    def _drop(self) -> None:
        self._heap.clear()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed or not self._heap:
                        self._thread = None
                        return
                    due = self._heap[0][0] - time.monotonic()
                    if due <= 0:
                        then = heapq.heappop(self._heap)[2]
                        break
                    self._cond.wait(due)
            try:
                then()
            except Exception as exc:
                logger.error("execpool: a deadline's callback raised", exc_info=exc)
