"""The owner's side of the pool's lifeline: the handle that starts it, has it
start the workers, and tells it about them as they come and go.

Runs in the caller (the pool's owner), on whichever thread starts, watches
or replaces a worker (execpool/pool/workers.py). The lifeline itself is
execpool/lifeline/process.py, a process of its own; this handle is the
only other end of its socket, and the words it sends are in
execpool/shared/lifeline_wire.py.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

from ..shared.kernel.proctree import is_stopped
from ..shared.lifeline_wire import PACKET_SIZE, hex_path, pidfd_exited, pidfd_signal, ready, starttime

logger = logging.getLogger("execpool")

#: How long the owner waits for the lifeline to start a worker (it is
#: continued first, should a tool have stopped it), and for the exit status
#: of a worker whose pidfd said it exited (the lifeline reaps at SIGCHLD).
SPAWN_TIMEOUT_S = 10.0
EXIT_REPORT_TIMEOUT_S = 1.0


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
        return self.wait(0) if pidfd_exited(self._pidfd) else None

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        if not pidfd_exited(self._pidfd, timeout):
            raise subprocess.TimeoutExpired(f"execpool worker {self.pid}", timeout or 0.0)
        with self._lock:
            if self._pidfd is not None:
                self.returncode = self._lifeline.exit_status(self.token, EXIT_REPORT_TIMEOUT_S)
                os.close(self._pidfd)
                self._pidfd = None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._lock:
            pidfd_signal(self._pidfd, sig)

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
        self._socket().close()
        self._start()
        self._flush()

    def worker(self, token: str, cgroup: Optional[str], jobs_dir: str) -> None:
        """Before the worker starts: what to remove should the owner die."""
        self._tell(token, f"dirs {token} {hex_path(cgroup)} {hex_path(jobs_dir)}")

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
                ready([self._socket().fileno()], 0.05, select.POLLOUT)
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
                sock = self._socket()
                packet = sock.recv(PACKET_SIZE)
            except BlockingIOError:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                ready([sock.fileno()], remaining)
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

    def _socket(self) -> socket.socket:
        """With the lock held: the socket to the lifeline; OSError once it
        is closed, as for a lifeline that is gone."""
        if self._sock is None:
            raise OSError(errno.EPIPE, "the pool's lifeline is closed")
        return self._sock

    def _send_now(self, line: str, fds: Sequence[int] = ()) -> bool:
        """With the lock held: one packet, if the socket takes it now."""
        try:
            if fds:
                socket.send_fds(self._socket(), [line.encode("ascii")], fds)
            else:
                self._socket().send(line.encode("ascii"))
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
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

