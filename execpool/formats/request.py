"""One way from a dict to a job: an ``execpool batch`` line, a ``/v1`` body,
a ``/run_code`` body, a ``/v1/batch`` tests body and the command line's
flags all become a job here, by one rule per field, and every refusal names
the field the way its caller wrote it (``"run_timeout"`` in a SandboxFusion
body, ``--timeout`` on the command line). The OpenAPI document is generated
from the same declaration (:func:`schema`).

Runs in the caller's processes that read JSON: the command (execpool/cli)
and the service (execpool/serve). It only turns data into data.

The declaration has two parts. ``FIELDS`` says, once for every front,
what each field is: its JSON type (checked first, in JSON's words), what
its value must be (a rule, which is the library's own check -- the one a
``PythonJob`` applies -- given the caller's name for the field), and what
it means. A ``Dialect`` says which fields one front takes, under which
names, and which it requires. A job's source with nothing in it is no
error here: the job is made and its Result says ``No code provided.``, as
the library's does, each front rendering that Result in its own format.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import glob
import json
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from ..shared import checks, languages
from ..shared.cells import SESSION_LANGUAGES
from ..shared.checks import MAX_FILES
from ..shared.jobs import DEFAULT_COMPILE_TIMEOUT_S, CodeJob, Job, Limits, PythonJob, ShellJob

#: Jobs in one /v1/batch (lines, or tests of one program): enough for any
#: real use; past them a small body would cost far more than it weighs.
MAX_BATCH_JOBS = 10_000

#: The largest ``memory_limit_MB`` taken (1 PiB): a cap, not a wish.
MAX_MEMORY_LIMIT_MB = 1 << 30

#: The smallest address space ``memory_limit_MB`` turns into where no cgroup
#: can cap memory: below it no interpreter starts at all.
MIN_ADDRESS_SPACE = 64 << 20


class BadField(ValueError):
    """A request that cannot become a job; the message names the field as
    the caller wrote it."""


def json_type(value: object) -> str:
    """The JSON name of a value's type, for messages about a field."""
    for types, name in (((bool,), "boolean"), ((str,), "string"), ((int, float), "number"),
                        ((dict,), "object"), ((list,), "array")):
        if isinstance(value, types):
            return name
    return "null" if value is None else type(value).__name__


@dataclasses.dataclass(frozen=True)
class Defaults:
    """What a request does not say, set by the front that reads it.
    ``max_timeout`` is a server's: with it a timeout is always required
    (null is refused) and bounded; without it the library's bound holds and
    null means no limit."""

    timeout: Optional[float] = 300.0
    max_timeout: Optional[float] = None
    warm: bool = False
    network: bool = True
    limits: Optional[Limits] = None
    #: Whether ``memory_limit_MB`` can be a cgroup cap here (else it becomes
    #: an address-space limit).
    memory_by_cgroup: bool = False
    #: A session's longest idle timeout, a server's (None: no bound).
    max_idle: Optional[float] = None


# -- the rules: the library's checks, given the caller's name for the field ----------------


def _source(label: str, value: str, _defaults: Defaults) -> str:
    return checks.text(label, value)


def _ident(label: str, value: Union[str, int], _defaults: Defaults) -> Union[str, int]:
    if isinstance(value, str):
        if not value:
            raise BadField(f"{label} must not be empty")
        checks.text(label, value)
    return value


def _timeout(label: str, value: Optional[float], defaults: Defaults) -> Optional[float]:
    if value is None:
        if defaults.max_timeout is not None:
            raise BadField(f"{label} must be a number of seconds (this server always has a limit)")
        return None
    if defaults.max_timeout is not None and isinstance(value, (int, float)) and value > defaults.max_timeout:
        raise BadField(f"{label} is over this server's limit of {defaults.max_timeout:g} s")
    checks.seconds(label, value)
    return value  # as given: the timeout's text shows it so ("after 1 seconds")


