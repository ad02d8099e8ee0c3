"""Warm jobs inside the worker: waiting for a spare, handed over to it, and
what the spare said about taking them.

Runs in the worker process, on its one thread, as part of its loop
(execpool/worker/loop.py). The spares come from the worker's ``SpareSupply``
(execpool/worker/warm/template.py); this module owns the queue of warm jobs waiting for
one and the hand-over itself: the job's description as marshal data in a
memfd, its stdin, its output pipes, its cgroup files and a *ready* pipe, in
one ``SCM_RIGHTS`` message -- with, for a sandboxed job, the Landlock
rulesets the worker built for it, which the spare enters before any of the
job's code runs (execpool/shared/kernel/sandbox.py). The ready pipe says whether the
spare took the job (``TAKEN``, with the CPU time it had spent before, which
is not the job's) or failed to start it (that, and then why); it is read
only once the spare has exited, so a spare that never says anything blocks
nobody. A spare killed after the hand-over but before it took the job ran none of it,
and the job goes back to the head of the queue.
"""

from __future__ import annotations

import os
import selectors
import time
from collections import deque
from typing import ContextManager, Optional, Protocol

from ..job import RunningJob
from ..spawn import memfd_holding, output_pipes
from .supply import SpareSupply, WarmSpare
from .wire import MAX_CGROUP_FDS, REHEARSE_WHEN_IDLE_S, encode_job, read_report


class Host(Protocol):
    """What the hand-over needs of the worker that runs it."""

    sel: selectors.BaseSelector
    spawn_method: str
    preload: tuple
    stopping: bool
    idle_since: Optional[float]

    def fail_start(self, job: RunningJob, exc: BaseException) -> None: ...
    def running(self, job: RunningJob, pid: int, readers: list) -> None: ...
    def close_output(self, job: RunningJob) -> None: ...
    def job_env(self, job: RunningJob) -> dict: ...
    def job_cwd(self, job: RunningJob) -> str: ...
    def job_fds(self, job: RunningJob) -> ContextManager[tuple]: ...


class WarmJobs:
    """The warm jobs waiting for a spare, and the spares they get."""

    def __init__(self, worker: Host, spares_parked: int) -> None:
        self.worker = worker
        self.spares = SpareSupply(worker.sel, worker.spawn_method, worker.preload, spares_parked, self.serve)
        # Oldest first.
        self.waiting: deque[RunningJob] = deque()

    def add(self, job: RunningJob) -> None:
        self.waiting.append(job)

    def forget(self, job: RunningJob) -> None:
        """A job that ended (timeout, cancel) while it waited."""
        self.waiting.remove(job)

    def serve(self) -> None:
        """Hand waiting jobs to parked spares, then ask for as many spares
        as are still missing."""
        worker = self.worker
        while self.waiting and not worker.stopping:
            spare = self.spares.pop()
            if spare is None:
                break
            job = self.waiting.popleft()
            try:
                handed = self._hand_over(job, spare)
            except Exception as exc:  # noqa: BLE001 - the job's start failure, as for a cold job
                worker.fail_start(job, exc)
                continue
            if not handed:
                self.waiting.appendleft(job)  # the spare was gone; the next one takes it
        if worker.stopping:
            return
        failure = self.spares.want(len(self.waiting))
        if failure is not None:
            while self.waiting:
                worker.fail_start(self.waiting.popleft(), OSError(failure))
        self.rehearse_if_idle()

    def rehearse_if_idle(self) -> None:
        """Parked spares rehearse only once the worker has had nothing to
        do for a while (execpool/worker/warm/template.py)."""
        idle_since = self.worker.idle_since
        if idle_since is not None and time.monotonic() - idle_since >= REHEARSE_WHEN_IDLE_S:
            self.spares.rehearse()

    def took(self, job: RunningJob) -> bool:
        """Read what the spare said on the ready pipe (closing it at EOF,
        once the job's code started or the spare died); return whether the
        spare took the job. A failure it reported is the job's INFRA error."""
        while job.ready_fd is not None:
            try:
                data = os.read(job.ready_fd, 4096)
            except BlockingIOError:
                break
            if not data:
                self.close_ready(job)
                break
            job.report += data
        taken, job.spent_before, failure = read_report(job.report)
        if failure and job.error is None:
            job.error = f"cannot start the tool: {failure.decode('utf-8', 'replace')}"
            job.infra = True
        return taken

    def close_ready(self, job: RunningJob) -> None:
        if job.ready_fd is not None:
            os.close(job.ready_fd)
            job.ready_fd = None

    def requeue(self, job: RunningJob) -> None:
        """Its spare died before it took the job: the next spare takes it."""
        self.close_ready(job)
        self.worker.close_output(job)
        job.pid = None
        job.report = b""
        self.waiting.appendleft(job)
        self.serve()

    def close(self) -> None:
        self.waiting.clear()
        self.spares.close()

    def _hand_over(self, job: RunningJob, spare: WarmSpare) -> bool:
        worker = self.worker
        start = job.start
        description = memfd_holding("execpool-job", encode_job(job.script, worker.job_env(job), worker.job_cwd(job),
                                                                start.limits, not start.network,
                                                                len(job.confinement()), job.writable))
        ready_r, ready_w = os.pipe()
        try:
            with output_pipes(start.separate_stderr) as (readers, out_w, err_w), \
                    worker.job_fds(job) as (stdin_fd, join_fds):
                handed = spare.hand(description, stdin_fd, out_w, err_w, ready_w, join_fds[:MAX_CGROUP_FDS],
                                    job.rulesets)  # kept until the job ends: a requeued job needs them again
        except BaseException:
            os.close(ready_r)
            raise
        finally:
            for fd in (description, ready_w):
                os.close(fd)
            spare.close()
        if not handed:
            for fd in (*readers, ready_r):
                os.close(fd)
            return False
        # Not watched: what the spare says there (one byte, or that and a
        # short failure) fits the pipe, and matters only once it has exited.
        os.set_blocking(ready_r, False)
        job.ready_fd = ready_r
        worker.running(job, spare.pid, readers)
        return True
