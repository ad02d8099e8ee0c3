"""The model-facing tool layer: what an LLM server hands a model and runs for it.

Who runs this: the server's thread (or the agent loop's tool thread) that
executes one tool call. It owns nothing but a lazily created, shared default
``ExecPool`` (closed at interpreter exit) and the sandbox directories; the
pool runs the code. Every entry point returns the string the model reads and
never raises: a tool's own failure, a bad argument and an internal error are
all text.

Result strings are rendered from the core ``Result`` in one place
(``tool_text``): the pool keeps only the head the model will read (the job's
``max_output_chars`` is this layer's limit), ``truncate`` adds the only
truncation notice, and the missing-path hint is computed from the whole
output -- the head plus the error lines the worker kept past it -- and
appended last. Streaming only observes, so a call returns the same string
with or without an ``output_callback``.
"""

from __future__ import annotations

import ast
import atexit
import dataclasses
import json
import os
import re
import threading
from typing import Any, Callable, Generator, List, Mapping, Optional, Union

from ..pool.future import JobOutput
from ..pool.sessions import Session
from ..pool.workspaces import WORKSPACE_PATH, Workspace
from ..shared import checks
from ..shared.jobs import PythonJob, ShellJob
from ..shared.kernel.sandbox import Sandbox
from ..shared.output import FILES_ADVICE, TOOL_RESULT_CHARS, truncation_notice
from ..shared.package import PACKAGE_DIR
from ..shared.result import ERROR_LINE_MARKERS, ERROR_PREFIX, NO_CODE_TEXT, NO_COMMAND_TEXT, Result
from ..supervisor import ExecPool


def env_int(name: str, default: int) -> int:
    """A positive integer from the environment; ``default`` when the variable
    is missing, not an integer, or not positive -- a typo in a deployment's
    environment must not turn into a zero-length limit."""
    try:
        value = int(os.environ[name])
    except (KeyError, ValueError):
        return default
    return value if value > 0 else default


#: Characters of output a tool result gives the model; longer output is cut
#: by ``truncate``. Read once, at import, from EXECPOOL_TOOL_RESULT_MAX_CHARS.
MAX_OUTPUT_CHARS = env_int("EXECPOOL_TOOL_RESULT_MAX_CHARS", TOOL_RESULT_CHARS)

#: Seconds a tool call may run when the caller does not say.
DEFAULT_TIMEOUT_S = 300

#: Where session directories live; read at every call, so a server (or a
#: test) can move it without re-importing. Default: ~/execpool_sandbox.
SANDBOX_ROOT_ENV = "EXECPOOL_SANDBOX_ROOT"

#: Model code runs in the strict sandbox (execpool/shared/kernel/sandbox.py) -- the
#: session's directory writable, the system's software readable, nothing
#: else -- or in the one the pool was given, if it was given one. Set this
#: variable to ``off`` to leave it to the pool (the shared pool has none):
#: on a kernel without the sandbox every call otherwise ends with an
#: ``Execution error`` saying what is missing. Read at every call; any
#: other value keeps the sandbox.
TOOL_SANDBOX_ENV = "EXECPOOL_TOOL_SANDBOX"

#: The directory of calls made without a session id.
DEFAULT_SESSION = "default"

#: Longer than any sane id, far below a file name's 255 bytes.
MAX_SESSION_ID_CHARS = 128

#: Absolute directories models were trained to write to on hosted code
#: interpreters; none of them exists here.
HABIT_PREFIXES = ("/mnt/data", "/mnt/outputs", "/home/sandbox", "/workspace", "/tmp/outputs")

#: Holds the ``sitecustomize`` that remaps /mnt/data inside Python tools.
SHIM_DIR = os.path.join(PACKAGE_DIR, "tool", "shim")

PYTHON_TOOL: dict = {
    "type": "function",
    "function": {
        "name": "python",
        "description": (
            "Run Python 3 code in a fresh interpreter and return everything it printed (stdout and "
            "stderr), with the exit code if it failed. Nothing is kept between calls except files, "
            "so import and define what you need each time, and print() the values you want to see: "
            "a bare last expression is not displayed. The working directory is writable and keeps "
            "its files across calls: use relative paths (e.g. 'results.csv') for every file you "
            "read or write. /mnt/data does not exist here. Long output is truncated; write large "
            "results to a file and print a summary."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "The Python source to run."},
            },
            "required": ["code"],
            "additionalProperties": False,
        },
    },
}

