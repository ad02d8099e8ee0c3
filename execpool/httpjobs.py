"""From the service's request bodies to jobs, and from Results to answers,
in its two dialects (shared/SERVE.md §2-3).

Runs in the service's process (execpool/serve.py), and only turns data into
data: no I/O, no pool. Every problem with a body is a ``BadRequest`` whose
message names the field, in the words the library's own checks use, because
the clients reading it are programs whose authors need to know which field
to fix.

execpool's dialect takes what an ``execpool batch`` input line takes, minus
``cwd`` (a client on another machine has no business naming the server's
directories), plus ``files`` and ``fetch_files``, and answers with the batch
record. SandboxFusion's dialect (``/run_code``) takes its request model and
answers with its response model, field for field, so its clients work
unchanged.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from typing import Any, Dict, List, Mapping, Optional, Union

from .jobfiles import JobFileError, check_path
from .jobs import Limits, PythonJob, ShellJob
from .records import json_type, result_record
from .result import Result, Status

Job = Union[PythonJob, ShellJob]

#: The largest request body (MiB), and how often a quiet stream says it is alive.
DEFAULT_MAX_BODY_MB = 64
DEFAULT_HEARTBEAT_S = 10.0
#: How long running jobs get to finish when the service is told to stop.
DEFAULT_GRACE_S = 10.0
#: Seconds a request's headers, and then its body, may take to arrive: a
#: client that trickles them would hold a connection for ever.
DEFAULT_READ_TIMEOUT_S = 30.0

#: Connections the service keeps open at most: each is a descriptor, and a
#: job can open thousands of connections to the server it runs under.
DEFAULT_MAX_CONNECTIONS = 4096

#: Jobs in one /v1/batch, and files one job may bring or fetch: enough for
#: any real use; past them a small body would cost the service far more
#: than it weighs (a record per line, a file per entry).
MAX_BATCH_JOBS = 10_000
MAX_FILES = 1_000
#: A job's own environment: Linux refuses more than ~2 MiB of arguments and
#: environment together (and any one string over 128 KiB).
MAX_ENV_VARS = 1_000
MAX_ENV_CHARS = 256 << 10

#: Keys of an execpool job body (the batch input line's, without ``cwd``).
RUN_KEYS = ("id", "python", "shell", "timeout", "stdin", "env", "files", "fetch_files")

#: The largest ``memory_limit_MB`` taken (1 PiB): a cap, not a wish.
MAX_MEMORY_LIMIT_MB = 1 << 30

#: SandboxFusion's languages that run here, and what runs them.
SANDBOX_FUSION_LANGUAGES = ("python", "bash")


class BadRequest(ValueError):
    """A body the service cannot run; the message names the field."""


@dataclasses.dataclass(frozen=True)
class JobRequest:
    """One job a request asks for, with the files that go with it."""

    job: Job
    ident: Any = None
    files: Mapping[str, bytes] = dataclasses.field(default_factory=dict)
    fetch: tuple = ()

    @property
    def size(self) -> int:
        """Roughly what submitting the job costs, in characters: its code,
        stdin and environment."""
        job = self.job
        return len(job.source) + len(job.stdin or "") + sum(len(k) + len(v) for k, v in (job.env or {}).items())

    @property
    def needs_directory(self) -> bool:
        """Whether the service must make the job's directory itself (to put
        files in, or to read them back) instead of leaving it to the pool."""
        return bool(self.files or self.fetch)


@dataclasses.dataclass(frozen=True)
class ServiceDefaults:
    """What a request does not say: set when the service starts."""

    timeout: float = 30.0
    max_timeout: float = 600.0
    warm: bool = False
    network: bool = True
    limits: Limits = Limits()


def parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None


# -- execpool's dialect ------------------------------------------------------------------


def run_request(obj: object, defaults: ServiceDefaults, *, separate_stderr: bool = False) -> JobRequest:
    """The job of a ``/v1/run``, ``/v1/stream`` or ``/v1/batch`` body."""
    if not isinstance(obj, dict):
        raise BadRequest(f"a job must be a JSON object, not {json_type(obj)}")
    unknown = sorted(set(obj) - set(RUN_KEYS))
    if unknown:
        raise BadRequest(f"unknown field {', '.join(map(json.dumps, unknown))} (a job has {', '.join(RUN_KEYS)})")
    if ("python" in obj) == ("shell" in obj):
        raise BadRequest('give either "python" or "shell", not both' if "python" in obj
                         else 'missing "python" or "shell"')
    ident = obj.get("id")
    if ident is not None and (isinstance(ident, bool) or not isinstance(ident, (str, int))):
        raise BadRequest(f'"id" must be a string or an integer, not {json_type(ident)}')
    kind = "python" if "python" in obj else "shell"
    env = obj.get("env")
    if env is not None and not isinstance(env, dict):
        raise BadRequest(f'"env" must be an object, not {json_type(env)}')
    if env and (len(env) > MAX_ENV_VARS or sum(len(k) + len(str(v)) for k, v in env.items()) > MAX_ENV_CHARS):
        # A tool could not start with it anyway (execve's E2BIG), after
        # costing the server far more than the body weighed.
        raise BadRequest(f'"env" is over {MAX_ENV_VARS} variables or {MAX_ENV_CHARS} characters')
    job = _job(kind, obj[kind], defaults, timeout=obj.get("timeout", defaults.timeout), stdin=obj.get("stdin"),
               env=env, separate_stderr=separate_stderr, source_field=kind)
    return JobRequest(job, ident, _files(obj.get("files"), "files"), _fetch(obj.get("fetch_files")))


def tests_requests(obj: dict, defaults: ServiceDefaults) -> List[JobRequest]:
    """``{"code": ..., "tests": [{"stdin", "expected"}, ...]}``: one job per
    test, the same program against each test's stdin; stderr apart, so
    that only stdout is compared."""
    unknown = sorted(set(obj) - {"code", "language", "timeout", "tests"})
    if unknown:
        raise BadRequest(f"unknown field {', '.join(map(json.dumps, unknown))} "
                         '(a tests body has "code", "language", "timeout", "tests")')
    language = obj.get("language", "python")
    if language not in ("python", "shell", "bash"):
        raise BadRequest(f'"language" must be "python" or "bash", not {json.dumps(language)}')
    tests = obj.get("tests")
    if not isinstance(tests, list) or not tests:
        raise BadRequest('"tests" must be a non-empty array of {"stdin", "expected"} objects')
    if len(tests) > MAX_BATCH_JOBS:
        raise BadRequest(f'"tests" has more than {MAX_BATCH_JOBS} tests; split them')
    requests = []
    for number, test in enumerate(tests):
        if not isinstance(test, dict) or not isinstance(test.get("expected"), str):
            raise BadRequest(f'tests[{number}] must be an object with a string "expected"')
        if set(test) - {"stdin", "expected"}:
            raise BadRequest(f'tests[{number}] has unknown fields (a test has "stdin", "expected")')
        kind = "python" if language == "python" else "shell"
        job = _job(kind, obj.get("code"), defaults, timeout=obj.get("timeout", defaults.timeout),
                   stdin=test.get("stdin"), env=None, separate_stderr=True, field=f"tests[{number}]")
        requests.append(JobRequest(job, number))
    return requests


def record(request: JobRequest, result: Result, files: Mapping[str, bytes], number: int = 1) -> dict:
    """The answer to one job in execpool's dialect: the batch record, plus
    ``files`` when the request fetched any."""
    answer = result_record(request.ident, number, result)
    if request.fetch:
        answer["files"] = {path: base64.b64encode(data).decode("ascii") for path, data in files.items()}
    return answer


def test_record(request: JobRequest, result: Result, expected: str) -> dict:
    answer = result_record(request.ident, request.ident + 1, result)
    answer["stderr"] = result.stderr
    answer["passed"] = result.status is Status.OK and result.output.rstrip("\n") == expected.rstrip("\n")
    return answer


# -- SandboxFusion's dialect ---------------------------------------------------------------


def sandbox_fusion_request(obj: object, defaults: ServiceDefaults, memory_by_cgroup: bool) -> JobRequest:
    """A ``/run_code`` body (SandboxFusion's ``RunCodeRequest``) as a job.
    ``memory_by_cgroup``: whether ``memory_limit_MB`` can be a cgroup cap
    here (else it is an address-space limit)."""
    if not isinstance(obj, dict):
        raise BadRequest(f"the request must be a JSON object, not {json_type(obj)}")
    language = obj.get("language") or "python"
    if language not in SANDBOX_FUSION_LANGUAGES:
        raise BadRequest(f"language {json.dumps(language)} is not supported here; supported: "
                         f"{', '.join(SANDBOX_FUSION_LANGUAGES)}")
    timeout = obj.get("run_timeout", 10)
    memory_mb = obj.get("memory_limit_MB", -1)
    if isinstance(memory_mb, bool) or not isinstance(memory_mb, int):
        raise BadRequest(f'"memory_limit_MB" must be an integer, not {json_type(memory_mb)}')
    limits = defaults.limits
    if memory_mb > MAX_MEMORY_LIMIT_MB:
        raise BadRequest(f'"memory_limit_MB" is over {MAX_MEMORY_LIMIT_MB}')
    if memory_mb > 0:
        cap = memory_mb << 20
        limits = (dataclasses.replace(limits, memory=cap) if memory_by_cgroup
                  else dataclasses.replace(limits, address_space=max(cap, 64 << 20)))
    files = obj.get("files") or {}
    if not isinstance(files, dict):
        raise BadRequest(f'"files" must be an object, not {json_type(files)}')
    kind = "python" if language == "python" else "shell"
    job = _job(kind, obj.get("code"), defaults, timeout=timeout, stdin=obj.get("stdin"), env=None,
               separate_stderr=True, limits=limits, empty_ok=True, timeout_field="run_timeout")
    present = {path: value for path, value in files.items() if value is not None}
    return JobRequest(job, None, _files(present, "files"), _fetch(obj.get("fetch_files")))


def sandbox_fusion_answer(result: Result, files: Mapping[str, bytes]) -> dict:
    """SandboxFusion's ``RunCodeResponse`` for a Result."""
    fetched = {path: base64.b64encode(data).decode("ascii") for path, data in files.items()}
    if result.status is Status.INFRA:
        return _sandbox_error(f"execpool could not run the code: {result.error}")
    if result.empty_message is not None:  # no code: what running an empty file gives
        run = _run_result("Finished", 0.0, 0.0, 0, "", "")
        return {**_answer("Success", ""), "run_result": run, "files": fetched}
    if result.status is Status.TIMEOUT:
        run = _run_result("TimeLimitExceeded", result.duration_s, result.cpu_s, None, result.output, result.stderr)
        return {**_answer("Failed", result.text), "run_result": run, "files": fetched}
    # A program killed over a cap (memory, processes) got SIGKILL: -9, as
    # SandboxFusion reports an out-of-memory kill.
    code = result.exit_code if result.exit_code is not None else -9
    run = _run_result("Finished", result.duration_s, result.cpu_s, code, result.output, result.stderr)
    top = "Success" if result.status is Status.OK else "Failed"
    return {**_answer(top, result.error or ""), "run_result": run, "files": fetched}


def sandbox_error(message: str) -> dict:
    """The answer for a request that cannot run (HTTP 200, as SandboxFusion
    answers; its clients raise on ``SandboxError`` with this message)."""
    return _sandbox_error(message)


def _sandbox_error(message: str) -> dict:
    return {**_answer("SandboxError", message), "run_result": None, "files": {}}


def _answer(status: str, message: str) -> dict:
    return {"status": status, "message": message, "compile_result": None, "run_result": None,
            "executor_pod_name": None, "files": {}}


def _run_result(status: str, seconds: float, cpu_seconds: Optional[float], code: Optional[int], stdout: str,
                stderr: str) -> dict:
    """``execution_time`` is wall-clock, ``cpu_time`` the CPU of the job's
    whole tree (``Result.cpu_s``), both in seconds as SandboxFusion's."""
    return {"status": status, "execution_time": round(seconds, 6),
            "cpu_time": None if cpu_seconds is None else round(cpu_seconds, 6), "return_code": code,
            "stdout": stdout, "stderr": stderr}


# -- shared ----------------------------------------------------------------------------------


def _job(kind: str, source: object, defaults: ServiceDefaults, *, timeout: object, stdin: object,
         env: Optional[dict], separate_stderr: bool, limits: Optional[Limits] = None, empty_ok: bool = False,
         field: str = "", source_field: str = "code", timeout_field: str = "timeout") -> Job:
    """``field`` prefixes messages about one part of a body (``tests[3]``);
    ``source_field`` and ``timeout_field`` are the body's names for them."""
    where = f"{field}: " if field else ""
    if not isinstance(source, str):
        raise BadRequest(f'{where}"{source_field}" must be a string, not {json_type(source)}')
    if not empty_ok and not source.strip():
        raise BadRequest(f"{where}No code provided." if kind == "python" else f"{where}No command provided.")
    if timeout is not None and not isinstance(timeout, bool) and isinstance(timeout, (int, float)) \
            and timeout > defaults.max_timeout:
        raise BadRequest(f'{where}"{timeout_field}" is over this server\'s limit of {defaults.max_timeout:g} s')
    if timeout is None:
        raise BadRequest(f'{where}"{timeout_field}" must be a number of seconds (this server always has a limit)')
    kwargs: Dict[str, Any] = {"timeout": timeout, "stdin": stdin, "env": env, "network": defaults.network,
                              "limits": limits or defaults.limits, "separate_stderr": separate_stderr}
    if kind == "python" and defaults.warm:
        kwargs["warm"] = True
    try:
        return (PythonJob if kind == "python" else ShellJob)(source, **kwargs)
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"{where}{_field_named(exc, timeout_field)}") from None


