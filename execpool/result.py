"""What a job's end looks like to the caller: a ``Result``, never an exception.

A tool exiting non-zero, timing out or being cancelled is data; so is a worker
dying under a job (``error``). ``text`` renders the model-facing string the
SPEC fixes, so every layer above (tools, loop, CLI) says the same thing.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class Result:
    """The end of one job.

    ``output`` is the merged stdout/stderr as ``communicate(text=True)`` would
    decode it, bounded to the job's ``max_output_chars`` head; ``output_chars``
    is the full length, so a flood is measurable without being kept.
    ``error_lines`` keeps the lines naming missing files even when they fall
    after the kept head, because the model-facing hint needs them.
    """

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

    @property
    def truncated(self) -> bool:
        return self.output_chars > len(self.output)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not (self.timed_out or self.cancelled or self.error)

    @property
    def signal_name(self) -> Optional[str]:
        """``SIGSEGV`` for a tool killed by signal 11; None for a normal exit."""
        if self.exit_code is None or self.exit_code >= 0:
            return None
        try:
            return signal.Signals(-self.exit_code).name
        except ValueError:
            return None

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
