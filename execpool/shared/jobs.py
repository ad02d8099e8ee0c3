"""Job specs: what a caller asks the pool to run, validated where it is built.

Misuse is caught here, in the caller's thread, with a precise ``TypeError`` or
``ValueError``, so nothing malformed ever reaches a worker and a bad job cannot
disturb the pool for the next one.
"""

from __future__ import annotations

import os
from dataclasses import KW_ONLY, dataclass, field
from typing import Mapping, Optional, Sequence, Tuple, Union

from . import checks, languages
from .files import File, fetch_patterns, job_files
from .kernel.sandbox import Sandbox, job_sandbox

MiB = 1 << 20
GiB = 1 << 30

#: The kernel refuses a single argv string longer than this (MAX_ARG_STRLEN).
MAX_SHELL_COMMAND_BYTES = 128 * 1024

Number = Union[int, float]


#: What the kernel takes for an rlimit or a cgroup cap (a signed 64-bit value).
MAX_LIMIT = 2**63 - 1

#: The kernel's ceiling for pid_max, and so for a job's process count.
MAX_PROCESSES = 4 * 1024 * 1024

#: The smallest disk bound: a job's space holds its script and its
#: directories' inodes before it writes anything.
MIN_DISK = 1 * MiB


@dataclass(frozen=True)
class Limits:
    """Per-tool limits: rlimits applied in the tool's process before exec,
    the cgroup caps below, and the disk a sandboxed tool may fill.

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
    #: execpool/shared/kernel/cgroups.py); a job asking for them where execpool cannot
    #: create cgroups ends with an ``Execution error``.
    processes: Optional[int] = None
    memory: Optional[int] = None
    #: Bytes a sandboxed job or session may write, all of it together: its
    #: working directory (unless it is a ``cwd`` of the caller's), home,
    #: ``/tmp``, ``/dev/shm``, its ``files`` and, for a CodeJob, what the
    #: compile leaves. It is one tmpfs of the job's own (a *space*,
    #: execpool/worker/space.py): the kernel's bound, for root as for any
    #: user, and memory until the job ends -- a pool admits sandboxed jobs
    #: while their bounds fit its ``disk_budget``. None: no bound of its own.
    disk: Optional[int] = 1 * GiB

    def __post_init__(self) -> None:
        for name in ("address_space", "cpu_seconds", "file_size", "open_files", "memory", "processes"):
            checks.integer(name, getattr(self, name), none_ok=True,
                           maximum=MAX_PROCESSES if name == "processes" else MAX_LIMIT,
                           over="more than the kernel can apply; pass None for no limit")
        checks.integer("disk", self.disk, none_ok=True, minimum=MIN_DISK, maximum=MAX_LIMIT,
                       over="more than the kernel can apply; pass None for no limit")

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
    #: Give stderr a pipe of its own (``Result.stderr``) instead of merging
    #: it into ``output``: a service whose clients read the two apart.
    separate_stderr: bool = False
    #: The kernel-enforced sandbox (execpool/shared/kernel/sandbox.py): None takes the
    #: pool's, False runs this job without one whatever the pool's,
    #: ``"strict"`` (kept as ``Sandbox()``) or a ``Sandbox`` runs it in one.
    sandbox: Union[None, bool, str, Sandbox] = None
    #: Written into the job's working directory before it starts, relative
    #: path to bytes (or a ``File``, for its mode) -- by its worker, never
    #: through a link. In a ``cwd`` of the caller's, a name it already
    #: holds is set aside for the job's run and put back after it, and the
    #: job's files are gone again: the caller's directory ends as it was,
    #: but for what the job itself wrote.
    files: Optional[Mapping[str, Union[bytes, File]]] = None
    #: Relative paths (``fnmatch`` patterns allowed) of files to bring back
    #: from the job's working directory once it ended, in ``Result.files``:
    #: regular files only, never through a link, at most FETCH_MAX_FILES
    #: files and FETCH_MAX_BYTES in all (what is past that is left out).
    fetch: Sequence[str] = ()

    kind = ""
    _source_field = ""

    @property
    def source(self) -> str:
        """The code or command, whichever field this kind of job names it by."""
        return getattr(self, self._source_field)

    def __post_init__(self) -> None:
        checks.text(self._source_field, self.source)
        if self.timeout is not None:
            try:
                checks.seconds("timeout", self.timeout)
            except ValueError as exc:
                raise ValueError(f"{exc}; pass timeout=None for no limit") from None
        if self.cwd is not None:
            cwd = os.fspath(self.cwd)
            checks.text("cwd", cwd)
            if not cwd:
                # abspath("") would quietly be the caller's own directory.
                raise ValueError("cwd must not be empty (None runs the job in a fresh private directory, "
                                 "\".\" in the caller's own)")
            # Relative to the caller, who wrote it; the worker runs from "/".
            object.__setattr__(self, "cwd", os.path.abspath(cwd))
        if self.env is not None:
            object.__setattr__(self, "env", checks.environment("env", self.env))
        if self.limits is not None and not isinstance(self.limits, Limits):
            raise TypeError(f"limits must be an execpool.Limits, not {type(self.limits).__name__}")
        checks.flag("keep_background", self.keep_background)
        checks.integer("max_output_chars", self.max_output_chars, none_ok=True)
        checks.flag("network", self.network)
        checks.flag("separate_stderr", self.separate_stderr)
        object.__setattr__(self, "sandbox", job_sandbox(self.sandbox))
        if self.stdin is not None:
            checks.text("stdin", self.stdin, nul_ok=True)
        if self.files is not None:
            object.__setattr__(self, "files", job_files("files", self.files))
        object.__setattr__(self, "fetch", fetch_patterns("fetch", self.fetch))

    @property
    def given_files(self) -> Tuple[Tuple[str, File], ...]:
        """``files`` as the channel carries them."""
        return tuple((self.files or {}).items())  # type: ignore[arg-type]


@dataclass(frozen=True)
class PythonJob(_Job):
    """Run ``code`` as ``python -u FILE`` with the FILE in the job's working
    directory, so ``__file__`` and ``sys.path[0]`` point there.

    ``warm=True`` runs it in a fork of the worker instead of a new
    interpreter: the same file, ``__main__``, limits, session and exit codes,
    without the interpreter's start-up (docs/library/warm.md says what can differ).
    """

    code: str
    warm: bool = field(default=False, kw_only=True)
    kind = "python"
    _source_field = "code"

    def __post_init__(self) -> None:
        super().__post_init__()
        checks.flag("warm", self.warm)


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


#: The longest file name Linux's file systems take, in bytes.
MAX_FILE_NAME_BYTES = 255

#: How long a compile may take unless the job says: a cold javac or rustc
#: takes a second or two, a big C++ program more.
DEFAULT_COMPILE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class CodeJob(_Job):
    """Run ``code``, a program in ``language`` (a name of the languages
    table, execpool/shared/languages.py), as SandboxFusion's ``/run_code``
    would: written to the language's file in a directory of the job's own
    with ``files`` beside it, compiled if the language compiles (within
    ``compile_timeout``, apart from ``timeout``), then run with ``stdin``.

    Both steps run in the job's sandbox. A compile is done once per pool
    for the same program (the pool's compile cache, execpool/pool/code.py)
    and under the pool's limits -- the job's own ``limits`` are its run's.
    The Result carries the compile's own Result as ``compile_result``.
    ``warm`` applies to ``python`` only, as PythonJob's does.

    ``args`` are appended to the language's run command (a special judge
    takes its files' names so, as testlib's checkers do); a ``python``
    program given any runs as ``python3 main.py ARGS``, cold.

    ``cwd``, where given, is the run's directory -- the caller's own, kept
    after the job, holding none of the names written into it (the files,
    the program, what the compile made) -- for a caller that reads files
    the program leaves; by default the run has a fresh one, removed after.
    """

    language: str
    code: str
    compile_timeout: Number = field(default=DEFAULT_COMPILE_TIMEOUT_S, kw_only=True)
    warm: bool = field(default=False, kw_only=True)
    args: Sequence[str] = field(default=(), kw_only=True)
    kind = "code"
    _source_field = "code"

    def __post_init__(self) -> None:
        checks.text("language", self.language)
        languages.get(self.language)
        super().__post_init__()
        checks.seconds("compile_timeout", self.compile_timeout)
        checks.flag("warm", self.warm)
        if isinstance(self.args, str) or not isinstance(self.args, (list, tuple)):
            raise TypeError(f"args must be a list or tuple of strings, not {type(self.args).__name__}")
        object.__setattr__(self, "args", tuple(checks.text(f"args[{n}]", arg) for n, arg in enumerate(self.args)))
        spec = self.spec
        if len(spec.source.encode("utf-8")) > MAX_FILE_NAME_BYTES:
            raise ValueError(f"the program's entry name makes its file name {spec.source[:40]!r}... longer than "
                             f"{MAX_FILE_NAME_BYTES} bytes, which no file system takes")
        if self.files is not None:
            ours = {spec.source, *(name for name, _ in spec.support)}
            for path in self.files:
                top = path.split("/", 1)[0]
                if top in ours:
                    raise ValueError(f"files must not hold {path!r}: execpool writes {top!r} for the "
                                     f"{self.language} program")

    @property
    def spec(self) -> languages.Language:
        """The row of its language, with the program's entry name in place."""
        return languages.get(self.language).for_program(self.code)


Job = Union[PythonJob, ShellJob, CodeJob]
