"""The few Linux calls Python's os module lacks (3.10/3.11), in one place:
prctl for the parent-death signal, child subreaper and dumpable flags and
the process name, unshare for a job's network namespace, close_range, a
fork whose child is its parent's sibling, and an open that follows no link.
Each raises OSError on failure."""

from __future__ import annotations

import ctypes
import os
import platform
import re
import signal
from typing import List, Optional, Tuple

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWNET = 0x40000000
CLONE_PARENT = 0x00008000

#: System call numbers that glibc's headers do not reach through ctypes.
_SYSCALLS = {
    "x86_64": {"clone": 56, "close_range": 436},
    "aarch64": {"clone": 220, "close_range": 436},
}.get(platform.machine(), {})

_libc = ctypes.CDLL(None, use_errno=True)
# The same library, called with the GIL held: a fork must not let another
# thread run between PyOS_BeforeFork and the system call.
_libc_gil = ctypes.PyDLL(None, use_errno=True)
_clone = _libc_gil.syscall
_clone.restype = ctypes.c_long
_clone.argtypes = (ctypes.c_long, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)


def _check(result: int, call: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{call}: {os.strerror(errno)}")


def prctl(option: int, value: int) -> None:
    _check(_libc.prctl(option, value, 0, 0, 0), f"prctl({option}, {value})")


def set_name(name: str) -> None:
    """The process name ``ps`` and psutil show (at most 15 bytes kept)."""
    _check(_libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()), 0, 0, 0), "prctl(PR_SET_NAME)")


def unshare_network() -> None:
    _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")


def close_range(low: int, high: int = 0xFFFFFFFF) -> None:
    """Close every descriptor from ``low`` to ``high``, whatever its number:
    the open-files limit says nothing about descriptors opened before it was
    lowered, so no loop up to it can be trusted to find them all."""
    number = _SYSCALLS.get("close_range")
    if number is not None and _libc.syscall(ctypes.c_long(number), ctypes.c_uint(low), ctypes.c_uint(high),
                                            ctypes.c_uint(0)) == 0:
        return
    for name in os.listdir("/proc/self/fd"):
        if low <= int(name) <= high:
            try:
                os.close(int(name))
            except OSError:
                pass  # the listing's own descriptor, already gone


_before_fork = ctypes.pythonapi.PyOS_BeforeFork
_after_fork_child = ctypes.pythonapi.PyOS_AfterFork_Child
_after_fork_parent = ctypes.pythonapi.PyOS_AfterFork_Parent


def fork_sibling() -> int:
    """``os.fork()``, except that the child's parent is the caller's parent
    (clone with CLONE_PARENT): the worker's warm template makes spares this
    way, so each spare is the worker's own child -- reaped by it, killed by
    its death -- without a middle process. Only for a single-threaded caller.
    """
    number = _SYSCALLS.get("clone")
    if number is None:
        raise OSError(f"fork_sibling: no clone system call number known for {platform.machine()}")
    _before_fork()
    pid = _clone(number, CLONE_PARENT | signal.SIGCHLD, 0, 0, 0, 0)
    if pid == 0:
        _after_fork_child()
        return 0
    errno = ctypes.get_errno()
    _after_fork_parent()
    if pid < 0:
        raise OSError(errno, f"clone(CLONE_PARENT): {os.strerror(errno)}")
    return pid


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_SYS_OPENAT2 = 437  # the same number on every architecture
_RESOLVE_NO_MAGICLINKS, _RESOLVE_NO_SYMLINKS, _RESOLVE_BENEATH = 0x02, 0x04, 0x08
_AT_FDCWD = -100


def open_unlinked(path: str, beneath: Optional[int] = None) -> int:
    """An ``O_PATH`` descriptor of ``path`` reached without following any
    link (``openat2``): where a job may write a directory on the way, it
    could put a link there between the worker resolving a path and using
    it. ``beneath``: a directory descriptor ``path`` is relative to and
    may not leave. Raises OSError (ELOOP where a link is on the way)."""
    return open_beneath(beneath, path, os.O_PATH)


def open_beneath(directory: Optional[int], path: str, flags: int, mode: int = 0) -> int:
    """``openat2`` of ``path`` with ``flags`` (O_CLOEXEC added), following
    no link on the way nor at its end; relative to ``directory`` and never
    leaving it (None: the working directory, any path). What execpool's
    own processes use for anything they create, read or remove in a
    directory a job can write: a job can swap a name for a link at any
    moment, and a link must lead nowhere. Raises OSError."""
    resolve = _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS | (0 if directory is None else _RESOLVE_BENEATH)
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    fd = int(_libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(_AT_FDCWD if directory is None else directory),
                           os.fsencode(path), ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how))))
    if fd < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno), path)
    return fd


#: How mountinfo writes a space, a tab, a newline or a backslash in a path.
_OCTAL = re.compile(r"\\([0-7]{3})")


def mounts(mountinfo: str) -> List[Tuple[str, str, str]]:
    """A ``/proc/<pid>/mountinfo``'s mounts: (mount id, parent's id, mount
    point), the point's escapes undone."""
    found = []
    for line in mountinfo.splitlines():
        fields = line.split()
        found.append((fields[0], fields[1], _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4])))
    return found