def _cwd(label: str, value: str, _defaults: Defaults) -> str:
    """Relative to where the command runs (its workers run in /)."""
    checks.text(label, value)
    if not value:
        raise BadField(f"{label} must not be empty")
    path = os.path.abspath(value)
    if not os.path.isdir(path):
        raise BadField(f"{label} {path!r} is not an existing directory")
    return path


def _env(label: str, value: Mapping[str, Any], _defaults: Defaults) -> Dict[str, str]:
    return checks.environment(label, value)


def _stdin(label: str, value: Optional[str], _defaults: Defaults) -> Optional[str]:
    return None if value is None else checks.text(label, value, nul_ok=True)


def check_path(label: str, path: object) -> str:
    """A path inside a job's directory (``checks.relative_path``), as a
    request field: a bad one runs nothing and answers 400."""
    try:
        return checks.relative_path(label, path)
    except (TypeError, ValueError) as exc:
        raise BadField(str(exc)) from None


def _files(label: str, value: Mapping[str, Any], _defaults: Defaults) -> Dict[str, bytes]:
    if len(value) > MAX_FILES:
        raise BadField(f"{label} has more than {MAX_FILES} files")
    decoded = {}
    for path, content in value.items():
        check_path(label, path)
        if content is None:
            continue  # SandboxFusion's clients send null for "no such file"
        if not isinstance(content, str):
            raise BadField(f"{label}[{json.dumps(path)}] must be a base64 string, not {json_type(content)}")
        try:
            decoded[path] = base64.b64decode(content, validate=True)
        except (binascii.Error, ValueError):
            raise BadField(f"{label}[{json.dumps(path)}] is not valid base64") from None
    return decoded


def _fetch(label: str, value: List[Any], _defaults: Defaults) -> Tuple[str, ...]:
    if len(value) > MAX_FILES:
        raise BadField(f"{label} has more than {MAX_FILES} paths")
    for path in value:
        check_path(label, path)
    return tuple(dict.fromkeys(value))  # each once: a path asked a thousand times is read once


def _memory_limit(label: str, value: int, defaults: Defaults) -> Optional[Limits]:
    """SandboxFusion's ``memory_limit_MB``: a cap on the job's memory, as a
    cgroup where the machine has one, else as its address space; never
    above the front's own cap (a server's --memory-mb)."""
    if value > MAX_MEMORY_LIMIT_MB:
        raise BadField(f"{label} is over {MAX_MEMORY_LIMIT_MB}")
    if value <= 0:
        return None
    limits = defaults.limits or Limits()
    cap = value << 20
    if defaults.memory_by_cgroup:
        return dataclasses.replace(limits, memory=min(cap, limits.memory or cap))
    return dataclasses.replace(limits, address_space=max(min(cap, limits.address_space or cap), MIN_ADDRESS_SPACE))


def _compile_seconds(label: str, value: float, defaults: Defaults) -> float:
    """A compile's timeout: bounded as a run's is (a compile nobody waits
    for any more still runs until it ends)."""
    if defaults.max_timeout is not None and value > defaults.max_timeout:
        raise BadField(f"{label} is over this server's limit of {defaults.max_timeout:g} s")
    return checks.seconds(label, value)


def _language(label: str, value: str, _defaults: Defaults) -> str:
    if value not in LANGUAGES:
        raise BadField(f"language {json.dumps(value)} is not in the languages table; known: "
                       f"{', '.join(name for name in LANGUAGES if name != 'shell')}")
    return LANGUAGES[value]


def _session_language(label: str, value: str, _defaults: Defaults) -> str:
    if value not in SESSION_LANGUAGES:
        raise BadField(f"{label} must be one of {', '.join(SESSION_LANGUAGES)}, not {json.dumps(value)}")
    return value


def _idle(label: str, value: Optional[float], defaults: Defaults) -> float:
    """A session's idle timeout: always one on a server (a forgotten session
    would hold its memory for ever), at most the server's longest."""
    if value is None:
        raise BadField(f"{label} must be a number of seconds")
    if defaults.max_idle is not None and value > defaults.max_idle:
        raise BadField(f"{label} is over this server's limit of {defaults.max_idle:g} s")
    return checks.seconds(label, value)


