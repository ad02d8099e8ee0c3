"""SandboxFusion's answer to ``/run_code`` (its ``RunCodeResponse``), field
for field, so that its clients -- its own ``sandbox-fusion`` package,
verl's reward and tool code -- work unchanged.

Runs in the service's process (execpool/serve). The request side is the
``RUN_CODE`` dialect of execpool/formats/request.py.
"""

from __future__ import annotations

import base64
from typing import Any, Dict, List, Mapping, Optional

from ..shared.cells import CellResult
from ..shared.result import Result, Status


def encoded(files: Mapping[str, bytes]) -> Dict[str, str]:
    """Fetched files as an answer carries them: base64 text."""
    return {path: base64.b64encode(data).decode("ascii") for path, data in files.items()}


def answer(result: Result, files: Mapping[str, bytes], pod: Optional[str] = None) -> Dict[str, Any]:
    """The ``RunCodeResponse`` for a job's Result, ``executor_pod_name``
    the replica that ran it (None for a lone server). A program with no code is
    what SandboxFusion makes of it -- an empty file, run: it succeeds. A
    compiled language's compile is ``compile_result``; when it failed (or
    timed out) nothing ran: ``run_result`` null, top ``Failed``."""
    return {**_answer(result, encoded(files)), "executor_pod_name": pod}


def _answer(result: Result, fetched: Dict[str, str]) -> Dict[str, Any]:
    if result.status is Status.INFRA:
        return sandbox_error(f"execpool could not run the code: {result.error}")
    if result.empty_message is not None:
        return {**_response("Success", ""), "run_result": _run_result("Finished", 0.0, 0.0, 0, "", ""),
                "files": fetched}
    compiled = None if result.compile_result is None else _step(result.compile_result)
    if result.compile_failed:
        return {**_response("Failed", ""), "compile_result": compiled, "files": fetched}
    top = "Success" if result.status is Status.OK else "Failed"
    message = result.text if result.status is Status.TIMEOUT else result.error or ""
    return {**_response(top, message), "compile_result": compiled, "run_result": _step(result), "files": fetched}


def _step(result: Result) -> Dict[str, Any]:
    """One step's ``RunResult``: a timeout's output is what came before the
    kill; a program killed over a cap (memory, processes) got SIGKILL: -9,
    as SandboxFusion reports an out-of-memory kill."""
    if result.status is Status.TIMEOUT:
        return _run_result("TimeLimitExceeded", result.duration_s, result.cpu_s, None, result.output, result.stderr)
    code = result.exit_code if result.exit_code is not None else -9
    return _run_result("Finished", result.duration_s, result.cpu_s, code, result.output, result.stderr)


def sandbox_error(message: str) -> Dict[str, Any]:
    """The answer for a request that cannot run (HTTP 200, as SandboxFusion
    answers; its clients raise on ``SandboxError`` with this message)."""
    return {**_response("SandboxError", message), "run_result": None, "files": {}}


def _response(status: str, message: str) -> Dict[str, Any]:
    return {"status": status, "message": message, "compile_result": None, "run_result": None,
            "executor_pod_name": None, "files": {}}


def _run_result(status: str, seconds: float, cpu_seconds: Optional[float], code: Optional[int], stdout: str,
                stderr: str) -> Dict[str, Any]:
    """``execution_time`` is wall-clock, ``cpu_time`` the CPU of the job's
    whole tree (``Result.cpu_s``), both in seconds as SandboxFusion's."""
    return {"status": status, "execution_time": round(seconds, 6),
            "cpu_time": None if cpu_seconds is None else round(cpu_seconds, 6), "return_code": code,
            "stdout": stdout, "stderr": stderr}


#: The ``RunCodeResponse``, for the OpenAPI document.
RUN_RESULT_SCHEMA = {"type": ["object", "null"], "properties": {
    "status": {"type": "string", "enum": ["Finished", "Error", "TimeLimitExceeded"]},
    "execution_time": {"type": "number"}, "cpu_time": {"type": ["number", "null"]},
    "return_code": {"type": ["integer", "null"]}, "stdout": {"type": "string"}, "stderr": {"type": "string"}}}
RESPONSE_SCHEMA = {"type": "object", "properties": {
    "status": {"type": "string", "enum": ["Success", "Failed", "SandboxError"]}, "message": {"type": "string"},
    "compile_result": RUN_RESULT_SCHEMA, "run_result": RUN_RESULT_SCHEMA,
    "executor_pod_name": {"type": ["string", "null"]},
    "files": {"type": "object", "additionalProperties": {"type": "string", "contentEncoding": "base64"}}}}


def jupyter_cell(result: CellResult) -> Dict[str, Any]:
    """One cell of a ``RunJupyterResponse``, as SandboxFusion's kernel
    driver fills it: its streams, the MIME bundles it showed (the value's
    among them, where it came), and its errors."""
    display = list(result.shown)
    errors = [result.error] if result.error is not None else []
    if not result.alive and result.message:
        errors.append({"ename": "SessionError", "evalue": result.message, "traceback": [result.message]})
    return {"stdout": result.stdout, "stderr": result.stderr, "display": display, "error": errors}


def jupyter_answer(status: str, seconds: float, cells: List[CellResult], files: Mapping[str, bytes],
                   message: str = "") -> Dict[str, Any]:
    """The ``RunJupyterResponse``: ``status`` is the driver's (``Finished``
    when every cell ran, ``TimeLimitExceeded`` past ``total_timeout``,
    ``Error`` when the session died); SandboxFusion gives the cells only
    when every cell ran."""
    finished = status == "Finished"
    driver = _run_result(status, seconds, None, 0 if finished else None, "", "")
    return {"status": "Success" if finished else "Failed", "message": message, "driver": driver,
            "cells": [jupyter_cell(cell) for cell in cells] if finished else [], "executor_pod_name": None,
            "files": encoded(files) if finished else {}}


def jupyter_error(message: str) -> Dict[str, Any]:
    return {"status": "SandboxError", "message": message, "driver": None, "cells": [], "executor_pod_name": None,
            "files": {}}
