"""The worker's side of warm Python: its template and the spares parked in
it, as handles the worker's loop watches.

Runs in the worker process, on its loop (execpool/worker/event_loop.py). The
template (execpool/tool/template.py) is a process the worker starts
once (again only if it dies); each spare it asks for arrives over the
template's socket as a pid and a socket of the spare's own, and waits
parked until a job is handed to it (execpool/worker/warm/handover.py). A
spare never writes to its socket, so the socket turns readable only when
the spare is gone. A tool can SIGSTOP the template and the parked spares
(they run as its user): each is continued whenever it is about to be
needed, so one stopped while idle costs nothing.
"""

from __future__ import annotations

import array
import contextlib
import os
import selectors
import signal
import socket
import subprocess
import sys
from typing import Callable, Optional, Tuple

from ...tool.become import Setup
from ...tool.spare_wire import JOB, REHEARSE, REHEARSE_SHELL, SPARE_PID, UNLIMITED
from ...tool.template import unfindable
from ..spawn import Tool, start_tool

#: How long the jobs' interpreter may take to say which ``preload`` modules
#: it lacks, when it is not the worker's.
PRELOAD_CHECK_S = 30.0

#: The template's malloc asks for transparent huge pages (glibc's
#: ``madvise``, which the usual system setting, ``madvise``, waits for), and
#: so do the spares it clones. A fork copies a page-table entry per page
#: mapped: a session holding 100 MB in 2 MiB pages forks in 0.4 ms of
#: kernel time, not 3-4 ms, and 1000 MB in 0.7 ms, not 20 (``fork()`` of
#: sessions); a big allocation faults 512 times less. A write after a fork
#: still copies 4 KiB (the kernel splits a shared huge page, it does not
#: copy it). glibc reads this at start only, so it is the template's alone:
#: not in any job's ``os.environ``, nor in what a job starts. A pool whose
#: jobs are given ``GLIBC_TUNABLES`` (``ExecPool(env=...)``) has its
#: template start with those instead.
MALLOC_TUNABLES = "glibc.malloc.hugetlb=1"


def preload_errors(python: str, preload: Tuple[str, ...]) -> Tuple[str, ...]:
    """Find what warm jobs should find already loaded -- the template
    imports it (execpool/tool/template.py), the worker imports none
    of the caller's code -- and report what cannot be found, so the pool
    can say which module is at fault."""
    if not preload:
        return ()
    if python == sys.executable:  # a venv's python is a link to its base: the path tells them apart
        return tuple(unfindable(preload))
    # Another interpreter (a runtime of the jobs' own): asked, as its
    # template will import them there.
    ask = ("import sys\nfrom execpool.tool.template import unfindable\n"
           "print(*unfindable(sys.argv[1:]), sep='\\n')")
    try:
        done = subprocess.run([python, "-c", ask, *preload], capture_output=True, text=True,
                              timeout=PRELOAD_CHECK_S, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return (f"{python} could not be asked for them: {exc}",)
    if done.returncode:
        return (f"{python} could not be asked for them: {done.stderr.strip()[-500:]}",)
    return tuple(line for line in done.stdout.splitlines() if line)


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

    def __init__(self, spawn_method: str, python: str, preload: tuple, warm_ipython: bool) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # The pool's interpreter, not necessarily the worker's: a warm
            # job runs with what a cold one would (execpool comes from the
            # worker's PYTHONPATH, which the spare takes off the job's path).
            argv = [python, "-m", "execpool.tool.template", str(os.getpid()), ",".join(preload),
                    "ipython" if warm_ipython else "no-ipython"]
            env = {"GLIBC_TUNABLES": MALLOC_TUNABLES, **os.environ}
            template = Tool(argv, env, Setup("/", UNLIMITED), stdin_fd=theirs.fileno())
            self.pid, readers = start_tool(template, spawn_method)
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
        if len(data) == SPARE_PID.size and len(fds) == 1:
            spare = socket.socket(fileno=fds[0])
            spare.setblocking(False)
            return WarmSpare(SPARE_PID.unpack(data)[0], spare)
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

    def rehearse(self, shell: bool) -> None:
        if not self.rehearsed:
            self.rehearsed = True
            with contextlib.suppress(OSError):  # gone: its socket's EOF says so
                self.sock.send(REHEARSE_SHELL if shell else REHEARSE)

    def hand(self, description: int, stdin_fd: int, out_fd: int, err_fd: int, ready_w: int,
             join_fds: list, rulesets: tuple = ()) -> bool:
        """Give the spare its job; False when the spare is gone (the job then
        needs another). The descriptors stay the caller's to close."""
        fds = array.array("i", [description, stdin_fd, out_fd, err_fd, ready_w, *rulesets, *join_fds])
        _continue(self.pid)
        try:
            self.sock.sendmsg([JOB], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
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

    def __init__(self, sel: selectors.BaseSelector, spawn_method: str, python: str, preload: tuple,
                 warm_ipython: bool, parked: int, on_change: Callable[[], None]) -> None:
        self.sel = sel
        self.spawn_method = spawn_method
        self.python = python
        self.preload = preload
        self.warm_ipython = warm_ipython
        self.target = parked
        self.on_change = on_change
        self.template: Optional[WarmTemplate] = None
        self.parked: dict[int, WarmSpare] = {}  # by socket fd, oldest first
        self.asked = 0
        self.failures = 0
        #: A session speaking IPython has started here: parked spares
        #: rehearse its shell too (execpool/tool/spare_wire.py, REHEARSE_SHELL).
        self.ipython_sessions = False

    def want(self, waiting: int) -> Optional[str]:
        """Ask for enough spares to serve ``waiting`` jobs and keep the
        target parked; return why no template can be had, if none can (once:
        the next call tries afresh)."""
        if self.template is None:
            if self.failures >= MAX_TEMPLATE_FAILURES:
                self.failures = 0
                return f"the warm template exited {MAX_TEMPLATE_FAILURES} times before it made a spare"
            try:
                self.template = WarmTemplate(self.spawn_method, self.python, self.preload, self.warm_ipython)
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
        """Have every parked spare rehearse (the worker is idle): its IPython
        shell too once a session here has spoken IPython."""
        for spare in self.parked.values():
            spare.rehearse(self.ipython_sessions)

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
