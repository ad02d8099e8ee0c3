"""A job as the worker sees it while it runs: its tool, its output, how it
ended. Worker side: the loop (execpool/worker/loop.py) and the warm hand-over
(execpool/worker/warm/handover.py) share it.
"""

from __future__ import annotations

import os
import resource
import time
from collections import deque
from typing import Optional, Tuple

from ..shared import channel
from .capture import MAX_ERROR_LINES, Capture
from ..shared.kernel.cgroups import JobGroup
from ..shared.output import LiveBudget
from ..shared.result import Result, Status


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
    """One running tool, as the worker sees it."""

    def __init__(self, start: channel.Start, marker: str) -> None:
        self.start = start
        self.marker = marker
        self.pid: Optional[int] = None
        self.exit_code: Optional[int] = None
        self.reaped = False
        self.end_reason: Optional[str] = None  # "timeout" | "cancel" | "limit" | "shutdown"
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
        self.pipes: dict[int, Capture] = {}
        # Both streams count against one budget: the live cap is per job. One
        # character past it is sent, so the caller knows the cap was hit.
        self.live = None if start.live_cap is None else LiveBudget(start.live_cap, slack=1)
        self.started = time.monotonic()
        self.tmpdir: Optional[str] = None
        self.script: Optional[str] = None
        # A sandboxed job's Landlock rulesets, open until its tool entered
        # them, and its private TMPDIR: ``tmpdir`` for a job without a cwd,
        # else a directory of its own (``sandbox_tmp``), removed like ``tmpdir``.
        self.rulesets: Tuple[int, ...] = ()
        # What its read-only view binds writable again; None: no view.
        self.writable: Optional[Tuple[str, ...]] = None
        self.private_tmp: Optional[str] = None
        self.sandbox_tmp: Optional[str] = None
        self.group: Optional[JobGroup] = None
        # A warm job's hand-over: the spare's ready pipe, what it said there.
        self.ready_fd: Optional[int] = None
        self.report = b""
        self.cost = Cost()
        # CPU seconds (user, system) its spare had spent before it took the
        # job: in the spare's wait4 figures, but not the job's.
        self.spent_before = (0.0, 0.0)
        # What the job's cgroup says, read before the group goes.
        self.group_cpu: Optional[tuple[float, float]] = None
        self.peak_memory: Optional[int] = None
        # Its tree's leftovers were killed: the Result waits (a bounded
        # while) until the kill's victims are reaped, so they count.
        self.swept = False
        self.victims: set[int] = set()

    def confinement(self) -> Tuple[int, ...]:
        """The rulesets to start the tool in, none for a job without a
        sandbox; OSError for a sandboxed job whose rulesets are gone -- it
        must never start unconfined."""
        if self.start.sandbox is not None and not self.rulesets:
            raise OSError("the job's sandbox rulesets are gone; it was not started unconfined")
        return self.rulesets

    def close_rulesets(self) -> None:
        for fd in self.rulesets:
            os.close(fd)
        self.rulesets = ()

    @property
    def eof(self) -> bool:
        """Every output pipe it had is closed: nothing more of its output can
        come, though a process of its tree may still run."""
        return not self.pipes

    def held_chars(self) -> int:
        """What of this job the worker held at once, in characters: its code,
        its stdin, its kept output."""
        start = self.start
        return len(start.source) + len(start.stdin or "") + sum(capture.kept for capture in self.captures)

    def status(self) -> Status:
        """In the order Result.text reads its fields, so status and text agree."""
        if self.error is not None:
            return Status.INFRA if self.infra else Status.ERROR
        if self.end_reason == "cancel":
            return Status.CANCELLED
        if self.end_reason == "timeout":
            return Status.TIMEOUT
        return Status.OK if self.exit_code == 0 else Status.ERROR

    def result(self) -> Result:
        return Result(
            status=self.status(),
            output=self.stdout.output,
            exit_code=None if self.end_reason or self.error else self.exit_code,
            timed_out=self.end_reason == "timeout",
            cancelled=self.end_reason == "cancel",
            duration_s=time.monotonic() - self.started,
            output_chars=self.stdout.total,
            timeout=self.start.timeout,
            error=self.error,
            error_lines=tuple(self.error_lines),
            stderr=self.stderr.output,
            stderr_chars=self.stderr.total,
            output_bytes=sum(capture.bytes for capture in self.captures),
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
