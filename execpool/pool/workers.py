"""Worker processes as the caller sees them: started, handed jobs, retired,
replaced, and cleaned up after.

Runs in the caller. :class:`Workers` owns the pool's worker processes and the
one lock over them; the dispatcher (execpool/pool/dispatch.py) reads their
messages and tells this module when one is gone, and ``ExecPool.submit``
asks it for the least-loaded worker.

A worker starts as a fresh interpreter (``sys.executable -m
execpool.worker``), its channel on two inherited socket descriptors, its
``WorkerConfig`` the first message on them, its environment scrubbed to what
runs Python -- never forked from the caller (fork copies a big server's page
tables, ~24 ms per GiB) and never through multiprocessing's spawn (it
re-imports the caller's ``__main__``). Where a cgroup v2 hierarchy is
writable it runs in a group of its own (execpool/shared/kernel/cgroups.py). The pool's
lifeline (execpool/lifeline/process.py) starts it on the pool's behalf, so that the
lifeline, a child subreaper, is every worker's parent: what escapes from a
worker's jobs is handed to it, and killed, should the worker die.

When a worker dies, its cleanup runs on a thread of its own
(``execpool-cleanup-PID``), not on the dispatcher: waiting for the process,
killing its cgroup and its process groups, scanning the host for its
markers and removing its directories can take a second, and every other
job's output would wait for it. Only that worker's jobs fail (``INFRA``,
with the worker's pid and exit status), after their trees are dead, and a
replacement starts.
"""

from __future__ import annotations

import collections
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from typing import Optional

from ..shared import worker_wire
from ..shared.errors import PoolBrokenError, PoolClosedError
from ..shared.kernel import cgroups
from ..shared.kernel.dirs import TRASH, remove_tree
from ..shared.kernel.proctree import kill_tree
from ..shared.package import PACKAGE_PARENT
from ..shared.result import Result, Status, describe_exit
from .config import PoolConfig
from .future import JobHandle
from .lifeline import Lifeline, WorkerChild
from .stats import StatsRecorder

#: A worker that dies before saying Ready this many times in a row means the
#: interpreter or the package is broken: stop respawning and say so.
MAX_STARTUP_FAILURES = 3

#: A replacement worker that cannot be started (no descriptors, no memory,
#: no process slots -- all of which a job can take for a while) is tried
#: again after this, doubling up to the most: a pool never gives up on a
#: passing shortage.
RESPAWN_BACKOFF_S = 0.05
RESPAWN_BACKOFF_MAX_S = 2.0

#: How long an exited worker's group may take to empty after cgroup.kill
#: (a dying process leaves it within milliseconds; one stuck in the kernel
#: may take longer, and then the group stays until the lifeline's turn).
GROUP_EMPTY_TIMEOUT_S = 2.0

#: How long a worker that closed its channel may take to exit before it is
#: SIGKILLed.
EXIT_WAIT_S = 1.0
#: How long a dead worker's cleanup waits for a successor that is starting
#: to take its directory (``_hand_over``).
HAND_OVER_WAIT_S = 5.0

#: No honest worker message comes near this (live output is capped, a
#: Result keeps max_output_chars); a longer one means the pipe was tampered
#: with, and the worker is treated as dead.
MAX_MESSAGE_BYTES = 1 << 30

logger = logging.getLogger("execpool")


class WorkerProcess:
    """The caller's record of one worker process and the jobs it runs."""

    def __init__(self, proc: WorkerChild, send: Connection, recv: Connection, token: str,
                 jobs_dir: str, group: Optional[cgroups.WorkerGroup]) -> None:
        self.proc = proc
        self.send_conn = send
        self.recv = recv
        self.frames = worker_wire.FrameReader(recv.fileno(), MAX_MESSAGE_BYTES)
        self.token = token
        self.jobs_dir = jobs_dir
        self.group = group
        self.send_lock = threading.Lock()
        self.jobs: dict[int, JobHandle] = {}
        self.pgids: dict[int, int] = {}
        #: The workspaces it holds (execpool/pool/workspaces.py): it retires
        #: only once they are closed too.
        self.workspaces: set[int] = set()
        self.started = 0
        self.ready = threading.Event()
        self.retiring = False
        # Why the dispatcher killed it, when it broke the channel protocol.
        self.fault: Optional[str] = None
        self.stopped_seen = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, msg: worker_wire.ToWorker) -> bool:
        try:
            with self.send_lock:
                worker_wire.send(self.send_conn, msg)
            return True
        except OSError:
            return False  # it died; the dispatcher sees the EOF and fails its jobs

    def close(self) -> None:
        """Under the send lock: a Cancel being sent from another thread must
        never write to a descriptor number that was closed and reused."""
        with self.send_lock:
            self.send_conn.close()
        self.recv.close()


