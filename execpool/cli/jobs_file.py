"""IN, the input file of ``execpool batch``: its lines, read without ever
holding more than one, parsed, and made into jobs -- or into the reason a
line is no job, which becomes its ``invalid`` record.

Runs in the command's process (execpool/cli/batch.py). A line is a job
request in the batch dialect of execpool/formats/request.py, the one parser
every front uses.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Iterator, NamedTuple, Optional

from ..formats.request import BATCH_LINE, BadField, Defaults, Job, check, json_type, parse

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


def line_key(number: int) -> str:
    """The resume key of a line without a usable id. JSON text never starts
    with '#', so this cannot collide with an id's key."""
    return f"#L{number}"


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
    try:
        ident = check(BATCH_LINE, "id", obj["id"])
    except BadField as exc:
        return Line(number, no_id, None, obj, str(exc))
    return Line(number, json.dumps(ident), ident, obj, None)


def make_job(line: Line, defaults: Defaults) -> tuple[Optional[Job], Optional[str]]:
    """(job, None) or (None, why the line is invalid)."""
    if line.reason is not None:
        return None, line.reason
    try:
        return parse(line.obj, BATCH_LINE, defaults).job, None
    except BadField as exc:
        return None, str(exc)


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