TERMINAL_TOOL: dict = {
    "type": "function",
    "function": {
        "name": "terminal",
        "description": (
            "Run a shell command with bash and return its output (stdout and stderr), with the "
            "exit code if it is not zero. Each call starts a new, non-interactive shell in the "
            "writable working directory: files persist between calls, but cd, variables and "
            "background processes do not, and nothing can be typed into a running command. Use "
            "relative paths for the files you create and read. /mnt/data does not exist here. "
            "Long output is truncated; redirect it to a file and inspect parts of it."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The bash command line to run."},
            },
            "required": ["command"],
            "additionalProperties": False,
        },
    },
}

OutputCallback = Callable[[str], None]


# --------------------------------------------------------------------------- truncation


def truncate(text: str, limit: Optional[int] = None) -> str:
    """``text`` itself up to ``limit`` characters (default MAX_OUTPUT_CHARS);
    beyond, its first ``limit`` characters and a notice saying how much there
    was and that files are the way to keep it."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, not {type(text).__name__}")
    return _truncate(text, len(text), _check_limit(limit))


def _check_limit(limit: object) -> int:
    return MAX_OUTPUT_CHARS if limit is None else checks.integer("limit", limit)


def _truncate(head: str, total: int, limit: int) -> str:
    """``head`` is the start of an output of ``total`` characters -- all of it
    when ``total <= limit``, which is what the pool keeps for a tool job."""
    if total <= limit:
        return head
    kept = head[:limit]
    return kept + truncation_notice(total, len(kept), FILES_ADVICE)


# --------------------------------------------------------------------------- missing-path hint

_PY_STR = r"""'(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*\""""
#: Python's ``[Errno 2] No such file or directory: 'a'`` (and ``-> 'b'`` for two-path calls).
_AFTER_STRERROR = re.compile(rf"No such file or directory: ({_PY_STR})(?: -> ({_PY_STR}))?")
#: ``ls: cannot access '/x'``, ``python: can't open file "/x"``, coreutils' ‘/x’ in UTF-8 locales.
_QUOTED_ABSOLUTE = re.compile(r"""'(/[^'\n]*)'|"(/[^"\n]*)"|‘(/[^’\n]*)’""")
#: ``bash: line 1: /x y: No such file or directory``: shells do not quote, spaces included
#: (colons not, which keeps the scan linear on a hostile line).
_SHELL_SUBJECT = re.compile(r"(?:^|(?<=: ))(/[^\x00:]*)(?=: No such file or directory)")
#: Anything else that looks like an absolute path, not inside a word or a URL.
_BARE_ABSOLUTE = re.compile(r"""(?<![\w.~:/\\-])/[^\s'"`:;,()\[\]{}<>\x00]+""")


def missing_path_hint(output: str, workdir: Optional[str] = None) -> str:
    """A hint for a model that used an absolute path that does not exist here.

    It applies when a line of ``output`` reports a missing file
    (``FileNotFoundError`` or ``No such file or directory``) at an absolute
    path outside ``workdir`` (default: the sandbox root), or names a habit
    prefix such as /mnt/data without a path that can be isolated. Lines that
    do not report a failure (traceback frames, prints) are never read, and a
    path inside ``workdir`` -- even one under /workspace -- is not a mistake.
    Returns the hint as one line, or "" when there is nothing to say.
    """
    if not isinstance(output, str):
        raise TypeError(f"output must be a str, not {type(output).__name__}")
    if workdir is None:
        workdir = _sandbox_root()
    roots = {os.path.normpath(workdir), os.path.realpath(workdir)}
    for line in output.splitlines():
        # The worker keeps exactly these lines past the output head.
        if not any(marker in line for marker in ERROR_LINE_MARKERS):
            continue
        paths, rest = _named_paths(line)
        for path in paths:
            if path.startswith("/") and os.path.normpath(path) != "/" and not _inside(path, roots):
                return _hint_for(path)
        for prefix in HABIT_PREFIXES:
            if prefix in rest:
                return (f"[hint] {prefix} does not exist in this sandbox. Your working directory "
                        "is writable: use a relative path for every file you read or write.")
    return ""


