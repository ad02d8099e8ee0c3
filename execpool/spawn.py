"""How a worker starts a tool process: every tool gets a new session, the
death signal, its rlimits, its working directory (and cgroup, and network
namespace) and the merged stdout/stderr pipe, in one of three ways:

- ``vfork``: execpool._spawn (C) vforks and execs ``bash -c`` or ``python -u FILE``;
- ``fork``: the pure-Python fallback, where the C extension was not built;
- ``warm``: no exec at all -- a fork of the worker becomes the job's
  interpreter (execpool/warm.py).

A warm job on an idle worker skips even the fork: the worker keeps a
*template*, a fork of itself made the first time, which does nothing but
fork *spares*. A spare rehearses a warm start (so the pages it will write
are copied before the job comes), then parks until a warm job is handed to
it over a socket. The worker never forks for them, so it never pays for the
copy-on-write faults a fork costs the parent: hundreds per fork, microseconds
each in a VM, on the path of every job the worker handles next. The
template, which only forks, writes almost nothing. It forks each spare
through a short-lived middle process, which exits at once: the spare is
then re-parented to the worker (a child subreaper), so the worker reaps its
warm jobs as it reaps every other tool and sees their exit at once. The
middle fork makes a spare cost more CPU than a plain fork, which is why a
busy worker makes none (execpool/worker.py). Without a spare (the first
warm job, a busy worker, a spare or template that was killed) a warm job is
forked from the worker.
"""

from __future__ import annotations

import array
import contextlib
import os
import pickle
import resource
import signal
import socket
import struct
import time
from typing import Callable, NoReturn, Optional

from . import _linux, warm
from .jobs import Limits

try:
    from . import _spawn
except ImportError:  # not built here; the pure-Python start is used instead
    _spawn = None

#: How tools are started: "vfork" (execpool._spawn) or "fork" (pure Python).
SPAWN_METHODS = ("vfork", "fork") if _spawn is not None else ("fork",)

_DEVNULL = os.open(os.devnull, os.O_RDONLY)

#: What the worker's own PYTHONPATH added to sys.path (execpool itself), which
#: a warm job's sys.path must not have: a cold tool does not.
_WORKER_PATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]

_RLIMITS = (
    ("address_space", "RLIMIT_AS"),
    ("cpu_seconds", "RLIMIT_CPU"),
    ("file_size", "RLIMIT_FSIZE"),
    ("open_files", "RLIMIT_NOFILE"),
)

#: A job hands its spare stdin, output, ready pipe and cgroup files.
_MAX_PASSED_FDS = 16

#: Template -> worker: a new spare's pid, its socket passed along.
_SPARE_PID = struct.Struct("=i")

#: A spare's first word on the ready pipe: it has the job. A spare that dies
#: before saying it was killed while parked, and the job needs a fresh fork.
_TAKEN = "\x01"

#: What ``ps`` calls a worker's template and its parked spares.
TEMPLATE_NAME = "execpool-templ"
SPARE_NAME = "execpool-spare"

#: How often a new spare looks whether the middle process that forked it is
#: gone (it exits right after the fork).
_REPARENT_POLL_S = 0.0002


def start_tool(argv: list, env: dict, cwd: str, limits: Limits, method: str, stdin_fd: int = -1,
               no_network: bool = False, join_fds: list = (), spare: Optional[WarmSpare] = None,
               ) -> tuple[int, int]:
    """Start one tool; return its pid and the read end of its merged
    stdout/stderr pipe. For ``method="warm"`` (argv is ``[python, -u, FILE]``)
    the job runs in ``spare`` if given and alive, else in a fresh fork."""
    stdin_fd = _DEVNULL if stdin_fd < 0 else stdin_fd
    out_r, out_w = os.pipe()
    try:
        if method == "vfork":
            envp = [f"{key}={value}" for key, value in env.items()]
            pid = _spawn.spawn(argv, envp, cwd, _limit_values(limits), stdin_fd, out_w, no_network, list(join_fds))
        elif method == "warm":
            script = argv[-1]
            pid = None
            if spare is not None:
                pid = spare.take(script, env, cwd, limits, stdin_fd, out_w, no_network, list(join_fds))
            if pid is None:
                pid = _fork_child(cwd, limits, stdin_fd, out_w, no_network, list(join_fds), _run_warm(script, env))
        else:
            pid = _fork_child(cwd, limits, stdin_fd, out_w, no_network, list(join_fds), _exec(argv, env))
    except BaseException:
        os.close(out_r)
        raise
    finally:
        os.close(out_w)
    return pid, out_r


