"""Admission control in front of the pool: how many jobs a service runs at
once, how many wait, and for how long.

Runs in the service's event loop (execpool/serve/app.py), one ``Admission`` per
app. A pool runs any number of jobs at once; a service must not, or a burst
of requests becomes a burst of processes and every request slows down
together until clients time out ("Read timed out" at 128 concurrent
callers). So at most ``max_in_flight`` jobs run; up to ``max_queue`` more
wait, first come first served, each for at most ``queue_timeout`` seconds.
A request that cannot start in time, or finds the queue full, is *told* so
at once (``Rejected``; the route answers 503 or 504), never left hanging,
and a waiting request whose client goes away leaves the queue without
running.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import time
from typing import Awaitable, Callable, Deque, Optional


class Reason(str, enum.Enum):
    """Why the service refused a request, or dropped its answer: the label
    of ``execpool_rejected_total``."""

    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    NO_WORKERS = "no_workers"  # the pool has no worker right now (one is being replaced)
    DISK_BUDGET = "disk_budget"  # a session whose disk bound does not fit the pool's disk budget now
    SESSIONS_FULL = "sessions_full"  # --max-sessions are open
    TOO_LARGE = "too_large"
    READ_TIMEOUT = "read_timeout"
    WRITE_TIMEOUT = "write_timeout"  # the client took none of its answer in time: dropped, slot freed
    AUTH = "auth"
    HOST = "host"
    CROSS_ORIGIN = "cross_origin"

    def __str__(self) -> str:
        return self.value


class Rejected(Exception):
    """The request cannot start now: ``reason`` says why, ``retry_after``
    is a hint in seconds for the client."""

    def __init__(self, reason: Reason, retry_after: int) -> None:
        super().__init__(reason.value)
        self.reason = reason
        self.retry_after = retry_after


class ClientGone(Exception):
    """The client disconnected while its request waited: nothing runs."""


class Admission:
    """Slots for running jobs, and the queue in front of them."""

    def __init__(self, max_in_flight: int, max_queue: int, queue_timeout: float) -> None:
        self.max_in_flight = max_in_flight
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.in_flight = 0
        self._waiters: Deque[asyncio.Future] = collections.deque()

    @property
    def queue_depth(self) -> int:
        return len(self._waiters)

    @property
    def full(self) -> bool:
        return self.in_flight >= self.max_in_flight and len(self._waiters) >= self.max_queue

    async def acquire(self, disconnected: Optional[Callable[[], Awaitable[None]]] = None, *,
                      bounded: bool = True, since: Optional[float] = None) -> float:
        """Take a slot; return how long the request waited for it.

        ``disconnected`` completes when the client goes away (ClientGone).
        ``bounded=False`` is for the later jobs of a batch already answering:
        they wait their turn without a queue limit or timeout, since a
        stream of records cannot turn into a 503 halfway. ``since`` (a
        ``time.monotonic()``) is when the request arrived: the queue timeout
        counts from then, so reading its body is part of its wait.
        """
        started = time.monotonic()
        timeout = self.queue_timeout - (0.0 if since is None else max(0.0, started - since))
        if self.in_flight < self.max_in_flight and not self._waiters:
            self.in_flight += 1
            return 0.0
        if bounded and len(self._waiters) >= self.max_queue:
            raise Rejected(Reason.QUEUE_FULL, max(1, round(self.queue_timeout)))
        turn: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        watcher = asyncio.ensure_future(disconnected()) if disconnected is not None else None
        granted = False
        try:
            waiting = {turn} if watcher is None else {turn, watcher}
            done, _ = await asyncio.wait(waiting, timeout=max(0.0, timeout) if bounded else None,
                                         return_when=asyncio.FIRST_COMPLETED)
            if turn in done:
                granted = True  # release() handed the slot over
                return time.monotonic() - started
            if watcher is not None and watcher in done:
                raise ClientGone()
            raise Rejected(Reason.QUEUE_TIMEOUT, max(1, round(self.queue_timeout)))
        finally:
            if watcher is not None:
                watcher.cancel()
            if not granted:
                if not turn.done():
                    turn.cancel()
                    self._waiters.remove(turn)
                elif not turn.cancelled():
                    self.release()  # handed over just as this request left (a task cancelled)

    def release(self) -> None:
        """Give the slot to the oldest waiter still waiting, or free it."""
        while self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_result(None)  # the slot passes on: in_flight stays
                return
        self.in_flight -= 1