def _named_paths(line: str) -> tuple[list[str], str]:
    """The paths a failing line names, most explicit shapes first, and what
    is left of the line once they are blanked out."""
    paths: list[str] = []

    def take(match: re.Match) -> str:
        for group in match.groups():
            if group is not None:
                paths.append(group)
        return "\x00"

    def take_literals(match: re.Match) -> str:
        for group in match.groups():
            if group is not None:
                try:
                    paths.append(str(ast.literal_eval(group)))
                except (ValueError, SyntaxError):
                    paths.append(group[1:-1])
        return "\x00"

    rest = _AFTER_STRERROR.sub(take_literals, line)
    rest = _QUOTED_ABSOLUTE.sub(take, rest)
    rest = _SHELL_SUBJECT.sub(take, rest)
    for match in _BARE_ABSOLUTE.finditer(rest):
        paths.append(match.group().rstrip("."))
    return paths, _BARE_ABSOLUTE.sub("\x00", rest)


def _inside(path: str, roots: set) -> bool:
    norm = os.path.normpath(path)
    return any(norm == root or norm.startswith(root.rstrip("/") + "/") for root in roots)


def _hint_for(path: str) -> str:
    norm = os.path.normpath(path)
    # A habit directory itself (``ls /mnt/data``) is the working directory: '.'.
    name = "." if norm in HABIT_PREFIXES else os.path.basename(norm) or "."
    return (f"[hint] {path} does not exist in this sandbox. Your working directory is writable "
            f"and holds your files: use a relative path, e.g. '{name}', not '{path}'.")


# --------------------------------------------------------------------------- sandbox directories

_SESSION_ID = re.compile(r"[A-Za-z0-9._-]+")


def _sandbox_root() -> str:
    root = os.environ.get(SANDBOX_ROOT_ENV) or os.path.join(os.path.expanduser("~"), "execpool_sandbox")
    return os.path.abspath(os.path.expanduser(root))


def get_sandbox_workdir(session_id: Optional[str] = None) -> str:
    """The writable working directory of ``session_id`` (of the default
    session when None), created if needed: ``ROOT/<session_id>`` under
    $EXECPOOL_SANDBOX_ROOT (default ~/execpool_sandbox).

    Session ids come from clients, so only plain names are accepted --
    letters, digits, ``-``, ``_`` and ``.``, at most MAX_SESSION_ID_CHARS,
    not ``.`` or ``..`` -- and no id can reach outside the root.
    """
    if session_id is None:
        name = DEFAULT_SESSION
    elif not isinstance(session_id, str):
        raise TypeError(f"session_id must be a str or None, not {type(session_id).__name__}")
    elif (not _SESSION_ID.fullmatch(session_id) or session_id in (".", "..")
          or len(session_id) > MAX_SESSION_ID_CHARS):
        raise ValueError(
            f"session_id {_short(session_id)} is not valid: use 1 to {MAX_SESSION_ID_CHARS} letters, "
            "digits, '-', '_' or '.' (not '.' or '..')"
        )
    else:
        name = session_id
    path = os.path.join(_sandbox_root(), name)
    os.makedirs(path, exist_ok=True)
    return path


# --------------------------------------------------------------------------- the shared pool

_default_pool: Optional[ExecPool] = None
_default_pool_lock = threading.Lock()


def _shared_pool() -> ExecPool:
    """The pool for callers that bring none: started on first use (a server
    that never runs a tool starts no workers), once, and closed at exit."""
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None:
            _default_pool = ExecPool()
            atexit.register(_default_pool.close)
        return _default_pool


# --------------------------------------------------------------------------- running tools


def python_exec(code: str, cancel_event: Optional[threading.Event] = None,
                timeout: Optional[float] = DEFAULT_TIMEOUT_S, output_callback: Optional[OutputCallback] = None,
                session_id: Optional[str] = None, pool: Optional[ExecPool] = None,
                session: Optional[Session] = None) -> str:
    """Run ``code`` as a Python script in the session's working directory
    and return the model-facing string; never raises.

    ``output_callback(text)`` receives live output as it is produced; if it
    raises, it is not called again and the job runs on. ``cancel_event``
    set from another thread ends the job with ``Execution cancelled.``;
    ``timeout=None`` means no limit. With ``session`` (a Python session,
    :func:`python_session`), the code runs as a cell of it, keeping its
    state from one call to the next; the string is the cell's, its last
    expression's value included.
    """
    if session is not None:
        return _run_cell("python", session, code, cancel_event, timeout, output_callback)
    return _run_tool("python", code, cancel_event, timeout, output_callback, session_id, pool)


