"""The pool's lifeline: the workers' parent, and what cleans up after a pool
whose owner is gone.

::

    owner (ExecPool, supervisor.py)             lifeline (python -m execpool.lifeline FD)
    -------------------------------             -----------------------------------------
    Lifeline handle, the socket's      <----->  a child subreaper; starts every worker
    only other end (close-on-exec,                (spawn: the worker's channel ends come
    never inherited by a worker or                with the request), reaps it and reports
    a tool): one packet per event                 its exit status
                                                a worker exits: every other child it has
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
any worker, and so in none of the workers' cgroups; and the **owner**,
through :class:`Lifeline`, the handle, and :class:`WorkerChild`, a started
worker as the owner sees it (pid, signals, exit status).

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
(execpool/cgroups.py, ``WorkerGroup``; root here) the workers' groups are
killed as well. What is beyond it: a tool that kills the lifeline itself
(it runs as the tool's user, unless the job is sandboxed); the lifeline is
then replaced, but the workers it started are re-parented to init, and a
process escaping from one of them reaches init when that worker dies.

The wire is a packet protocol of words (one ``SOCK_SEQPACKET`` packet per
line), never a pickle: the lifeline takes nothing it could be made to run.
Paths go as hex of their bytes.

    dirs TOKEN CGROUP JOBS_DIR   before a worker starts (CGROUP "-": none)
    spawn TOKEN                  start the worker, with its two channel
                                 descriptors attached (SCM_RIGHTS); answered
                                 "spawned TOKEN PID" or "failed TOKEN ERRNO"
    pid TOKEN PID STARTTIME      a worker another lifeline started (told to a
                                 replacement; STARTTIME from /proc/PID/stat,
                                 so a recycled pid is never signalled)
    gone TOKEN                   once the owner cleaned up after it itself
    exit TOKEN CODE              (lifeline -> owner) a worker it started was
                                 reaped: Popen's returncode
"""

from __future__ import annotations

import errno
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

import psutil

from . import _linux, cgroups
from .dirs import remove_tree
from .proctree import JOB_MARKER_ENV, is_stopped, kill_tree, stat_fields

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

#: How long the owner waits for the lifeline to start a worker (it is
#: continued first, should a tool have stopped it), and for the exit status
#: of a worker whose pidfd said it exited (the lifeline reaps at SIGCHLD).
SPAWN_TIMEOUT_S = 10.0
EXIT_REPORT_TIMEOUT_S = 1.0

#: Characters reserved in a worker's environment for a job marker (a
#: 12-character token, "/", a job id): blank room a warm job overwrites with
#: its own marker (execpool/warm.py).
MARKER_ROOM = 48

_TOKEN = re.compile(r"[0-9a-f]{1,64}\Z")
_PACKET_SIZE = 4096


def starttime(pid: int) -> Optional[int]:
    """When the process started, in clock ticks since boot (field 22 of
    ``/proc/PID/stat``): with the pid, what names one process for good."""
    fields = stat_fields(pid)
    return int(fields[19]) if len(fields) > 19 else None


def _hex(path: Optional[str]) -> str:
    return "-" if path is None else os.fsencode(path).hex()


def _unhex(word: str) -> Optional[str]:
    return None if word == "-" else os.fsdecode(bytes.fromhex(word))


