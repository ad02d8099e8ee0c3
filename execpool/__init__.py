"""execpool: run untrusted, model-written Python and shell code in a pool of
isolated worker processes, with live streaming, timeouts, cancellation and
whole-tree kills. This module only re-exports the public API."""

from .drain import (
    TOOL_OUTPUT_STREAM_MAX_CHARS,
    AsyncJobStream,
    accepts_output_callback,
    drain_queue,
    stream_tool_execution,
)
from .jobs import Limits, PythonJob, ShellJob
from .proctree import capture_process_group, drain_process_output, kill_process_tree
from .result import Result
from .supervisor import ExecPool, PoolClosedError



def __getattr__(name: str):
    """``execpool.chat_with_tools`` without importing httpx for callers who
    only run jobs."""
    if name == "chat_with_tools":
        from .loop import chat_with_tools

        return chat_with_tools
    raise AttributeError(f"module 'execpool' has no attribute {name!r}")


__all__ = [
    "TOOL_OUTPUT_STREAM_MAX_CHARS",
    "AsyncJobStream",
    "ExecPool",
    "Limits",
    "PoolClosedError",
    "PythonJob",
    "Result",
    "ShellJob",
    "accepts_output_callback",
    "capture_process_group",
    "chat_with_tools",
    "drain_process_output",
    "drain_queue",
    "kill_process_tree",
    "stream_tool_execution",
]
