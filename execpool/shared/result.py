"""What a job's end looks like to the caller: a ``Result``, never an exception.

A tool exiting non-zero, timing out or being cancelled is data; so is a worker
dying under a job. ``status`` says which of these happened in one field, and
keeps the program's failures (``ERROR``) apart from execpool's own
(``INFRA``), because an evaluation must never score a dead worker as a wrong
answer. ``text`` renders the model-facing string (docs/library/jobs.md: ``result.text``), so every
layer above (tools, loop, CLI, service) says the same thing.

Shared: the worker builds Results, the caller reads them.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from .files import File
from .output import truncation_notice

CANCELLED_TEXT = "Execution cancelled."
NO_CODE_TEXT = "No code provided."
NO_COMMAND_TEXT = "No command provided."
ERROR_PREFIX = "Execution error: "
COMPILE_FAILED_PREFIX = "Compilation failed. "


#: Lines that name a missing file: a Result keeps them past its output head
#: (``error_lines``), because the model-facing missing-path hint is computed
#: from them (execpool/worker/capture.py, execpool/agent/tools.py).
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

    What the job cost, as its worker measured it -- for cold, shell and warm
    jobs alike, and for jobs that were killed (timeout, cancel, a limit):
    the worker reaps the job's processes (the leader, and as a child
    subreaper every process the job left behind, attributed by its session
    or by the kill path) and adds up the kernel's ``wait4`` figures, each of
    which covers a process *and every descendant it waited for*. A job that
    never reached a worker, or whose worker died under it, has None in all
    five (nobody measured it).

    - ``cpu_user_s``, ``cpu_system_s``: CPU seconds of the job's processes.
      Their sum comes from the kernel's per-task clock (nanoseconds, given
      to the microsecond); the split between user and system is the
      kernel's estimate from timer ticks. Exact when every process of the
      job was reaped before the Result went out -- the worker waits for what
      the job's end killed -- and a lower bound otherwise: a process that
      left the job's session and group and ended on its own while the job
      ran belongs to no job the worker can tell; one stuck in the kernel
      past the worker's reap grace (a second), and what a
      ``keep_background`` job leaves running, end after the Result. A warm
      job's figures are its own: what its spare had spent before it took
      the job is taken off. Where the job has a cgroup v2 group, its
      ``cpu.stat`` is used when it says more (it counts every process that
      ran in the group, reaped or not).
    - ``max_rss_bytes``: the largest resident set of any one process of the
      job. Exact above a floor, an upper bound at it: Linux carries a
      process's high-water mark across ``exec`` and ``fork``, so the leader
      of a cold job starts at the resident set of the worker that started
      it (20-25 MB here; the worker resets its own mark before each start
      and hands freed memory back after a job that made it hold a lot, so
      what earlier jobs did to it does not count), a warm job's process at
      its template's (the interpreter and the ``preload`` modules it really
      shares: about 14 MB here), and a process the job forks at its
      parent's. A small job reports that floor.
    - ``peak_memory_bytes``: the peak of the job's memory cgroup (v2
      ``memory.peak``, v1 ``memory.max_usage_in_bytes``): the whole tree's
      memory at its highest, as the kernel charged it (anonymous memory, the
      page cache of what the job read or wrote, kernel memory). Only for a
      job that has a memory cgroup (``Limits(memory=...)``); else None.
    - ``processes``: how many of the job's processes the worker reaped: the
      leader, what the job left behind when it ended (killed then), the
      orphans whose parent exited first, and the escaped daemons the kill
      path found. A lower bound: a process reaped by its own parent inside
      the job -- each command a shell runs and waits for -- ends without the
      worker seeing it (Linux has no per-tree fork counter short of
      privileged tracing); its CPU and memory are counted all the same,
      through the parent that waited for it.
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
    cpu_user_s: Optional[float] = None
    cpu_system_s: Optional[float] = None
    max_rss_bytes: Optional[int] = None
    peak_memory_bytes: Optional[int] = None
    processes: Optional[int] = None
    #: A CodeJob's compile step as a Result of its own (its stdout and
    #: stderr apart), None where nothing compiled. When it did not succeed
    #: the program never ran, and this Result is the compile's, with
    #: ``compile_result`` set: its status, output and exit code.
    compile_result: Optional["Result"] = None
    #: Whether the compile was the pool's cached one (the same program was
    #: compiled before): ``compile_result`` is then that compile's.
    compile_cached: bool = False
    #: What the job's ``fetch`` found in its working directory once it
    #: ended: relative path to File (execpool/shared/files.py); and what it
    #: matched but left out, past FETCH_MAX_FILES or FETCH_MAX_BYTES.
    files: Dict[str, File] = field(default_factory=dict)
    files_left_out: Tuple[str, ...] = ()

    @property
    def compile_status(self) -> Optional[Status]:
        return None if self.compile_result is None else self.compile_result.status

    @property
    def compile_output(self) -> Optional[str]:
        """The compiler's stdout then its stderr; None where nothing compiled."""
        compiled = self.compile_result
        return None if compiled is None else compiled.output + compiled.stderr

    @property
    def compile_duration_s(self) -> Optional[float]:
        return None if self.compile_result is None else self.compile_result.duration_s

    @property
    def compile_failed(self) -> bool:
        """The program did not run: its compile did not succeed."""
        return self.compile_result is not None and self.compile_result.status is not Status.OK

    @property
    def truncated(self) -> bool:
        return self.output_chars > len(self.output)

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    @property
    def cpu_s(self) -> Optional[float]:
        """User plus system CPU seconds; None when nobody measured them."""
        if self.cpu_user_s is None or self.cpu_system_s is None:
            return None
        return self.cpu_user_s + self.cpu_system_s

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
        """The model-facing string: what a model reads of the job."""
        if self.empty_message is not None:
            return self.empty_message
        compiled = self.compile_result
        if compiled is not None and compiled.status is Status.INFRA:
            return compiled.text  # execpool's failure, not the compiler's
        if compiled is not None and compiled.status is not Status.OK:
            if compiled.status is Status.ERROR and compiled.exit_code is not None:
                return f"Compilation failed (exit code {compiled.exit_code}):\n{compiled.output}{compiled.stderr}"
            return COMPILE_FAILED_PREFIX + compiled.text
        if self.error is not None:
            return ERROR_PREFIX + self.error
        if self.cancelled:
            return CANCELLED_TEXT
        if self.timed_out:
            return timeout_text(self.timeout)
        body = self.output
        if self.truncated:
            body += truncation_notice(self.output_chars, len(self.output))
        if self.exit_code == 0:
            return body if body.strip() else "(no output)"
        return f"Exit code {self.exit_code}:\n" + body