def _cells(label: str, value: List[Any], _defaults: Defaults) -> Tuple[str, ...]:
    if len(value) > MAX_BATCH_JOBS:
        raise BadField(f"{label} has more than {MAX_BATCH_JOBS} cells")
    for number, cell in enumerate(value):
        if not isinstance(cell, str):
            raise BadField(f"{label}[{number}] must be a string, not {json_type(cell)}")
        checks.text(f"{label}[{number}]", cell)
    return tuple(value)


def _seconds_or_zero(label: str, value: float, defaults: Defaults) -> Optional[float]:
    """SandboxFusion's cell and total timeouts: 0 is none (then the server's
    longest), and no more than that."""
    if value == 0:
        return defaults.max_timeout
    checks.seconds(label, value)
    if defaults.max_timeout is not None and value > defaults.max_timeout:
        raise BadField(f"{label} is over this server's limit of {defaults.max_timeout:g} s")
    return value


def _kernel(label: str, value: str, _defaults: Defaults) -> str:
    if value != "python3":
        raise BadField(f'{label} must be "python3", not {json.dumps(value)}')
    return value


#: Language names a request may give -- the languages table's, and "shell"
#: -- and the kind of job each is: python the pool's PythonJob, bash (and
#: shell) its ShellJob, ``bash -c`` -- half the cost of the table's ``bash
#: main.sh`` through a directory of its own, and the same for ordinary
#: scripts (docs/library/languages.md says where they differ) -- the others a CodeJob.
LANGUAGES = {**{language.name: language.name for language in languages.TABLE}, "bash": "shell", "shell": "shell"}

Rule = Callable[[str, Any, Defaults], Any]


@dataclasses.dataclass(frozen=True)
class Field:
    """One field of a job request: its JSON Schema (whose ``type`` is
    checked before the rule, in JSON's words), what it means, and its rule
    (``rule(label, value, defaults)``: the value to use, or ``BadField`` /
    the library's ``ValueError``/``TypeError`` naming ``label``)."""

    schema: Mapping[str, Any]
    doc: str
    rule: Rule


_PATHS = {"type": "object", "additionalProperties": {"type": "string", "contentEncoding": "base64"}}

#: Every field any front takes, declared once.
FIELDS: Dict[str, Field] = {
    "id": Field({"type": ["string", "integer"]}, "Names the job in its record (unique within a batch).", _ident),
    "python": Field({"type": "string"}, "Python code to run, as `python -u FILE`.", _source),
    "shell": Field({"type": "string"}, "A command to run with `bash -c`.", _source),
    "code": Field({"type": "string"}, "The program, in `language` (default python).", _source),
    "language": Field({"type": "string", "enum": sorted(LANGUAGES)}, "The program's language.", _language),
    "timeout": Field({"type": ["number", "null"]}, "Seconds the job may run before its whole tree is killed.",
                     _timeout),
    "cwd": Field({"type": "string"}, "The directory to run in and keep (relative to where the command runs).", _cwd),
    "env": Field({"type": "object", "additionalProperties": {"type": "string"}},
                 "Variables added to the job's environment.", _env),
    "stdin": Field({"type": ["string", "null"]}, "The job's standard input (default: empty).", _stdin),
    "files": Field(_PATHS, "Files (relative path: base64) written into the job's directory before it starts.",
                   _files),
    "fetch_files": Field({"type": "array", "items": {"type": "string"}},
                         "Relative paths of files to return, base64, in the answer's `files`.", _fetch),
    "memory_limit_MB": Field({"type": "integer"}, "A cap on the job's memory in MiB (-1: none).", _memory_limit),
    "compile_timeout": Field({"type": "number"}, "Seconds the compile step may take, apart from the run's timeout.",
                             _compile_seconds),
    "session_language": Field({"type": "string", "enum": list(SESSION_LANGUAGES)}, "What the session keeps alive.",
                              _session_language),
    "idle_timeout": Field({"type": "number"}, "Seconds the session may go without a cell before it ends.", _idle),
    "ipython": Field({"type": ["boolean", "null"]},
                     "A Python session speaks IPython (true), plain Python (false), or IPython where the server's "
                     "Python has it (null, the default).", lambda _label, value, _defaults: value),
    "cells": Field({"type": "array", "items": {"type": "string"}}, "The cells to run, in order, in one session.",
                   _cells),
    "cell_timeout": Field({"type": "number"}, "Seconds each cell may run (0: no limit of its own).",
                          _seconds_or_zero),
    "total_timeout": Field({"type": "number"}, "Seconds all the cells may take together (0: the server's limit).",
                           _seconds_or_zero),
    "kernel": Field({"type": "string", "enum": ["python3"]}, "The kernel: Python.", _kernel),
}

