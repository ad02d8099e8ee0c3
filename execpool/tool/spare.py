"""A warm spare: a clone of the worker's template that waits for one job
and then becomes that job's interpreter, running the job's file as ``python
-u FILE`` would, without an interpreter start-up.

Who runs this module: each **spare**, from the moment the template
(execpool/tool/template.py) cloned it. Parked, it waits on its socket
for one job -- rehearsing a warm start meanwhile when its worker is idle and
asks, so it takes its copy-on-write faults before the job comes -- then
says on the job's ready pipe that it took the job (and the CPU it had spent
until then, which is not the job's), is given the session, death signal,
working directory, stdin/stdout/stderr, sandbox and rlimits every tool gets
(``spawn.become_tool``), and runs the job.

What is reset here is what a cold interpreter would have differently from
the template: the environment, ``sys.argv``, ``sys.path[0]``, fresh
unbuffered std streams, a new ``__main__``, signal dispositions and exit
handlers. What a cold run does at the end is done too: uncaught exceptions
through ``sys.excepthook`` with the runner's own frame cut off,
``SystemExit`` codes, waiting for non-daemon threads, atexit handlers,
flushing.

What can still differ from a cold run (docs/library/warm.md lists it for users):
modules the template had imported (execpool's own, and the pool's
``preload``) are already in ``sys.modules`` -- that is the speed-up -- with
their state as of its start; ``sys.flags`` and ``sys.orig_argv`` are the
template's; a ``sitecustomize`` is re-imported only when the job's
``PYTHONPATH`` provides one.
"""

from __future__ import annotations

import array
import atexit
import builtins
import ctypes
import io
import os
import signal
import socket
import sys
import threading
import types
from importlib.machinery import SourceFileLoader
from typing import Callable, NoReturn, TextIO

from ..shared.kernel import linux
from ..shared.kernel.markers import JOB_MARKER_ENV
from .become import Setup, become_tool
from .spare_wire import (
    FIXED_FDS,
    JOB,
    MAX_CGROUP_FDS,
    MAX_RULESETS,
    MAX_VIEW_FDS,
    REHEARSE,
    REHEARSE_SHELL,
    SPARE_NAME,
    SPARE_PID,
    decode_job,
    taken,
    view_arguments,
    view_fd_count,
)

#: What the worker's own PYTHONPATH added to sys.path (execpool itself),
#: which a warm job's sys.path must not have: a cold tool does not.
_WORKER_PATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]

#: ``sys.exit("message")`` and anything else that is not an int.
_EXIT_FAILURE = 1
#: What CPython exits with when flushing stdout fails at the end.
_EXIT_FLUSH_FAILED = 120

def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def park(channel: socket.socket, worker_pid: int, name: str) -> NoReturn:
    """A spare's life before its job: become the worker's child for good,
    hand the worker its own socket over the template's channel, wait for one
    job (rehearsing if asked), become its tool. EOF means no job will come."""
    ready_w = -1
    try:
        linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != worker_pid:
            os._exit(0)  # the worker is gone: no job will come
        linux.set_name(SPARE_NAME)
        sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        channel.sendmsg([SPARE_PID.pack(os.getpid())],
                        [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [theirs.fileno()]))])
        theirs.close()
        channel.close()  # so that the template's end reaches the worker as EOF
        most = FIXED_FDS + MAX_RULESETS + MAX_VIEW_FDS + MAX_CGROUP_FDS
        while (received := socket.recv_fds(sock, 16, most))[0] in (REHEARSE, REHEARSE_SHELL):
            rehearse(shell=received[0] == REHEARSE_SHELL)
        message, fds, flags, _addr = received
        if message != JOB or len(fds) < FIXED_FDS or flags & socket.MSG_CTRUNC:
            os._exit(0)  # EOF: the worker let its spare go
        sock.close()
        description, stdin_fd, out_fd, err_fd, ready_w, *join_fds = fds
        os.write(ready_w, taken())
        script, env, cwd, rlimits, no_network, n_rulesets, view = decode_job(_read_all(description))
        n_view = view_fd_count(view)
        if len(join_fds) < n_rulesets + n_view:
            raise ValueError("a sandboxed job came without its rulesets")
        arguments = None if view is None else view_arguments(view, join_fds[n_rulesets:n_rulesets + n_view])
        setup = Setup(cwd, rlimits, no_network, tuple(join_fds[n_rulesets + n_view:]), tuple(join_fds[:n_rulesets]),
                      arguments)
        linux.set_name(name)  # the interpreter's own, as a cold start has it
    except BaseException as exc:  # noqa: BLE001 - a broken hand-over is the job's start failure
        if ready_w >= 0:
            os.write(ready_w, f"warm spare: {exc}".encode("utf-8", "replace")[:2048])
        os._exit(127)
    become_tool(setup, (stdin_fd, out_fd, err_fd), ready_w, worker_pid, _run_as(script, env))



def _run_as(script: str, env: dict) -> Callable[[int], None]:
    return lambda ready_fd: run(script, env, _WORKER_PATH, ready_fd)