class Workers:
    """The pool's worker processes and the lock over them and their jobs."""

    def __init__(self, config: PoolConfig, on_change, on_job, stats: StatsRecorder) -> None:
        self.config = config
        self._stats = stats
        # Wake the dispatcher: always, for a worker to listen to; for a job
        # to watch, only if it sleeps without a timeout (called under lock).
        self._on_change = on_change
        self._on_job = on_job
        self.lock = threading.Lock()
        self.all: list[WorkerProcess] = []
        self.running_jobs = 0
        self.closed = False
        self.broken: Optional[str] = None
        self.preload_errors: tuple = ()
        self._startup_failures = 0
        #: Workers being cleaned up after, and those whose cleanup the
        #: machine has refused a thread so far (started by start_cleanups).
        self._cleanups: set[WorkerProcess] = set()
        self._unstarted: collections.deque[tuple[WorkerProcess, dict[int, JobHandle], bool]] = collections.deque()
        self._thread_refused = False  # said once until a thread starts again
        self._cleaned = threading.Condition(self.lock)
        self._closing = threading.Event()  # wakes a replacement waiting to try again
        self._scratch: dict[str, str] = {}  # token -> directory (scratch_dir)
        # Before any worker, so that it is in none of their groups and knows them all.
        self.lifeline = Lifeline(self._process_env())

    def start(self) -> None:
        with self.lock:
            for _ in range(self.config.workers):  # type: ignore[arg-type]
                self.all.append(self._spawn())

    def wait_ready(self, timeout: float) -> None:
        """Block until every worker can take a job, so the first job's latency
        is a job's latency and a broken interpreter fails here, loudly."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                pending = [w for w in self.all if not w.ready.is_set()]
            if self.broken is not None:
                raise PoolBrokenError(self.broken)
            if self.preload_errors:
                raise ValueError("cannot preload in the workers: " + "; ".join(self.preload_errors))
            if not pending:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PoolBrokenError(f"execpool workers did not start within {timeout} s")
            pending[0].ready.wait(min(remaining, 0.1))

    def assign(self, handle: JobHandle, deadline: Optional[float],
               worker: Optional[WorkerProcess] = None) -> WorkerProcess:
        """The least-loaded worker -- or ``worker``, a session's that a copy
        of it must share -- now running ``handle``'s job."""
        with self.lock:
            if self.closed:
                raise PoolClosedError("this ExecPool is closed")
            if worker is not None:
                if worker not in self.all:
                    raise PoolBrokenError(f"worker process {worker.pid} is gone")
            else:
                worker = self._least_loaded()
            handle.worker = worker
            handle.deadline = deadline
            worker.jobs[handle.job_id] = handle
            self.running_jobs += 1
            self._on_job()
            worker.started += 1
            # A session's fork goes to its parent's worker, retiring or not:
            # that worker is replaced once, not once per fork.
            if worker.started >= self.config.max_jobs_per_worker and not worker.retiring:
                worker.retiring = True
                self.all.append(self._spawn())
        return worker

    def _least_loaded(self) -> WorkerProcess:
        """(Under the lock.)"""
        candidates = [w for w in self.all if not w.retiring]
        if not candidates:
            raise PoolBrokenError(self.broken or "execpool has no worker to run this job right now: every "
                                  "worker died and none could be started again yet")
        return min(candidates, key=lambda w: len(w.jobs) + len(w.workspaces))

    def hold_workspace(self, ident: int) -> WorkerProcess:
        """The least-loaded worker, now holding workspace ``ident``."""
        with self.lock:
            if self.closed:
                raise PoolClosedError("this ExecPool is closed")
            worker = self._least_loaded()
            worker.workspaces.add(ident)
            return worker

    def let_go_workspace(self, worker: WorkerProcess, ident: int) -> None:
        """The workspace is closed: a retiring worker with nothing left goes."""
        with self.lock:
            worker.workspaces.discard(ident)
            retire = worker.retiring and not worker.jobs and not worker.workspaces and worker in self.all
        worker.send(worker_wire.CloseWorkspace(ident))
        if retire:
            worker.send(worker_wire.Shutdown())

    def finished(self, worker: WorkerProcess, job_id: int) -> Optional[JobHandle]:
        """The job's handle, no longer running; None if the worker runs no
        such job. Shuts a retiring worker down once it has no job left."""
        with self.lock:
            handle = worker.jobs.pop(job_id, None)
            if handle is not None:
                worker.pgids.pop(job_id, None)
                self.running_jobs -= 1
            retire = worker.retiring and not worker.jobs and not worker.workspaces
        if retire:
            worker.send(worker_wire.Shutdown())
        return handle

    def ready(self, worker: WorkerProcess, preload_errors: tuple) -> None:
        self.preload_errors = self.preload_errors or preload_errors
        worker.ready.set()
        self._startup_failures = 0

    def lost(self, worker: WorkerProcess) -> None:
        """The dispatcher saw the worker's channel end: from now on it is no
        one's to send jobs to or to listen to. Everything slow -- waiting for
        it, killing what it left, replacing it, failing its jobs -- happens on
        a cleanup thread."""
        with self.lock:
            if worker in self.all:
                self.all.remove(worker)
            lost, worker.jobs = worker.jobs, {}
            self.running_jobs -= len(lost)
            replace = not self.closed and not worker.retiring
            self._cleanups.add(worker)
            self._unstarted.append((worker, lost, replace))
        self.start_cleanups()

    @property
    def cleanups_waiting(self) -> bool:
        return bool(self._unstarted)

    def start_cleanups(self) -> None:
        """Start the cleanups not started yet, on the dispatcher's thread.
        A machine that refuses a thread now (a tenant holds every process
        slot) leaves them for the dispatcher's next period: its own thread
        must never end of it, or no job would be served again."""
        while self._unstarted:
            worker, lost, replace = self._unstarted[0]
            thread = threading.Thread(target=self._clean_up, args=(worker, lost, replace),
                                      name=f"execpool-cleanup-{worker.pid}", daemon=True)
            try:
                thread.start()
            except RuntimeError as exc:
                if not self._thread_refused:
                    self._thread_refused = True
                    logger.warning("execpool: cannot start a thread to clean up after worker %d now (%s); "
                                   "trying again", worker.pid, exc)
                return
            self._thread_refused = False
            self._unstarted.popleft()

    def close(self, timeout: float) -> None:
        """Shut every worker down: bounded by ``timeout`` for them to finish
        their trees, after which they are SIGKILLed."""
        with self.lock:
            self.closed = True
            workers = list(self.all)
        self._closing.set()
        for worker in workers:
            worker.send(worker_wire.Shutdown())
        for worker in workers:
            try:
                worker.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                worker.proc.kill()

    def join_cleanups(self, timeout: float) -> None:
        """After the dispatcher has stopped (no cleanup starts any more):
        wait for the running ones, then end the lifeline, which cleans up
        whatever is still left."""
        deadline = time.monotonic() + timeout
        while self._unstarted:  # no thread for them yet: done here
            self._clean_up(*self._unstarted.popleft())
        with self._cleaned:
            self._cleaned.wait_for(lambda: not self._cleanups, max(0.0, deadline - time.monotonic()))
            scratch, self._scratch = self._scratch, {}
        for token, directory in scratch.items():
            remove_tree(directory)
            self.lifeline.gone(token)
        self.lifeline.close(timeout)

    def scratch_dir(self) -> str:
        """A new directory (0700) of the pool's, removed by ``close`` --
        or, should the owner die first, by the lifeline, like a worker's."""
        token = secrets.token_hex(6)
        with self.lock:
            if self.closed:
                raise PoolClosedError("this ExecPool is closed")
            directory = tempfile.mkdtemp(prefix=f"execpool-{token}-scratch-")
            self.lifeline.worker(token, None, directory)
            self._scratch[token] = directory
        return directory

    # -- one worker's life ------------------------------------------------

    def _process_env(self) -> dict:
        """The whole environment of a worker or the lifeline: enough to run
        Python and find this package, none of the caller's secrets; and the
        glibc tunables the jobs are given, which their warm template must
        start with too (execpool/worker/warm/supply.py)."""
        kept = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "GLIBC_TUNABLES")
        env = {k: v for k, v in self.config.tool_env.items() if k in kept}
        env["PYTHONPATH"] = PACKAGE_PARENT
        return env

    def _spawn(self) -> WorkerProcess:
        """Called with the lock held."""
        config = self.config
        token = secrets.token_hex(6)
        # The worker makes each job's private directory in here; whatever a
        # dead worker left behind goes with it (see _release).
        jobs_dir = tempfile.mkdtemp(prefix=f"execpool-{token}-")
        group = cgroups.WorkerGroup.create(token) if config.cgroups else None
        self.lifeline.worker(token, None if group is None else group.path, jobs_dir)
        to_worker_r, to_worker_w = worker_wire.pipe()
        from_worker_r, from_worker_w = worker_wire.pipe()
        try:
            # The lifeline starts it, so that it is the worker's parent and
            # gets what escapes from the worker's jobs should the worker die.
            proc = self.lifeline.spawn(token, to_worker_r, from_worker_w)
        except BaseException:
            os.close(to_worker_w)
            os.close(from_worker_r)
            if group is not None:
                group.remove()
            remove_tree(jobs_dir)
            self.lifeline.gone(token)
            raise
        finally:
            os.close(to_worker_r)
            os.close(from_worker_w)
        # Now, before it is sent any job: the worker forks nothing until its
        # first one, so every process of every job is born in the group, at
        # the pool's niceness.
        if config.niceness is not None:
            try:
                os.setpriority(os.PRIO_PROCESS, proc.pid, config.niceness)
            except OSError as exc:
                logger.warning("execpool: cannot set worker %d's niceness to %d (%s); its tools run at %d",
                               proc.pid, config.niceness, exc.strerror, os.getpriority(os.PRIO_PROCESS, 0))
        if group is not None and not group.add(proc.pid):
            logger.warning("execpool: cannot move worker %d into its cgroup %s; it runs without one",
                           proc.pid, group.path)
            group.remove()
            group = None
        worker = WorkerProcess(proc, Connection(to_worker_w, readable=False),
                               Connection(from_worker_r, writable=False), token, jobs_dir, group)
        worker.send(worker_wire.WorkerConfig(
            token=token, spawn_method=config.spawn_method, preload=config.preload,
            warm_ipython=config.warm_ipython, cgroups=config.cgroups,
            jobs_dir=jobs_dir, warm_spares=config.warm_spares, python=config.python or sys.executable,
        ))
        self._on_change()
        return worker

    def _clean_up(self, worker: WorkerProcess, lost: dict[int, JobHandle], replace: bool) -> None:
        """Whatever goes wrong here, the dead worker's jobs get their INFRA
        Results: a future left pending would hang its caller for good. The
        successor is started before they get them (a caller that submits
        again at once finds it), unless the machine cannot start one yet:
        then after, trying again until it can. Its directory is removed
        after them: a job that filled it must not make its neighbours wait
        for their Results."""
        code = None
        successor_due = replace
        released: Optional[bool] = None  # whether its group is gone, once what it left running is
        try:
            try:
                code = worker.proc.wait(EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                code = worker.proc.wait()
            # Before the successor: what the dead worker's jobs left running
            # may hold the very descriptors or memory a new worker needs.
            # What they left on disk holds neither, and may be a job's
            # hundred thousand directories: removed once the Results are out.
            released = self._release(worker, bool(lost))
            successor_due = replace and self._may_replace(worker) and not self._start_successor(None)
        except Exception as exc:
            logger.error("execpool: cleaning up after worker %d failed", worker.pid, exc_info=exc)
        finally:
            if worker.fault is not None:
                cause = f"it broke the channel protocol ({worker.fault}) and was killed"
            else:
                cause = "the pool was closed" if self.closed else "it died unexpectedly"
            error = (f"worker process {worker.pid} running this job exited with {describe_exit(code)}: "
                     f"{cause}; its process tree was killed")
            for handle in lost.values():
                handle.finish(Result(status=Status.INFRA, error=error, worker_pid=worker.pid,
                                     worker_exit_code=code))
            if released is not None:
                if not self._hand_over(worker.jobs_dir):
                    remove_tree(worker.jobs_dir)
                if released:
                    self.lifeline.gone(worker.token)
            worker.close()
            if successor_due:
                self._keep_trying_successor()
            with self._cleaned:
                self._cleanups.discard(worker)
                self._cleaned.notify_all()

    def _hand_over(self, jobs_dir: str) -> bool:
        """Move a dead worker's directory into a live worker's trash, for
        that worker's remover to delete: one rename here. What a job left
        there -- a flood of directories -- would otherwise be removed by a
        thread of this process, the caller's server. False where no live
        worker takes it (the pool is closing): the caller removes it."""
        with self.lock:
            heirs = [] if self.closed else list(self.all)
        deadline = time.monotonic() + HAND_OVER_WAIT_S
        for heir in heirs:
            # A worker makes its trash as it starts: wait for a successor
            # that is starting, unless the pool closes meanwhile.
            while not heir.ready.wait(0.05):
                if self._closing.is_set() or time.monotonic() > deadline:
                    return False
            try:
                os.rename(jobs_dir, os.path.join(heir.jobs_dir, TRASH, os.path.basename(jobs_dir)))
                return True
            except OSError:
                continue
        return False

    def _may_replace(self, worker: WorkerProcess) -> bool:
        """Only a worker that dies before it is ready, again and again,
        means the pool is broken: then it is not replaced."""
        with self.lock:
            if not worker.ready.is_set():
                self._startup_failures += 1
                if self._startup_failures >= MAX_STARTUP_FAILURES:
                    self.broken = (f"execpool workers cannot start: {sys.executable} -m execpool.worker "
                                   f"exited with {describe_exit(worker.proc.poll())} before it was ready")
                    return False
        return True

    def _start_successor(self, retry_in: Optional[float]) -> bool:
        """One try; False when the machine cannot start a worker right now
        (no descriptors, memory or process slots -- a job can take them all
        for a while)."""
        with self.lock:
            if self.closed:
                return True
            try:
                self.all.append(self._spawn())
            except OSError as exc:
                logger.error("execpool: cannot start a replacement worker%s: %s",
                             "" if retry_in is None else f" (trying again in {retry_in:g} s)", exc)
                return False
        self._stats.worker_restarted()
        return True

    def _keep_trying_successor(self) -> None:
        """Until a successor starts or the pool closes: a pool whose last
        worker died must not stay without one."""
        backoff = RESPAWN_BACKOFF_S
        while not self._closing.wait(backoff):
            if self._start_successor(min(2 * backoff, RESPAWN_BACKOFF_MAX_S)):
                return
            backoff = min(2 * backoff, RESPAWN_BACKOFF_MAX_S)

    def _release(self, worker: WorkerProcess, had_jobs: bool) -> bool:
        """Whatever an exited worker's jobs left running, gone before their
        directory is: its cgroup killed whole (daemons that left their
        session and cleared their environment too), the process groups it
        reported and its marker swept, its per-job groups removed. Whether
        its group is gone: only then, and once its directory is, the
        lifeline is told the worker is gone -- until then it is the
        lifeline's to kill and remove, should this process die."""
        group = worker.group
        destroyed = group is None or group.destroy(GROUP_EMPTY_TIMEOUT_S)
        if group is not None and not destroyed:
            logger.warning("execpool: the cgroup %s of worker %d is not empty %s s after cgroup.kill",
                           group.path, worker.pid, GROUP_EMPTY_TIMEOUT_S)
        if had_jobs or worker.pgids:
            kill_tree(worker.pgids.values(), marker=worker.token)
        cgroups.remove_tree(cgroups.worker_bases(worker.token))
        return destroyed
