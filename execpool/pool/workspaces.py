"""Workspaces: files that outlive jobs -- an MCP connection's, a
conversation's, an agent's task's -- bounded like any sandboxed tenant's.

Runs in the caller. A job's space (execpool/worker/space.py) goes with the
job; a workspace is a space its worker keeps until it is closed, and the
jobs and sessions run in it (``ws.submit``, ``ws.run``, ``ws.session``)
take it as theirs: their working directory is its home, their ``/tmp`` and
``/dev/shm`` its own, and what one writes the next finds. They run on the
worker that holds it, in the sandbox (the pool's, else the strict one):
nothing of it has a path outside their view. Its disk bound comes out of
the pool's disk budget for its life, and is the bound of everything its
jobs write there together. Before, a connection's python, bash and
run_code calls shared a directory on the pool's disk, and one call filled
the disk for every neighbour.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any, Optional, Union

from ..shared import checks, worker_wire
from ..shared.errors import DiskBudgetError, PoolClosedError
from ..shared.jobs import MIN_DISK, Job
from ..shared.kernel.sandbox import STRICT, Sandbox, job_sandbox
from ..shared.result import Result
from .config import PoolConfig
from .future import JobFuture, OnEvent

if TYPE_CHECKING:
    from .engine import Engine
    from .sessions import Session
    from .workers import WorkerProcess

#: Where a workspace's jobs find it: their home, as their view has it.
WORKSPACE_PATH = "/home/user"


class Workspace:
    """A space that outlives jobs (module docstring). Made by
    ``ExecPool.workspace``; a context manager that closes it."""

    #: Where its jobs see it (their working directory and home).
    path = WORKSPACE_PATH

    def __init__(self, engine: "Engine", disk: Optional[int], sandbox: Sandbox) -> None:
        self._engine = engine
        self.disk = disk
        self.sandbox = sandbox
        self.id = engine.next_id()
        self._lock = threading.Lock()
        self._closed = False
        budget = engine.disk_budget
        if disk and not budget.try_acquire(disk):
            raise DiskBudgetError(f"a workspace's disk bound of {disk} bytes does not fit the pool's disk budget "
                                  f"now: {budget.describe()}")
        try:
            self.worker: "WorkerProcess" = engine.hold_workspace(self.id)
        except BaseException:
            budget.release(disk or 0, lasting=True)
            raise
        self.worker.send(worker_wire.OpenWorkspace(self.id, disk))

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, job: Job, *, on_event: Optional[OnEvent] = None,
               cancel_event: Optional[threading.Event] = None) -> JobFuture:
        """``ExecPool.submit`` for a job in this workspace: it runs in its
        home (``cwd`` must be None) and in its sandbox (the job's own, if it
        gives one with the view). Its ``files`` are the workspace's for its
        run and gone after, a file of the same name set aside meanwhile."""
        self._check_open()
        return self._engine.submit_in(self, job, on_event, cancel_event)

    def run(self, job: Job, *, cancel_event: Optional[threading.Event] = None) -> Result:
        return self.submit(job, cancel_event=cancel_event).result()

    def session(self, language: str = "python", **options: Any) -> "Session":
        """``ExecPool.session`` in this workspace (no ``cwd``; its sandbox is
        the workspace's). A session in a workspace cannot fork: its copy
        would share the workspace."""
        self._check_open()
        if options.get("cwd") is not None:
            raise ValueError("a session in a workspace runs in its home: cwd must be None")
        return self._engine.session_in(self, language,
                                       **{**options, "sandbox": self.sandbox_for(options.get("sandbox"))})

    def sandbox_for(self, sandbox: Union[None, bool, str, Sandbox]) -> Sandbox:
        """A job's sandbox in this workspace: its own if it gives one with
        the view, else the workspace's; ValueError for none."""
        chosen = job_sandbox(sandbox)
        if chosen is None:
            return self.sandbox
        if not isinstance(chosen, Sandbox) or not chosen.read_only_view:
            raise ValueError("a workspace's jobs run in the sandbox's view: sandbox must be None, 'strict' or a "
                             "Sandbox with read_only_view")
        return chosen

    def close(self) -> None:
        """Let it go: what its jobs wrote goes once the last of them ended."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._engine.let_go_workspace(self.worker, self.id)
        self._engine.disk_budget.release(self.disk or 0, lasting=True)

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("this workspace is closed")

    def __enter__(self) -> "Workspace":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Workspace {self.id} {'closed' if self._closed else 'open'}>"


def workspace_job(workspace: Workspace, job: Job) -> Job:
    """``job`` as it runs in ``workspace``: its sandbox settled; ValueError
    for a ``cwd``."""
    if job.cwd is not None:
        raise ValueError("a workspace's job runs in its home: cwd must be None")
    return dataclasses.replace(job, sandbox=workspace.sandbox_for(job.sandbox))


def workspace_options(config: PoolConfig, disk: Optional[int], sandbox: Union[None, str, Sandbox]) -> tuple:
    """``ExecPool.workspace``'s arguments checked: (disk, sandbox)."""
    if disk is not None:
        checks.integer("disk", disk, minimum=MIN_DISK)
    else:
        disk = config.limits.disk
    chosen = job_sandbox(sandbox)
    if chosen is False:
        raise ValueError("a workspace needs the sandbox (None takes the pool's, or the strict one)")
    box = chosen if isinstance(chosen, Sandbox) else config.sandbox or STRICT
    if not box.read_only_view:
        raise ValueError("a workspace needs the sandbox's view: Sandbox(read_only_view=False) has none")
    return disk, box
