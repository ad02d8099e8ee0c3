"""Files into a job's directory before it runs, and out of it after.

Runs in the caller: the pool, for a CodeJob's directory
(execpool/pool/code.py), and the service (execpool/serve/jobs.py), whose
requests may bring files for their jobs (``files``: relative path -> bytes)
and ask for files back (``fetch_files``). Both are confined to the job's
own directory, a fresh one the caller made: a path is relative, has no
``..`` and no empty or ``.`` part (``checks.relative_path``, before
anything runs, and again here), and every component is opened
relative to the one before it with ``O_NOFOLLOW`` -- a symlink the job
planted (to ``/etc/shadow``, to another job's directory) is refused, never
followed. A file read back must be a regular file (a FIFO would block the
reader, a device would never end) and at most ``max_bytes`` long.
"""

from __future__ import annotations

import os
import stat
from typing import Dict, Iterable, Mapping, Optional

from ..shared import checks

#: Bytes of one file read back: what a JSON answer can carry without the
#: reader holding far more than it sends.
DEFAULT_FETCH_MAX_BYTES = 16 * 1024 * 1024

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

#: How a path is named in the messages about it.
_LABEL = "file path"


class JobFileError(ValueError):
    """A file that cannot be written into the job's directory; the message
    names the path."""


def check_path(label: str, path: object) -> str:
    try:
        return checks.relative_path(label, path)
    except (TypeError, ValueError) as exc:
        raise JobFileError(str(exc)) from None


def write_files(directory: str, files: Mapping[str, bytes]) -> None:
    """Create each file (and its parent directories) in ``directory``,
    which nothing else writes to yet."""
    for path, data in files.items():
        *parents, name = check_path(_LABEL, path).split("/")
        fd = os.open(directory, _DIR_FLAGS)
        try:
            for part in parents:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                fd = _step(fd, part, path)
            out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                          dir_fd=fd)
            with open(out, "wb") as f:
                f.write(data)
        except OSError as exc:
            raise JobFileError(f"cannot create {path!r}: {exc.strerror}") from None
        finally:
            os.close(fd)


def read_files(directory: str, paths: Iterable[str], max_bytes: int = DEFAULT_FETCH_MAX_BYTES, *,
               max_total_bytes: Optional[int] = None) -> Dict[str, bytes]:
    """The regular files among ``paths`` that the job left in ``directory``,
    each at most ``max_bytes`` and together at most ``max_total_bytes``
    (what the answer can carry); what is missing, a symlink (anywhere on
    its path), not a regular file, too big or past the total is left out."""
    found: Dict[str, bytes] = {}
    left = max_total_bytes
    for path in paths:
        data = _read_one(directory, check_path(_LABEL, path), max_bytes if left is None else min(max_bytes, left))
        if data is not None:
            found[path] = data
            if left is not None:
                left -= len(data)
    return found


def _read_one(directory: str, path: str, max_bytes: int) -> Optional[bytes]:
    *parents, name = path.split("/")
    try:
        fd = os.open(directory, _DIR_FLAGS)
    except OSError:
        return None
    try:
        for part in parents:
            fd = _step(fd, part, path)
        try:
            file_fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        except OSError:
            return None
        info = os.fstat(file_fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > max_bytes:
            os.close(file_fd)
            return None
        with open(file_fd, "rb") as f:
            data = f.read(max_bytes + 1)
            return data if len(data) <= max_bytes else None
    except JobFileError:
        return None
    finally:
        os.close(fd)


def _step(fd: int, part: str, path: str) -> int:
    """The directory ``part`` inside ``fd``, never through a symlink. On
    success ``fd`` is closed; on failure it stays the caller's to close."""
    try:
        inner = os.open(part, _DIR_FLAGS, dir_fd=fd)
    except OSError as exc:
        raise JobFileError(f"{path!r}: {part!r} is not a directory inside the job's ({exc.strerror})") from None
    os.close(fd)
    return inner
