"""What the layers built beside ``submit`` -- sessions
(execpool/pool/sessions.py) and workspaces (execpool/pool/workspaces.py) --
may use of the pool beyond its public API, and nothing more.

Caller side. A session is one long job that must reach its own worker
again (its cells, its forks), and a workspace pins its jobs to the worker
that holds its space: both need job ids, the workers' assignment and the
cancel watcher, which ``ExecPool`` keeps private. They get them through
this protocol, which the pool hands them (execpool/supervisor.py), so that
the pool's insides can change without the layers knowing.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Optional, Protocol

from ..shared.jobs import Job
from .budget import DiskBudget
from .config import PoolConfig
from .future import JobFuture, JobHandle, OnEvent
from .stats import StatsRecorder

if TYPE_CHECKING:
    from .sessions import Session
    from .workers import WorkerProcess
    from .workspaces import Workspace


class Engine(Protocol):
    """A pool's workers, as sessions and workspaces reach them."""

    @property
    def config(self) -> PoolConfig:
        """The pool's settled configuration."""

    @property
    def disk_budget(self) -> DiskBudget:
        """What sandboxed tenants' disk bounds are taken from."""

    @property
    def stats(self) -> StatsRecorder:
        """Where a job's end is counted."""

    def next_id(self) -> int:
        """A job id no other job of the pool has."""

    def assign(self, handle: JobHandle, deadline: Optional[float],
               worker: Optional["WorkerProcess"]) -> "WorkerProcess":
        """The worker that runs ``handle``'s job: ``worker``, or the least
        loaded; ``PoolClosedError`` or ``PoolBrokenError`` where none will."""

    def hold_workspace(self, ident: int) -> "WorkerProcess":
        """The least-loaded worker, holding workspace ``ident`` from now on."""

    def let_go_workspace(self, worker: "WorkerProcess", ident: int) -> None:
        """Workspace ``ident`` is closed: ``worker`` may retire."""

    def watch(self, future: Future, cancel_event: threading.Event) -> None:
        """Cancel ``future`` once ``cancel_event`` is set."""

    def submit_in(self, workspace: "Workspace", job: Job, on_event: Optional[OnEvent],
                  cancel_event: Optional[threading.Event]) -> JobFuture:
        """``ExecPool.submit`` for a job in ``workspace``."""

    def session_in(self, workspace: "Workspace", language: str, **options: Any) -> "Session":
        """``ExecPool.session`` for a session in ``workspace``."""
