"""A pool's configuration: every knob of ``ExecPool``, checked in one place.

Runs in the caller. ``PoolConfig`` is frozen and validated when it is built,
as ``Limits`` and the job specs are, so a pool never starts half-configured
and every part of it (the workers' lifecycle, the dispatcher, submission)
reads settled values. ``ExecPool(**options)`` builds one;
``ExecPool.from_config(config)`` takes one that was built elsewhere (a
service's settings, a Ray actor's arguments).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Mapping, Optional, Tuple

import psutil

from ..shared import checks
from ..shared.jobs import Limits, PythonJob
from ..shared.kernel.sandbox import Sandbox, pool_sandbox
from ..shared.output import RESULT_HEAD_CHARS
from ..shared.package import has_spawn_extension

#: Variables a tool may see from the caller's environment. Everything else --
#: API keys, tokens, cloud credentials -- stays in the caller.
DEFAULT_ENV_ALLOWLIST = (
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "TERM", "TMPDIR",
)

#: Warm spares each worker keeps parked once idle: two, so back-to-back warm
#: jobs find one while the next is being made.
DEFAULT_WARM_SPARES = 2
MAX_WARM_SPARES = 64


@dataclass(frozen=True)
class PoolConfig:
    """How a pool runs: every option of ``ExecPool(...)`` (and of each
    ``RayPool`` actor's pool), documented here and only here. After
    construction ``workers``, ``python`` and ``spawn_method`` hold what
    "default" resolved to, and ``tool_env`` the environment every tool
    starts from (the allow-listed caller variables read now, plus ``env``)."""

    #: Worker processes (default: the number of CPUs). Each runs any number
    #: of jobs at once, so this bounds the pool's processes, not its
    #: concurrency.
    workers: Optional[int] = None
    #: The interpreter Python tools run with (default ``sys.executable``).
    python: Optional[str] = None
    #: The default rlimits and cgroup caps of every job (a job's own
    #: ``limits`` replaces them).
    limits: Limits = Limits()
    #: Variables every tool gets, on top of the allow-listed ones.
    env: Optional[Mapping[str, str]] = None
    #: The names copied from the caller's environment into every tool's.
    #: Everything else -- API keys, tokens, credentials -- stays in the caller.
    env_allowlist: Tuple[str, ...] = DEFAULT_ENV_ALLOWLIST
    #: Characters of output a Result keeps (its ``output_chars`` counts all).
    max_output_chars: int = RESULT_HEAD_CHARS
    #: A worker is retired, and a fresh one started, after this many jobs.
    max_jobs_per_worker: int = 1000
    #: The constructor returns once every worker is ready, at most this long.
    startup_timeout: float = 30.0
    #: How workers start tools: ``"vfork"`` through the small C extension
    #: execpool.tool._spawn (the default where it was built) or
    #: ``"fork"``, pure Python and a few milliseconds slower per tool; both
    #: set the session, rlimits and death signal before the tool's first
    #: instruction.
    spawn_method: str = "auto"
    #: Modules every worker's warm template imports, so that warm jobs
    #: (``PythonJob(warm=True)``) importing them start fast.
    preload: Tuple[str, ...] = ()
    #: Build IPython's shell in every worker's warm template, where the
    #: pool's Python has IPython, so that a session speaking it starts in
    #: milliseconds. False for a pool that opens no IPython session
    #: (``execpool eval`` and ``execpool batch`` pass it): the template is
    #: then about half the size, and every warm job, being a copy of it,
    #: costs less to start and to end (docs/batch/evaluation.md). An
    #: IPython session still runs there, building its shell as it starts.
    warm_ipython: bool = True
    #: Make the calling process non-dumpable, so tools running as the same
    #: user cannot read its environment (its secrets) through ``/proc``. It
    #: applies to the whole process and disables its core dumps.
    non_dumpable: bool = False
    #: False keeps execpool from creating cgroups even where it could:
    #: process caps are then kept by the worker counting, memory caps
    #: refused, and workers get no group of their own (so a daemon that
    #: leaves its session and clears its environment can outlive its worker).
    cgroups: bool = True
    #: Spares -- clones of a worker's warm template, about 2 MB each -- a
    #: worker keeps parked once it had a warm job (0: each warm job waits for
    #: one made for it).
    warm_spares: int = DEFAULT_WARM_SPARES
    #: ``"strict"`` (or a ``Sandbox`` adding paths to it) runs every job in
    #: the kernel-enforced sandbox (execpool/shared/kernel/sandbox.py); a
    #: job's own ``sandbox=`` overrides it (``False``: none). Where the
    #: kernel lacks it, sandboxed jobs end with an ``Execution error``
    #: (``execpool.sandbox_support()`` says what is missing).
    sandbox: Optional[Sandbox] = None
    #: The nice value (-20..19) of the workers and so of every tool; None
    #: keeps the caller's (a Ray worker's is 15, which is why ``RayPool``
    #: passes 0). Lowering it needs CAP_SYS_NICE; without it the workers
    #: keep the caller's value and execpool logs a warning.
    niceness: Optional[int] = None
    #: Megabytes the compile cache (execpool/pool/code.py) keeps of compiled
    #: programs, least recently used first out.
    compile_cache_mb: int = 1024
    #: Bytes the spaces of the sandboxed jobs and sessions alive at once may
    #: hold in all (each its ``Limits(disk=...)``; execpool/pool/budget.py):
    #: a space is a tmpfs, memory, so by default half of the machine's
    #: memory and swap. A job that does not fit waits for one that ends; a
    #: session that does not fit is refused (``DiskBudgetError``).
    disk_budget: Optional[int] = None
    #: Bytes of ``disk_budget`` that sessions and workspaces, which may
    #: live for hours, leave to jobs: past ``disk_budget - disk_kept_for_jobs``
    #: they are refused (``DiskBudgetError``), so that jobs always find room
    #: once the jobs before them end. Jobs in flight fill it first. ``execpool
    #: serve`` keeps its slots' worth (``--max-in-flight`` times ``--disk-mb``).
    disk_kept_for_jobs: int = 0
    tool_env: Mapping[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        settle = object.__setattr__  # frozen: normalised values are set once, here
        workers = (os.cpu_count() or 2) if self.workers is None else self.workers
        settle(self, "workers", checks.integer("workers", workers))
        checks.integer("max_output_chars", self.max_output_chars)
        checks.integer("max_jobs_per_worker", self.max_jobs_per_worker)
        checks.integer("compile_cache_mb", self.compile_cache_mb, minimum=0)
        if self.disk_budget is None:
            settle(self, "disk_budget", default_disk_budget())
        checks.integer("disk_budget", self.disk_budget)
        checks.integer("disk_kept_for_jobs", self.disk_kept_for_jobs, minimum=0, maximum=self.disk_budget)
        checks.seconds("startup_timeout", self.startup_timeout)
        checks.integer("warm_spares", self.warm_spares, minimum=0, maximum=MAX_WARM_SPARES)
        checks.flag("non_dumpable", self.non_dumpable)
        checks.flag("cgroups", self.cgroups)
        checks.flag("warm_ipython", self.warm_ipython)
        if self.niceness is not None:
            checks.integer("niceness", self.niceness, minimum=-20, maximum=19)
        settle(self, "sandbox", pool_sandbox(self.sandbox))
        if not isinstance(self.limits, Limits):
            raise TypeError(f"limits must be an execpool.Limits, not {type(self.limits).__name__}")
        settle(self, "spawn_method", _spawn_method(self.spawn_method))
        settle(self, "preload", checks.names("preload", self.preload, module=True))
        settle(self, "env_allowlist", checks.names("env_allowlist", self.env_allowlist, module=False))
        python = sys.executable if self.python is None else os.path.abspath(checks.text("python", self.python))
        if not os.access(python, os.X_OK) or os.path.isdir(python):
            raise ValueError(f"python interpreter {python!r} is not an executable file")
        settle(self, "python", python)
        # Checked the way a job's env is.
        extra = PythonJob("pass", env=self.env or {}).env or {}
        settle(self, "env", extra)
        tool_env = {name: os.environ[name] for name in self.env_allowlist if name in os.environ}
        tool_env.update(extra)
        settle(self, "tool_env", tool_env)


def _spawn_method(method: object) -> str:
    if method == "auto":
        return "vfork" if has_spawn_extension() else "fork"
    if method not in ("vfork", "fork"):
        raise ValueError(f"spawn_method must be 'auto', 'vfork' or 'fork', not {method!r}")
    if method == "vfork" and not has_spawn_extension():
        raise ValueError("spawn_method='vfork' needs the execpool.tool._spawn extension, which is not built here")
    return method


def disk_options(disk_mb: Optional[int], budget_mb: Optional[int], limits: Optional[Limits] = None,
                 jobs_at_once: int = 0) -> Dict[str, Any]:
    """A pool's ``limits`` (``limits`` or the defaults, with ``disk`` from
    ``disk_mb`` where given) and ``disk_budget``, from the commands'
    ``--disk-mb`` and ``--disk-budget-mb``; and what sessions and
    workspaces leave of it for ``jobs_at_once`` jobs (at most all of it)."""
    options: Dict[str, Any] = {}
    base = limits or Limits()
    if limits is not None or disk_mb is not None:
        options["limits"] = base if disk_mb is None else replace(base, disk=disk_mb << 20)
    budget = default_disk_budget() if budget_mb is None else budget_mb << 20
    if budget_mb is not None:
        options["disk_budget"] = budget
    disk = options.get("limits", base).disk
    if jobs_at_once and disk:
        options["disk_kept_for_jobs"] = min(budget, jobs_at_once * disk)
    return options


def default_disk_budget() -> int:
    """Half of the machine's memory and swap: a space is a tmpfs."""
    return (psutil.virtual_memory().total + psutil.swap_memory().total) // 2
