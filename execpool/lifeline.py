"""The pool's lifeline: what cleans up after a pool whose owner is gone.

::

    owner (ExecPool, supervisor.py)             lifeline (python -m execpool.lifeline FD)
    -------------------------------             -----------------------------------------
    Lifeline handle, the pipe's only   ------>  reads one line per event: a worker's
    write end (close-on-exec, never             directories, its pid, its departure
    inherited by a worker or a tool)            EOF -- the owner died, or close() is done:
                                                  SIGCONT the workers it knows, a grace to
                                                  clean up themselves, SIGKILL survivors,
                                                  cgroup.kill their groups, sweep their job
                                                  markers, remove their directories, exit

Who runs this module: the **lifeline**, one small process per pool, started
by the owner as a fresh interpreter (like the workers: scrubbed environment,
its own session, so a signal to the owner's process group misses it) before
any worker, and so in none of the workers' cgroups; and the **owner**,
through :class:`Lifeline`, the handle at the bottom of this module.

Why it exists: a worker kills what it owns when its control pipe closes, but
only a worker that runs sees that -- one its tool keeps SIGSTOPped never
does -- and the directories the supervisor makes per worker are removed by
the supervisor, which a SIGKILL of the owner takes along. The lifeline is
what is left then, and it needs nothing from the owner but the end of a pipe.

What holds where: with a writable cgroup v2 hierarchy (execpool/cgroups.py,
``WorkerGroup``; root here) nothing a job started survives the owner, also
a daemon that left its session and cleared its environment. Without one (a
non-root user on most machines) the lifeline still continues and kills the
workers, kills what carries their job markers and removes their
directories; a process that left its session *and* cleared its environment
is then beyond its reach.

The wire is a line protocol of words, never a pickle: the lifeline takes
nothing it could be made to run. Paths go as hex of their bytes.

    dirs TOKEN CGROUP JOBS_DIR   before a worker starts (CGROUP "-": none)
    pid TOKEN PID STARTTIME      once it runs (STARTTIME from /proc/PID/stat,
                                 so a recycled pid is never signalled)
    gone TOKEN                   once the owner cleaned up after it itself
"""

from __future__ import annotations

import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

from . import _linux, cgroups, channel
from .dirs import remove_tree
from .proctree import is_stopped, kill_tree, stat_fields

logger = logging.getLogger("execpool")

#: After the owner is gone: how long the workers get to clean up after
#: themselves (each continued every CONTINUE_EVERY_S, in case a tool keeps
#: stopping it) -- a worker that sees its owner's EOF kills its trees in
#: milliseconds, and everything must be gone within a second under load --
#: how long SIGKILLed ones get to die, and how long a killed worker group
#: gets to empty.
WORKER_GRACE_S = 0.25
CONTINUE_EVERY_S = 0.05
KILL_WAIT_S = 1.0
GROUP_EMPTY_TIMEOUT_S = 2.0

_TOKEN = re.compile(r"[0-9a-f]{1,64}\Z")
_READ_SIZE = 4096


def starttime(pid: int) -> Optional[int]:
    """When the process started, in clock ticks since boot (field 22 of
    ``/proc/PID/stat``): with the pid, what names one process for good."""
    fields = stat_fields(pid)
    return int(fields[19]) if len(fields) > 19 else None


def _hex(path: Optional[str]) -> str:
    return "-" if path is None else os.fsencode(path).hex()


def _unhex(word: str) -> Optional[str]:
    return None if word == "-" else os.fsdecode(bytes.fromhex(word))


