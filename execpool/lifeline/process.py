"""The pool's lifeline process: the workers' parent, and what cleans up
after a pool whose owner is gone.

::

    owner (ExecPool)                            lifeline (python -m execpool.lifeline FD)
    ----------------                            -----------------------------------------
    Lifeline handle (execpool/pool/     <---->  a child subreaper; starts every worker
    lifeline.py), the socket's only               (spawn: the worker's channel ends come
    other end (close-on-exec, never               with the request), reaps it and reports
    inherited by a worker or a tool):             its exit status
    one packet per event                        a worker exits: every other child it has
                                                  -- a tool, a daemon re-parented to it
                                                  when their worker died -- is SIGKILLed,
                                                  and again as theirs come to it
                                                EOF -- the owner died, or close() is done:
                                                  SIGCONT the workers, a grace to clean up
                                                  themselves, SIGKILL survivors, cgroup.kill
                                                  their groups, SIGKILL every other child
                                                  until none is left, sweep their markers,
                                                  remove their directories, exit

Who runs this module: the **lifeline**, one small process per pool, started
by the owner as a fresh interpreter (like the workers: scrubbed environment,
its own session, so a signal to the owner's process group misses it) before
any worker, and so in none of the workers' cgroups. The words it takes are
in execpool/shared/lifeline_wire.py.

Why it exists: a worker kills what it owns when its control pipe closes, but
only a worker that runs sees that -- one its tool keeps SIGSTOPped never
does -- and the directories the supervisor makes per worker are removed by
the supervisor, which a SIGKILL of the owner takes along. The lifeline is
what is left then, and it needs nothing from the owner but the end of a
socket.

Why it is the workers' parent: a process that leaves its session with
``setsid``, double-forks and clears its environment carries nothing that
names its job. While its worker lives it is that worker's child (a worker
is a child subreaper); when the worker dies -- SIGKILLed together with the
owner, say -- the kernel hands it to the nearest living subreaper among its
ancestors. The lifeline is that ancestor, so such a process becomes the
lifeline's child, and every child of the lifeline that is not a live worker
is the leftover of a dead one: it is killed on sight. This holds for any
user and needs no cgroup. With a writable cgroup v2 hierarchy
(execpool/shared/kernel/cgroups.py, ``WorkerGroup``; root here) the workers'
groups are killed as well. What is beyond it: a tool that kills the
lifeline itself (it runs as the tool's user, unless the job is sandboxed);
the lifeline is then replaced, but the workers it started are re-parented
to init, and a process escaping from one of them reaches init when that
worker dies.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

import psutil

from ..shared.kernel import cgroups, linux
from ..shared.kernel.dirs import remove_tree
from ..shared.kernel.markers import JOB_MARKER_ENV
from ..shared.kernel.proctree import kill_tree
from ..shared.lifeline_wire import PACKET_SIZE, TOKEN, pidfd_exited, pidfd_signal, ready, starttime, unhex_path

logger = logging.getLogger("execpool")

#: After the owner is gone: how long the workers get to clean up after
#: themselves (each continued every CONTINUE_EVERY_S, in case a tool keeps
#: stopping it) -- a worker that sees its owner's EOF kills its trees in
#: milliseconds, and everything must be gone within a second under load --
#: how long SIGKILLed ones get to die, how long a killed worker group gets
#: to empty, and how long the lifeline keeps killing what is handed to it.
WORKER_GRACE_S = 0.25
CONTINUE_EVERY_S = 0.05
KILL_WAIT_S = 1.0
GROUP_EMPTY_TIMEOUT_S = 2.0
ORPHANS_TIMEOUT_S = 5.0


#: Characters reserved in a worker's environment for a job marker (a
#: 12-character token, "/", a job id, "/", 16 secret characters): blank room
#: a warm job overwrites with its own marker (execpool/tool/spare.py).
MARKER_ROOM = 64


class _Known:
    """One worker as the lifeline knows it. The pid is held as a pidfd,
    taken while the process was surely the worker, so no signal ever goes to
    whoever gets the pid next; ``proc`` is set when this lifeline started it."""

    def __init__(self, token: str, cgroup: Optional[str], jobs_dir: str) -> None:
        self.token = token
        self.cgroup = cgroup
        self.jobs_dir = jobs_dir
        self.pidfd: Optional[int] = None
        self.proc: Optional[subprocess.Popen] = None

    def track(self, pid: int, start: Optional[int]) -> None:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return  # gone already (it saw the owner's end itself), or no pidfds here
        if start is not None and starttime(pid) != start:
            os.close(fd)  # gone, and the pid is someone else's now
            return
        self.forget()
        self.pidfd = fd

    def signal(self, sig: int) -> None:
        pidfd_signal(self.pidfd, sig)

    def exited(self) -> bool:
        return pidfd_exited(self.pidfd)

    def forget(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class _Lifeline:
    """The lifeline process's state: the workers it knows, by token, and
    those it started, by pid."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.known: dict[str, _Known] = {}
        self.children: dict[int, _Known] = {}
        # The worker's environment: the lifeline's own (the owner gave it
        # what runs Python and nothing else), plus room for a job marker.
        self.worker_env = {**os.environ, JOB_MARKER_ENV: " " * MARKER_ROOM}

    def apply(self, packet: bytes, fds: list) -> None:
        words = packet.decode("ascii", "replace").split()
        try:
            kind, token, *rest = words
            if not TOKEN.match(token):
                raise ValueError(f"token {token!r}")
            if kind == "dirs":
                cgroup, jobs_dir = map(unhex_path, rest)
                for path in (cgroup, jobs_dir):
                    if path is not None and not (os.path.isabs(path)
                                                 and os.path.basename(path).startswith("execpool-")):
                        raise ValueError(f"path {path!r}")
                if jobs_dir is None:
                    raise ValueError("no jobs directory")
                self.known[token] = _Known(token, cgroup, jobs_dir)
            elif kind == "spawn":
                if len(fds) != 2:
                    raise ValueError(f"{len(fds)} descriptors")
                self._spawn(self.known[token], fds)
            elif kind == "pid":
                pid, start = map(int, rest)
                self.known[token].track(pid, start)
            elif kind == "gone":
                self.known.pop(token).forget()
            else:
                raise ValueError(f"kind {kind!r}")
        except (ValueError, KeyError) as exc:
            logger.warning("execpool lifeline: ignored the packet %r: %s", packet[:200], exc)
        finally:
            for fd in fds:
                os.close(fd)

    def _spawn(self, worker: _Known, fds: list) -> None:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "execpool.worker", *map(str, fds)], pass_fds=fds, env=self.worker_env,
                cwd="/", start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            )
        except OSError as exc:
            self._send(f"failed {worker.token} {exc.errno or errno.EIO}")
            return
        worker.proc = proc
        worker.track(proc.pid, None)  # our child, not yet reaped: the pid is surely its
        self.children[proc.pid] = worker
        self._send(f"spawned {worker.token} {proc.pid}")

    def _send(self, line: str) -> None:
        try:
            self.sock.send(line.encode("ascii"))
        except OSError:
            pass  # the owner is gone: its EOF comes next

    def reap(self) -> None:
        """Reap every child that ended: a worker's exit status goes to the
        owner; then every child that is no live worker is killed."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                break
            worker = self.children.pop(pid, None)
            if worker is not None and worker.proc is not None:
                code = os.waitstatus_to_exitcode(status)
                worker.proc.returncode = code  # reaped here: Popen must not wait for it
                worker.proc = None
                worker.forget()
                self._send(f"exit {worker.token} {code}")
        self.kill_orphans()

    def kill_orphans(self) -> int:
        """SIGKILL every child that is not a live worker: whatever the kernel
        handed to this subreaper when a worker died. They are unreaped
        children, so their pids cannot be anyone else's. Returns how many."""
        orphans = [pid for pid in _children() if pid not in self.children]
        for pid in orphans:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(orphans)

    def clean_up(self) -> None:
        """Everything the owner would have done, in the order it matters: the
        workers first (each may still clean up its own jobs, given the
        chance), then whatever is left in their groups, handed to the
        lifeline or carrying their markers, then -- once nothing can write
        there any more -- their directories."""
        known = list(self.known.values())
        deadline = time.monotonic() + WORKER_GRACE_S
        running = [worker for worker in known if not worker.exited()]
        while running and time.monotonic() < deadline:
            for worker in running:
                worker.signal(signal.SIGCONT)
            running = _wait_exited(running, min(CONTINUE_EVERY_S, deadline - time.monotonic()))
        for worker in running:
            worker.signal(signal.SIGKILL)
        # Every group at once, then wait for each: what is in them dies together.
        groups = [cgroups.WorkerGroup(worker.cgroup) for worker in known if worker.cgroup is not None]
        for group in groups:
            group.kill()
        _wait_exited(running, KILL_WAIT_S)
        self.children.clear()  # every worker is dead: all that is left are orphans
        self._reap_all_orphans()
        for worker in known:
            if worker.cgroup is not None:
                cgroups.WorkerGroup(worker.cgroup).destroy(GROUP_EMPTY_TIMEOUT_S)
            kill_tree(marker=worker.token)
            cgroups.remove_tree(cgroups.worker_bases(worker.token))
            remove_tree(worker.jobs_dir)
            worker.forget()

    def _reap_all_orphans(self) -> None:
        """Kill and reap children until none is left (each one killed may
        hand over its own children as it dies), within a bound."""
        deadline = time.monotonic() + ORPHANS_TIMEOUT_S
        while time.monotonic() < deadline:
            killed = self.kill_orphans()
            try:
                pid, _ = os.waitpid(-1, 0 if killed else os.WNOHANG)
            except ChildProcessError:
                return
            if not killed and pid == 0:
                return


