"""What a new process does to itself to become a tool, before the tool's
first instruction.

Runs in the process that becomes the tool: a cold tool's child between its
fork and its exec (the C extension, execpool/tool/_spawn.c, does the same
steps after a vfork), and a warm job's spare (execpool/tool/spare.py). The
worker builds the :class:`Setup` and never runs :func:`become_tool` itself.
The order of the steps -- the job's cgroup, a new session, the network
namespace, the death signal, the working directory, its stdio, its sandbox
(entered while the rulesets' descriptors are still open), no other
descriptor, then its rlimits -- is what makes them hold: a lowered
open-files limit cannot hide a descriptor from the close, and a root tool
has lost the capability to raise its rlimits before they are set.
"""

from __future__ import annotations

import os
import resource
import signal
from dataclasses import dataclass
from typing import Callable, NoReturn, Optional, Tuple

from ..sandbox.enter import child_arguments, enter
from ..shared.jobs import Limits
from ..shared.kernel import linux

try:
    from . import _spawn
except ImportError:  # not built here; the pure-Python start is used instead
    _spawn = None  # type: ignore[assignment]  # the extension is optional: every use asks first

#: Stdin of a job that was given none (and of the template and spares).
DEVNULL = os.open(os.devnull, os.O_RDONLY)


#: The Limits fields that are rlimits, in the order execpool.tool._spawn takes them.
RLIMIT_FIELDS = ("address_space", "cpu_seconds", "file_size", "open_files")
_RLIMITS = (resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_FSIZE, resource.RLIMIT_NOFILE)


@dataclass(frozen=True)
class Setup:
    """What a tool's new process does to itself before the tool's first
    instruction -- a cold tool's after its vfork or fork, a warm job's in
    its spare -- in the order of the module docstring."""

    cwd: str
    #: The rlimits in the order execpool.tool._spawn takes them, -1 for none.
    rlimits: Tuple[int, ...]
    no_network: bool = False
    #: ``cgroup.procs`` files of the job's groups, written "0" to join them.
    join_fds: Tuple[int, ...] = ()
    #: The job's Landlock rulesets (execpool/sandbox/rulesets.py); none: no sandbox.
    rulesets: Tuple[int, ...] = ()
    #: The job's view (execpool/sandbox/view.py's ``View.arguments``); None: none.
    view: Optional[tuple] = None


def _apply_limits(rlimits: tuple) -> None:
    for which, value in zip(_RLIMITS, rlimits, strict=True):
        if value < 0:
            continue
        _soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value))


def rlimit_values(limits: Limits) -> tuple:
    """The rlimits in the order execpool.tool._spawn takes them, -1 for none:
    plain integers, which a spare receives and applies without building a
    Limits again."""
    return tuple(-1 if getattr(limits, field) is None else getattr(limits, field) for field in RLIMIT_FIELDS)


def become_tool(setup: Setup, stdio: tuple, ready_w: int, parent_pid: int, then: Callable[[int], None]) -> NoReturn:
    """In a fork of the worker (or a spare): ``setup``, with ``stdio`` on
    fds 0, 1 and 2. A failure before ``then`` takes over reaches the worker
    through ``ready_w``."""
    try:
        for fd in setup.join_fds:
            os.write(fd, b"0")  # this process into its job's cgroup
        os.setsid()
        if setup.no_network:
            linux.unshare_network()
        linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:
            os._exit(137)  # the parent died before the death signal was armed
        os.chdir(setup.cwd)
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
        if setup.rulesets:
            if _spawn is not None:
                _spawn.confine(*child_arguments(setup.rulesets, setup.view))
            else:
                enter(setup.rulesets, setup.view)
        close_all_but(ready_w)  # the worker's pipes, selector and channel are not the tool's
        _apply_limits(setup.rlimits)
        then(ready_w)
    except BaseException as exc:  # noqa: BLE001 - report, never return into the loop
        try:
            os.write(ready_w, str(exc).encode("utf-8", "replace")[:2048])
        finally:
            os._exit(127)
    os._exit(127)  # ``then`` execs or exits; returning would run the worker's loop in the tool


def close_all_but(keep: int) -> None:
    """Close every descriptor from 3 up except ``keep``, whatever its number."""
    if keep > 3:
        linux.close_range(3, keep - 1)
    linux.close_range(max(3, keep + 1))