def _ready(fds: list, timeout: Optional[float], events: int = select.POLLIN) -> list:
    """The descriptors among ``fds`` that are ready within ``timeout``
    seconds (None: no limit). poll, not select: a caller holding a thousand
    descriptors gives the pool's high numbers."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, events)
    return [fd for fd, _ in poller.poll(None if timeout is None else max(0.0, timeout) * 1000)]


def _signal(pidfd: Optional[int], sig: int) -> None:
    """Signal the process a pidfd holds; nothing once it is gone (a pidfd
    never reaches whoever has the pid next)."""
    if pidfd is not None:
        try:
            signal.pidfd_send_signal(pidfd, sig)
        except OSError:
            pass


def _exited(pidfd: Optional[int], timeout: Optional[float] = 0) -> bool:
    return pidfd is None or bool(_ready([pidfd], timeout))


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
        _signal(self.pidfd, sig)

    def exited(self) -> bool:
        return _exited(self.pidfd)

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
            if not _TOKEN.match(token):
                raise ValueError(f"token {token!r}")
            if kind == "dirs":
                cgroup, jobs_dir = map(_unhex, rest)
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
        _ready([worker.pidfd for worker in workers], remaining)


def main(argv: list) -> None:
    sock = socket.socket(fileno=int(argv[0]))
    sock.set_inheritable(False)
    # A tool running as the same user could otherwise open /proc/<lifeline>/fd
    # (a socket cannot be reopened, but its memory could be written).
    _linux.prctl(_linux.PR_SET_DUMPABLE, 0)
    _linux.prctl(_linux.PR_SET_CHILD_SUBREAPER, 1)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    lifeline = _Lifeline(sock)
    while True:
        ready = _ready([sock.fileno(), wake_r], None)
        if wake_r in ready:
            while True:
                try:
                    if not os.read(wake_r, _PACKET_SIZE):
                        break
                except BlockingIOError:
                    break
            lifeline.reap()
        if sock.fileno() in ready:
            try:
                packet, fds, _flags, _addr = socket.recv_fds(sock, _PACKET_SIZE, 2)
            except ConnectionResetError:  # the owner died with answers unread
                break
            if not packet:
                break
            lifeline.apply(packet, fds)
    lifeline.clean_up()


class WorkerChild:
    """A worker the lifeline started, as its owner sees it -- what the owner
    needs of a ``Popen``: ``pid``, ``poll``, ``wait``, ``send_signal``,
    ``kill``. Signals go through a pidfd (taken before the worker could be
    reaped), and the exit status is the one the lifeline reports; should the
    lifeline be gone by then, the worker has exited all the same and its
    status is unknown (None)."""

    def __init__(self, lifeline: "Lifeline", token: str, pid: int, pidfd: int) -> None:
        self._lifeline = lifeline
        self.token = token
        self.pid = pid
        self._pidfd: Optional[int] = pidfd
        self._lock = threading.Lock()
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        return self.wait(0) if _exited(self._pidfd) else None

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        if not _exited(self._pidfd, timeout):  # type: ignore[arg-type]
            raise subprocess.TimeoutExpired(f"execpool worker {self.pid}", timeout)  # type: ignore[arg-type]
        with self._lock:
            if self._pidfd is not None:
                self.returncode = self._lifeline.exit_status(self.token, EXIT_REPORT_TIMEOUT_S)
                os.close(self._pidfd)
                self._pidfd = None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._lock:
            _signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Lifeline:
    """The owner's handle: starts the lifeline, has it start the workers,
    and tells it, packet by packet, about them as they come and go. Telling
    never blocks -- a lifeline that a tool stopped must not stop the
    dispatcher -- so what the socket does not take now goes with the next
    packet; only starting a worker waits for the answer."""

    def __init__(self, env: dict) -> None:
        self._env = env
        self._lock = threading.Lock()
        # What the lifeline was told and still holds, by worker token: what
        # a new one is told should a tool kill this one.
        self._told: dict[str, list[str]] = {}
        self._exits: dict[str, int] = {}
        self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "execpool.lifeline", str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                env=self._env, cwd="/", start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock: Optional[socket.socket] = ours
        self._fd = ours.fileno()
        self._unsent = [line for lines in self._told.values() for line in lines]

    def watch(self) -> None:
        """Called by the supervisor's watchdog while jobs run: a tool can
        stop or kill the lifeline (it runs as the tool's user). A stopped
        one is continued; a dead one is replaced and told what it knew."""
        with self._lock:
            if self._sock is not None:
                self._keep_alive()

    def _keep_alive(self) -> None:
        """With the lock held."""
        if self.proc.poll() is None:
            if is_stopped(self.proc.pid):
                self.proc.send_signal(signal.SIGCONT)
            return
        logger.warning("execpool: the pool's lifeline (pid %d) died (%s); starting another -- the workers it "
                       "started are no longer its children", self.proc.pid, self.proc.returncode)
        self._sock.close()  # type: ignore[union-attr]
        self._start()
        self._flush()

    def worker(self, token: str, cgroup: Optional[str], jobs_dir: str) -> None:
        """Before the worker starts: what to remove should the owner die."""
        self._tell(token, f"dirs {token} {_hex(cgroup)} {_hex(jobs_dir)}")

    def spawn(self, token: str, read_fd: int, write_fd: int) -> WorkerChild:
        """Have the lifeline start the worker ``token`` (told with
        ``worker`` first) on these two channel descriptors, which the caller
        still closes. OSError when it cannot (the machine is out of
        processes or descriptors, or the lifeline does not answer)."""
        with self._lock:
            if self._sock is None:
                raise OSError(errno.EPIPE, "the pool's lifeline is closed")
            self._keep_alive()
            self._flush()
            deadline = time.monotonic() + SPAWN_TIMEOUT_S
            while self._unsent or not self._send_now(f"spawn {token}", [read_fd, write_fd]):
                self._flush()
                if time.monotonic() > deadline:
                    raise OSError(errno.ETIMEDOUT, "the pool's lifeline takes no request")
                _ready([self._fd], 0.05, select.POLLOUT)
            while True:
                reply = self._receive(deadline - time.monotonic())
                if reply is None:
                    raise OSError(errno.ETIMEDOUT, "the pool's lifeline did not start the worker")
                kind, who, value = reply
                if who != token:
                    continue
                if kind == "failed":
                    raise OSError(value, f"cannot start a worker: {os.strerror(value)}")
                pid = value
                break
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:  # it exited already, and was reaped: it started all the same
            raise OSError(exc.errno, f"worker {pid} ended as it started") from None
        child = WorkerChild(self, token, pid, pidfd)
        start = starttime(pid)
        if start is not None:
            self._tell(token, f"pid {token} {pid} {start}")  # for a replacement lifeline only
        return child

    def exit_status(self, token: str, timeout: float) -> Optional[int]:
        """The exit status the lifeline reported for the worker ``token``,
        waiting at most ``timeout`` for it; None when none came."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while token not in self._exits and self._sock is not None:
                if self._receive(deadline - time.monotonic()) is None:
                    break
            return self._exits.pop(token, None)

    def _receive(self, timeout: float) -> Optional[tuple]:
        """With the lock held: the next packet (kind, token, number), an exit
        report also kept aside for ``exit_status``; None after ``timeout`` or
        if the lifeline is gone."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                packet = self._sock.recv(_PACKET_SIZE)  # type: ignore[union-attr]
            except BlockingIOError:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                _ready([self._fd], remaining)
                continue
            except OSError:
                return None
            if not packet:
                return None
            try:
                kind, token, number = packet.decode("ascii").split()
                answer = (kind, token, int(number))
            except ValueError:
                logger.warning("execpool: ignored the lifeline's packet %r", packet[:200])
                continue
            if kind == "exit":
                self._exits[token] = answer[2]
            return answer

    def gone(self, token: str) -> None:
        """The owner cleaned up after this worker itself."""
        self._tell(token, f"gone {token}")

    def _tell(self, token: str, line: str) -> None:
        with self._lock:
            if line.startswith("gone "):
                self._told.pop(token, None)
            else:
                self._told.setdefault(token, []).append(line)
            if self._sock is None:
                return
            self._unsent.append(line)
            self._flush()

    def _send_now(self, line: str, fds: list = ()) -> bool:  # type: ignore[assignment]
        """With the lock held: one packet, if the socket takes it now."""
        try:
            if fds:
                socket.send_fds(self._sock, [line.encode("ascii")], fds)  # type: ignore[arg-type]
            else:
                self._sock.send(line.encode("ascii"))  # type: ignore[union-attr]
            return True
        except BlockingIOError:
            return False
        except OSError:
            return True  # gone (a killed lifeline): watch() replaces it and tells it all again

    def _flush(self) -> None:
        """With the lock held."""
        while self._unsent and self._send_now(self._unsent[0]):
            del self._unsent[0]

    def close(self, timeout: float) -> None:
        """The EOF the lifeline waits for; then reap it (it exits at once when
        every worker is ``gone``, else after cleaning up what is not)."""
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
                self._fd = None
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    main(sys.argv[1:])