def _field_named(exc: Exception, timeout_field: str) -> str:
    """The library's message, with SandboxFusion's name for the timeout."""
    text = str(exc)
    return text.replace("timeout", timeout_field, 1) if text.startswith("timeout") else text


def _files(files: object, field: str) -> Dict[str, bytes]:
    if files is None:
        return {}
    if not isinstance(files, dict):
        raise BadRequest(f'"{field}" must be an object of path: base64, not {json_type(files)}')
    if len(files) > MAX_FILES:
        raise BadRequest(f'"{field}" has more than {MAX_FILES} files')
    decoded = {}
    for path, value in files.items():
        try:
            check_path(path)
        except JobFileError as exc:
            raise BadRequest(f'"{field}": {exc}') from None
        if not isinstance(value, str):
            raise BadRequest(f'"{field}"[{json.dumps(path)}] must be a base64 string, not {json_type(value)}')
        try:
            decoded[path] = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest(f'"{field}"[{json.dumps(path)}] is not valid base64') from None
    return decoded


def _fetch(paths: object) -> tuple:
    if paths is None:
        return ()
    if not isinstance(paths, list):
        raise BadRequest(f'"fetch_files" must be an array of paths, not {json_type(paths)}')
    if len(paths) > MAX_FILES:
        raise BadRequest(f'"fetch_files" has more than {MAX_FILES} paths')
    for path in paths:
        try:
            check_path(path)
        except JobFileError as exc:
            raise BadRequest(f'"fetch_files": {exc}') from None
    return tuple(dict.fromkeys(paths))  # each once: a path asked a thousand times is read once