#: A schema type in a message: what the field must be.
_TYPE_WORDS = {"string": "a string", "number": "a number", "integer": "an integer", "object": "an object",
               "array": "an array", "boolean": "a boolean"}


def _of_type(value: object, wanted: str) -> bool:
    if wanted == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if wanted == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return json_type(value) == wanted


@dataclasses.dataclass(frozen=True)
class Dialect:
    """One front's body: the keys it takes (each filling the field of the
    same name unless ``fills`` says otherwise), the keys it requires, and
    whether it refuses keys it does not know (a misspelt "timout" would
    otherwise run with the default) -- SandboxFusion's does not: its own
    server ignores them. ``sources`` are the keys that carry the program,
    ``language`` the key that says what kind it is where there is one
    source key. ``label`` names a key in messages."""

    title: str
    keys: Tuple[str, ...]
    sources: Tuple[str, ...] = ("python", "shell")
    required: Tuple[str, ...] = ()
    fills: Mapping[str, str] = dataclasses.field(default_factory=dict)
    strict: bool = True
    separate_stderr: bool = False
    #: What the timeout is when the body gives none; None: the front's default.
    timeout: Optional[float] = None
    label: Callable[[str], str] = json.dumps

    def field(self, key: str) -> Field:
        return FIELDS[self.fills.get(key, key)]


#: The source keys of a front that takes any job: one of them.
_EITHER = ("python", "shell", "code")

#: A line of ``execpool batch``'s IN.
BATCH_LINE = Dialect("a line", ("id", "python", "shell", "code", "language", "compile_timeout", "timeout", "cwd", "env",
                                "stdin"), sources=_EITHER, required=("id",))

#: A job of execpool's own routes (``/v1/run``, ``/v1/stream``, a ``/v1/batch`` line): a batch line
#: without ``cwd`` (a client elsewhere has no business naming the server's directories), with files.
HTTP_JOB = Dialect("a job", ("id", "python", "shell", "code", "language", "compile_timeout", "timeout", "stdin", "env",
                             "files", "fetch_files"), sources=_EITHER)

#: SandboxFusion's ``RunCodeRequest``: its field names, its defaults (a 10 s run, python).
RUN_CODE = Dialect("the request", ("code", "language", "compile_timeout", "run_timeout", "memory_limit_MB",
                                   "stdin", "files", "fetch_files"),
                   sources=("code",), required=("code",), fills={"run_timeout": "timeout"}, strict=False,
                   separate_stderr=True, timeout=10.0)

#: ``/v1/batch``'s one program against many tests: the program's part (each test brings its stdin).
TESTS = Dialect("a tests body", ("code", "language", "compile_timeout", "timeout", "tests"), sources=("code",),
                required=("code", "tests"), separate_stderr=True)

#: ``POST /v1/sessions``: a session to open.
SESSION = Dialect("a session", ("language", "idle_timeout", "files", "memory_limit_MB", "ipython"), sources=(),
                  fills={"language": "session_language"})

#: ``POST /v1/sessions/{id}/run`` and ``/stream``: one cell.
CELL = Dialect("a cell", ("code", "timeout"), sources=(), required=("code",))

