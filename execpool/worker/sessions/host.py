"""The worker's sessions: their cells, interrupts and deadlines, and
their forks.

Runs in the worker process, on its loop (execpool/worker/event_loop.py), which
owns every job's life -- a session's too: its tool, output pipes, tree and
Result. This is what a session has besides: the socket its runtime takes
cells on (link.py), the cell running now and its deadline, and a Python
session's forks (fork.py: the copy's side; family.py: a sandboxed copy's
directories), whose copy the loop then runs as a job of its own.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import time
from typing import TYPE_CHECKING, Dict, List, Protocol

from ...shared import worker_wire
from ...shared.cells import FORK_TIMEOUT_S
from ...shared.output import LiveBudget
from ...tool.session_fork import MOUNTED
from ..capture import READ_SIZE, waiting_bytes
from ..running_job import Ending, RunningJob
from ..spawn import output_pipes
from ..timers import Kind
from .family import copy_layer, mount_copy
from .link import INTERRUPT_GRACE_S, MOUNT, STARTED, WORKER_REPLY_BYTES, ProtocolError, SessionLink, fork_answer

if TYPE_CHECKING:
    from ..launch import Launcher
    from ..owners import Tree
    from ..timers import Timers


class Host(Protocol):
    """What of the worker's loop its sessions use: its jobs and parts, and
    the steps of a job's life, which are the loop's alone."""

    jobs: Dict[int, RunningJob]
    sel: selectors.BaseSelector
    timers: "Timers"
    tree: "Tree"
    launcher: "Launcher"

    def send(self, msg: worker_wire.FromWorker) -> None: ...

    def end(self, job: RunningJob, ending: Ending) -> None: ...

    def fail_start(self, job: RunningJob, exc: BaseException) -> None: ...

    def new_job(self, start: worker_wire.Start) -> RunningJob: ...

    def running(self, job: RunningJob, pid: int, readers: List[int]) -> None: ...

    def count_processes(self, job: RunningJob) -> None: ...

    def read_output(self, job: RunningJob, fd: int, size: int = READ_SIZE) -> int: ...


class Sessions:
    """The worker's sessions, by their sockets' descriptors; the loop hands
    them its control messages and timers for sessions, and each job's end."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.jobs = host.jobs
        self.sel = host.sel
        self.timers = host.timers
        self.tree = host.tree
        self.launcher = host.launcher
        self.by_fd: Dict[int, RunningJob] = {}

    def cell(self, msg: worker_wire.Cell) -> None:
        """Send a cell down to its session's runtime. The pool sends one at
        a time, and none to a session that ended: anything else is dropped."""
        job = self.jobs.get(msg.job_id)
        link = None if job is None else job.link
        if job is None or link is None or link.running or job.ending is not None:
            return
        if job.start.live_cap is not None:  # the live cap is the cell's
            job.live = LiveBudget(job.start.live_cap, slack=1)
        link.begin(msg.source, sum(capture.total for capture in job.captures))
        self._watch(job)
        if msg.timeout is not None:
            link.deadline = time.monotonic() + msg.timeout
            self.timers.add(link.deadline, Kind.CELL, msg.job_id)

    def fork(self, msg: worker_wire.Fork) -> None:
        """Copy a Python session, between its cells, into a new one
        (execpool/tool/session_fork.py). The copy's directory, cgroup,
        pipes and socket are made here, as for any tool, and its pipes and
        socket go down with the fork frame; ``_forked`` takes the copy the
        runtime names as the new job's tool, in its cgroup."""
        child = self.host.new_job(msg.child)
        parent = self.jobs.get(msg.job_id)
        link = None if parent is None else parent.link
        if parent is None or link is None or link.running or parent.ending is not None:
            self.host.fail_start(child, OSError("the session ended before it could be forked"))
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
            self.host.fail_start(child, exc)
            self._broke_protocol(parent, exc)
            return
        except Exception as exc:  # noqa: BLE001 - the copy's start failed: its Result says why
            self.host.fail_start(child, exc)
            self.host.send(worker_wire.CellDone(msg.job_id, json.dumps({"error": str(exc)}).encode("utf-8"), False, 0))
            return
        finally:
            if layer >= 0:
                os.close(layer)  # the runtime's copy went down with the frame
        assert child.link is not None
        child.link.theirs.close()  # the runtime's copy went down with the frame
        link.forking = (child.start.job_id, readers)
        link.deadline = time.monotonic() + FORK_TIMEOUT_S
        self.timers.add(link.deadline, Kind.CELL, msg.job_id)
        self._watch(parent)

    def _prepare_confined_copy(self, parent: RunningJob, child: RunningJob) -> int:
        """A sandboxed session's copy takes its family's next spare
        (execpool/worker/sessions/family.py) as its space; the Landlock
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
        if child is None or child.link is None or child.space is None:
            return  # the copy's job is gone: its parent's answer says so
        if not pid or not self.tree.is_copy(pid, child):
            self._broke_protocol(parent, ProtocolError("the session named a process that is not its copy"))
            return
        assert child.family is not None
        given = parent.user_ns  # the session's own (execpool/worker/userns.py): its copy's is made beneath it
        try:
            # The namespaces a cell may have moved its interpreter to are
            # not the ones to clone and map in: the fork is refused then.
            if _user_ns(f"/proc/{parent.pid}") != _user_ns(given):
                raise OSError("the session left the user namespace it was started in")
            copy_user = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
            try:
                mount_copy(pid, child.space, child.family.trees, given)
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
        if child is not None and pid is not None and not self.tree.is_copy(pid, child):
            pid, why = None, "the process the session named is not its copy"
        if child is not None and pid is not None and child.group is not None:
            try:
                child.group.add(pid)
            except OSError as exc:
                pid, why = None, f"the session's copy could not join its cgroup: {exc}"
        if child is None or pid is None:
            for fd in readers:
                os.close(fd)
            if child is not None:
                self.host.fail_start(child, OSError(why))
                self.tree.kill_marked(child.marker)  # a copy its parent made all the same, then denied
            return json.dumps({"error": why}).encode("utf-8")
        self.host.running(child, pid, readers)
        self.begin(child)
        self.host.count_processes(child)
        return json.dumps({"pid": pid}).encode("utf-8")

    def ended(self, job: RunningJob) -> None:
        """A job is finishing (its Result goes next): a session's socket is
        no longer watched, a fork it was making is abandoned, and its
        family's unused spares go with the family's last member."""
        self._unwatch(job)
        self._abandon_fork(job)
        if job.family is not None and self.launcher.spares is not None:
            self.launcher.spares.remove(job.family.left())

    def cancel(self, job_id: int) -> None:
        """The caller interrupts a session's running cell (a cancel: what
        the cell started dies with it)."""
        job = self.jobs.get(job_id)
        if job is not None and job.link is not None and job.link.running and job.ending is None:
            job.link.cancelled = True
            self._interrupt(job)

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
            self.host.fail_start(child, OSError("the session ended while it forked"))
            self.tree.kill_marked(child.marker)

    def begin(self, job: RunningJob) -> None:
        self._watch(job)
        if job.start.idle_timeout is not None:
            self.timers.add(time.monotonic() + job.start.idle_timeout, Kind.IDLE, job.start.job_id)

    def _watch(self, job: RunningJob) -> None:
        assert job.link is not None
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if job.link.wants_write else 0)
        fd = job.link.sock.fileno()
        if fd in self.by_fd:
            self.sel.modify(fd, events, self._on_session)
        else:
            self.by_fd[fd] = job
            self.sel.register(fd, events, self._on_session)

    def _on_session(self, fd: int) -> None:
        """The session's socket: the rest of a cell goes down as it drains,
        each reply goes up as a CellDone -- after every byte the cell wrote
        before it (the runtime flushed before replying, so what it wrote is
        in the pipes by now). Nothing a session says once it is being
        killed goes on: its Result ends its cell (a reply its runtime sent
        just before the kill once answered a fork the worker had refused)."""
        job = self.by_fd.get(fd)
        if job is None:
            return
        if job.ending is not None:
            self._unwatch(job)
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
            self.host.send(worker_wire.CellDone(job.start.job_id, answer, link.interrupted, printed))
            link.done()
            if job.start.idle_timeout is not None:
                self.timers.add(link.idle_since + job.start.idle_timeout, Kind.IDLE, job.start.job_id)
        if link.violation is not None:
            self._broke_protocol(job, link.violation)
            return
        if closed:
            self._unwatch(job)  # the runtime is going: its job ends when it is reaped
        else:
            self._watch(job)
        if SessionLink.buffered > WORKER_REPLY_BYTES:
            self._shed_replies()

    def _broke_protocol(self, job: RunningJob, exc: ProtocolError) -> None:
        job.error = f"{exc}; it was killed"
        self.host.end(job, Ending.LIMIT)

    def _shed_replies(self) -> None:
        """The sessions' unfinished replies are over the worker's budget:
        the sessions holding the most of them end, largest first, until
        they are not -- a session is never ended for another's bytes."""
        holders = sorted((job for job in self.by_fd.values() if job.link is not None and job.link.held),
                         key=lambda job: job.link.held if job.link is not None else 0, reverse=True)
        for job in holders:
            if SessionLink.buffered <= WORKER_REPLY_BYTES:
                return
            assert job.link is not None
            held = job.link.held
            job.link.drop_reply()
            job.error = (f"its unfinished reply ({held >> 20} MiB) was the largest when this worker's sessions "
                         f"held over {WORKER_REPLY_BYTES >> 20} MiB of them; it was killed")
            self.host.end(job, Ending.LIMIT)

    def _drain_output(self, job: RunningJob) -> None:
        """What a cell wrote before its reply, read now so that it goes out
        before the CellDone: as many bytes as each pipe holds at this
        moment, no more (a process the cell left may go on writing)."""
        for fd in list(job.pipes):
            waiting = waiting_bytes(fd)
            while waiting > 0 and fd in job.pipes:
                got = self.host.read_output(job, fd, min(READ_SIZE, waiting))
                if not got:
                    break
                waiting -= got

    def _unwatch(self, job: RunningJob) -> None:
        if job.link is not None and self.by_fd.pop(job.link.sock.fileno(), None) is not None:
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

    def timer(self, job: RunningJob, kind: Kind) -> None:
        link = job.link
        if link is None or job.ending is not None:
            return
        now = time.monotonic()
        if kind is Kind.IDLE:
            if not link.running and now >= link.idle_since + (job.start.idle_timeout or 0.0):
                self.host.end(job, Ending.TIMEOUT)
        elif link.running and link.deadline is not None and now >= link.deadline:
            if not link.interrupted:
                self._interrupt(job)
            else:
                self.host.end(job, Ending.CANCEL if link.cancelled else Ending.TIMEOUT)



def _user_ns(where: "str | int") -> int:
    """The inode of a user namespace: a process's (its /proc directory) or
    one held open."""
    return os.fstat(where).st_ino if isinstance(where, int) else os.stat(f"{where}/ns/user").st_ino
