"""The pool's disk budget: what the spaces of the sandboxed jobs and
sessions alive at once may hold, in all.

Runs in the caller, at ``ExecPool.submit`` and at a session's start. A
sandboxed tenant writes only its space (execpool/worker/space.py), a tmpfs
of its ``Limits(disk=...)`` bytes: memory until it ends. Each bound holds
one tenant; this holds them together, so that tenants filling their spaces
at once never take the memory the pool and its neighbours need -- a bound
given is a bound kept, not hoped for. A job whose bound does not fit yet
waits, first come first served; a session, which may live for hours,
starts now or is refused (the service answers 503): a queue behind
sessions could wait for ever.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Callable, Deque, List, Optional

from ..shared.jobs import Limits
from ..shared.kernel.sandbox import Sandbox


def reserved(sandbox: Optional[Sandbox], limits: Limits) -> int:
    """What a tenant takes of the budget: its disk bound where it gets a
    space (a sandbox with its view), else nothing -- a job without one
    writes where its user may, and no budget of the pool's holds that."""
    if sandbox is None or not sandbox.read_only_view or limits.disk is None:
        return 0
    return limits.disk


@dataclass
class _Waiting:
    size: int
    start: Callable[[], None]


class DiskBudget:
    """``total`` bytes, handed out to tenants as they start and taken back
    as they end. Tenants that may live for hours -- sessions, workspaces --
    never hold its last ``kept`` bytes: jobs, which wait for room, must
    find some, or a client's idle sessions would hold every job back. Jobs
    fill that reserve first: jobs in flight leave the lasting tenants their
    room as long as they fit in it (the service's own checks, outside its
    --max-in-flight, once left a new server room for one MCP client)."""

    def __init__(self, total: int, kept: int = 0) -> None:
        self.total = total
        self.kept = kept
        self._lock = threading.Lock()
        self._taken = 0
        self._lasting = 0
        self._waiting: Deque[_Waiting] = collections.deque()
        self._closed = False

    @property
    def taken(self) -> int:
        return self._taken

    @property
    def waiting(self) -> int:
        """Jobs waiting for room."""
        with self._lock:
            return len(self._waiting)

    def fits(self, size: int) -> bool:
        """Whether ``size`` could ever fit (the caller's job is refused at
        once otherwise: it would wait for ever)."""
        return size <= self.total

    def acquire(self, size: int, start: Callable[[], None]) -> Optional[object]:
        """``start`` now, with ``size`` taken, if it fits and nobody waits
        before it; else later, when it does (on the thread that gives back
        what makes it fit). A token for :meth:`leave` while it waits."""
        with self._lock:
            if self._closed or not self._waiting and self._taken + size <= self.total:
                self._taken += size
                waiting = None
            else:
                waiting = _Waiting(size, start)
                self._waiting.append(waiting)
        if waiting is None:
            start()
        return waiting

    def try_acquire(self, size: int) -> bool:
        """``size`` taken now, for a lasting tenant (a session, a
        workspace), if it fits now beside the other lasting ones and what
        is kept for jobs, and beside the jobs alive; no waiting. Given back
        with ``release(size, lasting=True)``."""
        with self._lock:
            if self._waiting or self._lasting + size > self.total - self.kept or self._taken + size > self.total:
                return False
            self._taken += size
            self._lasting += size
            return True

    def leave(self, token: object) -> bool:
        """A waiter that no longer waits (cancelled); whether it was still waiting."""
        with self._lock:
            try:
                self._waiting.remove(token)  # type: ignore[arg-type]
            except ValueError:
                return False
        self._admit()
        return True

    def release(self, size: int, *, lasting: bool = False) -> None:
        if size:
            with self._lock:
                self._taken -= size
                if lasting:
                    self._lasting -= size
            self._admit()

    def _admit(self) -> None:
        """Start the waiters that fit now, in their order."""
        while True:
            with self._lock:
                if not self._waiting or self._taken + self._waiting[0].size > self.total:
                    return
                waiting = self._waiting.popleft()
                self._taken += waiting.size
            waiting.start()

    def close(self) -> List[Callable[[], None]]:
        """The waiters' starts, for a closing pool to end them; from now on
        every job starts at once (and finds the pool closed)."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = list(self._waiting), collections.deque()
        return [entry.start for entry in waiting]

    def describe(self) -> str:
        with self._lock:
            return (f"{self._taken} of {self.total} bytes are held by the spaces of sandboxed jobs and sessions "
                    f"alive, {self._lasting} of them by sessions and workspaces, which leave the last {self.kept} "
                    "to jobs")
