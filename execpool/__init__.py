"""execpool: run untrusted, model-written Python and shell code in a pool of
isolated worker processes, with live streaming, timeouts, cancellation and
whole-tree kills. This module is the public face: it only re-exports.

Where the code lives says which process runs it:

- ``execpool/pool``: the caller's process (``ExecPool`` and what it runs on);
- ``execpool/worker``: each worker process, with warm Python inside it;
- ``execpool/lifeline``: the pool's lifeline process;
- ``execpool/serve``: the ``execpool serve`` process;
- ``execpool/cli``: the ``execpool`` command's process;
- ``execpool/agent``: the model-facing tools and the tool-calling loop,
  in an LLM server's process (public as ``execpool.tools``, ``execpool.loop``);
- ``execpool/ray``: the Ray driver and its actors;
- ``execpool/formats``: the JSON shapes the command and the service share;
- ``execpool/shared``: what every process may import.

The exports are imported on first use (PEP 562): every worker process starts
as ``python -m execpool.worker``, which runs this file first, and a worker
that imported the caller's side (asyncio, the pool, httpx) would carry twice
the memory into every fork of itself -- its warm jobs' start-up cost.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .agent.loop import chat_with_tools
    from .drain import AsyncJobStream, accepts_output_callback, drain_queue, stream_tool_execution
    from .pool.config import PoolConfig
    from .pool.future import JobEvent, JobFuture, JobOutput, OutputCapped
    from .pool.sessions import CellFuture, Session
    from .pool.stats import PoolStats
    from .pool.toolchains import languages
    from .pool.workspaces import Workspace
    from .shared.cells import CellResult
    from .shared.errors import (
        DiskBudgetError,
        ExecPoolError,
        PoolBrokenError,
        PoolClosedError,
        SessionClosedError,
        SessionForkError,
    )
    from .shared.files import File
    from .shared.jobs import CodeJob, Limits, PythonJob, ShellJob
    from .shared.kernel.proctree import capture_process_group, drain_process_output, kill_process_tree
    from .shared.kernel.sandbox import Sandbox, SandboxSupport, sandbox_support
    from .shared.languages import Toolchain
    from .shared.output import TOOL_OUTPUT_STREAM_MAX_CHARS
    from .shared.result import Result, Status
    from .supervisor import ExecPool

_EXPORTS = {
    "chat_with_tools": "agent.loop",
    "PoolConfig": "pool.config",
    "JobEvent": "pool.future",
    "JobFuture": "pool.future",
    "JobOutput": "pool.future",
    "OutputCapped": "pool.future",
    "PoolStats": "pool.stats",
    "CellFuture": "pool.sessions",
    "Session": "pool.sessions",
    "CellResult": "shared.cells",
    "SessionClosedError": "shared.errors",
    "SessionForkError": "shared.errors",
    "DiskBudgetError": "shared.errors",
    "File": "shared.files",
    "AsyncJobStream": "drain",
    "accepts_output_callback": "drain",
    "drain_queue": "drain",
    "stream_tool_execution": "drain",
    "ExecPool": "supervisor",
    "Workspace": "pool.workspaces",
    "ExecPoolError": "shared.errors",
    "PoolBrokenError": "shared.errors",
    "PoolClosedError": "shared.errors",
    "CodeJob": "shared.jobs",
    "Limits": "shared.jobs",
    "PythonJob": "shared.jobs",
    "ShellJob": "shared.jobs",
    "Toolchain": "shared.languages",
    "languages": "pool.toolchains",
    "capture_process_group": "shared.kernel.proctree",
    "drain_process_output": "shared.kernel.proctree",
    "kill_process_tree": "shared.kernel.proctree",
    "Sandbox": "shared.kernel.sandbox",
    "SandboxSupport": "shared.kernel.sandbox",
    "sandbox_support": "shared.kernel.sandbox",
    "TOOL_OUTPUT_STREAM_MAX_CHARS": "shared.output",
    "Result": "shared.result",
    "Status": "shared.result",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'execpool' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list:
    return sorted({*globals(), *_EXPORTS})