class _Known:
    """One worker as the lifeline knows it. The pid is held as a pidfd,
    taken while the process was surely the worker, so no signal ever goes to
    whoever gets the pid next."""

    def __init__(self, token: str, cgroup: Optional[str], jobs_dir: str) -> None:
        self.token = token
        self.cgroup = cgroup
        self.jobs_dir = jobs_dir
        self.pidfd: Optional[int] = None

    def track(self, pid: int, start: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return  # gone already (it saw the owner's end itself), or no pidfds here
        if starttime(pid) != start:
            os.close(fd)  # gone, and the pid is someone else's now
            return
        self.forget()
        self.pidfd = fd

    def signal(self, sig: int) -> None:
        if self.pidfd is not None:
            try:
                signal.pidfd_send_signal(self.pidfd, sig)
            except OSError:
                pass

    def exited(self) -> bool:
        return self.pidfd is None or bool(select.select([self.pidfd], [], [], 0)[0])

    def forget(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _apply(known: dict, line: bytes) -> None:
    words = line.decode("ascii", "replace").split()
    try:
        kind, token, *rest = words
        if not _TOKEN.match(token):
            raise ValueError(f"token {token!r}")
        if kind == "dirs":
            cgroup, jobs_dir = map(_unhex, rest)
            for path in (cgroup, jobs_dir):
                if path is not None and not (os.path.isabs(path) and os.path.basename(path).startswith("execpool-")):
                    raise ValueError(f"path {path!r}")
            if jobs_dir is None:
                raise ValueError("no jobs directory")
            known[token] = _Known(token, cgroup, jobs_dir)
        elif kind == "pid":
            pid, start = map(int, rest)
            known[token].track(pid, start)
        elif kind == "gone":
            known.pop(token).forget()
        else:
            raise ValueError(f"kind {kind!r}")
    except (ValueError, KeyError) as exc:
        logger.warning("execpool lifeline: ignored the line %r: %s", line[:200], exc)


def _wait_exited(workers: list, timeout: float) -> list:
    """Wait (at most ``timeout``) until every worker has exited; return those that have not."""
    deadline = time.monotonic() + timeout
    while True:
        workers = [worker for worker in workers if not worker.exited()]
        remaining = deadline - time.monotonic()
        if not workers or remaining <= 0:
            return workers
        select.select([worker.pidfd for worker in workers], [], [], remaining)


def _clean_up(known: list) -> None:
    """Everything the owner would have done, in the order it matters: the
    workers first (each may still clean up its own jobs, given the chance),
    then whatever is left in their groups or carries their markers, then --
    once nothing can write there any more -- their directories."""
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
    for worker in known:
        if worker.cgroup is not None:
            cgroups.WorkerGroup(worker.cgroup).destroy(GROUP_EMPTY_TIMEOUT_S)
        kill_tree(marker=worker.token)
        cgroups.remove_tree(cgroups.worker_bases(worker.token))
        remove_tree(worker.jobs_dir)
        worker.forget()


def main(argv: list) -> None:
    fd = int(argv[0])
    os.set_inheritable(fd, False)
    # A tool running as the same user could otherwise open /proc/<lifeline>/fd
    # and keep a write end of this pipe open: the lifeline would never see EOF.
    _linux.prctl(_linux.PR_SET_DUMPABLE, 0)
    known: dict = {}
    pending = b""
    while True:
        data = os.read(fd, _READ_SIZE)
        if not data:
            break
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            _apply(known, line)
    _clean_up(list(known.values()))


class Lifeline:
    """The owner's handle: starts the lifeline and tells it, line by line,
    about the workers as they come and go. Writes never block -- a lifeline
    that a tool stopped must not stop the dispatcher -- so what the pipe does
    not take now goes with the next line."""

    def __init__(self, env: dict) -> None:
        self._env = env
        self._lock = threading.Lock()
        # What the lifeline was told and still holds, by worker token: what
        # a new one is told should a tool kill this one.
        self._told: dict[str, list[str]] = {}
        self._start()

    def _start(self) -> None:
        read_end, self._fd = channel.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "execpool.lifeline", str(read_end)], pass_fds=(read_end,), env=self._env,
                cwd="/", start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            )
        except BaseException:
            os.close(self._fd)
            raise
        finally:
            os.close(read_end)
        os.set_blocking(self._fd, False)
        self._unsent = b"".join(line.encode("ascii") + b"\n" for lines in self._told.values() for line in lines)

    def watch(self) -> None:
        """Called by the supervisor's watchdog while jobs run: a tool can
        stop or kill the lifeline (it runs as the tool's user). A stopped
        one is continued; a dead one is replaced and told what it knew."""
        with self._lock:
            if self._fd is None:
                return
            if self.proc.poll() is None:
                if is_stopped(self.proc.pid):
                    self.proc.send_signal(signal.SIGCONT)
                return
            logger.warning("execpool: the pool's lifeline (pid %d) died (%s); starting another",
                           self.proc.pid, self.proc.returncode)
            os.close(self._fd)
            self._start()
            self._flush()

    def worker(self, token: str, cgroup: Optional[str], jobs_dir: str) -> None:
        """Before the worker starts: what to remove should the owner die."""
        self._tell(token, f"dirs {token} {_hex(cgroup)} {_hex(jobs_dir)}")

    def started(self, token: str, pid: int) -> None:
        """Right after ``Popen``, while the pid is surely the worker's (not
        yet reaped, so not recycled)."""
        start = starttime(pid)
        if start is not None:
            self._tell(token, f"pid {token} {pid} {start}")

    def gone(self, token: str) -> None:
        """The owner cleaned up after this worker itself."""
        self._tell(token, f"gone {token}")

    def _tell(self, token: str, line: str) -> None:
        with self._lock:
            if line.startswith("gone "):
                self._told.pop(token, None)
            else:
                self._told.setdefault(token, []).append(line)
            if self._fd is None:
                return
            self._unsent += line.encode("ascii") + b"\n"
            self._flush()

    def _flush(self) -> None:
        """With the lock held."""
        try:
            while self._unsent:
                self._unsent = self._unsent[os.write(self._fd, self._unsent):]
        except OSError:
            pass  # full (a stopped lifeline) or gone (a killed one): watch() deals with either

    def close(self, timeout: float) -> None:
        """The EOF the lifeline waits for; then reap it (it exits at once when
        every worker is ``gone``, else after cleaning up what is not)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    main(sys.argv[1:])