#: SandboxFusion's ``RunJupyterRequest``: its names and defaults (45 s in all).
RUN_JUPYTER = Dialect("the request", ("cells", "cell_timeout", "total_timeout", "kernel", "files", "fetch_files",
                                      "memory_limit_MB"), sources=(), required=("cells",), strict=False)

#: The command line: ``execpool run``'s flags, named as typed.
COMMAND_LINE = Dialect("the command", ("python", "shell", "timeout", "cwd"), sources=("python", "shell"),
                       label=lambda key: f"--{key}")


@dataclasses.dataclass(frozen=True)
class JobRequest:
    """One job a request asks for, with what goes with it: the paths it
    asks back (its job ``fetch``-es them, each a name, not a pattern)."""

    job: Job
    ident: Any = None
    fetch: Tuple[str, ...] = ()

    @property
    def size(self) -> int:
        """Roughly what submitting the job costs, in characters: its code,
        stdin and environment."""
        job = self.job
        return len(job.source) + len(job.stdin or "") + sum(len(k) + len(v) for k, v in (job.env or {}).items())


def check(dialect: Dialect, key: str, value: object, defaults: Defaults = Defaults()) -> Any:
    """One field's value, checked by its type and its rule: what to use, or
    BadField naming ``key`` as ``dialect`` names it."""
    return _checked(dialect.label(key), dialect.field(key), value, defaults)


def _checked(label: str, field: Field, value: object, defaults: Defaults) -> Any:
    types = field.schema["type"]
    types = [types] if isinstance(types, str) else types
    if not any(_of_type(value, wanted) for wanted in types):
        wanted = " or ".join(_TYPE_WORDS[t] for t in types if t != "null")
        raise BadField(f"{label} must be {wanted}, not {json_type(value)}")
    try:
        return field.rule(label, value, defaults)
    except BadField:
        raise
    except (TypeError, ValueError) as exc:
        raise BadField(str(exc)) from None


def parse(obj: object, dialect: Dialect, defaults: Defaults = Defaults()) -> JobRequest:
    """The job ``obj`` asks for in ``dialect``; BadField if it asks for none."""
    values = read(obj, dialect, defaults)
    assert isinstance(obj, dict)
    kind, source = _program(obj, dialect, values)
    timeout = values.get("timeout", defaults.timeout if dialect.timeout is None else dialect.timeout)
    options: Dict[str, Any] = {"timeout": timeout, "network": defaults.network,
                               "limits": values.get("memory_limit_MB") or defaults.limits,
                               "separate_stderr": dialect.separate_stderr}
    for name in ("cwd", "env", "stdin"):
        if name in values:
            options[name] = values[name]
    if kind == "python" and defaults.warm:
        options["warm"] = True
    fetch = values.get("fetch_files", ())
    options["files"] = values.get("files", {})
    options["fetch"] = tuple(glob.escape(path) for path in fetch)  # names, not patterns
    try:
        if kind in ("python", "shell"):
            job: Job = (PythonJob if kind == "python" else ShellJob)(source, **options)
        else:
            job = CodeJob(kind, source, compile_timeout=values.get("compile_timeout", DEFAULT_COMPILE_TIMEOUT_S),
                          **options)
    except (TypeError, ValueError) as exc:
        raise BadField(str(exc)) from None
    return JobRequest(job, values.get("id"), fetch)


def ident_of(obj: object) -> Any:
    """The ``id`` a request gave, where it is one (an invalid job's record
    still names the job it asked for); else None."""
    if not isinstance(obj, dict):
        return None
    try:
        return check(HTTP_JOB, "id", obj["id"]) if "id" in obj else None
    except BadField:
        return None


