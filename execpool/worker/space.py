"""A sandboxed tenant's *space*: one tmpfs of its own, of the size its
``Limits(disk=...)`` says, that holds everything it may write.

Runs in the worker process and in its preparer (execpool/worker/preparer.py).
A sandboxed job's (or session's) home -- its working directory unless the
caller gave one --, ``/tmp`` and ``/dev/shm`` are directories of its space,
each attached at its place in the job's view (execpool/sandbox/view.py): one
counter for all of them, kept by the kernel, which refuses a write past it
(``ENOSPC``) to root as to anyone. Before, each was a tmpfs of half the
machine's memory, and the home a directory on the pool's disk: one session
filled the disk until every other tenant's job failed to start, and two
tmpfs mounts pinned all of the memory.

The space is made detached (``fsmount``) and the worker holds it by its
descriptor, so it never has a path: the worker writes the job's script and
``files`` into it and reads its ``fetch`` out of it relative to that
descriptor (execpool/worker/files.py), and nothing of it outlives the job:
once the worker lets go and the job's last process is gone, the kernel
frees it whole -- no walk, however many files the job made.

Where the worker may mount (root) it makes the space itself; elsewhere a
short-lived child makes it in the view's user namespace, the only place an
unprivileged worker may mount a tmpfs (execpool.tool._spawn.space).

A tmpfs's ``size`` counts data pages, not files: a million empty files fit
in a megabyte, each holding about a kilobyte of the kernel's memory (1038
bytes for a file, 1049 for a directory, measured on 6.18). So a space's
bound is shared: one file per BYTES_PER_INODE of it, each counted as
INODE_BYTES, and the rest for data -- files and data together hold at most
the bound.
"""

from __future__ import annotations

import ctypes
import os
import stat
from typing import Callable, Dict, List, Optional, Tuple, Union

from ..sandbox.view import SPACE_DIRECTORIES, SPACE_HOME, SPACE_SHM, SPACE_TMP
from ..shared.kernel.linux import open_beneath
from ..tool.become import _spawn
from .helper_forks import descriptor_from

#: One file allowed per this many bytes of a space's bound, each counted as
#: INODE_BYTES of it; never fewer than MIN_INODES.
BYTES_PER_INODE = 8 << 10
INODE_BYTES = 1 << 10
MIN_INODES = 64