def bash_exec(command: str, cancel_event: Optional[threading.Event] = None,
              timeout: Optional[float] = DEFAULT_TIMEOUT_S, output_callback: Optional[OutputCallback] = None,
              session_id: Optional[str] = None, pool: Optional[ExecPool] = None,
              session: Optional[Session] = None) -> str:
    """Run ``command`` with bash in the session's working directory; the
    same contract as :func:`python_exec` (``session``: a bash session)."""
    if session is not None:
        return _run_cell("bash", session, command, cancel_event, timeout, output_callback)
    return _run_tool("terminal", command, cancel_event, timeout, output_callback, session_id, pool)


def python_session(session_id: Optional[str] = None, pool: Optional[ExecPool] = None,
                   language: str = "python", idle_timeout: Optional[float] = 3600.0,
                   workspace: Optional[Workspace] = None, ipython: Optional[bool] = None) -> Session:
    """A session for a conversation's tool calls (``session=`` of
    :func:`python_exec`, :func:`execute_tool` and the loop): in the working
    directory of ``session_id`` (or in ``workspace``: :func:`tool_workspace`),
    so files the calls write persist as they do without a session, in the
    tool layer's sandbox and with its ``/mnt/data`` remap. Close it when
    the conversation ends (it also ends after ``idle_timeout`` seconds
    without a call, and with the pool). ``ipython``: ``pool.session``'s."""
    if pool is None:
        pool = _shared_pool()
    env = {"PYTHONPATH": _python_path(pool)} if language == "python" else None
    if workspace is not None:
        return workspace.session(language, env=env, idle_timeout=idle_timeout, ipython=ipython)
    return pool.session(language, cwd=get_sandbox_workdir(session_id), sandbox=_sandbox(pool), env=env,
                        idle_timeout=idle_timeout, ipython=ipython)


def tool_workspace(pool: ExecPool) -> Optional[Workspace]:
    """A workspace for one conversation's (or connection's) tool calls, in
    the tool layer's sandbox: its files, ``/tmp`` and ``/dev/shm`` within
    the pool's disk bound, shared by every call given it and gone with it
    (execpool/pool/workspaces.py) -- where the directory of a session id is
    on the caller's disk, bounded per file only. None where the tool layer
    runs without a sandbox (``EXECPOOL_TOOL_SANDBOX=off``): a workspace
    needs one. DiskBudgetError when its bound does not fit the pool's disk
    budget now."""
    if os.environ.get(TOOL_SANDBOX_ENV, "").strip().lower() == "off" and pool.config.sandbox is None:
        return None
    return pool.workspace(sandbox=_sandbox(pool))


def _run_cell(language: str, session: Session, source: str, cancel_event: Optional[threading.Event],
              timeout: Optional[float], output_callback: Optional[OutputCallback]) -> str:
    """A tool call as a cell of ``session``: the cell's string, capped like
    a job's, with the missing-path hint."""
    try:
        if not isinstance(session, Session):
            raise TypeError(f"session must be an execpool.Session, not {type(session).__name__}")
        if session.language != language:
            raise ValueError(f"this tool runs {language}, and the session given is a {session.language} session")
        if not source.strip():
            return NO_CODE_TEXT if language == "python" else NO_COMMAND_TEXT
        callback: List[Optional[OutputCallback]] = [output_callback]

        def on_event(event: object) -> None:
            if isinstance(event, JobOutput) and callback[0] is not None:
                try:
                    callback[0](event.text)
                except Exception:  # noqa: BLE001 - a broken consumer is dropped; the cell runs on
                    callback[0] = None

        result = session.submit(source, timeout=timeout, cancel_event=cancel_event,
                                on_event=None if output_callback is None else on_event).result()
        text = truncate(result.text, MAX_OUTPUT_CHARS)
        hint = missing_path_hint(result.text, session.cwd or WORKSPACE_PATH)
        return text if not hint else text + ("\n" if text.endswith("\n") else "\n\n") + hint
    except Exception as exc:  # noqa: BLE001 - the model reads every failure as text
        return ERROR_PREFIX + _one_line(str(exc) or type(exc).__name__)


