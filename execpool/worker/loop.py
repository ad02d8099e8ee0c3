"""The worker process: many tools at once, on one thread.

Runs as ``python -m execpool.worker READ_FD WRITE_FD``, started clean by the
supervisor (never forked from the caller), with its channel on the two
inherited descriptors and a scrubbed environment. The first message on the
channel is its ``WorkerConfig``. Jobs without a ``cwd`` get a private
directory in its ``jobs_dir``, which the supervisor made and removes when the
worker is gone.

One ``selectors`` loop waits on everything the worker owns:

- the control pipe (Start / Cancel / Shutdown from the supervisor; EOF means
  the process owning the pool is gone, so every tree is killed and the worker
  exits),
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

import json
import os
import secrets
import selectors
import signal
import time
from multiprocessing.connection import Connection
from typing import Dict, List, Optional, Set

from ..shared import channel
from ..shared.cells import FORK_TIMEOUT_S
from ..shared.kernel import linux
from ..shared.output import LiveBudget
from .capture import Stream, waiting_bytes
from .job import Ending, Phase, RunningJob
from .jobdirs import JobDirs, unlink
from .launch import Launcher
from .sessions.family import copy_layer, mount_copy
from .sessions.fork import MOUNTED
from .sessions.link import (
    INTERRUPT_GRACE_S,
    MOUNT,
    STARTED,
    WORKER_REPLY_BYTES,
    ProtocolError,
    SessionLink,
    fork_answer,
)
from .spawn import give_back_memory, keep_own_peak_resettable, output_pipes
from .timers import Kind, Timers
from .tree import Tree
from .warm.handover import Hooks, WarmJobs
from .warm.supply import preload_errors
from .warm.wire import REHEARSE_WHEN_IDLE_S

#: What the supervisor may send once the worker is configured.
_JOB_MESSAGES = (channel.Start, channel.Cancel, channel.Shutdown, channel.Cell, channel.Interrupt, channel.Fork)


#: One read per wake-up; 64 KiB is a full default pipe buffer.
READ_SIZE = 1 << 16

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
    directories (``JobDirs``), warm jobs and their spares (``WarmJobs``)."""

    def __init__(self, conn_in: Connection, conn_out: Connection, config: channel.WorkerConfig) -> None:
        self.conn_in = conn_in
        self.conn_out = conn_out
        self.token = config.token
        self.preload = config.preload
        self.pid = os.getpid()
        self.sel = selectors.DefaultSelector()
        self.jobs: Dict[int, RunningJob] = {}
        self.jobs_by_fd: Dict[int, RunningJob] = {}
        self.sessions_by_fd: Dict[int, RunningJob] = {}
        self.timers = Timers()
        self.dirs = JobDirs(config.jobs_dir)
        self.launcher = Launcher(config.token, config.spawn_method, config.cgroups, self.dirs, self._reap)
        self.python = config.python
        self.warm = WarmJobs(self.sel, config.spawn_method, config.python, config.preload, config.warm_spares,
                             Hooks(started=self._running, failed=self._fail_start,
                                   stopping=lambda: self.stopping, idle_since=lambda: self.idle_since))
        self.tree = Tree(self.pid, self._helpers, self.warm.spares.made)
        self.idle_since: Optional[float] = time.monotonic()  # None while a job runs
        self.stopping = False

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
        self._send(channel.Ready(self.pid, preload_errors(self.python, self.preload)))
        while not self.stopping:
            for key, _ in self.sel.select(self.timers.timeout()):
                key.data(key.fd)
                if self.stopping:
                    break
            self._fire_timers()
        self._shutdown()

    def _helpers(self) -> Set[int]:
        """The worker's children that belong to no job: the warm template,
        its spares, the preparer of sandboxed jobs' namespaces, the remover
        of jobs' directories."""
        helpers = set(self.warm.spares.pids())
        helpers.update(pid for pid in (self.launcher.ahead.pid, self.dirs.remover) if pid)
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
                self._session_timer(job, timer.kind)
            elif timer.kind is Kind.REAP:
                if time.monotonic() >= job.killed_at + REAP_GRACE_S:
                    self._finish(job)
            elif job.ending is not None:
                continue
            elif timer.kind is Kind.TIMEOUT:
                self._end(job, Ending.TIMEOUT)
            elif self.tree.over_cap(job):
                job.error = f"the job went over its process limit ({job.start.limits.processes}) and was killed"
                self._end(job, Ending.LIMIT)
            else:
                self.timers.add(time.monotonic() + PROCESS_COUNT_INTERVAL_S, Kind.COUNT, timer.job_id)

    def _send(self, msg: channel.FromWorker) -> None:
        try:
            channel.send(self.conn_out, msg)
        except OSError:
            self.stopping = True  # the owner is gone; nobody reads results

    # -- events ----------------------------------------------------------

    def _on_control(self, _fd: int) -> None:
        while not self.stopping:
            try:
                if not self.conn_in.poll():
                    return
                msg = channel.recv(self.conn_in, accept=_JOB_MESSAGES)
            except (EOFError, OSError):
                self.stopping = True
                return
            if isinstance(msg, channel.Start):
                self._start(msg)
            elif isinstance(msg, channel.Cancel):
                job = self.jobs.get(msg.job_id)
                if job is not None and job.ending is None:
                    self._end(job, Ending.CANCEL)
            elif isinstance(msg, channel.Shutdown):
                self.stopping = True
            elif isinstance(msg, channel.Cell):
                self._cell(msg)
            elif isinstance(msg, channel.Fork):
                self._fork(msg)
            elif isinstance(msg, channel.Interrupt):
                job = self.jobs.get(msg.job_id)
                if job is not None and job.link is not None and job.link.running and job.ending is None:
                    job.link.cancelled = True
                    self._interrupt(job)

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
        self._read_output(job, fd)

    def _read_output(self, job: RunningJob, fd: int, size: int = READ_SIZE) -> int:
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
                self._send(channel.Output(job.start.job_id, piece, stream))

    # -- a session's cells ---------------------------------------------

    def _cell(self, msg: channel.Cell) -> None:
        """Send a cell down to its session's runtime. The pool sends one at
        a time, and none to a session that ended: anything else is dropped."""
        job = self.jobs.get(msg.job_id)
        link = None if job is None else job.link
        if job is None or link is None or link.running or job.ending is not None:
            return
        if job.start.live_cap is not None:  # the live cap is the cell's
            job.live = LiveBudget(job.start.live_cap, slack=1)
        link.begin(msg.source, sum(capture.total for capture in job.captures))
        self._watch_session(job)
        if msg.timeout is not None:
            link.deadline = time.monotonic() + msg.timeout
            self.timers.add(link.deadline, Kind.CELL, msg.job_id)

    def _fork(self, msg: channel.Fork) -> None:
        """Copy a Python session, between its cells, into a new one
        (execpool/worker/sessions/fork.py). The copy's directory, cgroup,
        pipes and socket are made here, as for any tool, and its pipes and
        socket go down with the fork frame; ``_forked`` takes the copy the
        runtime names as the new job's tool, in its cgroup."""
        child = self._new_job(msg.child)
        parent = self.jobs.get(msg.job_id)
        link = None if parent is None else parent.link
        if parent is None or link is None or link.running or parent.ending is not None:
            self._fail_start(child, OSError("the session ended before it could be forked"))
            return  # its end answers its turn
        layer = -1
        spec: Dict[str, object]
        try:
            if parent.start.argv_kind != "python":
                raise OSError("only a Python session can be forked; a bash session cannot copy its shell")
            if parent.start.sandbox is None:
                self.launcher.prepare(child)
                copy = child.cwd != parent.cwd
                spec = {"marker": child.marker, "from": parent.cwd if copy else None, "to": child.cwd if copy else None}
            else:
                layer = self._prepare_confined_copy(parent, child)
                assert child.family is not None
                spec = {"marker": child.marker, "confine": {"paths": [target for _, target in child.family.trees],
                                                            "network": parent.start.network}}
            printed = sum(capture.total for capture in parent.captures)
            # A runtime not started yet (its spare is on the way) finds the
            # frame, descriptors and all, waiting on its socket.
            assert child.link is not None
            # No cgroup's file goes down: the worker moves the copy into its
            # group once it has it, and a writable cgroup.procs in the
            # session's hands would move any process into a group that dies.
            with output_pipes(True) as (readers, out_w, err_w):
                fds = [child.link.runtime_fd, out_w, err_w, *([layer] if layer >= 0 else [])]
                link.begin_fork(json.dumps(spec).encode("utf-8"), fds, printed)
        except ProtocolError as exc:
            self._fail_start(child, exc)
            self._broke_protocol(parent, exc)
            return
        except Exception as exc:  # noqa: BLE001 - the copy's start failed: its Result says why
            self._fail_start(child, exc)
            self._send(channel.CellDone(msg.job_id, json.dumps({"error": str(exc)}).encode("utf-8"), False, 0))
            return
        finally:
            if layer >= 0:
                os.close(layer)  # the runtime's copy went down with the frame
        assert child.link is not None
        child.link.theirs.close()  # the runtime's copy went down with the frame
        link.forking = (child.start.job_id, readers)
        link.deadline = time.monotonic() + FORK_TIMEOUT_S
        self.timers.add(link.deadline, Kind.CELL, msg.job_id)
        self._watch_session(parent)

    def _prepare_confined_copy(self, parent: RunningJob, child: RunningJob) -> int:
        """A sandboxed session's copy takes its family's next spare
        (execpool/worker/sessions/family.py) as its directory; the Landlock
        layer it will enter, for the fork frame."""
        family = parent.family
        if family is None:
            raise OSError("this sandboxed session cannot be forked: only one with the sandbox's view and no "
                          "Sandbox(write=...) paths can give a copy directories of its own")
        spare = family.take()
        child.family = family
        self.launcher.prepare_copy(child, spare)
        confiner = self.launcher.confiner()
        return copy_layer(confiner.handled, confiner.scoped, spare, family)

    def _mount_copy(self, parent: RunningJob, said: bytes) -> None:
        """A sandboxed session's copy, in namespaces of its own, waits for
        its trees: mounted by a helper, then the copy is told. A pid that
        is not the copy ends the session that named it."""
        assert parent.link is not None and parent.link.forking is not None and parent.pid is not None
        child = self.jobs.get(parent.link.forking[0])
        pid = int(said) if said.isdigit() else 0
        if child is None or child.link is None or child.tmpdir is None:
            return  # the copy's job is gone: its parent's answer says so
        if not pid or not self.tree.is_copy(pid, child):
            self._broke_protocol(parent, ProtocolError("the session named a process that is not its copy"))
            return
        assert child.family is not None
        given = parent.user_ns if parent.user_ns >= 0 else child.family.user_ns
        try:
            # The namespaces a cell may have moved its interpreter to are
            # not the ones to clone and map in: the fork is refused then.
            if _user_ns(f"/proc/{parent.pid}") != _user_ns("/proc/self" if given < 0 else given):
                raise OSError("the session left the user namespace it was started in")
            copy_user = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
            try:
                mount_copy(pid, child.tmpdir, child.family.trees, given)
                child.link.sock.send(MOUNTED)
            except BaseException:
                os.close(copy_user)
                raise
            child.user_ns = copy_user
        except (OSError, ValueError) as exc:  # ValueError: a view's bounds (the session's own view keeps within)
            child.error = f"the copy could not have directories of its own: {exc}"
            os.kill(pid, signal.SIGKILL)  # its parent then answers that it died, and _forked says why

    def _forked(self, parent: RunningJob, answer: bytes) -> bytes:
        """The runtime answered a fork: the copy it names, if it is the
        worker's child, runs the new job; the reply for the pool."""
        assert parent.link is not None and parent.link.forking is not None
        child_id, readers = parent.link.forking
        child = self.jobs.get(child_id)
        pid, why = fork_answer(answer)
        if child is not None and child.error is not None:
            pid, why = None, child.error  # a sandboxed copy that could not have its directories
        if child is not None and child.family is not None and pid is not None and child.user_ns < 0:
            # A sandboxed copy never runs on its parent's directories (its
            # process, nobody's now, goes as a stray).
            pid, why = None, "the session's copy never had directories of its own"
        if child is not None and pid is not None and self.tree.is_copy(pid, child) and child.group is not None:
            try:
                child.group.add(pid)
            except OSError as exc:
                pid, why = None, f"the session's copy could not join its cgroup: {exc}"
        elif child is not None and pid is not None and not self.tree.is_copy(pid, child):
            pid, why = None, "the process the session named is not its copy"
        if child is None or pid is None:
            for fd in readers:
                os.close(fd)
            if child is not None:
                self._fail_start(child, OSError(why))
                self.tree.kill_marked(child.marker)  # a copy its parent made all the same, then denied
            return json.dumps({"error": why}).encode("utf-8")
        self._running(child, pid, readers)
        self._session_begins(child)
        self._count_processes(child)
        if child.family is not None and child.start.cwd is not None:  # a sandboxed copy's: not the one asked for
            return json.dumps({"pid": pid, "directory": child.cwd}).encode("utf-8")
        return json.dumps({"pid": pid}).encode("utf-8")

    def _abandon_fork(self, parent: RunningJob) -> None:
        """A session that ends while it forks takes its copy's job with it,
        and the copy if it was made."""
        if parent.link is None or parent.link.forking is None:
            return
        child_id, readers = parent.link.forking
        parent.link.forking = None
        for fd in readers:
            os.close(fd)
        child = self.jobs.get(child_id)
        if child is not None:
            self._fail_start(child, OSError("the session ended while it forked"))
            self.tree.kill_marked(child.marker)

    def _session_begins(self, job: RunningJob) -> None:
        self._watch_session(job)
        if job.start.idle_timeout is not None:
            self.timers.add(time.monotonic() + job.start.idle_timeout, Kind.IDLE, job.start.job_id)

    def _watch_session(self, job: RunningJob) -> None:
        assert job.link is not None
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if job.link.wants_write else 0)
        fd = job.link.sock.fileno()
        if fd in self.sessions_by_fd:
            self.sel.modify(fd, events, self._on_session)
        else:
            self.sessions_by_fd[fd] = job
            self.sel.register(fd, events, self._on_session)

    def _on_session(self, fd: int) -> None:
        """The session's socket: the rest of a cell goes down as it drains,
        each reply goes up as a CellDone -- after every byte the cell wrote
        before it (the runtime flushed before replying, so what it wrote is
        in the pipes by now)."""
        job = self.sessions_by_fd.get(fd)
        if job is None:
            return
        link = job.link
        assert link is not None
        try:
            link.send_pending()
            said, closed = link.read()
        except ProtocolError as exc:
            self._broke_protocol(job, exc)
            return
        except OSError:
            said, closed = [], True
        for what, answer in said:
            if what == STARTED:
                if link.interrupted:
                    self._signal_cell(job)  # the interrupt that waited for the cell's start
                continue
            if what == MOUNT:
                self._mount_copy(job, answer)
                if job.ending is not None:
                    return
                continue
            if link.forking is not None:
                answer = self._forked(job, answer)
            if link.cancelled:
                self.tree.kill_cell(job, link.began)  # what it started in its last moments
            self._drain_output(job)
            printed = sum(capture.total for capture in job.captures) - link.printed_before
            self._send(channel.CellDone(job.start.job_id, answer, link.interrupted, printed))
            link.done()
            if job.start.idle_timeout is not None:
                self.timers.add(link.idle_since + job.start.idle_timeout, Kind.IDLE, job.start.job_id)
        if link.violation is not None:
            self._broke_protocol(job, link.violation)
            return
        if closed:
            self._unwatch_session(job)  # the runtime is going: its job ends when it is reaped
        else:
            self._watch_session(job)
        if SessionLink.buffered > WORKER_REPLY_BYTES:
            self._shed_replies()

    def _broke_protocol(self, job: RunningJob, exc: ProtocolError) -> None:
        job.error = f"{exc}; it was killed"
        self._end(job, Ending.LIMIT)

    def _shed_replies(self) -> None:
        """The sessions' unfinished replies are over the worker's budget:
        the sessions holding the most of them end, largest first, until
        they are not -- a session is never ended for another's bytes."""
        holders = sorted((job for job in self.sessions_by_fd.values() if job.link is not None and job.link.held),
                         key=lambda job: job.link.held if job.link is not None else 0, reverse=True)
        for job in holders:
            if SessionLink.buffered <= WORKER_REPLY_BYTES:
                return
            assert job.link is not None
            held = job.link.held
            job.link.drop_reply()
            job.error = (f"its unfinished reply ({held >> 20} MiB) was the largest when this worker's sessions "
                         f"held over {WORKER_REPLY_BYTES >> 20} MiB of them; it was killed")
            self._end(job, Ending.LIMIT)

    def _drain_output(self, job: RunningJob) -> None:
        """What a cell wrote before its reply, read now so that it goes out
        before the CellDone: as many bytes as each pipe holds at this
        moment, no more (a process the cell left may go on writing)."""
        for fd in list(job.pipes):
            waiting = waiting_bytes(fd)
            while waiting > 0 and fd in job.pipes:
                got = self._read_output(job, fd, min(READ_SIZE, waiting))
                if not got:
                    break
                waiting -= got

    def _unwatch_session(self, job: RunningJob) -> None:
        if job.link is not None and self.sessions_by_fd.pop(job.link.sock.fileno(), None) is not None:
            self.sel.unregister(job.link.sock.fileno())

    def _interrupt(self, job: RunningJob) -> None:
        """SIGINT to the session's group, which its runtime turns into the
        cell's end; if the cell is still running after the grace, the
        session is killed (``_session_timer``)."""
        link = job.link
        assert link is not None
        link.interrupted = True
        if link.started:
            self._signal_cell(job)
        if link.cancelled:  # a call's cancel kills what it started, as a job's does; a timeout keeps it
            self.tree.kill_cell(job, link.began)
        link.deadline = time.monotonic() + INTERRUPT_GRACE_S
        self.timers.add(link.deadline, Kind.CELL, job.start.job_id)

    def _signal_cell(self, job: RunningJob) -> None:
        if job.pid is None:
            return
        try:
            os.killpg(job.pid, signal.SIGINT)
        except OSError:
            pass  # the runtime is gone already: its reap ends the session

    def _session_timer(self, job: RunningJob, kind: Kind) -> None:
        link = job.link
        if link is None or job.ending is not None:
            return
        now = time.monotonic()
        if kind is Kind.IDLE:
            if not link.running and now >= link.idle_since + (job.start.idle_timeout or 0.0):
                self._end(job, Ending.TIMEOUT)
        elif link.running and link.deadline is not None and now >= link.deadline:
            if not link.interrupted:
                self._interrupt(job)
            else:
                self._end(job, Ending.CANCEL if link.cancelled else Ending.TIMEOUT)

    # -- a job's life ----------------------------------------------------

    def _start(self, start: channel.Start) -> None:
        job = self._new_job(start)
        try:
            self.launcher.prepare(job)
            argv = self.launcher.argv(job)
            if start.warm:
                self.warm.add(job)
            else:
                self._running(job, *self.launcher.start(job, argv))
        except Exception as exc:  # noqa: BLE001 - any spawn failure is the job's Result
            self._fail_start(job, exc)
            return
        if start.timeout is not None:
            self.timers.add(job.started + start.timeout, Kind.TIMEOUT, start.job_id)
        if job.link is not None:
            self._session_begins(job)
        self._count_processes(job)
        if start.warm:
            self.warm.serve()

    def _count_processes(self, job: RunningJob) -> None:
        """A process cap no cgroup holds is the worker's to count."""
        if job.start.limits.processes is not None and job.group is None:
            self.timers.add(time.monotonic(), Kind.COUNT, job.start.job_id)

    def _new_job(self, start: channel.Start) -> RunningJob:
        # The job sees its marker, and ids count up: without a part no job
        # can guess, one could mark its processes as a neighbour's -- to
        # get the neighbour killed over its process cap, or its own
        # processes kept alive and billed to the neighbour.
        job = RunningJob(start, f"{self.token}/{start.job_id}/{secrets.token_hex(8)}")
        self.jobs[start.job_id] = job
        self.idle_since = None
        return job

    def _fail_start(self, job: RunningJob, exc: BaseException) -> None:
        job.failed_to_start(exc)
        job.given_up()
        self._finish(job)

    def _running(self, job: RunningJob, pid: int, readers: List[int]) -> None:
        """The tool ``pid`` runs the job; ``readers`` are its output pipes'
        read ends, one per Capture of the job, in the same order."""
        job.running(pid)
        self.tree.started(job, pid)
        for fd, capture in zip(readers, job.captures, strict=True):
            os.set_blocking(fd, False)
            job.pipes[fd] = capture
            self.jobs_by_fd[fd] = job
            self.sel.register(fd, selectors.EVENT_READ, self._on_output)
        self._send(channel.Spawned(job.start.job_id, pid, pid))

    def _close_output(self, job: RunningJob) -> None:
        for fd in list(job.pipes):
            self._close_pipe(job, fd)

    def _close_pipe(self, job: RunningJob, fd: int) -> None:
        self.sel.unregister(fd)
        del self.jobs_by_fd[fd]
        del job.pipes[fd]
        os.close(fd)

    def _end(self, job: RunningJob, ending: Ending) -> None:
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
        trashed = None
        tmp_trashed = None if job.sandbox_tmp is None else self.dirs.discard(job.sandbox_tmp)
        if job.family is not None and self.launcher.spares is not None:
            self.launcher.spares.remove(job.family.left())
        if job.tmpdir is not None:
            trashed = self.dirs.discard(job.tmpdir)  # the script in it too
        elif job.script is not None:
            unlink(job.script)
        self._unwatch_session(job)
        self._abandon_fork(job)
        self._send(channel.Finished(job.start.job_id, job.result()))
        # A warm job keeps its rulesets and view until now (a requeue needs
        # them), a job's own namespace made ahead is torn down here, not on
        # its way out; or the tool never started.
        job.release()
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
        config = channel.recv(conn_in, accept=(channel.WorkerConfig,))
    except (EOFError, OSError):
        return  # the pool is gone (or garbled its channel) before it said what to do
    assert isinstance(config, channel.WorkerConfig)
    Worker(conn_in, Connection(write_fd, readable=False), config).serve()


def _user_ns(where: "str | int") -> int:
    """The inode of a user namespace: a process's (its /proc directory) or
    one held open."""
    return os.fstat(where).st_ino if isinstance(where, int) else os.stat(f"{where}/ns/user").st_ino
