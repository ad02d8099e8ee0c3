"""A Python session's fork: its interpreter copied, copy-on-write, to
become a session of its own.

Runs in the session's own process (execpool/worker/sessions/python.py),
between cells, when the worker sends a fork frame: the copy's socket, its
stdout and stderr pipes and its cgroup's files come with it, and a JSON
spec -- the copy's job marker, the directory to copy and where to. The
worker then takes the copy as any session's tool (execpool/worker/loop.py,
``Worker._forked``), so the copy must be its child: a single-threaded
interpreter is cloned with CLONE_PARENT; one with threads is forked through
a middle process that exits at once (the worker is the subreaper its
orphan goes to), since only ``fork()`` runs the at-fork handlers that
threaded libraries (OpenBLAS, glibc's allocator) need in a copy.

Before the parent answers, the copy has left its parent's session and
process group, armed its death signal, joined its cgroup, taken its own
output pipes and socket, copied the directory and moved into it, and
stamped its own marker: from then on nothing of its parent's is its own.
It reports its pid, or why it could not, on a pipe its parent reads.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import sys
from typing import Any, Dict, List, Optional

from ...shared.kernel import linux
from ...shared.kernel.markers import JOB_MARKER_ENV
from ..warm.spare import stamp_marker

#: How long a copy made through a middle process waits for the middle one
#: to exit (it does at once), and so for its re-parenting to the worker.
_REPARENT_WAIT_S = 2.0


def fork_copy(runtime: Any, spec: Optional[Dict[str, Any]], fds: List[int]) -> Optional[Dict[str, Any]]:
    """In the parent, ``{"pid": N}`` or ``{"error": why}``; in the copy,
    None, once it is its own session."""
    if not isinstance(spec, dict) or len(fds) < 3 or not isinstance(spec.get("marker"), str):
        for fd in fds:
            os.close(fd)
        return {"error": "the worker sent a fork without what it needs"}
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # else both would print what the parent had buffered
        except (OSError, ValueError):
            pass
    worker = os.getppid()
    said_r, said_w = os.pipe()
    try:
        pid = _copy(worker)
    except OSError as exc:
        pid = -1
        os.write(said_w, f"cannot fork the session: {exc}".encode("utf-8", "replace"))
    if pid == 0:
        try:
            os.close(said_r)
            _become(runtime, spec, fds, worker)
            os.write(said_w, b"%d" % os.getpid())
        except BaseException as exc:  # noqa: BLE001 - the parent says why; the copy goes
            os.write(said_w, f"the copy could not start: {type(exc).__name__}: {exc}".encode("utf-8", "replace"))
            os._exit(1)
        os.close(said_w)
        return None
    os.close(said_w)
    for fd in fds:
        os.close(fd)
    said = _read_all(said_r)
    if said.isdigit():
        return {"pid": int(said)}
    return {"error": said.decode("utf-8", "replace") or "the copy died before it started"}


def _copy(worker: int) -> int:
    """fork(): 0 in the copy, which is (or is about to be) the worker's
    child; in the parent, a positive number (the copy's pid is told on the
    pipe)."""
    if _threads() == 1:
        return linux.fork_sibling()
    middle = os.fork()
    if middle == 0:
        try:
            if os.fork():
                os._exit(0)
            if os.getppid() != worker:
                _outlive(os.getppid())
            return 0
        except BaseException:  # noqa: BLE001 - never back into the parent's loop
            os._exit(1)
    os.waitpid(middle, 0)
    return middle


def _outlive(middle: int) -> None:
    """Wait for the middle process to have exited: a pidfd is readable once
    its exit re-parented its children (to the worker, the subreaper)."""
    try:
        fd = os.pidfd_open(middle)
    except ProcessLookupError:
        return
    try:
        select.select([fd], [], [], _REPARENT_WAIT_S)
    finally:
        os.close(fd)


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 2  # unknown: the safe way


def _become(runtime: Any, spec: Dict[str, Any], fds: List[int], worker: int) -> None:
    """The copy leaves everything of its parent's that it can name."""
    sock, out_fd, err_fd, *joins = fds
    for fd in joins:
        os.write(fd, b"0")  # into the copy's own cgroup
        os.close(fd)
    os.setsid()
    linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != worker:
        raise OSError("the worker is gone")
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    os.close(runtime.channel.detach())  # the parent's socket: closed, not shut down
    runtime.channel = socket.socket(fileno=sock)
    source, target = spec.get("from"), spec.get("to")
    here = os.getcwd()
    if isinstance(source, str) and isinstance(target, str):
        with os.scandir(source) as entries:
            if next(entries, None) is not None:
                shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
        if here == source or here.startswith(source.rstrip(os.sep) + os.sep):
            here = target + here[len(source):]
    os.chdir(here)
    if os.environ.get("PWD"):
        os.environ["PWD"] = here
    os.environ[JOB_MARKER_ENV] = spec["marker"]
    stamp_marker(spec["marker"])


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 4096):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)
