"""What a job's end looks like to the caller: a ``Result``, never an exception.

A tool exiting non-zero, timing out or being cancelled is data; so is a worker
dying under a job. ``status`` says which of these happened in one field, and
keeps the program's failures (``ERROR``) apart from execpool's own
(``INFRA``), because an evaluation must never score a dead worker as a wrong
answer. ``text`` renders the model-facing string the SPEC fixes, so every
layer above (tools, loop, CLI, service) says the same thing.

Shared: the worker builds Results, the caller reads them.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, field
from typing import Optional, Tuple

CANCELLED_TEXT = "Execution cancelled."
NO_CODE_TEXT = "No code provided."
NO_COMMAND_TEXT = "No command provided."
ERROR_PREFIX = "Execution error: "


#: Lines that name a missing file: a Result keeps them past its output head
#: (``error_lines``), because the model-facing missing-path hint is computed
#: from them (execpool/capture.py, execpool/tools.py).
ERROR_LINE_MARKERS = ("FileNotFoundError", "No such file or directory")


def timeout_text(timeout: object) -> str:
    return f"Execution timed out after {timeout} seconds."


def describe_exit(code: Optional[int]) -> str:
    """Render an exit status the way loky does: signals by name."""
    if code is None:
        return "unknown exit status"
    if code < 0:
        try:
            return f"{signal.Signals(-code).name}({code})"
        except ValueError:
            return f"signal {-code}({code})"
    return f"exit code {code}"


class Status(str, enum.Enum):
    """How a job ended. A ``str``, so it is its own JSON value (``"ok"``)."""

    #: The program exited 0.
    OK = "ok"
    #: The program failed: it exited non-zero, died of a signal, went over a
    #: limit of its own (processes, memory), or there was no code to run.
    ERROR = "error"
    #: It ran past its timeout and its tree was killed.
    TIMEOUT = "timeout"
    #: It was cancelled (a cancel_event, ``future.cancel()``, a closed stream).
    CANCELLED = "cancelled"
    #: execpool failed, not the program: its worker died, the tool could not
    #: be started, or the pool was closed under it. Worth running again.
    INFRA = "infra"

    def __str__(self) -> str:
        return self.value

    def __reduce_ex__(self, protocol: object) -> tuple:
        # By value, on every Python: some 3.11 releases pickle a member as
        # getattr(Status, name), which the channel's unpickler rightly refuses.
        return Status, (self.value,)


def _signal_name(code: Optional[int]) -> Optional[str]:
    if code is None or code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return None


@dataclass(frozen=True)
class Result:
    """The end of one job.

    ``output`` is the merged stdout/stderr as ``communicate(text=True)`` would
    decode it, bounded to the job's ``max_output_chars`` head; ``output_chars``
    is the full length, so a flood is measurable without being kept. A job
    with ``separate_stderr`` has only its stdout there and its stderr, decoded
    and bounded the same way, in ``stderr`` and ``stderr_chars`` (otherwise
    "" and 0); ``text`` then shows the model stdout alone.
    ``output_bytes`` counts the raw bytes the worker read from the tool's
    pipes, all of them, whatever was kept: a flood's size before decoding.
    ``error_lines`` keeps the lines naming missing files (from both streams)
    even when they fall after the kept head, because the model-facing hint
    needs them.
    ``error`` says what went wrong when the program did not simply exit (an
    ``INFRA`` failure, a limit); when a worker died under the job,
    ``worker_pid`` and ``worker_exit_code`` (negative: the signal, as in
    ``Popen.returncode``) say which and how.
    """

    status: Status
    output: str = ""
    exit_code: Optional[int] = None
    timed_out: bool = False
    cancelled: bool = False
    duration_s: float = 0.0
    output_chars: int = 0
    timeout: Optional[float] = None
    error: Optional[str] = None
    empty_message: Optional[str] = None
    error_lines: Tuple[str, ...] = field(default=())
    worker_pid: Optional[int] = None
    worker_exit_code: Optional[int] = None
    stderr: str = ""
    stderr_chars: int = 0
    output_bytes: int = 0

    @property
    def truncated(self) -> bool:
        return self.output_chars > len(self.output)

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    @property
    def signal_name(self) -> Optional[str]:
        """``SIGSEGV`` for a tool killed by signal 11; None for a normal exit."""
        return _signal_name(self.exit_code)

    @property
    def worker_signal(self) -> Optional[str]:
        """``SIGKILL`` when the job's worker was killed by signal 9 under it."""
        return _signal_name(self.worker_exit_code)

    @property
    def text(self) -> str:
        """The model-facing string of SPEC §2."""
        if self.empty_message is not None:
            return self.empty_message
        if self.error is not None:
            return ERROR_PREFIX + self.error
        if self.cancelled:
            return CANCELLED_TEXT
        if self.timed_out:
            return timeout_text(self.timeout)
        body = self.output
        if self.truncated:
            body += (
                f"\n... (output truncated: {self.output_chars} chars total, "
                f"the first {len(self.output)} kept)"
            )
        if self.exit_code == 0:
            return body if body.strip() else "(no output)"
        return f"Exit code {self.exit_code}:\n" + body
