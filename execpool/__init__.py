"""execpool: run untrusted, model-written Python and shell code in a pool of
isolated worker processes, with live streaming, timeouts, cancellation and
whole-tree kills. This module only re-exports the public API.

The exports are imported on first use (PEP 562): every worker process starts
as ``python -m execpool.worker``, which runs this file first, and a worker
that imported the caller-side modules (asyncio, the pool, httpx) would carry
twice the memory into every fork of itself -- its warm jobs' start-up cost.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import PoolConfig
    from .drain import AsyncJobStream, accepts_output_callback, drain_queue, stream_tool_execution
    from .future import TOOL_OUTPUT_STREAM_MAX_CHARS, JobEvent, JobFuture, JobOutput, OutputCapped
    from .jobs import Limits, PythonJob, ShellJob
    from .lifecycle import PoolClosedError
    from .loop import chat_with_tools
    from .proctree import capture_process_group, drain_process_output, kill_process_tree
    from .result import Result, Status
    from .sandbox import Sandbox, SandboxSupport, sandbox_support
    from .stats import PoolStats
    from .supervisor import ExecPool

_EXPORTS = {
    "PoolConfig": "config",
    "TOOL_OUTPUT_STREAM_MAX_CHARS": "future",
    "JobEvent": "future",
    "JobFuture": "future",
    "JobOutput": "future",
    "OutputCapped": "future",
    "AsyncJobStream": "drain",
    "accepts_output_callback": "drain",
    "drain_queue": "drain",
    "stream_tool_execution": "drain",
    "Limits": "jobs",
    "PythonJob": "jobs",
    "ShellJob": "jobs",
    "chat_with_tools": "loop",
    "capture_process_group": "proctree",
    "drain_process_output": "proctree",
    "kill_process_tree": "proctree",
    "Result": "result",
    "Status": "result",
    "Sandbox": "sandbox",
    "SandboxSupport": "sandbox",
    "sandbox_support": "sandbox",
    "PoolStats": "stats",
    "ExecPool": "supervisor",
    "PoolClosedError": "lifecycle",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'execpool' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list:
    return sorted({*globals(), *_EXPORTS})
