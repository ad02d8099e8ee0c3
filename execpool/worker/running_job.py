"""A job as the worker sees it while it runs: its tool, its output, its
life, how it ended.

Runs in the worker process: the loop (execpool/worker/event_loop.py), the process
book (execpool/worker/owners.py) and the warm hand-over
(execpool/worker/warm/handover.py) share it. A job's life is a ``Phase``
with its moves in one place (``_MOVES``); why the worker ended it, if it
did, is an ``Ending``.
"""

from __future__ import annotations

import contextlib
import enum
import os
import resource
import time
from collections import deque
from typing import Dict, Iterator, List, Optional, Tuple

from ..sandbox.view import View
from ..shared import worker_wire
from ..shared.files import File
from ..shared.kernel.cgroups import JobGroup
from ..shared.output import LiveBudget
from ..shared.result import Result, Status
from ..tool.become import DEVNULL
from .capture import MAX_ERROR_LINES, Capture
from .files import Placed
from .sessions.family import Family
from .sessions.link import SessionLink
from .space import Space
from .spawn import memfd_holding


class Phase(enum.Enum):
    """Where a job's leader is in its life."""

    #: A warm job waiting for a spare: no process yet.
    WAITING = "waiting"
    #: Its leader runs, or has exited and is not reaped yet.
    RUNNING = "running"
    #: Its leader was reaped -- or never ran (its start failed, it ended
    #: while waiting) or was given up on (the pool closed): nothing more of
    #: it will be reaped for the job.
    REAPED = "reaped"
    #: Its Result is out.
    FINISHED = "finished"


#: The moves a job's life may make: a spare that dies before it takes the
#: job sends it back to waiting; a killed leader stuck in the kernel past
#: the reap grace is finished without being reaped.
_MOVES = {
    Phase.WAITING: {Phase.RUNNING, Phase.REAPED},
    Phase.RUNNING: {Phase.WAITING, Phase.REAPED, Phase.FINISHED},
    Phase.REAPED: {Phase.FINISHED},
    Phase.FINISHED: set(),
}


class Ending(enum.Enum):
    """Why the worker ended a job before its tool did."""

    TIMEOUT = "timeout"
    CANCEL = "cancel"
    #: It went over a limit the worker keeps (its process count).
    LIMIT = "limit"
    #: The pool was closed under it.
    SHUTDOWN = "shutdown"


class Cost:
    """What a job's processes used, added up as the worker reaps them: each
    ``wait4`` figure covers one process and every descendant it waited for
    (Result's docstring says what that makes exact and what a bound)."""

    __slots__ = ("user", "system", "max_rss_kib", "processes")

    def __init__(self) -> None:
        self.user = 0.0
        self.system = 0.0
        self.max_rss_kib = 0
        self.processes = 0

    def add(self, usage: "resource.struct_rusage") -> None:
        self.user += usage.ru_utime
        self.system += usage.ru_stime
        self.max_rss_kib = max(self.max_rss_kib, usage.ru_maxrss)
        self.processes += 1


