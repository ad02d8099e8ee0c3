"""How a worker starts a tool process: every tool gets a new session, the
death signal, its working directory (and cgroup, and network namespace), its
output pipe on fd 1 and fd 2 (or, for a job that keeps stderr apart, a pipe
for each), its sandbox (execpool/shared/kernel/sandbox.py: entered while the rulesets'
descriptors are still open), no other descriptor, and its rlimits -- in that
order, so a lowered open-files limit cannot hide a descriptor from the
close, and a root tool has lost the capability to raise its rlimits before
they are set -- in one of three ways:

- ``vfork``: execpool.worker._spawn (C) vforks and execs ``bash -c`` or
  ``python -u FILE``;
- ``fork``: the pure-Python fallback, where the C extension was not built;
- ``warm``: no exec at all -- a parked spare of the worker's template
  becomes the job's interpreter (execpool/worker/warm/spare.py). The worker
  hands warm jobs to spares itself (execpool/worker/warm/handover.py);
  :func:`become_tool` is the ``Setup`` the spare shares with a fork.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, NoReturn, Optional, Tuple

from ..shared.jobs import Limits
from ..shared.kernel import linux, sandbox

try:
    from . import _spawn
except ImportError:  # not built here; the pure-Python start is used instead
    _spawn = None  # type: ignore[assignment]  # the extension is optional: every use asks first

#: How a worker builds a sandboxed job's Landlock rulesets: one C call each
#: where the extension was built (execpool/worker/rulesets.py).
RULESET_BUILDER = None if _spawn is None else _spawn.ruleset

#: How tools are started: "vfork" (execpool.worker._spawn) or "fork" (pure Python).
SPAWN_METHODS = ("vfork", "fork") if _spawn is not None else ("fork",)

#: Stdin of a job that was given none (and of the template and spares).
DEVNULL = os.open(os.devnull, os.O_RDONLY)


#: The Limits fields that are rlimits, in the order execpool.worker._spawn takes them.
RLIMIT_FIELDS = ("address_space", "cpu_seconds", "file_size", "open_files")
_RLIMITS = (resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_FSIZE, resource.RLIMIT_NOFILE)


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
class Setup:
    """What a tool's new process does to itself before the tool's first
    instruction -- a cold tool's after its vfork or fork, a warm job's in
    its spare -- in the order of the module docstring."""

    cwd: str
    #: The rlimits in the order execpool.worker._spawn takes them, -1 for none.
    rlimits: Tuple[int, ...]
    no_network: bool = False
    #: ``cgroup.procs`` files of the job's groups, written "0" to join them.
    join_fds: Tuple[int, ...] = ()
    #: The job's Landlock rulesets (execpool/worker/rulesets.py); none: no sandbox.
    rulesets: Tuple[int, ...] = ()
    #: The job's view (execpool/worker/view.py's ``View.arguments``); None: none.
    view: Optional[tuple] = None


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
            confinement = sandbox.child_arguments(setup.rulesets, setup.view) if setup.rulesets else None
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


def _apply_limits(rlimits: tuple) -> None:
    for which, value in zip(_RLIMITS, rlimits, strict=True):
        if value < 0:
            continue
        _soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value))


def rlimit_values(limits: Limits) -> tuple:
    """The rlimits in the order execpool.worker._spawn takes them, -1 for none:
    plain integers, which a spare receives and applies without building a
    Limits again."""
    return tuple(-1 if getattr(limits, field) is None else getattr(limits, field) for field in RLIMIT_FIELDS)


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
                _spawn.confine(*sandbox.child_arguments(setup.rulesets, setup.view))
            else:
                sandbox.enter(setup.rulesets, setup.view)
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
