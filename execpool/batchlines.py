"""IN, the input file of ``execpool batch``: its lines, read without ever
holding more than one, parsed, and made into jobs -- or into the reason a
line is no job, which becomes its ``invalid`` record.

Caller side: the command's process (execpool/cli.py), which owns the
resume rules (execpool/records.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from typing import Any, Iterator, NamedTuple, Optional

from .jobs import PythonJob, ShellJob
from .records import json_type, line_key

#: Keys an input line of ``execpool batch`` may have. Anything else is
#: refused (a misspelt "timout" would otherwise silently run with the default).
BATCH_KEYS = ("id", "python", "shell", "timeout", "cwd", "env", "stdin")

#: The longest input line read, in bytes without its newline. A longer one
#: is read past in pieces and becomes an invalid record, so no single line
#: costs more memory than this.
MAX_LINE_BYTES = 16 * 1024 * 1024

#: The most digits an integer in an input line may have. Python converts
#: this many whatever PYTHONINTMAXSTRDIGITS says (it cannot be set lower:
#: ``sys.int_info.str_digits_check_threshold``), so an id that is read is
#: always written and read back on resume; past its own limit Python refuses
#: the whole line, and with no limit a line of digits takes quadratic time.
MAX_INT_DIGITS = 640


class Line(NamedTuple):
    """One input line, parsed as far as it goes."""

    number: int
    key: str  # what resume compares: the id as JSON, or "#L<number>" for a line without a usable id
    id: Any  # the id as given, or None
    obj: Optional[dict]  # the JSON object, when the line is one
    reason: Optional[str]  # why the line is invalid, when it is


class _HugeInt(ValueError):
    """An integer past MAX_INT_DIGITS, raised from inside ``json.loads``."""


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _HugeInt(f"an integer of {digits} digits (a line's integers may have at most {MAX_INT_DIGITS})")
    return int(text)


def parse_line(number: int, raw: Optional[bytes]) -> Line:
    """The line's JSON and id: all that the scan for duplicate ids needs.
    ``raw`` is None for a line over MAX_LINE_BYTES."""
    no_id = line_key(number)
    if raw is None:
        return Line(number, no_id, None, None, f"line is longer than {MAX_LINE_BYTES >> 20} MiB")
    try:
        obj = json.loads(raw, parse_int=_bounded_int)
    except _HugeInt as exc:
        return Line(number, no_id, None, None, str(exc))
    except UnicodeDecodeError as exc:
        return Line(number, no_id, None, None, f"line is not valid UTF-8 ({exc.reason} at byte {exc.start})")
    except json.JSONDecodeError as exc:
        return Line(number, no_id, None, None, f"bad JSON: {exc.msg} at column {exc.colno}")
    except RecursionError:
        return Line(number, no_id, None, None, "bad JSON: nested too deeply")
    if not isinstance(obj, dict):
        return Line(number, no_id, None, None, f"a line must be a JSON object, not {json_type(obj)}")
    if "id" not in obj:
        return Line(number, no_id, None, obj, 'missing "id"')
    ident = obj["id"]
    if isinstance(ident, bool) or not isinstance(ident, (str, int)):
        return Line(number, no_id, None, obj, f'"id" must be a string or an integer, not {json_type(ident)}')
    if isinstance(ident, str):
        if not ident:
            return Line(number, no_id, None, obj, '"id" must not be empty')
        try:
            ident.encode("utf-8")
        except UnicodeEncodeError:
            return Line(number, no_id, None, obj, '"id" is not valid text (a lone surrogate)')
    return Line(number, json.dumps(ident), ident, obj, None)


@dataclasses.dataclass(frozen=True)
class JobDefaults:
    timeout: Optional[float]
    warm: bool


def make_job(line: Line, defaults: JobDefaults) -> tuple[Optional[Any], Optional[str]]:
    """(job, None) or (None, why the line is invalid)."""
    if line.reason is not None:
        return None, line.reason
    obj = line.obj
    assert obj is not None
    unknown = sorted(set(obj) - set(BATCH_KEYS))
    if unknown:
        return None, (f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(json.dumps, unknown))} "
                      f"(a line has {', '.join(BATCH_KEYS)})")
    if ("python" in obj) == ("shell" in obj):
        return None, ('give either "python" or "shell", not both' if "python" in obj
                      else 'missing "python" or "shell"')
    kind = "python" if "python" in obj else "shell"
    source = obj[kind]
    if not isinstance(source, str):
        return None, f'"{kind}" must be a string, not {json_type(source)}'
    if not source.strip():
        return None, "No code provided." if kind == "python" else "No command provided."
    kwargs: dict = {"timeout": obj.get("timeout", defaults.timeout)}
    for name in ("env", "stdin"):
        if obj.get(name) is not None:
            kwargs[name] = obj[name]
    cwd = obj.get("cwd")
    if cwd is not None:
        if not isinstance(cwd, str):
            return None, f'"cwd" must be a string, not {json_type(cwd)}'
        kwargs["cwd"] = cwd
    if kind == "python" and defaults.warm:
        kwargs["warm"] = True
    try:
        job = (PythonJob if kind == "python" else ShellJob)(source, **kwargs)
    except (TypeError, ValueError) as exc:
        return None, str(exc)
    # The job made cwd absolute, relative to where the command runs (workers
    # run in /); checked here so one missing directory is one invalid record,
    # not a failed batch.
    if job.cwd is not None and not os.path.isdir(job.cwd):
        return None, f"cwd {job.cwd!r} is not an existing directory"
    return job, None


def input_lines(f) -> Iterator[tuple[int, Optional[bytes]]]:
    """Numbered non-blank lines; numbers count every line, as editors do.
    A line over MAX_LINE_BYTES comes as None, never held whole."""
    for number in itertools.count(1):
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        if len(raw) <= MAX_LINE_BYTES or raw.endswith(b"\n"):
            if raw.strip():
                yield number, raw
            continue
        while raw and not raw.endswith(b"\n"):
            raw = f.readline(MAX_LINE_BYTES)
        yield number, None
