"""A job as the worker sees it while it runs: its tool, its output, how it
ended. Worker side: the loop (execpool/worker.py) and the warm hand-over
(execpool/handover.py) share it.
"""

from __future__ import annotations

import time
from typing import Optional

from . import channel
from .capture import Capture
from .cgroups import JobGroup
from .result import Status


class RunningJob:
    """One running tool, as the worker sees it."""

    def __init__(self, start: channel.Start, marker: str) -> None:
        self.start = start
        self.marker = marker
        self.pid: Optional[int] = None
        self.fd: Optional[int] = None
        self.exit_code: Optional[int] = None
        self.reaped = False
        self.eof = False
        self.end_reason: Optional[str] = None  # "timeout" | "cancel" | "limit" | "shutdown"
        self.killed_at = 0.0
        self.error: Optional[str] = None
        # Whether ``error`` is execpool's failure (the tool never started,
        # the pool closed under it), not the program's (it went over a limit).
        self.infra = False
        self.capture = Capture(start.max_output_chars)
        self.live_sent = 0
        self.started = time.monotonic()
        self.tmpdir: Optional[str] = None
        self.script: Optional[str] = None
        self.group: Optional[JobGroup] = None
        # A warm job's hand-over: the spare's ready pipe, what it said there.
        self.ready_fd: Optional[int] = None
        self.report = b""

    def status(self) -> Status:
        """In the order Result.text reads its fields, so status and text agree."""
        if self.error is not None:
            return Status.INFRA if self.infra else Status.ERROR
        if self.end_reason == "cancel":
            return Status.CANCELLED
        if self.end_reason == "timeout":
            return Status.TIMEOUT
        return Status.OK if self.exit_code == 0 else Status.ERROR