def run(path: str, env: dict, worker_path: list, ready_fd: int) -> NoReturn:
    """Become the job's interpreter, close ``ready_fd`` (telling the worker
    the job started), run ``path`` as ``__main__`` and exit with its status."""
    # The template and its spares are not dumpable (a parked spare must stay
    # out of tools' reach); a cold tool is, after its exec.
    linux.prctl(linux.PR_SET_DUMPABLE, 1)
    _reset_handlers()
    stamp_marker(env.get(JOB_MARKER_ENV, ""))
    _set_environ(env)
    sys.argv = [path]
    job_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(path), *job_path,
                   *(p for p in sys.path[1:] if p not in worker_path and p not in job_path)]
    _fresh_std_streams()
    if job_path:
        sys.modules.pop("sitecustomize", None)
        try:
            import sitecustomize  # noqa: F401 - what a cold start imports from the job's path
        except ImportError:
            pass
    main = _new_main(path)
    sys.modules["__main__"] = main
    os.close(ready_fd)
    status = _run_main(path, main)
    os._exit(status)


def rehearse(shell: bool = False) -> None:
    """Run the steps of :func:`run` that leave no trace, on harmless input,
    in a warm spare waiting for its job (execpool/worker/spawn.py); with
    ``shell``, a silent cell through the IPython shell too, where the
    template built one.

    A spare is a clone of the template: every page it writes for the first time
    is copied then, a page fault that costs microseconds in a VM, and a warm
    start writes a few hundred pages (reference counts of the objects it
    touches). Taking those faults while the spare waits halves its start."""
    _reset_handlers()
    stamp_marker("")
    _set_environ(dict(os.environ))
    _fresh_std_streams()
    _new_main(os.devnull)
    compile("", os.devnull, "exec", dont_inherit=True)
    # Without making this module need IPython.
    ipython = sys.modules.get("execpool.tool.ipython_shell") if shell else None
    if ipython is not None:
        ipython.rehearse()


def _reset_handlers() -> None:
    """The worker's signal handling and exit handlers are not the job's."""
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    atexit._clear()


def _set_environ(env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)


def _new_main(path: str) -> types.ModuleType:
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins, __package__=None,
                         __spec__=None, __loader__=SourceFileLoader("__main__", path))
    return main


def stamp_marker(marker: str) -> None:
    """Write the job's marker into the environment block the kernel shows as
    /proc/<pid>/environ -- the worker's own, reserved blank for this at its
    start. ``os.environ`` changes only this process's copy, so without the
    stamp a daemon forked (without exec) from a warm job would carry no
    marker and could not be attributed to its job."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rpartition(b")")[2].split()
    # env_start and env_end are fields 50 and 51 of stat; 3 precede this split.
    start, end = int(fields[47]), int(fields[48])
    block = ctypes.string_at(start, end - start)
    key = f"{JOB_MARKER_ENV}=".encode()
    if block.startswith(key):
        value_at = len(key)
    elif b"\0" + key in block:
        value_at = block.index(b"\0" + key) + 1 + len(key)
    else:
        return  # a worker started without the reserved room
    room = block.index(b"\0", value_at) - value_at
    stamp = marker.encode()
    if len(stamp) <= room:
        ctypes.memmove(start + value_at, stamp.ljust(room), room)


def _fresh_std_streams() -> None:
    """What ``-u`` gives: unbuffered binary layers, write-through text, in the
    encodings and error handlers this interpreter chose for its own streams
    (the worker's locale is the tools' locale)."""
    def text(fd: int, mode: str, like: TextIO) -> io.TextIOWrapper:
        raw = io.FileIO(fd, mode, closefd=False)
        layer = io.BufferedReader(raw) if mode == "rb" else raw
        return io.TextIOWrapper(layer, encoding=like.encoding, errors=like.errors,
                                write_through=mode != "rb")

    # The __std*__ names too, which typeshed calls final: a cold interpreter's
    # are its own streams, and a job that restores them must get these.
    sys.stdin = sys.__stdin__ = text(0, "rb", sys.__stdin__ or sys.stdin)  # type: ignore[misc]
    sys.stdout = sys.__stdout__ = text(1, "wb", sys.__stdout__ or sys.stdout)  # type: ignore[misc]
    sys.stderr = sys.__stderr__ = text(2, "wb", sys.__stderr__ or sys.stderr)  # type: ignore[misc]


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return _EXIT_FAILURE


def _run_main(path: str, main: types.ModuleType) -> int:
    interrupted = False
    try:
        with open(path, "rb") as f:
            code = compile(f.read(), path, "exec", dont_inherit=True)
        exec(code, main.__dict__)
        status = 0
    except SystemExit as exc:
        status = _exit_code(exc.code)
    except BaseException as exc:  # noqa: BLE001 - the job's uncaught exception, reported as Python would
        # Cut this frame off, on the exception itself: the default hook
        # prints the exception's own traceback, not the one it is given.
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        interrupted = isinstance(exc, KeyboardInterrupt)
        status = _EXIT_FAILURE
    status = _finalize(status)
    if interrupted:
        # A cold interpreter ends an uncaught Ctrl-C by dying of SIGINT.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return status


def _finalize(status: int) -> int:
    """Py_FinalizeEx's order: non-daemon threads, atexit handlers, flush."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:  # noqa: BLE001 - a cold interpreter ignores these too
        pass
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001
        status = _EXIT_FLUSH_FAILED
    try:
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001
        pass
    return status
