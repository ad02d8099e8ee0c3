"""A sandboxed job's user namespace of its own: the name of every process
the job will ever have.

Runs in the worker process (and its preparer). The worker makes the
namespace before the job's tool starts -- a child of the worker's own, or
of its view's where the worker lacks CAP_SYS_ADMIN, the worker's ids mapped
to themselves -- and the tool enters it last, after its view's mounts
(execpool/tool/_spawn.c, execpool/shared/kernel/sandbox.py). No process
leaves its user namespace's subtree: entering another needs a capability
there, which a sandboxed process never has. So a process that left its
job's session and process group and cleared its environment -- its job's
marker -- still names its job by the user namespaces above its own
(``NS_GET_PARENT``), for root as for any user, with or without cgroups:
before, it was nobody's until its worker had no job running at all, and
an open session (anyone's) is a job for its whole life.

Mapping a new namespace's ids means writing its own ``/proc/self/uid_map``,
and a process's ``/proc`` files belong to root while its memory is not
dumpable -- the worker's never is (a tool of its user could otherwise read
other jobs' code and environment in it). Root writes them all the same; an
unprivileged worker has its namespaces made by :class:`_Maker`, a fresh
interpreter -- not a fork of the worker, whose memory holds other jobs'
data -- that holds nothing but the view's user namespace and its socket,
and so may be dumpable: a process of the same user may make namespaces
beneath that one anyway.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import sys
from typing import Iterator, List, Optional

from ..shared.kernel import linux
from ..shared.kernel.sandbox import VIEW_MOUNT_NS, view_kind
from ..tool.become import _spawn
from .helper_forks import USERNS_NAME, descriptor_from, fork_helper

#: ioctl(2) on a user namespace's descriptor: its parent's (linux/nsfs.h).
NS_GET_PARENT = 0xB702
#: User namespaces nest at most this deep (the kernel's limit).
_MAX_DEPTH = 33


#: Namespaces a worker keeps made for its next jobs: making one (72 us here)
#: was a third of what the sandbox added to a shell job's start.
STOCK = 2


class Namespaces:
    """The worker's maker of its jobs' user namespaces, beneath its view's
    template's (``parent_fd``, -1 for the worker's own), with a stock made
    once a Result is out (``refill``): they are all alike."""

    def __init__(self) -> None:
        self._maker: Optional[_Maker] = None
        self._stock: List[int] = []
        #: What the stock was made beneath, by identity (a template built
        #: again may have its descriptor's number; its stock holds the
        #: old one's namespace, so that identity is the old one's alone).
        self._parent: Optional[int] = None

    def take(self, parent_fd: int) -> int:
        """One from the stock, or a new one: its descriptor, the caller's;
        OSError when it cannot be made."""
        if self._stock and self._parent == _identity_of(parent_fd):
            return self._stock.pop()
        return self._make(parent_fd)

    def refill(self, parent_fd: int) -> None:
        """Make what the stock lacks, beneath ``parent_fd``; a failure is
        said when a job asks."""
        if self._parent != _identity_of(parent_fd):
            self._drop_stock()
            self._parent = _identity_of(parent_fd)
        try:
            while len(self._stock) < STOCK:
                self._stock.append(self._make(parent_fd))
        except OSError:
            pass

    def _make(self, parent_fd: int) -> int:
        if view_kind() == VIEW_MOUNT_NS:
            return make(parent_fd)
        if self._maker is None or self._maker.parent != parent_fd:
            if self._maker is not None:
                self._maker.close()
            self._maker = _Maker(parent_fd)
        return self._maker.make()

    def _drop_stock(self) -> None:
        for fd in self._stock:
            os.close(fd)
        self._stock.clear()

    @property
    def pid(self) -> int:
        """The maker's pid (0: none), which the worker's sweeps leave alone."""
        return 0 if self._maker is None else self._maker.pid

    def close(self) -> None:
        self._drop_stock()
        if self._maker is not None:
            self._maker.close()
            self._maker = None


class _Maker:
    """A helper of an unprivileged worker that makes user namespaces, one
    per request (module docstring): ``python -m execpool.worker.userns``,
    started once per view, with its socket and the view's user namespace."""

    def __init__(self, parent: int) -> None:
        self.parent = parent
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fds = (theirs.fileno(), parent)

        def become() -> None:
            for fd in fds:
                os.set_inheritable(fd, True)
            # The worker's environment is scrubbed already: what it has, it may give.
            os.execv(sys.executable, [sys.executable, "-m", __name__, *map(str, fds)])

        try:
            self.pid = fork_helper(USERNS_NAME, fds, become)
        finally:
            theirs.close()

    def make(self) -> int:
        try:
            self._sock.send(b"?")
            message, fds, _flags, _address = socket.recv_fds(self._sock, 1 << 12, 1)
        except OSError as exc:
            raise OSError(f"a job's user namespace: its maker is gone ({exc.strerror})") from None
        if message != b"+" or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise OSError(message.decode("utf-8", "replace") or "a job's user namespace: its maker is gone")
        return fds[0]

    def close(self) -> None:
        self._sock.close()  # it exits at EOF; the worker reaps it
        self.pid = 0


