"""The few Linux calls Python's os module lacks (3.10/3.11), in one place:
prctl for the parent-death signal, child subreaper and dumpable flags and
the process name, and unshare for a job's network namespace. Each raises OSError on failure."""

from __future__ import annotations

import ctypes
import os

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWNET = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)


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