def shape(disk: Optional[int]) -> Tuple[bytes, bytes]:
    """The tmpfs ``size`` and ``nr_inodes`` for a bound of ``disk`` bytes
    (None: the kernel's own defaults, half the memory's pages for each)."""
    if disk is None:
        return b"50%", str(os.sysconf("SC_PHYS_PAGES") // 2).encode()
    inodes = max(MIN_INODES, disk // BYTES_PER_INODE)
    return str(max(disk - inodes * INODE_BYTES, 4096)).encode(), str(inodes).encode()


class Space:
    """A space, held by the descriptor of its detached mount. ``close``
    lets it go; the kernel frees it once no process of its job holds it."""

    def __init__(self, fd: int, disk: Optional[int]) -> None:
        self.fd = fd
        self.disk = disk

    def directory(self, name: str) -> int:
        """A descriptor of one of its directories, open for reading, reached
        without a link (its job may have replaced any name with one); the
        caller closes it."""
        return open_beneath(self.fd, name, os.O_RDONLY | os.O_DIRECTORY)

    def handles(self, names: Tuple[str, ...] = (SPACE_HOME, SPACE_TMP, SPACE_SHM)) -> List[int]:
        """``O_PATH`` descriptors of its directories ``names``: what the
        job's Landlock rules name (rules name inodes, wherever the view
        mounts them); the caller closes them."""
        opened: List[int] = []
        try:
            for name in names:
                opened.append(open_beneath(self.fd, name, os.O_PATH | os.O_DIRECTORY))
        except BaseException:
            for fd in opened:
                os.close(fd)
            raise
        return opened

    def take(self) -> int:
        """Its descriptor, the caller's from now on."""
        fd, self.fd = self.fd, -1
        return fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Workspaces:
    """The worker's workspaces (execpool/pool/workspaces.py): spaces that
    outlive the jobs that run in them, by the pool's ids. ``make`` makes a
    space of a disk bound, ``release`` lets go of descriptors (the
    worker's remover)."""

    def __init__(self, make: Callable[[Optional[int]], Space], release: Callable[[List[int]], None]) -> None:
        self._make = make
        self._release = release
        #: A workspace's space, or why it could not be made (its jobs end with that).
        self._open: Dict[int, Union[Space, str]] = {}

    def open(self, ident: int, disk: Optional[int]) -> None:
        try:
            self._open[ident] = self._make(disk)
        except OSError as exc:
            self._open[ident] = f"the workspace could not be made: {exc}"

    def space(self, ident: int) -> Space:
        """The workspace's space, as a job's (its own descriptor of it, let
        go with the job); OSError where there is none."""
        entry = self._open.get(ident)
        if entry is None:
            raise OSError("the workspace is closed")
        if isinstance(entry, str):
            raise OSError(entry)
        return Space(os.dup(entry.fd), entry.disk)

    def close(self, ident: int) -> None:
        entry = self._open.pop(ident, None)
        if isinstance(entry, Space):
            self._release([entry.take()])

    def close_all(self) -> None:
        for ident in list(self._open):
            self.close(ident)


def make(disk: Optional[int], user_fd: int = -1, mnt_fd: int = -1,
         directories: Tuple[Tuple[str, int], ...] = SPACE_DIRECTORIES) -> Space:
    """A new space of ``disk`` bytes, with ``directories`` made in it.
    ``user_fd`` and ``mnt_fd``: the view's template's namespaces, where a
    worker without CAP_SYS_ADMIN has its space made (-1: made here).
    Raises OSError."""
    size, inodes = shape(disk)
    fd = _spawn.space(size, inodes, user_fd, mnt_fd) if _spawn is not None else _made(size, inodes, user_fd, mnt_fd)
    try:
        for name, mode in directories:
            os.mkdir(name, mode, dir_fd=fd)
            if mode & ~0o777 or os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode & 0o777 != mode:
                # The worker's umask took bits away, or the sticky bit: no
                # process but this one has the space yet.
                os.chmod(name, mode, dir_fd=fd)
            if not stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                raise OSError(f"the space's {name} is not a directory")
    except BaseException:
        os.close(fd)
        raise
    return Space(fd, disk)


# -- without the C extension: the same system calls through ctypes ---------------------------------

_SYS_FSOPEN, _SYS_FSCONFIG, _SYS_FSMOUNT, _SYS_SETNS = 430, 431, 432, 308 if os.uname().machine == "x86_64" else 268
_FSCONFIG_SET_STRING, _FSCONFIG_CMD_CREATE = 1, 6
_MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV = 0x2, 0x4
_CLONE_NEWUSER, _CLONE_NEWNS = 0x10000000, 0x00020000
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _call(number: int, *args: object) -> int:
    result = int(_libc.syscall(ctypes.c_long(number), *args))
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"making a job's space: {os.strerror(errno)}")
    return result


def _new_space(size: bytes, inodes: bytes) -> int:
    fs = _call(_SYS_FSOPEN, b"tmpfs", ctypes.c_uint(1))
    try:
        for key, value in ((b"size", size), (b"nr_inodes", inodes), (b"mode", b"0700")):
            _call(_SYS_FSCONFIG, ctypes.c_int(fs), ctypes.c_uint(_FSCONFIG_SET_STRING), key, value, ctypes.c_int(0))
        _call(_SYS_FSCONFIG, ctypes.c_int(fs), ctypes.c_uint(_FSCONFIG_CMD_CREATE), None, None, ctypes.c_int(0))
        return _call(_SYS_FSMOUNT, ctypes.c_int(fs), ctypes.c_uint(1),
                     ctypes.c_uint(_MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV))
    finally:
        os.close(fs)


def _made(size: bytes, inodes: bytes, user_fd: int, mnt_fd: int) -> int:
    """The space, made here or -- in the view's namespaces -- by a fork of
    the worker (which never changes namespaces itself) that sends it back."""
    if user_fd < 0:
        return _new_space(size, inodes)

    def make() -> int:
        _call(_SYS_SETNS, ctypes.c_int(user_fd), ctypes.c_int(_CLONE_NEWUSER))
        _call(_SYS_SETNS, ctypes.c_int(mnt_fd), ctypes.c_int(_CLONE_NEWNS))
        return _new_space(size, inodes)

    return descriptor_from("execpool-space", (user_fd, mnt_fd), make)
