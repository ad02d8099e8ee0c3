"""A pool's configuration: every knob of ``ExecPool``, checked in one place.

Runs in the caller. ``PoolConfig`` is frozen and validated when it is built,
as ``Limits`` and the job specs are, so a pool never starts half-configured
and every part of it (the workers' lifecycle, the dispatcher, submission)
reads settled values. ``ExecPool(**options)`` builds one;
``ExecPool.from_config(config)`` takes one that was built elsewhere (a
service's settings, a Ray actor's arguments).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field
from typing import Mapping, Optional, Tuple

from . import checks
from .jobs import Limits, PythonJob
from .sandbox import Sandbox, pool_sandbox

#: Variables a tool may see from the caller's environment. Everything else --
#: API keys, tokens, cloud credentials -- stays in the caller.
DEFAULT_ENV_ALLOWLIST = (
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "TERM", "TMPDIR",
)

#: Warm spares each worker keeps parked once idle: two, so back-to-back warm
#: jobs find one while the next is being made.
DEFAULT_WARM_SPARES = 2
MAX_WARM_SPARES = 64

#: How much output a Result keeps by default (the full length is always counted).
DEFAULT_MAX_OUTPUT_CHARS = 1_000_000

#: Whether the C extension was built, asked without loading it here: it is
#: the workers' to load, not the caller's.
_HAS_SPAWN_EXTENSION = importlib.util.find_spec("execpool._spawn") is not None


@dataclass(frozen=True)
class PoolConfig:
    """How a pool runs. Each field is documented where ``ExecPool`` takes it;
    after construction ``workers``, ``python`` and ``spawn_method`` hold what
    "default" resolved to, and ``tool_env`` the environment every tool starts
    from (the allow-listed caller variables read now, plus ``env``)."""

    workers: Optional[int] = None
    python: Optional[str] = None
    limits: Limits = Limits()
    env: Optional[Mapping[str, str]] = None
    env_allowlist: Tuple[str, ...] = DEFAULT_ENV_ALLOWLIST
    max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS
    max_jobs_per_worker: int = 1000
    startup_timeout: float = 30.0
    spawn_method: str = "auto"
    preload: Tuple[str, ...] = ()
    non_dumpable: bool = False
    cgroups: bool = True
    warm_spares: int = DEFAULT_WARM_SPARES
    sandbox: Optional[Sandbox] = None
    niceness: Optional[int] = None
    tool_env: Mapping[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        settle = object.__setattr__  # frozen: normalised values are set once, here
        workers = (os.cpu_count() or 2) if self.workers is None else self.workers
        settle(self, "workers", checks.integer("workers", workers))
        checks.integer("max_output_chars", self.max_output_chars)
        checks.integer("max_jobs_per_worker", self.max_jobs_per_worker)
        checks.seconds("startup_timeout", self.startup_timeout)
        checks.integer("warm_spares", self.warm_spares, minimum=0, maximum=MAX_WARM_SPARES)
        checks.flag("non_dumpable", self.non_dumpable)
        checks.flag("cgroups", self.cgroups)
        if self.niceness is not None:
            checks.integer("niceness", self.niceness, minimum=-20, maximum=19)
        settle(self, "sandbox", pool_sandbox(self.sandbox))
        if not isinstance(self.limits, Limits):
            raise TypeError(f"limits must be an execpool.Limits, not {type(self.limits).__name__}")
        settle(self, "spawn_method", _spawn_method(self.spawn_method))
        settle(self, "preload", _names("preload", self.preload, module=True))
        settle(self, "env_allowlist", _names("env_allowlist", self.env_allowlist, module=False))
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
        return "vfork" if _HAS_SPAWN_EXTENSION else "fork"
    if method not in ("vfork", "fork"):
        raise ValueError(f"spawn_method must be 'auto', 'vfork' or 'fork', not {method!r}")
    if method == "vfork" and not _HAS_SPAWN_EXTENSION:
        raise ValueError("spawn_method='vfork' needs the execpool._spawn extension, which is not built here")
    return method


def _names(field_name: str, names: object, *, module: bool) -> Tuple[str, ...]:
    """A tuple of names from any iterable of them -- but not one string,
    which would be its characters."""
    if isinstance(names, str):
        raise TypeError(f"{field_name} must be a list of names, not one string")
    try:
        names = tuple(names)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{field_name} must be a list of names, not {type(names).__name__}") from None
    for name in names:
        checks.text(f"{field_name} entry", name)
        if module and not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"{field_name} entry {name!r} is not a module name")
    return names
