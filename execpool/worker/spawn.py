"""How a worker starts a tool process, in one of three ways:

- ``vfork``: the C extension (execpool/tool/_spawn.c) vforks and execs
  ``bash -c`` or ``python -u FILE``, setting the tool up in between;
- ``fork``: the pure-Python fallback, where the extension was not built:
  the child runs :func:`execpool.tool.become.become_tool`, then execs;
- ``warm``: no exec at all -- a parked spare of the worker's template
  becomes the job's interpreter (execpool/tool/spare.py), handed the job by
  the worker (execpool/worker/warm/handover.py) with the same ``Setup``.

What the new process does to itself, and in which order, is the tool's
side: execpool/tool/become.py. The worker's side is here: the output pipes,
the start, and its own memory figures.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Tuple

from ..sandbox.enter import child_arguments
from ..tool.become import DEVNULL, Setup, _spawn, become_tool

#: How a worker builds a sandboxed job's Landlock rulesets: one C call each
#: where the extension was built (execpool/sandbox/rulesets.py).
RULESET_BUILDER = None if _spawn is None else _spawn.ruleset

#: How tools are started: "vfork" (execpool.tool._spawn) or "fork" (pure Python).
SPAWN_METHODS = ("vfork", "fork") if _spawn is not None else ("fork",)


class _OwnMemory:
    """What the worker does about its own memory for its tools' sake.

    Linux carries a process's resident high-water mark across exec, and a
    vfork (or fork) child's is its parent's: every tool's ``ru_maxrss``
    starts at the worker's. So before each start the worker sets its own
    mark back to what it holds at that moment (writing "5" to its
    ``/proc/self/clear_refs``, opened once, before the worker makes itself
    non-dumpable -- then only root could), and after a job that made it
    hold a lot (a large output kept, a large stdin) it hands the freed heap
    back to the kernel (``malloc_trim``), which glibc would otherwise keep
    resident: a job that did that raises no later job's figure."""

    clear_refs = -1
    trim = None

    @classmethod
    def open(cls) -> None:
        try:
            cls.clear_refs = os.open("/proc/self/clear_refs", os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            cls.clear_refs = -1  # no such file (no procfs): the floor is the worker's own peak
        try:
            cls.trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            cls.trim = None  # not glibc

    @classmethod
    def reset_peak(cls) -> None:
        if cls.clear_refs >= 0:
            try:
                os.write(cls.clear_refs, b"5")
            except OSError:
                pass

    @classmethod
    def give_back(cls) -> None:
        if cls.trim is not None:
            cls.trim(0)


keep_own_peak_resettable = _OwnMemory.open
give_back_memory = _OwnMemory.give_back


@dataclass(frozen=True)
class Tool:
    """A tool to start: what it runs, what it starts with, how it is set up."""

    argv: List[str]
    env: Dict[str, str]
    setup: Setup
    stdin_fd: int = DEVNULL
    separate_stderr: bool = False


def start_tool(tool: Tool, method: str) -> Tuple[int, List[int]]:
    """Start ``tool`` with ``method`` "vfork" or "fork"; return its pid and
    the read ends of its output pipes (see :func:`output_pipes`)."""
    setup = tool.setup
    _OwnMemory.reset_peak()
    with output_pipes(tool.separate_stderr) as (readers, out_w, err_w):
        if method == "vfork":
            envp = [f"{key}={value}" for key, value in tool.env.items()]
            confinement = child_arguments(setup.rulesets, setup.view) if setup.rulesets else None
            pid = _spawn.spawn(tool.argv, envp, setup.cwd, setup.rlimits, tool.stdin_fd, out_w, err_w,
                               setup.no_network, list(setup.join_fds), confinement)
        else:
            pid = _fork_child(setup, (tool.stdin_fd, out_w, err_w), _exec(tool.argv, tool.env))
    return pid, readers


@contextlib.contextmanager
def output_pipes(separate_stderr: bool) -> Iterator[tuple[list, int, int]]:
    """A tool's output pipes: the read ends -- stdout's, then stderr's when
    it has one of its own -- and the write ends for its fd 1 and fd 2, one
    pipe for both unless ``separate_stderr``. The write ends are closed on
    leaving, once the tool (or its spare) holds its own copies, so the
    worker sees EOF when the tool's tree is done writing; the read ends are
    the caller's, unless the block raises."""
    readers: list = []
    writers: list = []
    try:
        for _ in range(2 if separate_stderr else 1):
            read_end, write_end = os.pipe()
            readers.append(read_end)
            writers.append(write_end)
        yield readers, writers[0], writers[-1]
    except BaseException:
        for fd in readers:
            os.close(fd)
        raise
    finally:
        for fd in writers:
            os.close(fd)


def memfd_holding(name: str, data: bytes) -> int:
    """An anonymous file holding ``data``, rewound: a tool's stdin, which it
    reads at its own pace while the worker never blocks writing it, or a warm
    job's description for its spare."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _exec(argv: list, env: dict) -> Callable[[int], None]:
    def then(_ready_fd: int) -> None:
        # exec resets caught signals itself; ignored ones would stay ignored.
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        os.execve(argv[0], argv, env)

    return then



def _fork_child(setup: Setup, stdio: tuple, then: Callable[[int], None]) -> int:
    """Fork, set the child up as every tool is set up, then hand it to
    ``then(ready_fd)``, which execs."""
    ready_r, ready_w = os.pipe()
    worker_pid = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        become_tool(setup, stdio, ready_w, worker_pid, then)
    os.close(ready_w)
    failure = b""
    while chunk := os.read(ready_r, 4096):  # EOF: the exec closed it
        failure += chunk
    os.close(ready_r)
    if failure:
        os.waitpid(pid, 0)
        raise OSError(failure.decode("utf-8", "replace"))
    return pid


