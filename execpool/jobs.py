"""Job specs: what a caller asks the pool to run, validated where it is built.

Misuse is caught here, in the caller's thread, with a precise ``TypeError`` or
``ValueError``, so nothing malformed ever reaches a worker and a bad job cannot
disturb the pool for the next one.
"""

from __future__ import annotations

import math
import os
from dataclasses import KW_ONLY, dataclass, field
from typing import Mapping, Optional, Union

GiB = 1 << 30

#: The kernel refuses a single argv string longer than this (MAX_ARG_STRLEN).
MAX_SHELL_COMMAND_BYTES = 128 * 1024

#: A timeout above this is almost certainly a unit mistake; ``None`` means no limit.
MAX_TIMEOUT_S = 7 * 24 * 3600.0

Number = Union[int, float]


#: What the kernel takes for an rlimit or a cgroup cap (a signed 64-bit value).
MAX_LIMIT = 2**63 - 1

#: The kernel's ceiling for pid_max, and so for a job's process count.
MAX_PROCESSES = 4 * 1024 * 1024


def _shown(value: object) -> str:
    """``repr(value)`` for an error message, but an int past 64 bits by its
    size: Python refuses to print one of thousands of digits (raising a
    ValueError that names no field), and nobody would read it anyway."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"<{'a negative' if value < 0 else 'an'} integer of {value.bit_length()} bits>"
    return repr(value)


def _check_positive_int(name: str, value: object, maximum: Optional[int] = MAX_LIMIT) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None, not {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {_shown(value)}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={_shown(value)} is more than the kernel can apply (at most {maximum}); "
                         "pass None for no limit")


def check_interval(name: str, value: object) -> float:
    """Validate a positive, finite number of seconds (intervals, timeouts)
    of at most MAX_TIMEOUT_S, which every timer and queue wait can take."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf
    if math.isnan(seconds) or seconds <= 0 or math.isinf(seconds):
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {_shown(value)}")
    if seconds > MAX_TIMEOUT_S:
        raise ValueError(f"{name}={_shown(value)} is over {MAX_TIMEOUT_S:.0f} s")
    return seconds


def _check_text(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be str, not {type(value).__name__}")
    if "\x00" in value:
        raise ValueError(f"{name} contains a NUL byte, which no program can receive")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name} is not valid text: {exc.reason} at index {exc.start}") from None


@dataclass(frozen=True)
class Limits:
    """Per-tool limits: rlimits applied in the tool's process before exec,
    and the cgroup caps below.

    ``None`` leaves the worker's own limit in place. The defaults stop a
    runaway allocation, a disk fill or an fd leak without getting in the way
    of ordinary programs (numpy and friends reserve a few GiB of address space).
    CPU time is unlimited by default because the wall timeout already bounds it.
    """

    address_space: Optional[int] = 8 * GiB
    cpu_seconds: Optional[int] = None
    file_size: Optional[int] = 1 * GiB
    open_files: Optional[int] = 1024
    #: Processes (and threads) the job may have at once, and its memory in
    #: bytes: caps that hold for root too, kept by a cgroup per job (see
    #: execpool/cgroups.py); a job asking for them where execpool cannot
    #: create cgroups ends with an ``Execution error``.
    processes: Optional[int] = None
    memory: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("address_space", "cpu_seconds", "file_size", "open_files", "memory"):
            _check_positive_int(name, getattr(self, name))
        _check_positive_int("processes", self.processes, MAX_PROCESSES)

    @property
    def needs_cgroup(self) -> bool:
        return self.processes is not None or self.memory is not None


@dataclass(frozen=True)
class _Job:
    _: KW_ONLY
    timeout: Optional[Number] = 300
    cwd: Optional[Union[str, os.PathLike]] = None
    env: Optional[Mapping[str, str]] = None
    limits: Optional[Limits] = None
    keep_background: bool = False
    max_output_chars: Optional[int] = None
    stdin: Optional[str] = None
    network: bool = True

    kind = ""
    _source_field = ""

    @property
    def source(self) -> str:
        """The code or command, whichever field this kind of job names it by."""
        return getattr(self, self._source_field)

    def __post_init__(self) -> None:
        _check_text(self._source_field, self.source)
        if self.timeout is not None:
            try:
                check_interval("timeout", self.timeout)
            except ValueError as exc:
                raise ValueError(f"{exc}; pass timeout=None for no limit") from None
        if self.cwd is not None:
            cwd = os.fspath(self.cwd)
            _check_text("cwd", cwd)
            if not cwd:
                # abspath("") would quietly be the caller's own directory.
                raise ValueError("cwd must not be empty (None runs the job in a fresh private directory, "
                                 "\".\" in the caller's own)")
            # Relative to the caller, who wrote it; the worker runs from "/".
            object.__setattr__(self, "cwd", os.path.abspath(cwd))
        if self.env is not None:
            if not isinstance(self.env, Mapping):
                raise TypeError(f"env must be a mapping of str to str, not {type(self.env).__name__}")
            for key, value in self.env.items():
                _check_text("env key", key)
                _check_text(f"env[{key!r}]", value)
                if not key or "=" in key:
                    raise ValueError(f"env key {key!r} is not a valid variable name")
            object.__setattr__(self, "env", dict(self.env))
        if self.limits is not None and not isinstance(self.limits, Limits):
            raise TypeError(f"limits must be an execpool.Limits, not {type(self.limits).__name__}")
        if not isinstance(self.keep_background, bool):
            raise TypeError("keep_background must be a bool")
        _check_positive_int("max_output_chars", self.max_output_chars, maximum=None)
        if not isinstance(self.network, bool):
            raise TypeError("network must be a bool")
        if self.stdin is not None:
            if not isinstance(self.stdin, str):
                raise TypeError(f"stdin must be str or None, not {type(self.stdin).__name__}")
            try:
                self.stdin.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"stdin is not valid text: {exc.reason} at index {exc.start}") from None


@dataclass(frozen=True)
class PythonJob(_Job):
    """Run ``code`` as ``python -u FILE`` with the FILE in the job's working
    directory, so ``__file__`` and ``sys.path[0]`` point there.

    ``warm=True`` runs it in a fork of the worker instead of a new
    interpreter: the same file, ``__main__``, limits, session and exit codes,
    without the interpreter's start-up (see the README for what can differ).
    """

    code: str
    warm: bool = field(default=False, kw_only=True)
    kind = "python"
    _source_field = "code"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.warm, bool):
            raise TypeError("warm must be a bool")


@dataclass(frozen=True)
class ShellJob(_Job):
    """Run ``command`` with ``bash -c`` (POSIX sh where bash is missing)."""

    command: str
    kind = "shell"
    _source_field = "command"

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.command.encode("utf-8")) > MAX_SHELL_COMMAND_BYTES:
            raise ValueError(
                f"command is over the kernel's {MAX_SHELL_COMMAND_BYTES // 1024} KiB limit for one "
                "argument; write it to a file in cwd and run that file instead"
            )


Job = Union[PythonJob, ShellJob]
