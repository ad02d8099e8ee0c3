"""The worker process: many tools at once, on one thread.

Runs as ``python -m execpool.worker READ_FD WRITE_FD``, started clean by the
supervisor (never forked from the caller), with its channel on the two
inherited descriptors and a scrubbed environment. The first message on the
channel is its ``WorkerConfig``. Jobs without a ``cwd`` get a private
directory in its ``jobs_dir``, which the supervisor made and removes when the
worker is gone.

One ``selectors`` loop waits on everything the worker owns:

- the control pipe (Start / Cancel / Shutdown from the supervisor, and a
  session's Cell / Interrupt / Fork; EOF means the process owning the pool
  is gone, so every tree is killed and the worker exits),
- a self-pipe fed by ``signal.set_wakeup_fd``: SIGCHLD reaps every child --
  tool leaders and, because the worker is a child subreaper, any daemon that
  escaped its group and was re-parented here -- so no zombie stays; what each
  reaped process used (``wait4``) is added to the cost of the job it belonged
  to, which its Result carries,
- one non-blocking output pipe per running tool (two for a job that keeps
  stderr apart; it ends at EOF on both),
- the warm template's socket, where the spares the worker asked for arrive,
  and the parked spares' sockets, readable only when a spare died
  (execpool/worker/warm/supply.py; execpool/worker/warm/handover.py: how a
  warm job is handed to a spare; execpool/worker/launch.py and spawn.py: how
  tools are started),
- each session's socket, where its runtime takes cells and answers them
  (execpool/worker/sessions/host.py: what a session has besides a job's
  life, its forks included),
- and a heap of deadlines (execpool/worker/timers.py), whose earliest is
  the select timeout.

There are no threads, so starting a tool from here is safe and cheap, and
killing is immediate: a Cancel is handled the moment it is read. The worker
holds every running job's code, environment and stdin, so no job's code
ever runs in a copy of its memory: a cold tool execs straight after its
vfork, and a warm job runs in a spare of a template that never held a job.
Output is read with ``os.read``, kept only as far as the Result needs
(execpool/worker/capture.py), and forwarded live only up to the stream's cap plus
one character (the producer-side cap: a flood never fills any pipe or queue
beyond it).
"""

from __future__ import annotations

import os
import secrets
import selectors
import signal
import time
from multiprocessing.connection import Connection
from typing import Dict, List, Optional, Set

from ..shared import worker_wire
from ..shared.kernel import linux
from ..tool.spare_wire import REHEARSE_WHEN_IDLE_S
from . import files
from .capture import READ_SIZE, Stream
from .jobdirs import JobDirs
from .launch import Launcher
from .owners import Tree
from .running_job import Ending, Phase, RunningJob
from .sessions.host import Sessions
from .spawn import give_back_memory, keep_own_peak_resettable
from .timers import Kind, Timers
from .warm.handover import Hooks, WarmJobs
from .warm.supply import preload_errors

#: What the supervisor may send once the worker is configured.
_JOB_MESSAGES = (worker_wire.Start, worker_wire.Cancel, worker_wire.Shutdown, worker_wire.Cell,
                 worker_wire.Interrupt, worker_wire.Fork, worker_wire.OpenWorkspace, worker_wire.CloseWorkspace)


#: Where no cgroup keeps a job's process cap, the worker counts the job's
#: processes this often and kills the job once it is over: a fork storm is
#: stopped, though it may pass the cap for up to one interval.
PROCESS_COUNT_INTERVAL_S = 0.02

#: A job that made the worker hold this many characters (its kept output,
#: its code and stdin) has the worker hand its freed heap back once the
#: Result is out (execpool/worker/spawn.py says why: the next tools' memory
#: figures). Smaller jobs leave nothing worth a trim.
TRIM_AFTER_CHARS = 4 << 20

#: A killed process that is not reaped by then (stuck in the kernel) no
#: longer holds up its job's Result -- nor is it in the Result's cost.
REAP_GRACE_S = 1.0


