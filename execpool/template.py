"""Where warm jobs start: a worker's *template* process and its *spares*.

Who runs this module:

- the **template**, ``python -m execpool.template WORKER_PID PRELOAD``: a
  fresh interpreter the worker starts with an exec (never a fork of the
  worker), so it has never held any job's code, environment, stdin or
  output. It imports what warm jobs should find loaded, freezes its heap,
  and then does one thing: on each request from its worker it clones a
  *spare* with CLONE_PARENT (see ``_linux.fork_sibling``), so the spare is
  the worker's own child -- reaped by the worker, killed with it -- and
  hands the spare's socket to the worker;
- each **spare**: waits for exactly one job on its socket -- rehearsing a
  warm start meanwhile when its worker is idle and asks, so it takes its
  copy-on-write faults before the job comes -- and becomes that job's
  interpreter (execpool/warm.py);
- the **worker** (execpool/worker.py), through :class:`WarmTemplate` and
  :class:`WarmSpare`, the handles at the bottom of this module.

Every warm job runs in a spare, so a warm job's memory holds what the
template held and its own job's data, never another job's: not of a job that
runs beside it, nor of one that ran before. The hand-over is a single
message of descriptors: the job's description as JSON in an anonymous file
(no unpickling, nothing but strings, numbers and booleans), its stdin, its
stdout and stderr (one pipe twice, unless the job keeps them apart), the
ready pipe, the job's sandbox rulesets when it has them, and its cgroup
files. A parked spare is not sandboxed: it restricts itself for its one
job, so no two jobs ever share a domain. Nothing in it blocks the worker: the spare
reports on the ready pipe, which the worker watches in its loop like any
other descriptor.
"""

from __future__ import annotations

import array
import contextlib
import gc
import importlib
import marshal
import os
import resource
import selectors
import signal
import socket
import struct
import sys
from typing import Callable, NoReturn, Optional

from . import _linux, sandbox, warm
from .jobs import Limits
from .spawn import DEVNULL, RLIMIT_FIELDS, become_tool, rlimit_values, run_warm, start_tool

#: Spare -> worker, over the template's channel: the spare's pid, its
#: socket passed along.
_SPARE_PID = struct.Struct("=i")

#: Worker -> spare: the hand-over's one message, and the descriptors it
#: carries (description, stdin, stdout, stderr, ready pipe, then the
#: sandbox's rulesets, as many as the description says, then cgroup files).
_JOB = b"job"
_FIXED_FDS = 5
MAX_RULESETS = 2
MAX_CGROUP_FDS = 8

#: A spare's first word on the ready pipe: it has the job. A spare that dies
#: before saying it was killed while parked, and the job goes to another.
TAKEN = b"\x01"

#: Said with TAKEN, in the same write: the CPU seconds (user, system) the
#: spare had spent until then -- its clone, its wait, its rehearsals. They
#: are in its ``wait4`` figures but are not the job's, and the worker takes
#: them off, so a warm job's CPU is its own. Written before any of the job's
#: code runs, and the pipe is closed before it does: the job cannot forge it.
_SPENT = struct.Struct("=dd")

#: Worker -> parked spare: rehearse a warm start now (execpool/warm.py),
#: taking the copy-on-write faults a job would take. Only a worker idle for
#: REHEARSE_WHEN_IDLE_S asks: a busy worker's spares are taken soon, and
#: there a rehearsal would only spend CPU that a batch is short of.
_REHEARSE = b"rehearse"
REHEARSE_WHEN_IDLE_S = 0.01

#: What ``ps`` calls a worker's template and its parked spares.
TEMPLATE_NAME = "execpool-templ"
SPARE_NAME = "execpool-spare"

#: No limits for the template itself: it runs no job's code.
_UNLIMITED = Limits(address_space=None, cpu_seconds=None, file_size=None, open_files=None)


def encode_job(script: str, env: dict, cwd: str, limits: Limits, no_network: bool, rulesets: int,
               writable: Optional[tuple]) -> bytes:
    """marshal, not pickle: it builds plain values in C -- no class is
    looked up, nothing is called -- and it runs little Python in a spare,
    whose every page touched is a copy-on-write fault on a warm job's path."""
    return marshal.dumps((script, env, cwd, rlimit_values(limits), no_network, rulesets, writable))


