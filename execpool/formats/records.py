"""The record of a job: one JSON object, as ``execpool batch`` writes it to
OUT and execpool's own routes answer it.

Runs in the caller's processes that write records: the command
(execpool/cli) and the service (execpool/serve). The keys are declared
once (``RECORD``), with their JSON types and meaning; the records built
here and the OpenAPI document's description of them both come from it.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

from ..shared.cells import CellResult
from ..shared.result import Result, Status

#: Statuses of records: a Result's (execpool.Status), or "invalid" for a
#: line or job that could not run as asked.
STATUSES = (*(status.value for status in Status), "invalid")

#: What a job cost, as its worker measured it: the Result's fields of these
#: names (execpool/shared/result.py says which are exact and which bounds).
#: In the record of a job that never ran they are null.
COST_KEYS = ("cpu_user_s", "cpu_system_s", "max_rss_bytes", "peak_memory_bytes", "processes")

#: A CodeJob's compile step (execpool/shared/result.py); null in the record
#: of a job where nothing compiled.
COMPILE_KEYS = ("compile_status", "compile_output", "compile_duration_s")

#: A record's keys, in order: (JSON Schema, meaning).
RECORD: Mapping[str, tuple] = {
    "id": ({"type": ["string", "integer", "null"]}, "The job's id, as given."),
    "status": ({"type": "string", "enum": list(STATUSES)},
               "ok, error (non-zero exit, a signal, a cap, no code), timeout, cancelled, infra (execpool failed: "
               "worth running again) or invalid (the job could not run as asked)."),
    "exit_code": ({"type": ["integer", "null"]}, "The exit code; negative for a signal; null when it did not exit."),
    "output": ({"type": "string"}, "stdout and stderr as one stream, cut to the kept head."),
    "output_chars": ({"type": "integer"}, "The whole output's length, however much was kept."),
    "duration_s": ({"type": "number"}, "Wall seconds the job ran."),
    "cpu_user_s": ({"type": ["number", "null"]}, "User CPU seconds of the job's whole tree."),
    "cpu_system_s": ({"type": ["number", "null"]}, "System CPU seconds of the job's whole tree."),
    "max_rss_bytes": ({"type": ["integer", "null"]}, "The largest resident set of any one of its processes."),
    "peak_memory_bytes": ({"type": ["integer", "null"]}, "The tree's peak memory, where it had a memory cgroup."),
    "processes": ({"type": ["integer", "null"]}, "Processes of the job its worker reaped (a lower bound)."),
    "compile_status": ({"type": ["string", "null"], "enum": [*(status.value for status in Status), None]},
                       "A compiled language's compile: ok, error (the compiler failed: the program did not run), "
                       "timeout, cancelled or infra; null where nothing compiled."),
    "compile_output": ({"type": ["string", "null"]}, "What the compiler printed, stdout then stderr."),
    "compile_duration_s": ({"type": ["number", "null"]},
                           "Wall seconds of the compile (the first one's, where it came from the compile cache)."),
    "line": ({"type": "integer"}, "The input line (or job) number."),
    "error": ({"type": ["string", "null"]},
              "Why, when the job did not simply exit: the model-facing text (timeout, cancelled, no code, execpool's "
              "error) or why it is invalid."),
}


def result_record(ident: Any, number: int, result: Result) -> Dict[str, Any]:
    """The record of a job that ran. ``error`` is the model-facing text when
    the job did not simply exit (timeout, cancelled, no code, execpool's
    failure)."""
    plain_exit = (result.error is None and result.empty_message is None and not result.compile_failed
                  and not (result.timed_out or result.cancelled))
    return {
        "id": ident, "status": result.status.value, "exit_code": result.exit_code, "output": result.output,
        "output_chars": result.output_chars, "duration_s": round(result.duration_s, 4),
        **{key: getattr(result, key) for key in COST_KEYS},
        "compile_status": None if result.compile_status is None else result.compile_status.value,
        "compile_output": result.compile_output,
        "compile_duration_s": None if result.compile_duration_s is None else round(result.compile_duration_s, 4),
        "line": number, "error": None if plain_exit else result.text,
    }


def test_record(number: int, result: Result, expected: str) -> Dict[str, Any]:
    """The record of one test of a program (``/v1/batch``'s tests body):
    its stderr apart, and whether it ``passed`` -- it exited 0 and its
    stdout is ``expected`` (trailing newlines aside)."""
    record = result_record(number, number + 1, result)
    record["stderr"] = result.stderr
    record["passed"] = result.status is Status.OK and result.output.rstrip("\n") == expected.rstrip("\n")
    return record


#: What a test's record adds (``test_record``).
TEST_KEYS: Mapping[str, tuple] = {
    "stderr": ({"type": "string"}, "The test's stderr, apart."),
    "passed": ({"type": "boolean"}, "It exited 0 and its stdout equals the expected one, trailing newlines aside."),
}

#: What a record of a job that fetched files adds.
FILES_KEYS: Mapping[str, tuple] = {
    "files": ({"type": "object", "additionalProperties": {"type": "string", "contentEncoding": "base64"}},
              "The fetched files that were there (relative path: base64)."),
}


def invalid_record(ident: Any, number: int, reason: str) -> Dict[str, Any]:
    """The record of a job that could not run as asked (a line that is no
    job, a file that could not be written), with the reason in ``error``."""
    return {"id": ident, "status": "invalid", "exit_code": None, "output": "", "output_chars": 0,
            "duration_s": 0.0, **dict.fromkeys(COST_KEYS), **dict.fromkeys(COMPILE_KEYS), "line": number,
            "error": reason}


def schema(extra: Mapping[str, tuple] = {}) -> dict:
    """The JSON Schema of a record (with ``extra`` keys a route adds), for
    the OpenAPI document."""
    keys = {**RECORD, **extra}
    return {"type": "object", "required": list(RECORD),
            "properties": {key: {**shape, "description": doc} for key, (shape, doc) in keys.items()}}


def cell_record(result: CellResult) -> Dict[str, Any]:
    """A session's cell, as ``/v1/sessions/{id}/run`` answers it."""
    return {"status": result.status.value, "stdout": result.stdout, "stderr": result.stderr, "value": result.value,
            "data": result.data, "display": list(result.display), "value_at": result.value_at, "error": result.error,
            "exit_code": result.exit_code, "alive": result.alive, "message": result.message,
            "duration_s": result.duration_s, "execution_count": result.execution_count, "text": result.text,
            **{key: getattr(result, key, None) for key in COST_KEYS}}
