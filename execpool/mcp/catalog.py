"""The tools an MCP client is offered, and a call's arguments checked.

Runs in the MCP server's process (``execpool mcp``, or ``execpool serve``
with its ``/mcp`` endpoint), on its event loop, for ``tools/list`` and at
the start of every ``tools/call``. The descriptions are the tool layer's
(execpool/agent/tools.py), which models were tuned on -- except the
stateful python tool's, which must say that state is kept, and run_code's,
which the tool layer does not have. Arguments arrive as whatever JSON the
client sent; a mistake a model can fix becomes ``BadCall``, whose message
is the tool error it reads.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
from typing import Any, Dict, List, Mapping, Optional

from ..agent.tools import PYTHON_TOOL, TERMINAL_TOOL
from ..shared.languages import TABLE
from ..shared.result import NO_CODE_TEXT, NO_COMMAND_TEXT

PYTHON, BASH, RUN_CODE, RESET = "python", "bash", "run_code", "reset"

#: The languages of run_code: the table's, but those with a tool of their own.
OTHER_LANGUAGES = tuple(language.name for language in TABLE if language.name not in (PYTHON, BASH))

STATEFUL_PYTHON_DESCRIPTION = (
    "Run Python 3 code in this conversation's interpreter and return what it printed (stdout and stderr), then "
    "the value of its last expression, as a notebook cell shows it; a cell that raises ends with its traceback. "
    "Variables, imports and definitions are kept from one call to the next until you call reset. Images the code "
    "displays (a matplotlib figure, display(image)) come back as images. The working directory is writable and "
    "keeps its files across calls: use relative paths (e.g. 'results.csv') for every file you read or write. "
    "/mnt/data does not exist here. Long output is truncated; write large results to a file and print a summary."
)

RUN_CODE_DESCRIPTION = (
    "Run a program in another language -- compiled first where the language compiles -- and return its output "
    "(stdout and stderr), the compiler's errors, or the exit code if it failed. Each call is a new program, run "
    "in the working directory that the python and bash tools share: files persist, nothing else does. Use "
    "relative paths for the files you create and read. A language this machine has no toolchain for answers "
    "with an error saying so. Long output is truncated."
)

RESET_DESCRIPTION = (
    "Start Python over: the next python call runs in a fresh interpreter, without the variables, imports and "
    "definitions of earlier calls. Files in the working directory stay."
)


class BadCall(ValueError):
    """A call the server will not run; the message is what the model reads."""


@dataclasses.dataclass(frozen=True)
class Call:
    """One checked ``tools/call``: which tool, the program, its language
    (``python``, ``bash`` or run_code's) and the seconds it may run."""

    tool: str
    source: str = ""
    language: str = ""
    timeout: float = 0.0


@dataclasses.dataclass(frozen=True)
class Catalog:
    """The tools of one server: ``stateful`` adds reset and says python
    keeps its state; ``timeout`` is a call's default, ``max_timeout`` the
    most a call may ask."""

    stateful: bool
    timeout: float
    max_timeout: float

    def tools(self) -> List[Dict[str, Any]]:
        """Each tool as MCP lists it: name, description, input schema."""
        python = STATEFUL_PYTHON_DESCRIPTION if self.stateful else PYTHON_TOOL["function"]["description"]
        listed = [
            _tool(PYTHON, python, {"code": _property(PYTHON_TOOL, "code")}, self._timeout()),
            _tool(BASH, TERMINAL_TOOL["function"]["description"], {"command": _property(TERMINAL_TOOL, "command")},
                  self._timeout()),
            _tool(RUN_CODE, RUN_CODE_DESCRIPTION, {
                "language": {"type": "string", "enum": list(OTHER_LANGUAGES),
                             "description": "The program's language."},
                "code": {"type": "string", "description": "The program's source."},
            }, self._timeout()),
        ]
        if self.stateful:
            listed.append(_tool(RESET, RESET_DESCRIPTION, {}, None))
        return listed

    def parse(self, name: str, arguments: Optional[Mapping[str, Any]]) -> Call:
        """The call, or ``BadCall`` saying what to send instead."""
        fields = {PYTHON: ("code",), BASH: ("command",), RUN_CODE: ("language", "code")}.get(name)
        if fields is None and not (name == RESET and self.stateful):
            known = ", ".join(tool["name"] for tool in self.tools())
            raise BadCall(f"Unknown tool {reprlib.repr(name)}: the tools are {known}.")
        given = dict(arguments or {})
        if name == RESET:
            if given:
                raise BadCall(f"Invalid arguments for tool 'reset': it takes none, got {', '.join(map(repr, given))}.")
            return Call(RESET)
        assert fields is not None
        unexpected = sorted(set(given) - {*fields, "timeout"})
        if unexpected:
            raise BadCall(f"Invalid arguments for tool {name!r}: unexpected {', '.join(map(repr, unexpected))}; "
                          f"it takes {', '.join(map(repr, fields))} and 'timeout'.")
        for field in fields:
            if not isinstance(given.get(field), str):
                got = "nothing" if field not in given else type(given[field]).__name__
                raise BadCall(f"Invalid arguments for tool {name!r}: {field!r} must be a string, got {got}.")
        source = given[fields[-1]]
        if not source.strip():
            raise BadCall(NO_COMMAND_TEXT if name == BASH else NO_CODE_TEXT)
        language = {PYTHON: PYTHON, BASH: BASH}.get(name) or given["language"]
        if name == RUN_CODE and language not in OTHER_LANGUAGES:
            raise BadCall(f"Invalid arguments for tool 'run_code': unknown language {reprlib.repr(language)}; the "
                          f"languages are {', '.join(OTHER_LANGUAGES)} (python and bash have tools of their own).")
        return Call(name, source, language, self._seconds(name, given.get("timeout")))

    def _seconds(self, name: str, value: object) -> float:
        if value is None:
            return self.timeout
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise BadCall(f"Invalid arguments for tool {name!r}: 'timeout' must be a positive number of seconds, "
                          f"got {reprlib.repr(value)}.")
        if value > self.max_timeout:
            raise BadCall(f"Invalid arguments for tool {name!r}: 'timeout' may be at most {self.max_timeout:g} "
                          f"seconds, got {value:g}.")
        return float(value)

    def _timeout(self) -> Dict[str, Any]:
        return {"type": "number", "exclusiveMinimum": 0, "maximum": self.max_timeout,
                "description": f"Seconds this call may run (default {self.timeout:g}, at most {self.max_timeout:g})."}


def _tool(name: str, description: str, properties: Dict[str, Any], timeout: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    required = list(properties)
    if timeout is not None:
        properties = {**properties, "timeout": timeout}
    return {"name": name, "description": description,
            "inputSchema": {"type": "object", "properties": properties, "required": required,
                            "additionalProperties": False}}


def _property(tool: Mapping[str, Any], name: str) -> Dict[str, Any]:
    return dict(tool["function"]["parameters"]["properties"][name])