def _run_tool(tool_name: str, source: str, cancel_event: Optional[threading.Event],
              timeout: Optional[float], output_callback: Optional[OutputCallback],
              session_id: Optional[str], pool: Optional[ExecPool]) -> str:
    try:
        if output_callback is not None and not callable(output_callback):
            raise TypeError(f"output_callback must be callable, not {type(output_callback).__name__}")
        if pool is None:
            pool = _shared_pool()
        job = tool_job(tool_name, source, pool, timeout=timeout, session_id=session_id)
        if output_callback is None:
            result = pool.run(job, cancel_event=cancel_event)
        else:
            result = _consume(pool.stream(job, tool_name=tool_name, cancel_event=cancel_event),
                              output_callback)
        return tool_text(result, job)
    except Exception as exc:  # noqa: BLE001 - the model reads every failure as text
        return ERROR_PREFIX + _one_line(str(exc) or type(exc).__name__)


def tool_job(tool_name: str, source: str, pool: ExecPool, *, timeout: Optional[float] = DEFAULT_TIMEOUT_S,
             session_id: Optional[str] = None, in_workspace: bool = False) -> Union[PythonJob, ShellJob]:
    """The job :func:`python_exec` (``tool_name`` ``"python"``) or
    :func:`bash_exec` (``"terminal"``) runs for a call: for a caller that
    submits it itself -- an asyncio server awaiting the pool's future
    rather than holding a thread per call -- and gives its Result to
    :func:`tool_text`; ``in_workspace``: for ``Workspace.submit`` (no
    working directory of its own: the workspace's). Raises ValueError or
    TypeError for bad input."""
    if not isinstance(pool, ExecPool):
        raise TypeError(f"pool must be an execpool.ExecPool, not {type(pool).__name__}")
    workdir = None if in_workspace else get_sandbox_workdir(session_id)
    sandbox = None if in_workspace else _sandbox(pool)
    if tool_name == "python":
        return PythonJob(source, timeout=timeout, cwd=workdir, max_output_chars=MAX_OUTPUT_CHARS,
                         env={"PYTHONPATH": _python_path(pool)}, sandbox=sandbox)
    if tool_name == "terminal":
        return ShellJob(source, timeout=timeout, cwd=workdir, max_output_chars=MAX_OUTPUT_CHARS, sandbox=sandbox)
    raise ValueError(f"tool_name must be 'python' or 'terminal', not {tool_name!r}")


def tool_text(result: Result, job: Union[PythonJob, ShellJob]) -> str:
    """The model-facing string of a :func:`tool_job`'s Result,
    capped at ``MAX_OUTPUT_CHARS``, with the missing-path hint.

    ``Result.text`` renders the status strings and exit codes; it is given
    the already-truncated output as the whole output, so its own truncation
    notice (for the pool's cap) never doubles ours.
    """
    if result.empty_message is not None or result.error is not None or result.cancelled or result.timed_out:
        return result.text
    shown = _truncate(result.output, result.output_chars, MAX_OUTPUT_CHARS)
    text = dataclasses.replace(result, output=shown, output_chars=len(shown)).text
    if result.truncated:
        # The kept head may end inside the failing line; the worker kept that
        # line whole, with every other line naming a missing file.
        head = result.output[: result.output.rfind("\n") + 1]
        scanned = head + "\n".join(result.error_lines)
    else:
        scanned = result.output
    hint = missing_path_hint(scanned, WORKSPACE_PATH if job.cwd is None else str(job.cwd))
    if not hint:
        return text
    return text + ("\n" if text.endswith("\n") else "\n\n") + hint


