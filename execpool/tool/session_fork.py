"""A Python session's fork: its interpreter copied, copy-on-write, to
become a session of its own.

Runs in the session's own process (execpool/tool/python_session.py),
between cells, when the worker sends a fork frame: the copy's socket and
its stdout and stderr pipes come with it, and a JSON spec -- the copy's
job marker, the directory to copy and where to. The
worker then takes the copy as any session's tool
(execpool/worker/sessions/host.py, ``Sessions._forked``), so the copy must
be its child: a single-threaded
interpreter is cloned with CLONE_PARENT; one with threads is forked through
a middle process that exits at once (the worker is the subreaper its
orphan goes to), since only ``fork()`` runs the at-fork handlers that
threaded libraries (OpenBLAS, glibc's allocator) need in a copy.

Before the parent answers, the copy has left its parent's session and
process group, armed its death signal, taken its own
output pipes and socket, stamped its own marker, copied the directory and
moved into it: from then on nothing of its parent's is its own. A
sandboxed session's copy (execpool/worker/sessions/family.py) instead
unshares a user and a mount namespace, says ``+`` and its pid on the pipe
(the parent asks the worker to mount the copy's own trees), waits for the
worker's word on its socket, copies its parent's files into those trees
and enters a Landlock layer of its own. The copy reports its pid, or why it
could not start, on the pipe its parent reads.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import stat
import sys
from typing import Any, Callable, Dict, List, Optional, Set

from ..sandbox import enter
from ..shared.kernel import linux
from ..shared.kernel.markers import JOB_MARKER_ENV
from .spare import stamp_marker

#: The byte the worker sends a sandboxed copy once its trees are mounted.
MOUNTED = b"\x01"
_CLONE_NEWUSER, _CLONE_NEWNS = 0x10000000, 0x00020000

#: Why a copy could not start is told in at most this many characters (a
#: copy of thousands of files could fail on each), and read in at most
#: this many bytes.
_WHY_CHARS = 2000
_SAID_BYTES = 4 * _WHY_CHARS + 64

#: How long a copy made through a middle process waits for the middle one
#: to exit (it does at once), and so for its re-parenting to the worker.
_REPARENT_WAIT_S = 2.0


def fork_copy(runtime: Any, spec: Optional[Dict[str, Any]], fds: List[int],
              ask_mount: Callable[[int], None]) -> Optional[Dict[str, Any]]:
    """In the parent, ``{"pid": N}`` or ``{"error": why}``; in the copy,
    None, once it is its own session. A sandboxed session's copy (the spec's
    ``confine``) has its own namespaces first, and the parent asks the worker
    to mount its trees there (``ask_mount``) before it goes on."""
    confine = spec.get("confine") if isinstance(spec, dict) else None
    if not isinstance(spec, dict) or len(fds) != (4 if confine else 3) or not isinstance(spec.get("marker"), str) \
            or confine is not None and not isinstance(confine, dict):
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
            _become(runtime, spec, fds, worker, said_w)
            os.write(said_w, b"%d" % os.getpid())
        except BaseException as exc:  # noqa: BLE001 - the parent says why; the copy goes
            why = f"the copy could not start: {type(exc).__name__}: {exc}"
            why = why if len(why) <= _WHY_CHARS else why[:_WHY_CHARS] + " [...]"
            os.write(said_w, why.encode("utf-8", "replace"))
            os._exit(1)
        os.close(said_w)
        return None
    os.close(said_w)
    for fd in fds:
        os.close(fd)
    said = _read_said(said_r, ask_mount)
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


def _become(runtime: Any, spec: Dict[str, Any], fds: List[int], worker: int, said_w: int) -> None:
    """The copy leaves everything of its parent's that it can name."""
    confine = spec.get("confine")
    layer = fds.pop() if confine else -1
    sock, out_fd, err_fd = fds
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
    os.environ[JOB_MARKER_ENV] = spec["marker"]
    stamp_marker(spec["marker"])
    here = os.getcwd()
    if confine:
        _own_trees(runtime.channel, confine, layer, said_w)
    else:
        source, target = spec.get("from"), spec.get("to")
        if isinstance(source, str) and isinstance(target, str):
            _copy_tree(source, target, source, _mount_points())
            if here == source or here.startswith(source.rstrip(os.sep) + os.sep):
                here = target + here[len(source):]
    os.chdir(here)  # in a confined copy, the same path in its own trees
    if os.environ.get("PWD"):
        os.environ["PWD"] = here


def _own_trees(channel: socket.socket, confine: Dict[str, Any], layer: int, said_w: int) -> None:
    """A sandboxed session's copy: in namespaces of its own (a network one
    too where its session has no network: not its parent's loopback), it
    asks (through its parent) for its trees, copies its parent's files into them and
    enters its own Landlock layer (execpool/worker/sessions/family.py)."""
    paths = [path for path in confine.get("paths", ()) if isinstance(path, str)]
    mounted = _mount_points()  # its parent's, which it shares until it unshares
    theirs = [(os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), path) for path in paths]
    try:
        enter.unshare_capless(_CLONE_NEWUSER | _CLONE_NEWNS | (0 if confine.get("network") else linux.CLONE_NEWNET))
        os.write(said_w, b"+%d\n" % os.getpid())
        if channel.recv(1) != MOUNTED:
            raise OSError("the worker did not mount the copy's directories")
        for fd, path in theirs:
            _copy_tree(f"/proc/self/fd/{fd}", path, path, mounted)
    finally:
        for fd, _ in theirs:
            os.close(fd)
    enter.confine_again(layer)
    os.close(layer)


def _copy_tree(source: str, target: str, origin: str, mounted: Set[str]) -> None:
    """``source``'s files into ``target`` (made if missing): directories,
    regular files and links as they are; what is mounted in it (``mounted``:
    the mount points, as paths beneath ``origin``, the path ``source`` is
    reached at -- the view's mounts, which a sandboxed copy has again),
    pipes, sockets and devices left out: a copy of one cannot be made, and
    the fork failed on it."""

    def left_out(directory: str, names: List[str]) -> Set[str]:
        out = set()
        here = os.path.join(origin, os.path.relpath(directory, source))
        for name in names:
            try:
                mode = os.lstat(os.path.join(directory, name)).st_mode
            except OSError:
                out.add(name)
                continue
            if os.path.normpath(os.path.join(here, name)) in mounted or not (
                    stat.S_ISDIR(mode) or stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
                out.add(name)
        return out

    with os.scandir(source) as entries:
        if next(entries, None) is None:
            return
    shutil.copytree(source, target, symlinks=True, ignore=left_out, dirs_exist_ok=True)


def _mount_points() -> Set[str]:
    """Every mount point in this process's mount namespace."""
    with open("/proc/self/mountinfo") as f:
        return {point for _, _, point in linux.mounts(f.read())}


def _read_said(fd: int, ask_mount: Callable[[int], None]) -> bytes:
    """What the copy says on its pipe: its pid once it is ready, or why it
    could not be; a sandboxed one first says ``+pid`` to have its trees
    mounted, which the worker is asked for at once."""
    said = b""
    while chunk := os.read(fd, 4096):
        said = (said + chunk)[:_SAID_BYTES]
        if said.startswith(b"+") and b"\n" in said:
            line, _, said = said.partition(b"\n")
            if line[1:].isdigit():
                ask_mount(int(line[1:]))
    os.close(fd)
    return said