def read(obj: object, dialect: Dialect, defaults: Defaults = Defaults()) -> Dict[str, Any]:
    """The fields ``obj`` gives in ``dialect``, each checked and by the
    field's name (``fills``); BadField for a body that is not one."""
    if not isinstance(obj, dict):
        raise BadField(f"{dialect.title} must be a JSON object, not {json_type(obj)}")
    if dialect.strict:
        unknown = sorted(set(obj) - set(dialect.keys))
        if unknown:
            shown = ", ".join(map(dialect.label, unknown))
            raise BadField(f"unknown field{'s' if len(unknown) > 1 else ''} {shown} "
                           f"({dialect.title} has {', '.join(map(dialect.label, dialect.keys))})")
    for key in dialect.required:
        if key not in obj:
            raise BadField(f"missing {dialect.label(key)}")
    # null is "not given" -- but for a timeout (no limit) and a required field (an error).
    return {dialect.fills.get(key, key): check(dialect, key, value, defaults)
            for key, value in obj.items() if key in dialect.keys and key != "tests"
            and (value is not None or key in dialect.required or dialect.fills.get(key, key) == "timeout")}


def _program(obj: dict, dialect: Dialect, values: dict) -> Tuple[str, str]:
    """The job's kind -- python, shell or a language of the table -- and
    its source: the one source key given, and with ``code`` the language."""
    given = [key for key in dialect.sources if key in obj]
    if len(given) != 1:
        keys = [dialect.label(key) for key in dialect.sources]
        listed = f"{', '.join(keys[:-1])} or {keys[-1]}"
        raise BadField(f"give one of {listed}, not both {' and '.join(map(dialect.label, given))}"
                       if len(given) == 2 else f"give one of {listed}, not all three" if given
                       else f"missing {listed}")
    if given[0] != "code":
        if "language" in obj:
            raise BadField(f"{dialect.label('language')} goes with {dialect.label('code')}, not "
                           f"{dialect.label(given[0])}")
        return given[0], values[given[0]]
    return values.get("language", "python"), values["code"]


def parse_tests(obj: dict, defaults: Defaults = Defaults()) -> List[Tuple[JobRequest, str]]:
    """``{"code", "language", "timeout", "tests": [{"stdin", "expected"}, ...]}``:
    the same program against each test's stdin, with the stdout each test
    expects; stderr apart, so that only stdout is compared."""
    tests = obj.get("tests")
    if not isinstance(tests, list) or not tests:
        raise BadField('"tests" must be a non-empty array of {"stdin", "expected"} objects')
    if len(tests) > MAX_BATCH_JOBS:
        raise BadField(f'"tests" has more than {MAX_BATCH_JOBS} tests; split them')
    program = parse(obj, TESTS, defaults).job
    requests = []
    for number, test in enumerate(tests):
        where = f"tests[{number}]"
        if not isinstance(test, dict) or not isinstance(test.get("expected"), str):
            raise BadField(f'{where} must be an object with a string "expected"')
        if set(test) - {"stdin", "expected"}:
            raise BadField(f'{where} has unknown fields (a test has "stdin", "expected")')
        stdin = _checked(f"{where}.stdin", FIELDS["stdin"], test.get("stdin"), defaults)
        requests.append((JobRequest(dataclasses.replace(program, stdin=stdin), number), test["expected"]))
    return requests


def timeout_flag(text: str) -> Optional[float]:
    """``--timeout``'s text as the command line gives it: seconds, or
    'none' (also 0 and 'inf') for no limit, then the timeout's rule."""
    if text.strip().lower() in ("none", "0", "inf"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise BadField(f"--timeout must be a number of seconds or 'none', not {text!r}") from None
    return check(COMMAND_LINE, "timeout", value)


def schema(dialect: Dialect) -> dict:
    """The JSON Schema of a body of ``dialect``, for the OpenAPI document."""
    properties = {}
    for key in dialect.keys:
        if key == "tests":
            continue
        field = dialect.field(key)
        properties[key] = {**field.schema, "description": field.doc}
    body: Dict[str, Any] = {"type": "object", "properties": properties}
    if dialect.required:
        body["required"] = list(dialect.required)
    if len(dialect.sources) > 1:
        body["oneOf"] = [{"required": [key]} for key in dialect.sources]
    if dialect.strict:
        body["additionalProperties"] = False
    return body