def _apply_limits(limits: Limits) -> None:
    for field, name in _RLIMITS:
        value = getattr(limits, field)
        if value is None:
            continue
        which = getattr(resource, name)
        _soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value))


def _limit_values(limits: Limits) -> tuple:
    """The rlimits in the order execpool._spawn takes them, -1 for none."""
    return tuple(-1 if getattr(limits, field) is None else getattr(limits, field) for field, _ in _RLIMITS)


def _exec(argv: list, env: dict) -> Callable[[int], None]:
    def then(_ready_fd: int) -> None:
        # exec resets caught signals itself; ignored ones would stay ignored.
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        os.execve(argv[0], argv, env)

    return then


def _run_warm(script: str, env: dict) -> Callable[[int], None]:
    return lambda ready_fd: warm.run(script, env, _WORKER_PATH, ready_fd)


def _fork_child(cwd: str, limits: Limits, stdin_fd: int, out_fd: int, no_network: bool,
                join_fds: list, then: Callable[[int], None]) -> int:
    """Fork, set the child up as every tool is set up, then hand it to
    ``then(ready_fd)``, which execs, or closes ``ready_fd`` and runs warm."""
    ready_r, ready_w = os.pipe()
    worker_pid = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        _become_tool(cwd, limits, stdin_fd, out_fd, no_network, join_fds, ready_w, worker_pid, then)
    os.close(ready_w)
    failure = _await_start(ready_r)
    if failure:
        os.waitpid(pid, 0)
        raise OSError(failure)
    return pid


