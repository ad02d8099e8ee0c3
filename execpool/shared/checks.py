"""Argument checks with messages that name the field: one place for them.

Misuse of the API is an exception raised in the caller's frame, before
anything reaches a worker, and its message names the argument and what it
got -- the service turns the same messages into its 400s. Every layer
(jobs, pool configuration, batch, tools, loop, CLI) checks through these, so
a rule such as "a bool is not a count" holds everywhere at once.
"""

from __future__ import annotations

import math
import os
from typing import Iterable, Literal, Mapping, Optional, Tuple, overload

#: A number of seconds above this is almost certainly a unit mistake.
MAX_SECONDS = 7 * 24 * 3600.0


def shown(value: object) -> str:
    """``repr(value)`` for an error message, but an int past 64 bits by its
    size: Python refuses to print one of thousands of digits (raising a
    ValueError that names no field), and nobody would read it anyway."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"<{'a negative' if value < 0 else 'an'} integer of {value.bit_length()} bits>"
    return repr(value)


@overload
def integer(name: str, value: object, *, minimum: int = 1, maximum: Optional[int] = None,
            none_ok: Literal[False] = False, over: str = "") -> int: ...
@overload
def integer(name: str, value: object, *, minimum: int = 1, maximum: Optional[int] = None,
            none_ok: bool, over: str = "") -> Optional[int]: ...
def integer(name: str, value: object, *, minimum: int = 1, maximum: Optional[int] = None,
            none_ok: bool = False, over: str = "") -> Optional[int]:
    """An int in ``[minimum, maximum]`` (``None`` too when ``none_ok``).
    A bool is refused: ``True`` is not a count. ``over`` is added to the
    message for a value above ``maximum``, to say what to do instead."""
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        kind = "an int or None" if none_ok else "an int"
        raise TypeError(f"{name} must be {kind}, not {type(value).__name__}")
    if value < minimum:
        wanted = "positive" if minimum == 1 else f"at least {minimum}"
        raise ValueError(f"{name} must be {wanted}, got {shown(value)}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={shown(value)} is over its maximum of {maximum}" + (f"; {over}" if over else ""))
    return value


def flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, not {type(value).__name__}")
    return value


def seconds(name: str, value: object) -> float:
    """A positive, finite number of seconds (an interval, a timeout) of at
    most MAX_SECONDS, which every timer and queue wait can take."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if math.isnan(number) or number <= 0 or math.isinf(number):
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {shown(value)}")
    if number > MAX_SECONDS:
        raise ValueError(f"{name}={shown(value)} is over {MAX_SECONDS:.0f} s")
    return number


def text(name: str, value: object, *, nul_ok: bool = False) -> str:
    """A str that a program can receive: valid UTF-8 (no lone surrogates)
    and, unless ``nul_ok`` (stdin), no NUL byte."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be str, not {type(value).__name__}")
    if not nul_ok and "\x00" in value:
        raise ValueError(f"{name} contains a NUL byte, which no program can receive")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{name} is not valid text: {exc.reason} at index {exc.start}") from None
    return value


#: A job's own environment: Linux refuses more than ~2 MiB of arguments and
#: environment together (and any one string over 128 KiB), so more than
#: this could never start a tool -- after costing whoever sent it far more
#: than it weighed.
MAX_ENV_VARS = 1_000
MAX_ENV_CHARS = 256 << 10


def environment(name: str, value: object) -> dict:
    """A mapping of variable names to values a program can receive, as a
    new dict: names non-empty and without ``=``, both sides text."""
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a mapping of str to str, not {type(value).__name__}")
    for key, item in value.items():
        text(f"{name} key", key)
        text(f"{name}[{key!r}]", item)
        if not key or "=" in key:
            raise ValueError(f"{name} key {key!r} is not a valid variable name")
    if len(value) > MAX_ENV_VARS or sum(len(k) + len(v) for k, v in value.items()) > MAX_ENV_CHARS:
        raise ValueError(f"{name} is over {MAX_ENV_VARS} variables or {MAX_ENV_CHARS} characters")
    return dict(value)


def names(field_name: str, value: object, *, module: bool) -> Tuple[str, ...]:
    """A tuple of names from any iterable of them -- but not one string,
    which would be its characters."""
    if isinstance(value, str) or not isinstance(value, Iterable):
        kind = "one string" if isinstance(value, str) else type(value).__name__
        raise TypeError(f"{field_name} must be a list of names, not {kind}")
    found = tuple(value)
    for name in found:
        text(f"{field_name} entry", name)
        if module and not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"{field_name} entry {name!r} is not a module name")
    return found


#: Files one job may bring: enough for any real use; past them a small
#: request would cost far more than it weighs.
MAX_FILES = 1_000

#: Levels a file path may have, and the bytes of one of its names: a
#: caller cannot make execpool build a tree deeper than this.
MAX_PATH_DEPTH = 32
MAX_NAME_BYTES = 255


def relative_path(label: str, path: object) -> str:
    """A path inside a job's directory: relative, no ``..``, ``.`` or empty
    part, at most MAX_PATH_DEPTH levels of names of at most MAX_NAME_BYTES.
    Checked before anything runs, so a bad path runs nothing."""
    value = text(label, path)
    if os.path.isabs(value):
        raise ValueError(f"{label}: the path {value!r} is absolute; give it relative to the job's directory")
    parts = value.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"{label}: the path {value!r} must be a plain relative path (no '..', '.' or empty parts)")
    if len(parts) > MAX_PATH_DEPTH or any(len(part.encode("utf-8")) > MAX_NAME_BYTES for part in parts):
        raise ValueError(f"{label}: the path {value[:80]!r} is more than {MAX_PATH_DEPTH} levels deep or has a "
                         f"name over {MAX_NAME_BYTES} bytes")
    return value


def files(name: str, value: object) -> dict:
    """Files for a job's directory -- relative path: content -- as a new
    dict; what the content may be is execpool/shared/files.py's business."""
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a mapping of relative paths to bytes, not {type(value).__name__}")
    if len(value) > MAX_FILES:
        raise ValueError(f"{name} has more than {MAX_FILES} files")
    for path in value:
        relative_path(name, path)
    return dict(value)


def cancel_event(value: object) -> object:
    """A ``threading.Event``, or anything with its ``is_set``/``set`` (an
    event shared with other code), or None."""
    if value is not None and not (callable(getattr(value, "is_set", None)) and callable(getattr(value, "set", None))):
        raise TypeError("cancel_event must be a threading.Event (or have is_set/set)")
    return value
