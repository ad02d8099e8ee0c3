"""The worker's helpers: forks of the worker that do one slow thing off its
loop, for as long as the worker lives.

Who runs this module: the worker (``fork_helper``) and, in the child, each
helper until it calls its body -- the preparer of sandboxed jobs'
namespaces (execpool/worker/preparer.py) and the remover of jobs' directories
(execpool/worker/jobdirs.py). The worker is single-threaded, so a fork of it
is safe; a helper keeps nothing of the worker's but the descriptors it
names (a job's pipe or namespace held here would outlive the job), dies with
the worker, and is spared by the worker's sweeps (execpool/worker/owners.py).
"""

from __future__ import annotations

import os
import signal
import socket
from typing import Callable, Iterable

from ..shared.kernel import linux

#: The helpers' process names, as ``ps`` shows them.
PREPARER_NAME = "execpool-prep"
REMOVER_NAME = "execpool-rm"
#: Not a fork: the fresh interpreter an unprivileged worker has its jobs'
#: user namespaces made by (execpool/worker/userns.py).
USERNS_NAME = "execpool-userns"


def fork_helper(name: str, keep: Iterable[int], body: Callable[[], None]) -> int:
    """Fork a helper named ``name`` that runs ``body`` with only ``keep``
    (and the standard streams) open; its pid. It exits when ``body``
    returns or raises."""
    worker = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    try:
        linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
        linux.set_name(name)
        if os.getppid() == worker:  # else the worker died before the death signal was armed
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGTERM, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            low = 3
            for fd in sorted(set(keep)):
                if fd > low:
                    linux.close_range(low, fd - 1)
                low = max(low, fd + 1)
            linux.close_range(low)
            body()
    finally:
        os._exit(0)


def descriptor_from(name: str, keep: Iterable[int], make: Callable[[], int]) -> int:
    """A descriptor ``make`` opens in a helper named ``name`` -- a fork of the
    worker, which may change its namespaces where the worker never does --
    sent back here; OSError with what ``make`` raised."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    def body() -> None:
        try:
            socket.send_fds(theirs, [b"+"], [make()])
        except OSError as exc:
            theirs.send(str(exc).encode("utf-8", "replace") or b"failed")

    try:
        pid = fork_helper(name, (theirs.fileno(), *keep), body)
        theirs.close()
        message, fds, _flags, _address = socket.recv_fds(ours, 1 << 12, 1)
        os.waitpid(pid, 0)
    finally:
        ours.close()
        theirs.close()
    if message != b"+" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise OSError(message.decode("utf-8", "replace") or f"{name} died")
    return fds[0]
