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
    "drain_process_output",
    "drain_queue",
    "kill_process_tree",
    "stream_tool_execution",
]
