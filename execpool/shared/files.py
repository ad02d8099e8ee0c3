"""Files that cross between a caller and a job's directory as data: those
a job is given before it starts (``files=``) and those it gives back
(``fetch=``, ``Result.files``).

Shared: the caller checks them in the job spec (execpool/shared/jobs.py),
the channel carries them, and the worker writes and reads them in the job's
directory by descriptor (execpool/worker/files.py) -- never the caller by
path: that directory is the job's to change while it runs, and a name
there can become a link to anywhere at any moment.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass
from typing import Dict, Mapping, Tuple

from . import checks

#: What a Result brings back of a job's ``fetch``, in all: a job's files
#: come back in one message, which both ends hold whole for a moment.
FETCH_MAX_BYTES = 64 << 20
#: And in files: a pattern may match a directory of a hundred thousand.
FETCH_MAX_FILES = 1_000


@dataclass(frozen=True)
class File:
    """A file's bytes and its permission bits (``0o755`` for a program)."""

    data: bytes
    mode: int = 0o644

    def __post_init__(self) -> None:
        if not isinstance(self.data, (bytes, bytearray)):
            raise TypeError(f"File.data must be bytes, not {type(self.data).__name__}")
        object.__setattr__(self, "data", bytes(self.data))
        checks.integer("File.mode", self.mode, minimum=0, maximum=0o777,
                       over="more than permission bits: no setuid, setgid or sticky file")

    @property
    def executable(self) -> bool:
        return bool(self.mode & stat.S_IXUSR)


def job_files(name: str, value: object) -> Dict[str, File]:
    """A job's ``files``: relative path to bytes or :class:`File`, as a new
    dict of Files (bytes become ``0o644``)."""
    given = checks.files(name, value)
    for path, content in given.items():
        if not isinstance(content, (bytes, bytearray, File)):
            raise TypeError(f"{name}[{path!r}] must be bytes or an execpool.File, not {type(content).__name__}")
    for path in given:
        parent = path.rsplit("/", 1)[0] if "/" in path else None
        while parent is not None:
            if parent in given:
                raise ValueError(f"{name} has both {parent!r} and {path!r}: a file cannot hold another")
            parent = parent.rsplit("/", 1)[0] if "/" in parent else None
    return {path: content if isinstance(content, File) else File(content) for path, content in given.items()}


def fetch_patterns(name: str, value: object) -> Tuple[str, ...]:
    """A job's ``fetch``: relative paths, each may hold ``fnmatch`` patterns
    (``*.class``, ``out/*``) in any of its parts; ``glob.escape`` a name
    that holds ``*``, ``?`` or ``[``."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name} must be a list of relative paths, not {type(value).__name__}")
    patterns = tuple(value)
    if len(patterns) > FETCH_MAX_FILES:
        raise ValueError(f"{name} names more than {FETCH_MAX_FILES} paths")
    for pattern in patterns:
        checks.relative_path(name, pattern)
    return tuple(dict.fromkeys(patterns))


def sizes(files: Mapping[str, File]) -> int:
    return sum(len(file.data) for file in files.values())
