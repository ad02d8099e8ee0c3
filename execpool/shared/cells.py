"""What one cell of a session gives back: ``CellResult``, and how it is
read from the reply the session's runtime wrote.

Shared: the caller builds it (execpool/pool/sessions.py) from what the
worker passed on unread (execpool/worker/sessions/link.py). That reply
comes from the session's own process, where the cell's code runs and
could have written anything on the socket, so it is read as untrusted:
a reply that is not what the runtime writes makes the cell an error that
says so, never an exception in the caller.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from .output import RESULT_HEAD_CHARS, truncation_notice
from .result import CANCELLED_TEXT, ERROR_PREFIX, Status, timeout_text

#: What each kind of session is, as ``pool.session`` takes it.
SESSION_LANGUAGES = ("python", "bash")

#: How long a fork may take -- the copy copies the session's directory --
#: before the session is interrupted and, past the grace, killed.
FORK_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class CellResult:
    """One cell's outcome.

    ``status``: ``ok``; ``error`` (the cell raised, or its command exited
    non-zero); ``timeout`` and ``cancelled`` (it was interrupted -- the
    session lives on unless ``alive`` says otherwise); ``infra`` (execpool
    failed under it: its worker died, the pool closed). ``stdout`` and
    ``stderr`` are what it printed, apart; ``output`` is both as the worker
    read them (each stream in its order; two pipes cannot say which of two
    writes close together came first).
    Python's cells have ``value`` (the last expression's ``text/plain``),
    ``data`` (its whole MIME bundle), ``display`` (``display()`` calls and
    matplotlib figures, each a MIME bundle, binary types base64),
    ``value_at`` (how many of those came before the value: a notebook
    shows the figures a cell left open after it; ``shown`` is the lot in
    that order) and ``error`` (``{"ename", "evalue", "traceback"}``); bash's have
    ``exit_code``. ``alive`` is False once the session is gone, and
    ``message`` says why.
    """

    status: Status
    stdout: str = ""
    stderr: str = ""
    output: str = ""
    value: Optional[str] = None
    data: Optional[Dict[str, Any]] = None
    display: Tuple[Dict[str, Any], ...] = ()
    value_at: Optional[int] = None
    error: Optional[Dict[str, Any]] = None
    exit_code: Optional[int] = None
    alive: bool = True
    message: Optional[str] = None
    execution_count: int = 0
    duration_s: float = 0.0
    timeout: Optional[float] = None
    #: What a Python cell cost, as its session measured it: the CPU seconds
    #: of the session's process and of the processes it waited for, and the
    #: session's peak resident memory so far. None for bash's cells.
    cpu_user_s: Optional[float] = None
    cpu_system_s: Optional[float] = None
    max_rss_bytes: Optional[int] = None
    #: How much each stream printed: over RESULT_HEAD_CHARS, only the head is kept.
    output_chars: int = field(default=0, repr=False)

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    @property
    def shown(self) -> Tuple[Dict[str, Any], ...]:
        """Every MIME bundle the cell showed, as a notebook shows them: its
        displays with its value in its place among them."""
        if self.data is None:
            return self.display
        at = len(self.display) if self.value_at is None else min(max(self.value_at, 0), len(self.display))
        return (*self.display[:at], self.data, *self.display[at:])

    @property
    def text(self) -> str:
        """The model-facing string, as ``Result.text`` for a job: what the
        cell printed, then its value, then its error's traceback; a timeout,
        a cancel or execpool's failure said as a job's is."""
        if self.status is Status.INFRA:
            return ERROR_PREFIX + (self.message or "the session is gone")
        body = self.output
        if self.output_chars > len(self.output):
            body += truncation_notice(self.output_chars, len(self.output))
        if self.status is Status.TIMEOUT:
            return _joined(body, timeout_text(self.timeout))
        if self.status is Status.CANCELLED:
            return _joined(body, CANCELLED_TEXT)
        if self.value is not None:
            body = _joined(body, self.value)
        if self.error is not None:
            body = _joined(body, "\n".join(self.error.get("traceback") or ()))
        elif self.exit_code:
            body = f"Exit code {self.exit_code}:\n" + body
        if not self.alive and self.message:
            body = _joined(body, self.message)
        return body if body.strip() else "(no output)"


def _joined(first: str, second: str) -> str:
    if not first:
        return second
    return first + ("" if first.endswith("\n") else "\n") + second


class Printed:
    """A running cell's output as it arrives: both streams apart and as
    they came, each kept up to RESULT_HEAD_CHARS."""

    def __init__(self) -> None:
        self.parts: Dict[str, list] = {"stdout": [], "stderr": [], "output": []}
        self.kept = {"stdout": 0, "stderr": 0, "output": 0}
        self.total = 0

    def add(self, text: str, stream: str) -> None:
        self.total += len(text)
        for name in (stream, "output"):
            room = RESULT_HEAD_CHARS - self.kept[name]
            if room > 0:
                piece = text[:room]
                self.parts[name].append(piece)
                self.kept[name] += len(piece)

    def fields(self, printed: int) -> dict:
        """Its CellResult fields, ``printed`` being what the worker counted
        (past the worker's cap for a cell, nothing more came here)."""
        return {"stdout": "".join(self.parts["stdout"]), "stderr": "".join(self.parts["stderr"]),
                "output": "".join(self.parts["output"]), "output_chars": max(printed, self.total)}


def read_reply(language: str, reply: bytes) -> dict:
    """The CellResult fields a runtime's reply gives: Python's JSON, bash's
    exit status. A reply the runtime would not write is the cell's error."""
    if language == "bash":
        return _bash_reply(reply)
    try:
        fields = json.loads(reply.decode("utf-8"))
    except (ValueError, RecursionError):  # RecursionError: brackets nested past the parser's depth
        return _garbled()
    if not (isinstance(fields, dict) and _optional(fields.get("value"), str)
            and _optional(fields.get("data"), dict) and isinstance(fields.get("display"), list)
            and all(isinstance(item, dict) for item in fields["display"])
            and _optional(fields.get("error"), dict) and type(fields.get("execution_count")) is int
            and (fields.get("value_at") is None or type(fields["value_at"]) is int)):
        return _garbled()
    error = fields["error"]
    if error is not None and not (isinstance(error.get("ename"), str) and isinstance(error.get("evalue"), str)
                                  and isinstance(error.get("traceback"), list)
                                  and all(isinstance(line, str) for line in error["traceback"])):
        return _garbled()
    cost = fields.get("cost")
    if not (isinstance(cost, dict) and all(type(cost.get(key)) in kinds for key, kinds in _COST.items())):
        return _garbled()
    return {"status": Status.ERROR if error is not None else Status.OK, "value": fields["value"],
            "data": fields["data"], "display": tuple(fields["display"]), "value_at": fields.get("value_at"),
            "error": error,
            "execution_count": fields["execution_count"], **{key: cost[key] for key in _COST}}


def _bash_reply(reply: bytes) -> dict:
    """Bash's reply: the ``time`` keyword's report, then the exit status on
    a line of its own. A cell that changed ``TIMEFORMAT`` changed the report:
    the cost is then unknown, the status still read."""
    try:
        report, _, status = reply.decode("ascii").rpartition("\n")
        code = int(status)
    except (UnicodeDecodeError, ValueError):
        return _garbled()
    fields: dict = {"status": Status.OK if code == 0 else Status.ERROR, "exit_code": code}
    seconds = report.split()
    if len(seconds) == 2:
        try:
            fields["cpu_user_s"], fields["cpu_system_s"] = (max(0.0, float(value)) for value in seconds)
        except ValueError:
            pass
    return fields


#: A Python reply's cost fields and the JSON types each may have.
_COST = {"cpu_user_s": (float, int), "cpu_system_s": (float, int), "max_rss_bytes": (int,)}


def _optional(value: object, kind: type) -> bool:
    return value is None or isinstance(value, kind)


def _garbled() -> dict:
    why = "the session's reply to this cell was garbled (its code wrote on the session's socket)"
    return {"status": Status.ERROR, "error": {"ename": "SessionError", "evalue": why, "traceback": [why]}}