def decode_job(data: bytes) -> tuple[str, dict, str, tuple, bool, int, Optional[tuple]]:
    """The hand-over's description, checked field by field: a spare takes
    nothing but what :func:`encode_job` writes."""
    script, env, cwd, rlimits, no_network, rulesets, writable = marshal.loads(data)
    if not (type(script) is str and type(cwd) is str and type(no_network) is bool and type(env) is dict
            and type(rulesets) is int and 0 <= rulesets <= MAX_RULESETS
            and (writable is None or type(writable) is tuple and all(type(path) is str for path in writable))
            and all(type(k) is str and type(v) is str for k, v in env.items())
            and type(rlimits) is tuple and len(rlimits) == len(RLIMIT_FIELDS)
            and all(type(value) is int for value in rlimits)):
        raise ValueError("not a warm job description")
    return script, env, cwd, rlimits, no_network, rulesets, writable


def _taken() -> bytes:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return TAKEN + _SPENT.pack(usage.ru_utime, usage.ru_stime)


def read_report(report: bytes) -> tuple[bool, tuple[float, float], bytes]:
    """What a spare said on its ready pipe: whether it took the job, the CPU
    it had spent before, and the failure it reported after (b"" for none)."""
    if not report.startswith(TAKEN) or len(report) < len(TAKEN) + _SPENT.size:
        return False, (0.0, 0.0), report[len(TAKEN):]
    return True, _SPENT.unpack_from(report, len(TAKEN)), report[len(TAKEN) + _SPENT.size:]


def main(argv: list) -> NoReturn:
    """The template's life: set up once, then one spare per request until
    the worker closes its socket."""
    worker_pid, preload = int(argv[0]), [name for name in argv[1].split(",") if name]
    try:
        # The worker's socket came as stdin; the template writes nothing.
        sock = socket.socket(fileno=os.dup(0))
        for fd in (0, 1, 2):
            os.dup2(DEVNULL, fd)
        # Only root may then read a spare's memory or trace it: a parked
        # spare is a template's clone, and a job's tools run as this user.
        _linux.prctl(_linux.PR_SET_DUMPABLE, 0)
        if os.getppid() != worker_pid:
            os._exit(0)  # the worker died before we got here
        for name in preload:
            with contextlib.suppress(BaseException):  # the worker already reported it
                importlib.import_module(name)
        warm.rehearse()
        decode_job(encode_job("", {}, "", _UNLIMITED, False, 0, None))
        sandbox.prepare()
        gc.collect()
        gc.freeze()
        with open("/proc/self/comm", encoding="utf-8") as f:
            name = f.read().strip()
        _linux.set_name(TEMPLATE_NAME)
        # As little as possible between clones: every page the template
        # writes after one is copied, the clone having shared it.
        while sock.recv(16):
            if _linux.fork_sibling() == 0:
                _park(sock, worker_pid, name)
    except BaseException:  # noqa: BLE001 - the worker sees EOF and starts another template
        os._exit(1)
    os._exit(0)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def _park(channel: socket.socket, worker_pid: int, name: str) -> NoReturn:
    """A spare's life before its job: become the worker's child for good,
    hand the worker its own socket over the template's channel, wait for one
    job (rehearsing if asked), become its tool. EOF means no job will come."""
    ready_w = -1
    try:
        _linux.prctl(_linux.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != worker_pid:
            os._exit(0)  # the worker is gone: no job will come
        _linux.set_name(SPARE_NAME)
        sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        channel.sendmsg([_SPARE_PID.pack(os.getpid())],
                        [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [theirs.fileno()]))])
        theirs.close()
        channel.close()  # so that the template's end reaches the worker as EOF
        while (received := socket.recv_fds(sock, 16, _FIXED_FDS + MAX_RULESETS + MAX_CGROUP_FDS))[0] == _REHEARSE:
            warm.rehearse()
        message, fds, flags, _addr = received
        if message != _JOB or len(fds) < _FIXED_FDS or flags & socket.MSG_CTRUNC:
            os._exit(0)  # EOF: the worker let its spare go
        sock.close()
        description, stdin_fd, out_fd, err_fd, ready_w, *join_fds = fds
        os.write(ready_w, _taken())
        script, env, cwd, rlimits, no_network, n_rulesets, writable = decode_job(_read_all(description))
        if len(join_fds) < n_rulesets:
            raise ValueError("a sandboxed job came without its rulesets")
        rulesets, join_fds = tuple(join_fds[:n_rulesets]), join_fds[n_rulesets:]
        _linux.set_name(name)  # the interpreter's own, as a cold start has it
    except BaseException as exc:  # noqa: BLE001 - a broken hand-over is the job's start failure
        if ready_w >= 0:
            os.write(ready_w, f"warm spare: {exc}".encode("utf-8", "replace")[:2048])
        os._exit(127)
    become_tool(cwd, rlimits, (stdin_fd, out_fd, err_fd), no_network, join_fds, ready_w, worker_pid,
                run_warm(script, env), rulesets, writable)