class RunningJob:
    """One job, from its Start to its Result."""

    def __init__(self, start: worker_wire.Start, marker: str) -> None:
        self.start = start
        self.marker = marker
        self.phase = Phase.WAITING
        self.pid: Optional[int] = None
        self.exit_code: Optional[int] = None
        self.ending: Optional[Ending] = None
        self.killed_at = 0.0
        self.error: Optional[str] = None
        # Whether ``error`` is execpool's failure (the tool never started,
        # the pool closed under it), not the program's (it went over a limit).
        self.infra = False
        self.error_lines: deque[str] = deque(maxlen=MAX_ERROR_LINES)  # of both streams
        self.stdout = Capture("stdout", start.max_output_chars, self.error_lines)
        self.stderr = Capture("stderr", start.max_output_chars, self.error_lines)
        # One per output pipe, in the order execpool/worker/spawn.py makes them: a
        # merged job's one pipe carries both streams, and its stderr stays empty.
        self.captures = (self.stdout, self.stderr) if start.separate_stderr else (self.stdout,)
        # The read ends not yet at EOF (or closed by a kill), and their Captures.
        self.pipes: Dict[int, Capture] = {}
        # Both streams count against one budget: the live cap is per job. One
        # character past it is sent, so the caller knows the cap was hit.
        self.live = None if start.live_cap is None else LiveBudget(start.live_cap, slack=1)
        self.started = time.monotonic()
        # Where it runs and what it is given (execpool/worker/launch.py):
        # its directory on the worker's side (``tmpdir`` when it is a private
        # one; "/" for a job whose working directory is its space's home),
        # a descriptor of its working directory (-1: none yet), its script
        # there (a name), what writing its files did there, the environment
        # its tool starts with.
        self.cwd = ""
        self.env: Dict[str, str] = {}
        self.tmpdir: Optional[str] = None
        self.workdir = -1
        self.script: Optional[str] = None
        self.placed: Optional[Placed] = None
        #: What its ``fetch`` found there once it ended, and left out.
        self.fetched: Dict[str, File] = {}
        self.left_out: Tuple[str, ...] = ()
        # A sandboxed job's space (execpool/worker/space.py), held until its
        # Result is out; its Landlock rulesets and its view
        # (execpool/sandbox/view.py), open until its tool entered them; and,
        # for one without the view, its private TMPDIR: ``tmpdir`` for a job
        # without a cwd, else a directory of its own (``sandbox_tmp``),
        # removed like ``tmpdir``.
        self.space: Optional[Space] = None
        self.rulesets: Tuple[int, ...] = ()
        self.view: Optional[View] = None
        self.sandbox_tmp: Optional[str] = None
        self.group: Optional[JobGroup] = None
        # A sandboxed Python session's spares for its forks, shared with its
        # copies (execpool/worker/sessions/family.py).
        self.family: Optional[Family] = None
        #: A sandboxed job's own user namespace (execpool/worker/userns.py;
        #: a session's copy's, the one it made itself), held until its
        #: Result: what names its processes, and where a copy's are made (-1:
        #: none).
        self.user_ns = -1
        # A warm job's hand-over: the spare's ready pipe, what it said there.
        self.ready_fd: Optional[int] = None
        self.report = b""
        self.cost = Cost()
        # CPU seconds (user, system) its spare had spent before it took the
        # job: in the spare's wait4 figures, but not the job's.
        self.spent_before = (0.0, 0.0)
        # What the job's cgroup says, read before the group goes.
        self.group_cpu: Optional[Tuple[float, float]] = None
        self.peak_memory: Optional[int] = None
        # Its tree's leftovers were killed: the Result waits (a bounded
        # while) until the kill's victims are reaped, so they count.
        self.swept = False
        self.victims: set[int] = set()
        # A session's socket and cell (execpool/worker/sessions/link.py).
        self.link: Optional[SessionLink] = SessionLink() if start.session else None

    # -- its life --------------------------------------------------------------------------

    def _move(self, phase: Phase) -> None:
        if phase not in _MOVES[self.phase]:
            raise RuntimeError(f"job {self.start.job_id} cannot go from {self.phase.value} to {phase.value}")
        self.phase = phase

    def running(self, pid: int) -> None:
        """Its leader (a cold tool, or the spare that took it) is ``pid``."""
        self._move(Phase.RUNNING)
        self.pid = pid

    def requeued(self) -> None:
        """Its spare died before it took the job: it waits for another."""
        self._move(Phase.WAITING)
        self.pid = None
        self.report = b""

    def reaped(self, exit_code: int) -> None:
        self._move(Phase.REAPED)
        self.exit_code = exit_code

    def given_up(self) -> None:
        """Nothing more will be reaped for it: it never ran, or the worker
        stops waiting for it."""
        if self.phase is not Phase.REAPED:
            self._move(Phase.REAPED)

    def finished(self) -> None:
        self._move(Phase.FINISHED)

    def failed_to_start(self, why: object, infra: bool = True) -> None:
        """Its tool never started: execpool's failure, or (``infra`` False)
        the job's own -- files that do not fit its directory."""
        self.error = f"cannot start the tool: {why}"
        self.infra = infra

    @property
    def leader_alive(self) -> bool:
        """Its leader may still run: started and not reaped."""
        return self.phase is Phase.RUNNING

    @property
    def eof(self) -> bool:
        """Every output pipe it had is closed: nothing more of its output can
        come, though a process of its tree may still run."""
        return not self.pipes

    # -- what it holds ---------------------------------------------------------------------

    def confinement(self) -> Tuple[int, ...]:
        """The rulesets to start the tool in, none for a job without a
        sandbox; OSError for a sandboxed job whose rulesets are gone -- it
        must never start unconfined."""
        if self.start.sandbox is not None and not self.rulesets:
            raise OSError("the job's sandbox rulesets are gone; it was not started unconfined")
        return self.rulesets

    def close_rulesets(self) -> None:
        """Once its tool holds its domain; a namespace of the job's own,
        made ahead, stays until :meth:`release`."""
        for fd in self.rulesets:
            os.close(fd)
        self.rulesets = ()
        if self.view is not None and not self.view.own_namespace:
            self.view.close()
            self.view = None

    def release(self) -> None:
        """Everything it holds for its tool's start, once its Result is out
        (its space is the caller's to let go: ``take_space``)."""
        self.close_workdir()
        if self.link is not None:
            self.link.close()
        if self.user_ns >= 0:
            os.close(self.user_ns)
            self.user_ns = -1
        self.close_rulesets()
        if self.view is not None:
            self.view.close()
            self.view = None

    def view_arguments(self) -> Optional[tuple]:
        return None if self.view is None else self.view.arguments()

    def script_path(self) -> str:
        """Its script as its tool names it: in its working directory, as
        the tool sees that (in its view, where it has one)."""
        if self.script is None:
            return ""
        return os.path.join(self.cwd if self.view is None else self.view.cwd, self.script)

    @property
    def in_shared_directory(self) -> bool:
        """Whether its working directory outlives it -- a caller's, or its
        workspace's -- so that what execpool put there is taken back."""
        return self.start.cwd is not None or self.start.workspace is not None

    def close_workdir(self) -> None:
        if self.workdir >= 0:
            os.close(self.workdir)
            self.workdir = -1

    def own_names(self) -> Tuple[str, ...]:
        """What execpool put in its working directory that is not the job's:
        its script, the caller's files set aside."""
        aside = () if self.placed is None else tuple(name for _, name in self.placed.aside)
        return (*(() if self.script is None else (self.script,)), *aside)

    def take_space(self) -> Optional[Space]:
        """Its space, no longer its: for the worker's remover to let go of."""
        space, self.space = self.space, None
        return space

    @contextlib.contextmanager
    def start_fds(self) -> Iterator[Tuple[int, List[int]]]:
        """Its stdin and its cgroup's ``cgroup.procs`` files, open for as
        long as starting its tool needs them."""
        fds: List[int] = []
        try:
            stdin_fd = DEVNULL
            if self.link is not None:
                stdin_fd = self.link.runtime_fd
            elif self.start.stdin is not None:
                stdin_fd = memfd_holding("execpool-stdin", self.start.stdin.encode("utf-8"))
                fds.append(stdin_fd)
            join_fds = [] if self.group is None else [os.open(path, os.O_WRONLY | os.O_CLOEXEC)
                                                      for path in self.group.procs_files()]
            fds.extend(join_fds)
            yield stdin_fd, join_fds
        finally:
            for fd in fds:
                os.close(fd)

    def held_chars(self) -> int:
        """What of this job the worker held at once, in characters: its code,
        its stdin, its kept output."""
        start = self.start
        return len(start.source) + len(start.stdin or "") + sum(capture.kept for capture in self.captures)

    # -- its Result --------------------------------------------------------------------------

    def status(self) -> Status:
        """In the order Result.text reads its fields, so status and text agree."""
        if self.error is not None:
            return Status.INFRA if self.infra else Status.ERROR
        if self.ending is Ending.CANCEL:
            return Status.CANCELLED
        if self.ending is Ending.TIMEOUT:
            return Status.TIMEOUT
        return Status.OK if self.exit_code == 0 else Status.ERROR

    def result(self) -> Result:
        return Result(
            status=self.status(),
            output=self.stdout.output,
            exit_code=None if self.ending or self.error else self.exit_code,
            timed_out=self.ending is Ending.TIMEOUT,
            cancelled=self.ending is Ending.CANCEL,
            duration_s=time.monotonic() - self.started,
            output_chars=self.stdout.total,
            timeout=self.start.timeout,
            error=self.error,
            error_lines=tuple(self.error_lines),
            stderr=self.stderr.output,
            stderr_chars=self.stderr.total,
            output_bytes=sum(capture.bytes for capture in self.captures),
            files=self.fetched,
            files_left_out=self.left_out,
            **self._cost(),
        )

    def _cost(self) -> dict:
        user = max(0.0, self.cost.user - self.spent_before[0])
        system = max(0.0, self.cost.system - self.spent_before[1])
        if self.group_cpu is not None:
            user, system = max(user, self.group_cpu[0]), max(system, self.group_cpu[1])
        return {"cpu_user_s": round(user, 6), "cpu_system_s": round(system, 6),
                "max_rss_bytes": self.cost.max_rss_kib * 1024, "peak_memory_bytes": self.peak_memory,
                "processes": self.cost.processes}