def _children() -> list:
    """This process's children. psutil scans /proc for them: the kernel's
    own list (``/proc/PID/task/TID/children``) is an option a kernel may
    lack, and this runs only when a child ended."""
    return [child.pid for child in psutil.Process().children()]


def _wait_exited(workers: list, timeout: float) -> list:
    """Wait (at most ``timeout``) until every worker has exited; return those that have not."""
    deadline = time.monotonic() + timeout
    while True:
        workers = [worker for worker in workers if not worker.exited()]
        remaining = deadline - time.monotonic()
        if not workers or remaining <= 0:
            return workers
        ready([worker.pidfd for worker in workers], remaining)


def main(argv: list) -> None:
    sock = socket.socket(fileno=int(argv[0]))
    sock.set_inheritable(False)
    # A tool running as the same user could otherwise open /proc/<lifeline>/fd
    # (a socket cannot be reopened, but its memory could be written).
    linux.prctl(linux.PR_SET_DUMPABLE, 0)
    linux.prctl(linux.PR_SET_CHILD_SUBREAPER, 1)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    lifeline = _Lifeline(sock)
    while True:
        readable = ready([sock.fileno(), wake_r], None)
        if wake_r in readable:
            while True:
                try:
                    if not os.read(wake_r, PACKET_SIZE):
                        break
                except BlockingIOError:
                    break
            lifeline.reap()
        if sock.fileno() in readable:
            try:
                packet, fds, _flags, _addr = socket.recv_fds(sock, PACKET_SIZE, 2)
            except ConnectionResetError:  # the owner died with answers unread
                break
            if not packet:
                break
            lifeline.apply(packet, fds)
    lifeline.clean_up()
