"""The words between a pool's owner and its lifeline, and the pidfd and
``/proc`` calls both ends make.

Shared: the owner's handle (execpool/pool/lifeline.py) writes these words
and the lifeline process (execpool/lifeline/process.py) reads them. The
wire is a packet protocol of words -- one ``SOCK_SEQPACKET`` packet per
line -- never a pickle: the lifeline takes nothing it could be made to run.
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

import os
import re
import select
import signal
from typing import Optional

from .kernel.proctree import stat_fields

#: A worker's token: what names its processes, groups and directories.
TOKEN = re.compile(r"[0-9a-f]{1,64}\Z")

#: The largest packet either end sends.
PACKET_SIZE = 4096


def starttime(pid: int) -> Optional[int]:
    """When the process started, in clock ticks since boot (field 22 of
    ``/proc/PID/stat``): with the pid, what names one process for good."""
    fields = stat_fields(pid)
    return int(fields[19]) if len(fields) > 19 else None


def hex_path(path: Optional[str]) -> str:
    return "-" if path is None else os.fsencode(path).hex()


def unhex_path(word: str) -> Optional[str]:
    return None if word == "-" else os.fsdecode(bytes.fromhex(word))


def ready(fds: list, timeout: Optional[float], events: int = select.POLLIN) -> list:
    """The descriptors among ``fds`` that are ready within ``timeout``
    seconds (None: no limit). poll, not select: a caller holding a thousand
    descriptors gives the pool's high numbers."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, events)
    return [fd for fd, _ in poller.poll(None if timeout is None else max(0.0, timeout) * 1000)]


def pidfd_signal(pidfd: Optional[int], sig: int) -> None:
    """Signal the process a pidfd holds; nothing once it is gone (a pidfd
    never reaches whoever has the pid next)."""
    if pidfd is not None:
        try:
            signal.pidfd_send_signal(pidfd, sig)
        except OSError:
            pass


def pidfd_exited(pidfd: Optional[int], timeout: Optional[float] = 0) -> bool:
    return pidfd is None or bool(ready([pidfd], timeout))