def _become_tool(cwd: str, limits: Limits, stdin_fd: int, out_fd: int, no_network: bool,
                 join_fds: list, ready_w: int, parent_pid: int, then: Callable[[int], None]) -> NoReturn:
    """In a fork of the worker (or a spare): the session, death signal,
    limits, directory and pipes every tool gets. A failure before ``then``
    takes over reaches the worker through ``ready_w``."""
    try:
        for fd in join_fds:
            os.write(fd, b"0")  # this process into its job's cgroup
        os.setsid()
        if no_network:
            _linux.unshare_network()
        _linux.prctl(_linux.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:
            os._exit(137)  # the parent died before the death signal was armed
        _apply_limits(limits)
        os.chdir(cwd)
        os.dup2(stdin_fd, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        _close_all_but(ready_w)  # the worker's pipes, selector and channel are not the tool's
        then(ready_w)
    except BaseException as exc:  # noqa: BLE001 - report, never return into the loop
        try:
            os.write(ready_w, str(exc).encode("utf-8", "replace")[:2048])
        finally:
            os._exit(127)
    os._exit(127)  # ``then`` execs or exits; returning would run the worker's loop in the tool


def _await_start(ready_r: int) -> str:
    """Wait until the child execs or starts its warm job (``ready_r`` reaches
    EOF); return what it reported if it failed before that, else ""."""
    failure = b""
    while chunk := os.read(ready_r, 4096):
        failure += chunk
    os.close(ready_r)
    return failure.decode("utf-8", "replace")


def _close_all_but(*keep: int) -> None:
    """Close every descriptor from 3 up except ``keep``."""
    low = 3
    for fd in sorted(set(keep)):
        os.closerange(low, fd)
        low = max(low, fd + 1)
    os.closerange(low, resource.getrlimit(resource.RLIMIT_NOFILE)[0])


class WarmTemplate:
    """The worker's side of its template process (see the module docstring):
    the worker watches ``sock``, where each spare it asked for arrives."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        worker_pid = os.getpid()
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            raise
        if pid == 0:
            ours.close()
            _serve_spares(theirs, worker_pid)
        theirs.close()
        self.pid = pid
        self.sock = ours

    def ask(self) -> None:
        """For one more spare; it arrives through :meth:`receive`."""
        with contextlib.suppress(OSError):
            self.sock.send(b"s")

    def receive(self) -> Optional[WarmSpare]:
        """The next spare, or None once the template is gone."""
        try:
            data, fds, _flags, _addr = socket.recv_fds(self.sock, 64, 1)
        except OSError:
            return None
        if len(data) == _SPARE_PID.size and len(fds) == 1:
            return WarmSpare(_SPARE_PID.unpack(data)[0], socket.socket(fileno=fds[0]))
        for fd in fds:
            os.close(fd)
        return None

    def close(self) -> None:
        """The template reads EOF and exits; spares already made stay."""
        self.sock.close()


def _serve_spares(sock: socket.socket, worker_pid: int) -> NoReturn:
    """The template's loop: one spare per request, until EOF."""
    try:
        _linux.prctl(_linux.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != worker_pid:
            os._exit(0)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        _close_all_but(_DEVNULL, sock.fileno())
        with open("/proc/self/comm", encoding="utf-8") as f:
            name = f.read().strip()
        _linux.set_name(TEMPLATE_NAME)
        while sock.recv(16):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            pid_r, pid_w = os.pipe()
            middle = os.fork()
            if middle == 0:
                ours.close()
                os.close(pid_r)
                middle = os.getpid()
                spare = os.fork()
                if spare == 0:
                    os.close(pid_w)
                    _park(theirs, worker_pid, middle, name)
                os.write(pid_w, _SPARE_PID.pack(spare))
                os._exit(0)
            theirs.close()
            os.close(pid_w)
            pid = os.read(pid_r, _SPARE_PID.size)
            os.close(pid_r)
            os.waitpid(middle, 0)
            if len(pid) == _SPARE_PID.size:
                fds = array.array("i", [ours.fileno()])
                sock.sendmsg([pid], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            ours.close()
    except BaseException:  # noqa: BLE001 - the worker sees EOF and forks its warm jobs itself
        os._exit(1)
    os._exit(0)  # the worker let its template go


class WarmSpare:
    """The worker's handle on one parked spare: its pid and its socket."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.sock = sock

    def take(self, script: str, env: dict, cwd: str, limits: Limits, stdin_fd: int, out_fd: int,
             no_network: bool, join_fds: list) -> Optional[int]:
        """Start the job in the spare and return its pid (now the tool's), or
        None when the spare is gone and the job needs a fresh fork."""
        payload = pickle.dumps((script, env, cwd, limits, no_network))
        message = len(payload).to_bytes(8, "little") + payload
        ready_r, ready_w = os.pipe()
        fds = array.array("i", [stdin_fd, out_fd, ready_w, *join_fds])
        try:
            sent = self.sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        except OSError:
            os.close(ready_r)
            return None
        else:
            # The job is the spare's now: whatever goes wrong from here, the
            # ready pipe says, and no fresh fork may run it a second time.
            if sent < len(message):
                with contextlib.suppress(OSError):
                    self.sock.sendall(message[sent:])
        finally:
            os.close(ready_w)
            self.sock.close()
        report = _await_start(ready_r)
        if not report.startswith(_TAKEN):
            return None  # killed while parked (by a job's pkill, say) before it took the job
        if report != _TAKEN:
            raise OSError(report[len(_TAKEN):])  # the worker reaps the spare as any child
        return self.pid

    def close(self) -> None:
        """The spare reads EOF and exits."""
        self.sock.close()


def _park(sock: socket.socket, worker_pid: int, middle: int, name: str) -> NoReturn:
    """A spare's life before its job: drop every descriptor but stdio and
    its socket (the template's channel too, so its EOF reaches the worker),
    become the worker's child, rehearse, wait for one job, become its tool.
    EOF means no job will come."""
    ready_w = -1
    try:
        _close_all_but(_DEVNULL, sock.fileno())
        while (parent := os.getppid()) == middle:
            time.sleep(_REPARENT_POLL_S)
        # Armed only now: the middle process's exit would have fired it.
        _linux.prctl(_linux.PR_SET_PDEATHSIG, signal.SIGKILL)
        if parent != worker_pid or os.getppid() != worker_pid:
            os._exit(0)  # the worker is gone (or is no subreaper): no job will come
        _linux.set_name(SPARE_NAME)
        warm.rehearse()
        pickle.loads(pickle.dumps(("", {}, "", Limits(), False)))  # the hand-over's pages too
        head, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, _MAX_PASSED_FDS)
        if len(fds) < 3:
            os._exit(0)  # EOF: the worker let its spare go
        stdin_fd, out_fd, ready_w, *join_fds = fds
        os.write(ready_w, _TAKEN.encode())
        data = bytearray(head)
        while len(data) < 8 or len(data) < 8 + int.from_bytes(data[:8], "little"):
            chunk = sock.recv(1 << 16)
            if not chunk:
                os._exit(0)
            data += chunk
        sock.close()
        script, env, cwd, limits, no_network = pickle.loads(data[8:])
        _linux.set_name(name)  # the interpreter's own, as a cold start has it
    except BaseException as exc:  # noqa: BLE001 - a broken hand-over is the job's start failure
        if ready_w >= 0:
            os.write(ready_w, f"warm spare: {exc}".encode("utf-8", "replace")[:2048])
        os._exit(127)
    _become_tool(cwd, limits, stdin_fd, out_fd, no_network, join_fds, ready_w, worker_pid,
                 _run_warm(script, env))
