"""How a worker starts a tool process: every tool gets a new session, the
death signal, its working directory (and cgroup, and network namespace), its
output pipe on fd 1 and fd 2 (or, for a job that keeps stderr apart, a pipe
for each), its sandbox (execpool/shared/kernel/sandbox.py: entered while the rulesets'
descriptors are still open), no other descriptor, and its rlimits -- in that
order, so a lowered open-files limit cannot hide a descriptor from the
close, and a root tool has lost the capability to raise its rlimits before
they are set -- in one of three ways:

- ``vfork``: execpool._spawn (C) vforks and execs ``bash -c`` or ``python -u FILE``;
- ``fork``: the pure-Python fallback, where the C extension was not built;
- ``warm``: no exec at all -- a parked spare of the worker's template becomes
  the job's interpreter (execpool/worker/warm/template.py, execpool/worker/warm/spare.py). The worker
  hands warm jobs to spares itself; :func:`become_tool` is the setup the
  spare shares with a fork.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
from typing import Callable, Iterator, NoReturn, Optional, Tuple

from ..shared.jobs import Limits
from ..shared.kernel import linux, sandbox

try:
    from . import _spawn
except ImportError:  # not built here; the pure-Python start is used instead
    _spawn = None

#: How a worker builds a sandboxed job's Landlock rulesets: one C call each
#: where the extension was built (execpool/worker/rulesets.py).
RULESET_BUILDER = None if _spawn is None else _spawn.ruleset

#: How tools are started: "vfork" (execpool._spawn) or "fork" (pure Python).
SPAWN_METHODS = ("vfork", "fork") if _spawn is not None else ("fork",)

#: Stdin of a job that was given none (and of the template and spares).
DEVNULL = os.open(os.devnull, os.O_RDONLY)


#: The Limits fields that are rlimits, in the order execpool._spawn takes them.
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


def start_tool(argv: list, env: dict, cwd: str, limits: Limits, method: str, stdin_fd: int = -1,
               no_network: bool = False, join_fds: list = (), separate_stderr: bool = False,
               rulesets: Tuple[int, ...] = (), writable: Optional[Tuple[str, ...]] = None) -> tuple[int, list]:
    """Start one tool with ``method`` "vfork" or "fork"; return its pid and
    the read ends of its output pipes (see :func:`output_pipes`). Its
    ``rulesets`` (execpool/worker/rulesets.py), if any, confine the tool before it
    runs, in a read-only view but for its ``writable`` paths unless those
    are None."""
    stdin_fd = DEVNULL if stdin_fd < 0 else stdin_fd
    _OwnMemory.reset_peak()
    with output_pipes(separate_stderr) as (readers, out_w, err_w):
        if method == "vfork":
            envp = [f"{key}={value}" for key, value in env.items()]
            confinement = sandbox.child_arguments(rulesets, _view(writable, cwd)) if rulesets else None
            pid = _spawn.spawn(argv, envp, cwd, rlimit_values(limits), stdin_fd, out_w, err_w, no_network,
                               list(join_fds), confinement)
        else:
            pid = _fork_child(cwd, rlimit_values(limits), (stdin_fd, out_w, err_w), no_network, list(join_fds),
                              _exec(argv, env), rulesets, writable)
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
    for which, value in zip(_RLIMITS, rlimits):
        if value < 0:
            continue
        _soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value))


def rlimit_values(limits: Limits) -> tuple:
    """The rlimits in the order execpool._spawn takes them, -1 for none:
    plain integers, which a spare receives and applies without building a
    Limits again."""
    return tuple(-1 if getattr(limits, field) is None else getattr(limits, field) for field in RLIMIT_FIELDS)


def _view(writable: Optional[Tuple[str, ...]], cwd: str) -> Optional[tuple]:
    return None if writable is None else sandbox.view_arguments(writable, cwd)


def _exec(argv: list, env: dict) -> Callable[[int], None]:
    def then(_ready_fd: int) -> None:
        # exec resets caught signals itself; ignored ones would stay ignored.
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        os.execve(argv[0], argv, env)

    return then



def _fork_child(cwd: str, rlimits: tuple, stdio: tuple, no_network: bool, join_fds: list,
                then: Callable[[int], None], rulesets: Tuple[int, ...] = (),
                writable: Optional[Tuple[str, ...]] = None) -> int:
    """Fork, set the child up as every tool is set up, then hand it to
    ``then(ready_fd)``, which execs."""
    ready_r, ready_w = os.pipe()
    worker_pid = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        become_tool(cwd, rlimits, stdio, no_network, join_fds, ready_w, worker_pid, then, rulesets, writable)
    os.close(ready_w)
    failure = b""
    while chunk := os.read(ready_r, 4096):  # EOF: the exec closed it
        failure += chunk
    os.close(ready_r)
    if failure:
        os.waitpid(pid, 0)
        raise OSError(failure.decode("utf-8", "replace"))
    return pid


def become_tool(cwd: str, rlimits: tuple, stdio: tuple, no_network: bool, join_fds: list, ready_w: int,
                parent_pid: int, then: Callable[[int], None], rulesets: Tuple[int, ...] = (),
                writable: Optional[Tuple[str, ...]] = None) -> NoReturn:
    """In a fork of the worker (or a spare): the session, death signal,
    directory, pipes, sandbox (when given ``rulesets``, and ``writable``
    for its read-only view) and limits every
    tool gets; ``stdio`` holds what goes on fds 0, 1 and 2. A failure before
    ``then`` takes over reaches the worker through ``ready_w``."""
    try:
        for fd in join_fds:
            os.write(fd, b"0")  # this process into its job's cgroup
        os.setsid()
        if no_network:
            linux.unshare_network()
        linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:
            os._exit(137)  # the parent died before the death signal was armed
        os.chdir(cwd)
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
        if rulesets:
            if _spawn is not None:
                _spawn.confine(*sandbox.child_arguments(rulesets, _view(writable, cwd)))
            else:
                sandbox.enter(rulesets, _view(writable, cwd))
        close_all_but(ready_w)  # the worker's pipes, selector and channel are not the tool's
        _apply_limits(rlimits)
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
