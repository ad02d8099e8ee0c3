"""Warm jobs inside the worker: waiting for a spare, handed over to it, and
what the spare said about taking them.

Runs in the worker process, on its one thread, as part of its loop
(execpool/worker/event_loop.py). The spares come from the worker's ``SpareSupply``
(execpool/worker/warm/supply.py); this module owns the queue of warm jobs waiting for
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
from dataclasses import dataclass
from typing import Callable, List, Optional

from ...tool.become import Setup, rlimit_values
from ...tool.spare_wire import MAX_CGROUP_FDS, REHEARSE_WHEN_IDLE_S, encode_job, read_report, view_fds
from ..running_job import RunningJob
from ..spawn import memfd_holding, output_pipes
from .supply import SpareSupply, WarmSpare


@dataclass(frozen=True)
class Hooks:
    """All the hand-over tells the worker, and asks of it: a job's spare
    runs it, a job could not start, whether the worker is stopping, since
    when it is idle. Everything else a warm job needs is on the job."""

    started: Callable[[RunningJob, int, List[int]], None]
    failed: Callable[[RunningJob, BaseException], None]
    stopping: Callable[[], bool]
    idle_since: Callable[[], Optional[float]]


class WarmJobs:
    """The warm jobs waiting for a spare, and the spares they get."""

    def __init__(self, sel: selectors.BaseSelector, spawn_method: str, python: str, preload: tuple,
                 warm_ipython: bool, spares_parked: int, hooks: Hooks) -> None:
        self.hooks = hooks
        self.spares = SpareSupply(sel, spawn_method, python, preload, warm_ipython, spares_parked, self.serve)
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
        hooks = self.hooks
        while self.waiting and not hooks.stopping():
            spare = self.spares.pop()
            if spare is None:
                break
            job = self.waiting.popleft()
            try:
                handed = self._hand_over(job, spare)
            except Exception as exc:  # noqa: BLE001 - the job's start failure, as for a cold job
                hooks.failed(job, exc)
                continue
            if not handed:
                self.waiting.appendleft(job)  # the spare was gone; the next one takes it
        if hooks.stopping():
            return
        failure = self.spares.want(len(self.waiting))
        if failure is not None:
            while self.waiting:
                hooks.failed(self.waiting.popleft(), OSError(failure))
        self.rehearse_if_idle()

    def rehearse_if_idle(self) -> None:
        """Parked spares rehearse only once the worker has had nothing to
        do for a while (execpool/tool/spare_wire.py says why)."""
        idle_since = self.hooks.idle_since()
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
            job.failed_to_start(failure.decode("utf-8", "replace"))
        return taken

    def close_ready(self, job: RunningJob) -> None:
        if job.ready_fd is not None:
            os.close(job.ready_fd)
            job.ready_fd = None

    def requeue(self, job: RunningJob) -> None:
        """Its spare died before it took the job (the worker closed the
        spare's output pipes): the next spare takes it."""
        self.close_ready(job)
        job.requeued()
        self.waiting.appendleft(job)
        self.serve()

    def close(self) -> None:
        self.waiting.clear()
        self.spares.close()

    def _hand_over(self, job: RunningJob, spare: WarmSpare) -> bool:
        start = job.start
        self.spares.ipython_sessions |= start.ipython
        setup = Setup(job.cwd, rlimit_values(start.limits), not start.network, (), job.confinement(),
                      job.view_arguments())
        description = memfd_holding("execpool-job", encode_job(job.script_path(), job.env, setup))
        ready_r, ready_w = os.pipe()
        try:
            with output_pipes(start.separate_stderr) as (readers, out_w, err_w), \
                    job.start_fds() as (stdin_fd, join_fds):
                # The rulesets and view are kept until the job ends: a requeued job needs them again.
                handed = spare.hand(description, stdin_fd, out_w, err_w, ready_w, join_fds[:MAX_CGROUP_FDS],
                                    (*job.rulesets, *view_fds(setup.view)))
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
        self.hooks.started(job, spare.pid, readers)
        return True
