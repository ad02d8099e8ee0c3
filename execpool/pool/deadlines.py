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
from typing import Callable, List, Optional

from .lazy_thread import OnDemandThread

logger = logging.getLogger("execpool")


class Deadlines(OnDemandThread):
    _name = "execpool-deadlines"

    def __init__(self) -> None:
        super().__init__()
        # [due, order, callback]: a cancelled entry's callback is None.
        self._heap: List[list] = []
        self._order = itertools.count()
        self._cancelled = 0

    def add(self, seconds: float, then: Callable[[], None]) -> Optional[object]:
        """Call ``then`` (on the deadlines' thread) in ``seconds``; a handle
        for :meth:`cancel` (None once closed). A callback whose wait ended
        another way finds that out itself."""
        with self._cond:
            if self._closed:
                return None
            entry = [time.monotonic() + seconds, next(self._order), then]
            heapq.heappush(self._heap, entry)
            self._wake()
            return entry

    def cancel(self, handle: Optional[object]) -> None:
        """The wait ended: its callback, and what that holds, go now rather
        than at its time -- marked, not searched for (thousands of waits
        end together); the heap is rebuilt once half of it is marked, and
        the thread ends with the last live one."""
        if not isinstance(handle, list):
            return
        with self._cond:
            if handle[2] is None:
                return  # called, or cancelled, already
            handle[2] = None
            self._cancelled += 1
            if 2 * self._cancelled >= len(self._heap):
                self._heap = [entry for entry in self._heap if entry[2] is not None]
                heapq.heapify(self._heap)
                self._cancelled = 0
                self._cond.notify()

    def _drop(self) -> None:
        self._heap.clear()
        self._cancelled = 0

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed or not self._heap:
                        self._thread = None
                        return
                    due = self._heap[0][0] - time.monotonic()
                    if due <= 0:
                        entry = heapq.heappop(self._heap)
                        then, entry[2] = entry[2], None
                        if then is None:
                            self._cancelled -= 1
                            continue
                        break
                    self._cond.wait(due)
            try:
                then()
            except Exception as exc:
                logger.error("execpool: a deadline's callback raised", exc_info=exc)