# -- the worker's handles -------------------------------------------------------


def _continue(pid: int) -> None:
    """A tool can SIGSTOP the template and parked spares (they run as its
    user): each is continued whenever it is about to be needed, so one
    stopped while idle costs nothing. (A child of the worker's, so its pid
    cannot be someone else's before the worker reaps it.)"""
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGCONT)


class WarmTemplate:
    """The worker's side of its template: the worker watches ``sock``, where
    each spare it asked for arrives. Starting one costs an interpreter
    start-up (tens of milliseconds), once per worker, or again after the
    template died."""

    def __init__(self, spawn_method: str, preload: tuple) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            argv = [sys.executable, "-m", "execpool.template", str(os.getpid()), ",".join(preload)]
            self.pid, readers = start_tool(argv, dict(os.environ), "/", _UNLIMITED, spawn_method, theirs.fileno())
            for fd in readers:
                os.close(fd)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self.sock = ours
        self.made = 0

    def ask(self) -> bool:
        """For one more spare; it arrives through :meth:`receive`. False when
        the request could not be sent (a template that is stopped or gone)."""
        _continue(self.pid)
        try:
            self.sock.send(b"s")
        except OSError:
            return False
        return True

    def receive(self) -> Optional[WarmSpare]:
        """The next spare; None once the template is gone; BlockingIOError
        when none has arrived after all."""
        try:
            data, fds, _flags, _addr = socket.recv_fds(self.sock, 64, 1, socket.MSG_CMSG_CLOEXEC)
        except OSError as exc:
            if isinstance(exc, BlockingIOError):
                raise
            return None
        if len(data) == _SPARE_PID.size and len(fds) == 1:
            spare = socket.socket(fileno=fds[0])
            spare.setblocking(False)
            return WarmSpare(_SPARE_PID.unpack(data)[0], spare)
        for fd in fds:
            os.close(fd)
        return None

    def close(self) -> None:
        """The template reads EOF and exits; spares already made stay."""
        self.sock.close()