#: The routes, described for people (``GET /openapi.json``).
OPENAPI: dict = {
    "openapi": "3.1.0",
    "info": {"title": "execpool serve", "version": "1",
             "description": "Run Python and shell code in isolated processes. See shared/SERVE.md."},
    "paths": {
        "/v1/run": {"post": {"summary": "Run one job; answer its record",
                             "requestBody": {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Job"}}}},
                             "responses": {"200": {"description": "the job's record (as execpool batch writes it)"},
                                           "400": {"description": "a field is wrong; the message names it"},
                                           "401": {"description": "token missing or wrong"},
                                           "413": {"description": "body too large"},
                                           "503": {"description": "overloaded; see Retry-After"}}}},
        "/v1/stream": {"post": {"summary": "Run one job; answer Server-Sent Events: data lines with tool_output "
                                           "events, ': keep-alive' comments, then 'event: result' with the record",
                                "requestBody": {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Job"}}}},
                                "responses": {"200": {"description": "text/event-stream"}}}},
        "/v1/batch": {"post": {"summary": "Run NDJSON jobs, or {code, tests: [{stdin, expected}]}; answer NDJSON "
                                          "records as jobs finish",
                               "responses": {"200": {"description": "application/x-ndjson"}}}},
        "/run_code": {"post": {"summary": "SandboxFusion's run_code (RunCodeRequest -> RunCodeResponse)",
                               "responses": {"200": {"description": "RunCodeResponse"},
                                             "504": {"description": "overloaded: retry"}}}},
        "/": {"get": {"summary": "a page to run code by hand (it talks to /v1/stream)"}},
        "/v1/ping": {"get": {"summary": "SandboxFusion's ping: \"pong\""}},
        "/healthz": {"get": {"summary": "the process answers"}},
        "/readyz": {"get": {"summary": "workers are alive and the queue is not full (else 503)"}},
        "/metrics": {"get": {"summary": "Prometheus metrics"}},
    },
    "components": {"schemas": {"Job": {
        "type": "object",
        "properties": {
            "id": {"type": ["string", "integer"]}, "python": {"type": "string"}, "shell": {"type": "string"},
            "timeout": {"type": "number"}, "stdin": {"type": "string"},
            "env": {"type": "object", "additionalProperties": {"type": "string"}},
            "files": {"type": "object", "additionalProperties": {"type": "string", "contentEncoding": "base64"}},
            "fetch_files": {"type": "array", "items": {"type": "string"}},
        },
        "additionalProperties": False,
    }}},
}