def _serve(sock: socket.socket, parent: int) -> None:
    """The maker's life: a namespace for each request, until EOF."""
    linux.set_name(USERNS_NAME)
    while sock.recv(16):
        try:
            fd = make(parent)
        except OSError as exc:
            sock.send(f"a job's user namespace: {exc}".encode("utf-8", "replace"))
            continue
        try:
            socket.send_fds(sock, [b"+"], [fd])
        finally:
            os.close(fd)


def make(parent_fd: int = -1) -> int:
    """A new user namespace beneath ``parent_fd`` (-1: this process's own),
    this process's ids mapped to themselves, setgroups denied: its
    descriptor. Only for a process that may write its own ``/proc`` files
    (root, or a dumpable one). Raises OSError."""
    uid, gid = os.geteuid(), os.getegid()
    uid_map, gid_map = f"{uid} {uid} 1".encode(), f"{gid} {gid} 1".encode()
    if _spawn is not None:
        return _spawn.user_namespace(parent_fd, uid_map, gid_map)
    return _made(parent_fd, uid_map, gid_map)


def _identity_of(parent_fd: int) -> int:
    return -1 if parent_fd < 0 else identity(parent_fd)


def identity(fd: int) -> int:
    """A namespace's inode number: unique while a descriptor holds it."""
    return os.fstat(fd).st_ino


def ancestry(pid: int) -> Iterator[int]:
    """The inode numbers of ``pid``'s user namespace and those above it, the
    nearest first (none where its namespace cannot be read: it is gone, or
    not the worker's to look at)."""
    try:
        fd: Optional[int] = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        for _ in range(_MAX_DEPTH):
            assert fd is not None
            yield identity(fd)
            try:
                parent = fcntl.ioctl(fd, NS_GET_PARENT)
            except OSError:
                return  # the top, or above what the worker may see
            os.close(fd)
            fd = parent
    finally:
        if fd is not None:
            os.close(fd)


# -- without the C extension: a fork of the worker does it ------------------------------------------

_CLONE_NEWUSER = 0x10000000
_libc = ctypes.CDLL(None, use_errno=True)


def _made(parent_fd: int, uid_map: bytes, gid_map: bytes) -> int:
    """``make`` through ctypes, in a fork of the caller -- root, or the
    maker, dumpable already -- that sends the namespace back."""

    def make_one() -> int:
        if parent_fd >= 0 and _libc.setns(parent_fd, _CLONE_NEWUSER) != 0 or _libc.unshare(_CLONE_NEWUSER) != 0:
            raise OSError(ctypes.get_errno(), f"a job's user namespace: {os.strerror(ctypes.get_errno())}")
        for name, text in (("setgroups", b"deny"), ("uid_map", uid_map), ("gid_map", gid_map)):
            with open(f"/proc/self/{name}", "wb") as f:
                f.write(text)
        return os.open("/proc/self/ns/user", os.O_RDONLY | os.O_CLOEXEC)

    return descriptor_from(USERNS_NAME, [parent_fd] if parent_fd >= 0 else [], make_one)


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])), int(sys.argv[2]))