def _sandbox(pool: ExecPool) -> Optional[Sandbox]:
    """A tool job's ``sandbox=``: None leaves it to the pool (its own
    sandbox, or ``off``); else the strict one, with the directories of the
    PYTHONPATH the pool gives its tools readable -- the caller put them
    there for the tools to import."""
    if os.environ.get(TOOL_SANDBOX_ENV, "").strip().lower() == "off" or pool.config.sandbox is not None:
        return None
    entries = pool.env.get("PYTHONPATH", "").split(os.pathsep)
    return Sandbox(read=tuple(path for path in entries if os.path.isabs(path) and os.path.exists(path)))


def _python_path(pool: ExecPool) -> str:
    """The shim first, then whatever PYTHONPATH the pool gives its tools
    (the shim takes itself off again, leaving exactly that)."""
    inherited = pool.env.get("PYTHONPATH")
    return SHIM_DIR if not inherited else SHIM_DIR + os.pathsep + inherited


def _consume(stream: Generator[dict, None, Result], output_callback: OutputCallback) -> Result:
    """Drive a job's event stream, feeding its live output to the callback.

    A callback that raises is dropped -- the consumer is gone or broken, the
    job is not -- and the job runs to its normal end. A BaseException
    (KeyboardInterrupt) propagates, and closing the stream cancels the job.
    """
    callback: Optional[OutputCallback] = output_callback
    try:
        while True:
            try:
                event = next(stream)
            except StopIteration as stop:
                return stop.value
            if callback is not None and event["type"] == "tool_output":
                try:
                    callback(event["text"])
                except Exception:  # noqa: BLE001 - see docstring
                    callback = None
    finally:
        stream.close()


# --------------------------------------------------------------------------- dispatch

_TOOLS: Mapping[str, tuple[str, Callable[..., str]]] = {
    PYTHON_TOOL["function"]["name"]: ("code", python_exec),
    TERMINAL_TOOL["function"]["name"]: ("command", bash_exec),
}


def execute_tool(name: str, arguments: Union[str, Mapping[str, Any], None], *,
                 cancel_event: Optional[threading.Event] = None, timeout: Optional[float] = None,
                 output_callback: Optional[OutputCallback] = None, session_id: Optional[str] = None,
                 pool: Optional[ExecPool] = None, session: Optional[Session] = None) -> str:
    """Run the model's call of tool ``name`` with ``arguments`` (the JSON
    string of a tool call, or a dict) and return the string the model reads.
    ``session`` (a Python session, :func:`python_session`) keeps the python
    tool's state between calls; the terminal tool runs as before.

    Mistakes the model can fix -- an unknown tool, malformed JSON, a missing
    or non-string argument -- get a one-line message saying what to send;
    ``timeout=None`` means DEFAULT_TIMEOUT_S. Never raises.
    """
    try:
        spec = _TOOLS.get(name) if isinstance(name, str) else None
        if spec is None:
            return f"Unknown tool {_short(name)}: the available tools are {', '.join(map(repr, _TOOLS))}."
        field, run = spec
        usage = f'{{"{field}": "..."}}'
        if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
            arguments = {}
        elif isinstance(arguments, (str, bytes, bytearray)):
            try:
                arguments = json.loads(arguments)
            except ValueError as exc:
                return (f"Invalid arguments for tool {name!r}: not valid JSON ({_one_line(str(exc))}); "
                        f"send a JSON object like {usage}.")
        if not isinstance(arguments, Mapping):
            return (f"Invalid arguments for tool {name!r}: expected a JSON object like {usage}, "
                    f"got {type(arguments).__name__}.")
        if field not in arguments:
            return f"Invalid arguments for tool {name!r}: missing the required string argument {field!r}."
        value = arguments[field]
        if not isinstance(value, str):
            return (f"Invalid arguments for tool {name!r}: {field!r} must be a string, "
                    f"got {type(value).__name__}.")
        return run(value, cancel_event=cancel_event,
                   timeout=DEFAULT_TIMEOUT_S if timeout is None else timeout,
                   output_callback=output_callback, session_id=session_id, pool=pool,
                   session=session if run is python_exec else None)
    except Exception as exc:  # noqa: BLE001 - the model reads every failure as text
        return ERROR_PREFIX + _one_line(str(exc) or type(exc).__name__)


def _short(value: object, limit: int = 80) -> str:
    """A one-line repr that a hostile value cannot make huge."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _one_line(text: str) -> str:
    return " ".join(text.splitlines())