class Worker:
    """The loop and what it owns: the jobs by id and by output descriptor
    (one or two per job), the deadlines; its parts keep the rest -- whose
    each process is (``Tree``), how tools start (``Launcher``), the jobs'
    directories (``JobDirs``), warm jobs and their spares (``WarmJobs``),
    sessions' cells and forks (``Sessions``). The steps of a job's life
    (``new_job``, ``running``, ``end``, ``fail_start``...) are public to
    those parts, a session's copy being a job like any other."""

    def __init__(self, conn_in: Connection, conn_out: Connection, config: worker_wire.WorkerConfig) -> None:
        self.conn_in = conn_in
        self.conn_out = conn_out
        self.token = config.token
        self.preload = config.preload
        self.pid = os.getpid()
        self.sel: selectors.BaseSelector = selectors.DefaultSelector()
        self.jobs: Dict[int, RunningJob] = {}
        self.jobs_by_fd: Dict[int, RunningJob] = {}
        self.timers = Timers()
        self.dirs = JobDirs(config.jobs_dir)
        self.launcher = Launcher(config.token, config.spawn_method, config.cgroups, self.dirs, self._reap, self.sel)
        self.python = config.python
        self.warm = WarmJobs(self.sel, config.spawn_method, config.python, config.preload, config.warm_ipython,
                             config.warm_spares,
                             Hooks(started=self.running, failed=self.fail_start,
                                   stopping=lambda: self.stopping, idle_since=lambda: self.idle_since))
        self.tree = Tree(self.pid, self._helpers, self.warm.spares.made)
        self.idle_since: Optional[float] = time.monotonic()  # None while a job runs
        self.stopping = False
        self.sessions = Sessions(self)

    # -- the loop --------------------------------------------------------

    def serve(self) -> None:
        sig_r, sig_w = os.pipe()
        os.set_blocking(sig_r, False)
        os.set_blocking(sig_w, False)
        signal.set_wakeup_fd(sig_w, warn_on_full_buffer=False)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        self.sel.register(sig_r, selectors.EVENT_READ, self._on_signal)
        self.sel.register(self.conn_in.fileno(), selectors.EVENT_READ, self._on_control)
        self.send(worker_wire.Ready(self.pid, preload_errors(self.python, self.preload)))
        while not self.stopping:
            for key, _ in self.sel.select(self.timers.timeout()):
                key.data(key.fd)
                if self.stopping:
                    break
            self._fire_timers()
        self._shutdown()

    def _helpers(self) -> Set[int]:
        """The worker's children that belong to no job: the warm template,
        its spares, the preparer of sandboxed jobs' namespaces, the maker
        of their user namespaces, the remover of jobs' directories."""
        helpers = set(self.warm.spares.pids())
        helpers.update(pid for pid in (self.launcher.ahead.pid, self.launcher.namespaces.pid, self.dirs.remover) if pid)
        return helpers

    def _fire_timers(self) -> None:
        """Every deadline that came due (execpool/worker/timers.py says what
        each kind is). Entries of jobs that ended otherwise are stale."""
        for timer in self.timers.due():
            if timer.kind is Kind.REHEARSE:
                self.warm.rehearse_if_idle()
                continue
            job = self.jobs.get(timer.job_id)
            if job is None:
                continue
            if timer.kind in (Kind.CELL, Kind.IDLE):
                self.sessions.timer(job, timer.kind)
            elif timer.kind is Kind.REAP:
                if time.monotonic() >= job.killed_at + REAP_GRACE_S:
                    self._finish(job)
            elif job.ending is not None:
                continue
            elif timer.kind is Kind.TIMEOUT:
                self.end(job, Ending.TIMEOUT)
            elif self.tree.over_cap(job):
                job.error = f"the job went over its process limit ({job.start.limits.processes}) and was killed"
                self.end(job, Ending.LIMIT)
            else:
                self.timers.add(time.monotonic() + PROCESS_COUNT_INTERVAL_S, Kind.COUNT, timer.job_id)

    def send(self, msg: worker_wire.FromWorker) -> None:
        try:
            worker_wire.send(self.conn_out, msg)
        except OSError:
            self.stopping = True  # the owner is gone; nobody reads results

    # -- events ----------------------------------------------------------

    def _on_control(self, _fd: int) -> None:
        while not self.stopping:
            try:
                if not self.conn_in.poll():
                    return
                msg = worker_wire.recv(self.conn_in, accept=_JOB_MESSAGES)
            except (EOFError, OSError):
                self.stopping = True
                return
            if isinstance(msg, worker_wire.Start):
                self._start(msg)
            elif isinstance(msg, worker_wire.Cancel):
                job = self.jobs.get(msg.job_id)
                if job is not None and job.ending is None:
                    self.end(job, Ending.CANCEL)
            elif isinstance(msg, worker_wire.Shutdown):
                self.stopping = True
            elif isinstance(msg, worker_wire.Cell):
                self.sessions.cell(msg)
            elif isinstance(msg, worker_wire.Fork):
                self.sessions.fork(msg)
            elif isinstance(msg, worker_wire.Interrupt):
                self.sessions.cancel(msg.job_id)
            elif isinstance(msg, worker_wire.OpenWorkspace):
                self.launcher.workspaces.open(msg.workspace_id, msg.disk)
            elif isinstance(msg, worker_wire.CloseWorkspace):
                self.launcher.workspaces.close(msg.workspace_id)

    def _on_signal(self, fd: int) -> None:
        try:
            signums = os.read(fd, 4096)
        except BlockingIOError:
            signums = b""
        if signal.SIGTERM in signums:
            self.stopping = True
        self._reap()

    def _reap(self) -> None:
        """Reap every child that has exited and add what it used to its
        job's cost. Each is looked at before it is reaped (WNOWAIT), while
        its /proc stat still names its session and group. The jobs are
        settled after the last reap, so that a leader's orphans, re-parented
        here as it exited and reaped in the same round, are in its Result."""
        touched = []
        tree = self.tree
        ownerless = False
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                break
            if info is None:
                break
            pid = info.si_pid
            job = tree.leader(pid)
            owner = tree.owner(pid) if job is None else None
            try:
                _pid, status, usage = os.wait4(pid, 0)
            except ChildProcessError:
                continue
            if job is not None:
                if job.start.warm and not self.warm.took(job) and job.ending is None:
                    tree.forget_session(pid)  # what that spare used was not the job's either
                    self._close_output(job)
                    self.warm.requeue(job)  # its spare died parked, before it took the job
                    continue
                job.reaped(os.waitstatus_to_exitcode(status))
                job.cost.add(usage)
                touched.append(job)
            elif owner is not None:
                owner.cost.add(usage)
                owner.victims.discard(pid)
                touched.append(owner)
            elif not self.warm.spares.exited(pid):
                tree.remove_stale()  # the template, a spare, a stray, or a job's process reaped after its Result
                ownerless = True
        for job in touched:
            self._settle(job)
        if ownerless and not self.jobs:
            # What it had started is the worker's child now, and with no job
            # running it can be no job's: a stray that reached the worker
            # after the last job's end (its parent outlived the job) would
            # otherwise run until the next job ends.
            tree.sweep_strays()

    def _on_output(self, fd: int) -> None:
        job = self.jobs_by_fd.get(fd)
        if job is None:
            return  # an event from the same select batch as the Cancel that closed it
        self.read_output(job, fd)

    def read_output(self, job: RunningJob, fd: int, size: int = READ_SIZE) -> int:
        """One read of a job's output pipe: the bytes it took (0: none now,
        or the pipe ended)."""
        try:
            data = os.read(fd, size)
        except BlockingIOError:
            return 0
        except OSError:
            data = b""
        capture = job.pipes[fd]
        if data:
            self._consume(job, capture.stream, capture.feed(data))
            return len(data)
        self._consume(job, capture.stream, capture.finish())
        self._close_pipe(job, fd)
        if job.eof:
            self._settle(job)
        return 0

    def _consume(self, job: RunningJob, stream: Stream, text: str) -> None:
        """Forward live output only up to the stream's cap plus one
        character, counting both of a job's streams against it."""
        if text and job.live is not None and not job.live.capped:
            piece = job.live.take(text)
            if piece:
                self.send(worker_wire.Output(job.start.job_id, piece, stream))

    # -- a job's life ----------------------------------------------------

    def _start(self, start: worker_wire.Start) -> None:
        job = self.new_job(start)
        try:
            self.launcher.prepare(job)
            argv = self.launcher.argv(job)
            if start.warm:
                self.warm.add(job)
            else:
                self.running(job, *self.launcher.start(job, argv))
        except Exception as exc:  # noqa: BLE001 - any spawn failure is the job's Result
            self.fail_start(job, exc)
            return
        if start.timeout is not None:
            self.timers.add(job.started + start.timeout, Kind.TIMEOUT, start.job_id)
        if job.link is not None:
            self.sessions.begin(job)
        self.count_processes(job)
        if start.warm:
            self.warm.serve()

    def count_processes(self, job: RunningJob) -> None:
        """A process cap no cgroup holds is the worker's to count."""
        if job.start.limits.processes is not None and job.group is None:
            self.timers.add(time.monotonic(), Kind.COUNT, job.start.job_id)

    def new_job(self, start: worker_wire.Start) -> RunningJob:
        # The job sees its marker, and ids count up: without a part no job
        # can guess, one could mark its processes as a neighbour's -- to
        # get the neighbour killed over its process cap, or its own
        # processes kept alive and billed to the neighbour.
        job = RunningJob(start, f"{self.token}/{start.job_id}/{secrets.token_hex(8)}")
        self.jobs[start.job_id] = job
        self.idle_since = None
        return job

    def fail_start(self, job: RunningJob, exc: BaseException) -> None:
        job.failed_to_start(exc, infra=not isinstance(exc, files.FilesError))
        job.given_up()
        self._finish(job)

    def running(self, job: RunningJob, pid: int, readers: List[int]) -> None:
        """The tool ``pid`` runs the job; ``readers`` are its output pipes'
        read ends, one per Capture of the job, in the same order."""
        job.running(pid)
        self.tree.started(job, pid)
        for fd, capture in zip(readers, job.captures, strict=True):
            os.set_blocking(fd, False)
            job.pipes[fd] = capture
            self.jobs_by_fd[fd] = job
            self.sel.register(fd, selectors.EVENT_READ, self._on_output)
        self.send(worker_wire.Spawned(job.start.job_id, pid, pid))

    def _close_output(self, job: RunningJob) -> None:
        for fd in list(job.pipes):
            self._close_pipe(job, fd)

    def _close_pipe(self, job: RunningJob, fd: int) -> None:
        self.sel.unregister(fd)
        del self.jobs_by_fd[fd]
        del job.pipes[fd]
        os.close(fd)

    def end(self, job: RunningJob, ending: Ending) -> None:
        """Timeout, cancel, a limit: the one kill path, then wait for the reap."""
        job.ending = ending
        if job.phase is Phase.WAITING:  # a warm job still waiting for a spare
            self.warm.forget(job)
            job.given_up()
            self._finish(job)
            return
        job.killed_at = time.monotonic()
        self.timers.add(job.killed_at + REAP_GRACE_S, Kind.REAP, job.start.job_id)
        job.swept = True
        self.tree.kill(job)
        self._close_output(job)
        self._settle(job)

    def _settle(self, job: RunningJob) -> None:
        """Send the job's Result once its leader is reaped and its output
        closed -- and, unless it keeps background processes, once what it
        left running has been killed and reaped too, so that the Result
        counts it: a matter of a SIGCHLD or two, bounded by REAP_GRACE_S."""
        if job.phase is not Phase.REAPED or not (job.eof or job.ending):
            return
        if job.pid is not None and not job.start.keep_background:
            if not job.swept:
                job.swept = True
                job.killed_at = time.monotonic()
                self.tree.kill(job)
                if self.tree.left(job):
                    self.timers.add(job.killed_at + REAP_GRACE_S, Kind.REAP, job.start.job_id)
                    return
            elif self.tree.left(job) and time.monotonic() < job.killed_at + REAP_GRACE_S:
                return
        self._finish(job)

    def _finish(self, job: RunningJob) -> None:
        if job.start.job_id not in self.jobs:
            return
        del self.jobs[job.start.job_id]
        if not self.jobs:
            self.idle_since = time.monotonic()
            self.timers.add(self.idle_since + REHEARSE_WHEN_IDLE_S, Kind.REHEARSE)
        self._close_output(job)
        if job.ready_fd is not None:
            self.warm.took(job)
            self.warm.close_ready(job)
        keep = job.ending is None and job.start.keep_background
        if job.pid is not None and job.ending is None and not keep and not job.swept:
            self.tree.kill(job)
        job.finished()
        self.tree.finished(job, keep=keep and job.pid is not None)
        if job.group is not None:
            job.peak_memory = job.group.peak_memory()
            job.group_cpu = job.group.cpu_seconds()
            if job.group.oom_killed() and job.ending is None:
                job.error = f"the job went over its memory limit ({job.start.limits.memory} bytes) and was killed"
            if job.start.keep_background or not job.group.remove():
                self.tree.stale(job.group)  # removed once its last process is reaped
        if job.workdir >= 0 and job.start.fetch:
            job.fetched, job.left_out = files.fetch(job.workdir, job.start.fetch, skip=job.own_names())
        trashed = None
        tmp_trashed = None if job.sandbox_tmp is None else self.dirs.discard(job.sandbox_tmp)
        if job.tmpdir is not None:
            trashed = self.dirs.discard(job.tmpdir)  # the script in it too
        elif job.workdir >= 0 and job.in_shared_directory:  # given back as it was
            if job.script is not None:
                files.remove(job.workdir, job.script)
            if job.placed is not None:
                files.undo(job.workdir, job.placed)
        # Let go before the Result: a caller may unmount its directory as soon as it has it.
        job.close_workdir()
        self.sessions.ended(job)
        self.send(worker_wire.Finished(job.start.job_id, job.result()))
        # A warm job keeps its rulesets and view until now (a requeue needs
        # them), a job's own namespace made ahead is torn down here, not on
        # its way out; or the tool never started. Its space goes last, to
        # the remover: freeing what the job left in it is not the loop's.
        job.release()
        space = job.take_space()
        if space is not None:
            self.dirs.release([space.take()])
        if trashed is not None:
            self.dirs.collect(trashed, job.script)
        if tmp_trashed is not None:
            self.dirs.collect(tmp_trashed)
        if not self.jobs:
            self.tree.sweep_strays()  # after the Result: the tree it belongs to is dead already
        if not self.stopping:  # else its preparer is killed already, and no job is to come
            self.launcher.make_ahead()
        if job.held_chars() >= TRIM_AFTER_CHARS:
            for capture in job.captures:
                capture.release()
            give_back_memory()

    def _shutdown(self) -> None:
        """Everything below the worker dies first, then every job still
        running gets its Result (INFRA: the pool was closed under it). A job
        that had ended and was only waiting for its leftovers to be reaped
        keeps its own outcome."""
        self.tree.kill_all({job.pid for job in self.jobs.values() if job.pid is not None}, self.token,
                           spare=[self.dirs.remover] if self.dirs.remover else [])
        for job in list(self.jobs.values()):
            if job.start.job_id not in self.jobs:
                continue  # a copy whose fork its parent's end abandoned
            if job.ending is None and not job.swept:
                # execpool's doing, not the program's: INFRA, worth running again.
                job.ending = Ending.SHUTDOWN
                job.error = "the pool was closed while this job ran; its process tree was killed"
                job.infra = True
            job.given_up()
            self._finish(job)
        self.warm.close()
        self._reap()
        self.launcher.close()
        self.dirs.close()


def main(argv: List[str]) -> None:
    read_fd, write_fd = map(int, argv)
    for fd in (read_fd, write_fd):
        os.set_inheritable(fd, False)
    linux.prctl(linux.PR_SET_CHILD_SUBREAPER, 1)
    keep_own_peak_resettable()  # while /proc/self is still this process's own to open
    # Tools run as this user: without this, one could open /proc/<worker>/fd
    # and write into the channel. Exec makes each tool dumpable again.
    linux.prctl(linux.PR_SET_DUMPABLE, 0)
    conn_in = Connection(read_fd, writable=False)
    try:
        config = worker_wire.recv(conn_in, accept=(worker_wire.WorkerConfig,))
    except (EOFError, OSError):
        return  # the pool is gone (or garbled its channel) before it said what to do
    assert isinstance(config, worker_wire.WorkerConfig)
    Worker(conn_in, Connection(write_fd, readable=False), config).serve()