class WarmSpare:
    """The worker's handle on one parked spare: its pid and its socket.
    The spare never writes to the socket, so the socket turns readable only
    when the spare is gone."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.sock = sock
        self.rehearsed = False

    def rehearse(self) -> None:
        if not self.rehearsed:
            self.rehearsed = True
            with contextlib.suppress(OSError):  # gone: its socket's EOF says so
                self.sock.send(_REHEARSE)

    def hand(self, description: int, stdin_fd: int, out_fd: int, err_fd: int, ready_w: int,
             join_fds: list, rulesets: tuple = ()) -> bool:
        """Give the spare its job; False when the spare is gone (the job then
        needs another). The descriptors stay the caller's to close."""
        fds = array.array("i", [description, stdin_fd, out_fd, err_fd, ready_w, *rulesets, *join_fds])
        _continue(self.pid)
        try:
            self.sock.sendmsg([_JOB], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        except OSError:
            return False
        return True

    def close(self) -> None:
        """The spare reads EOF and exits (or has its job already)."""
        self.sock.close()


#: A template that dies this many times in a row before it made a single
#: spare cannot start (a broken interpreter or preload -- or a tool keeps
#: killing it): the warm jobs waiting for a spare then fail instead of
#: waiting for ever, and the next warm job tries again.
MAX_TEMPLATE_FAILURES = 3


class SpareSupply:
    """The worker's stock of spares: its template, the spares parked in it,
    and how many are on their way. The worker's loop owns the selector;
    ``on_change`` is called whenever a spare arrives or one is lost, so the
    worker can hand out waiting jobs and ask for more."""

    def __init__(self, sel: selectors.BaseSelector, spawn_method: str, preload: tuple, parked: int,
                 on_change: Callable[[], None]) -> None:
        self.sel = sel
        self.spawn_method = spawn_method
        self.preload = preload
        self.target = parked
        self.on_change = on_change
        self.template: Optional[WarmTemplate] = None
        self.parked: dict[int, WarmSpare] = {}  # by socket fd, oldest first
        self.asked = 0
        self.failures = 0

    def want(self, waiting: int) -> Optional[str]:
        """Ask for enough spares to serve ``waiting`` jobs and keep the
        target parked; return why no template can be had, if none can (once:
        the next call tries afresh)."""
        if self.template is None:
            if self.failures >= MAX_TEMPLATE_FAILURES:
                self.failures = 0
                return f"the warm template exited {MAX_TEMPLATE_FAILURES} times before it made a spare"
            try:
                self.template = WarmTemplate(self.spawn_method, self.preload)
            except OSError as exc:
                return f"cannot start the warm template: {exc}"
            self.sel.register(self.template.sock, selectors.EVENT_READ, self._on_template)
        while len(self.parked) + self.asked < waiting + self.target and self.template.ask():
            self.asked += 1
        return None

    def pop(self) -> Optional[WarmSpare]:
        """The oldest parked spare (rehearsed by now), or None."""
        if not self.parked:
            return None
        spare = self.parked.pop(next(iter(self.parked)))
        self.sel.unregister(spare.sock)
        return spare

    def rehearse(self) -> None:
        """Have every parked spare rehearse (the worker is idle)."""
        for spare in self.parked.values():
            spare.rehearse()

    def pids(self) -> set:
        """The worker's children that are the template or a parked spare."""
        return {spare.pid for spare in self.parked.values()} | (set() if self.template is None else
                                                                 {self.template.pid})

    def made(self, pid: int) -> bool:
        """Whether ``pid`` is a spare of the live template that has no job:
        still in the template's session (a job's spare makes its own at once,
        and nothing a job starts can join the template's)."""
        if self.template is None:
            return False
        try:
            return os.getsid(pid) == self.template.pid
        except OSError:
            return False

    def exited(self, pid: int) -> bool:
        """The worker reaped ``pid``: True when it was the template."""
        if self.template is None or pid != self.template.pid:
            return False
        self._lose_template()
        self.on_change()
        return True

    def close(self) -> None:
        if self.template is not None:
            self.sel.unregister(self.template.sock)
            self.template.close()
            self.template = None
        while (spare := self.pop()) is not None:
            spare.close()

    def _on_template(self, fd: int) -> None:
        if self.template is None or self.template.sock.fileno() != fd:
            return  # an event from the select batch in which the template was lost
        try:
            spare = self.template.receive()
        except BlockingIOError:
            return
        if spare is None:
            self._lose_template()
        else:
            self.asked -= 1
            self.failures = 0
            self.template.made += 1
            self.parked[spare.sock.fileno()] = spare
            self.sel.register(spare.sock, selectors.EVENT_READ, self._on_spare_gone)
        self.on_change()

    def _on_spare_gone(self, fd: int) -> None:
        """A parked spare's socket turned readable: the spare died (killed
        while parked, by a job's pkill say). Another will be asked for."""
        spare = self.parked.pop(fd, None)
        if spare is not None:
            self.sel.unregister(spare.sock)
            spare.close()
            self.on_change()

    def _lose_template(self) -> None:
        if self.template is None:
            return
        self.failures += self.template.made == 0
        self.sel.unregister(self.template.sock)
        self.template.close()
        self.template = None
        self.asked = 0  # the spares it was making die with their socket's other end


if __name__ == "__main__":
    main(sys.argv[1:])
