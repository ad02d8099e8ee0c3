"""A job's files in its working directory: its script and ``files`` written
before it starts, its ``fetch`` read after it ended, and a caller's
directory given back as it was -- every step relative to a descriptor of
that directory, never through a link.

Runs in the worker process, on its loop (execpool/worker/launch.py writes,
execpool/worker/event_loop.py reads and puts back). The directory is the job's to
change: a sandboxed session sharing a caller's directory with a job, or the
job itself, can swap any name there for a link to a host file at any
moment. Done by path, a ``chmod`` after a copy set a host file to 0755 for a
tenant (the compile cache did that, for a CodeJob given a ``cwd``). Here
every name is opened with ``openat2`` beneath the directory without
following a link (execpool.shared.kernel.linux.open_beneath), a file is
made with ``O_EXCL`` and its mode set on its descriptor, and a name is
renamed or removed only within a directory descriptor: the worst a job can
make of it is a failure, inside its own directory.

In a directory of the caller's, a name the job's files need that the
caller already has is set aside under a name of its own for the job's run
(:class:`Placed`), and put back when the job ends, after the job's own file
of that name is removed: the caller's file wins in the end, and the job
still runs with its own.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import secrets
import stat
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

from ..shared.files import FETCH_MAX_BYTES, FETCH_MAX_FILES, File
from ..shared.kernel.linux import open_beneath

#: Where a caller's file waits while a job's file of the same name is in
#: its place; and the prefix of a job's script.
ASIDE_PREFIX = ".execpool-aside-"
SCRIPT_PREFIX = ".execpool-"
#: Names a fetch pattern may look at in all: a job can fill a directory with
#: a hundred thousand, and the worker's loop serves every other job.
FETCH_MAX_NAMES = 100_000

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY


class FilesError(OSError):
    """A job's file that could not be written: its message names the path.
    The job's, not execpool's: the same files fail the same way again."""


@dataclass
class Placed:
    """What writing a job's files did to its directory: the directories
    made and the names written (relative paths), and the caller's files set
    aside -- (its name, where it waits), both relative to the same parent."""

    made: List[str] = field(default_factory=list)
    written: List[str] = field(default_factory=list)
    aside: List[Tuple[str, str]] = field(default_factory=list)


def open_directory(path: str) -> int:
    """A descriptor of the job's working directory ``path``, for the job's
    life. The caller named it, links and all: they are resolved now, and a
    link a job put on the way since it was resolved is refused."""
    return open_beneath(None, os.path.realpath(path), _DIRECTORY)


def write_script(directory: int, source: str) -> str:
    """The job's script, a new file of a random name in ``directory``; its name."""
    for _ in range(16):
        name = f"{SCRIPT_PREFIX}{secrets.token_hex(8)}.py"
        try:
            fd = open_beneath(directory, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue  # a job took the name in advance: it costs it nothing
        with open(fd, "w", encoding="utf-8") as f:
            f.write(source)
        return name
    raise OSError(errno.EEXIST, "no free name for the job's script")


def remove(directory: int, name: str) -> None:
    """Remove ``name`` (a file, a link, an empty directory) from
    ``directory``, quietly: the job may have removed or replaced it."""
    parent, base = _parent(directory, name)
    if parent is None:
        return
    try:
        try:
            os.unlink(base, dir_fd=parent)
        except IsADirectoryError:
            os.rmdir(base, dir_fd=parent)
    except OSError:
        pass
    finally:
        if parent != directory:
            os.close(parent)


def make_path(directory: int, path: str, is_dir: bool) -> None:
    """``path`` beneath ``directory``, a directory or an empty file, and the
    directories above it; what is there already is kept."""
    parent, name = _parent(directory, path, made=[])
    assert parent is not None
    try:
        if is_dir:
            try:
                os.mkdir(name, 0o755, dir_fd=parent)
            except FileExistsError:
                pass
        else:
            os.close(open_beneath(parent, name, os.O_WRONLY | os.O_CREAT, 0o644))
    finally:
        if parent != directory:
            os.close(parent)


def write(directory: int, files: Tuple[Tuple[str, File], ...], set_aside: bool) -> Placed:
    """Write ``files`` into ``directory``, each a new file with its mode,
    its parent directories made as needed. ``set_aside``: the directory is
    the caller's, whose files of the same names wait aside (``undo`` puts
    them back); otherwise it is new and a name taken is an error.
    FilesError naming the path; what was done before it is undone."""
    placed = Placed()
    try:
        for path, file in files:
            parent, name = _parent(directory, path, made=placed.made)
            assert parent is not None
            try:
                if set_aside:
                    _set_aside(parent, name, path, placed)
                fd = open_beneath(parent, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                placed.written.append(path)
                with open(fd, "wb") as f:
                    f.write(file.data)
                    os.fchmod(f.fileno(), file.mode)
            finally:
                if parent != directory:
                    os.close(parent)
    except OSError as exc:
        undo(directory, placed)
        if isinstance(exc, FilesError):
            raise
        raise FilesError(exc.errno, f"cannot write the job's file {path!r}: {exc.strerror}") from None
    return placed


def undo(directory: int, placed: Placed) -> None:
    """Remove what ``write`` wrote and put back what it set aside, quietly:
    the job may have changed either meanwhile."""
    for path in reversed(placed.written):
        remove(directory, path)
    for path, aside in reversed(placed.aside):
        parent, name = _parent(directory, path)
        if parent is None:
            continue
        try:
            os.rename(os.path.basename(aside), name, src_dir_fd=parent, dst_dir_fd=parent)
        except OSError:
            pass  # its place was taken again (the job wrote it): the job's, as anything it wrote is
        finally:
            if parent != directory:
                os.close(parent)
    for path in reversed(placed.made):
        remove(directory, path)  # only if still empty: what the job put there is its own
    placed.made.clear()
    placed.written.clear()
    placed.aside.clear()


def fetch(directory: int, patterns: Tuple[str, ...],
          skip: Tuple[str, ...] = ()) -> Tuple[Dict[str, File], Tuple[str, ...]]:
    """The regular files beneath ``directory`` that ``patterns`` match
    (``fnmatch`` per part; a ``*`` does not match a leading dot, as in a
    shell), none reached through a link and none of ``skip`` (the job's
    script, what waits aside): at most FETCH_MAX_FILES files and
    FETCH_MAX_BYTES in all; and the paths of those that did not fit (at most
    FETCH_MAX_FILES of them)."""
    found: Dict[str, File] = {}
    left_out: List[str] = []
    budget = [FETCH_MAX_BYTES, FETCH_MAX_NAMES]
    for pattern in patterns:
        for path, fd in _matches(directory, pattern.split("/"), "", budget):
            try:
                if path in found or path in skip or path in left_out:
                    continue
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode):
                    continue
                if len(found) >= FETCH_MAX_FILES or info.st_size > budget[0]:
                    if len(left_out) < FETCH_MAX_FILES:
                        left_out.append(path)
                    continue
                data = os.read(fd, info.st_size + 1) if info.st_size else b""
                if len(data) > info.st_size or len(data) > budget[0]:
                    left_out.append(path)  # it grew since: a process the job left still writes it
                    continue
                budget[0] -= len(data)
                found[path] = File(data, stat.S_IMODE(info.st_mode) & 0o777)
            finally:
                os.close(fd)
    return found, tuple(left_out)


def _matches(directory: int, parts: List[str], prefix: str, budget: List[int]) -> Iterator[Tuple[str, int]]:
    """(relative path, descriptor open for reading) of each file that the
    pattern's ``parts`` match beneath ``directory``; the caller closes each."""
    head, rest = parts[0], parts[1:]
    for name in _names(directory, head, budget):
        path = prefix + name
        flags = _DIRECTORY if rest else os.O_RDONLY | os.O_NONBLOCK
        try:
            fd = open_beneath(directory, name, flags)
        except OSError:
            continue  # gone, a link, not a directory, or not ours to read
        if not rest:
            yield path, fd
            continue
        try:
            yield from _matches(fd, rest, path + "/", budget)
        finally:
            os.close(fd)


def _names(directory: int, part: str, budget: List[int]) -> List[str]:
    if not any(magic in part for magic in "*?["):
        return [part]
    names = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                budget[1] -= 1
                if budget[1] < 0:
                    break
                if (part.startswith(".") or not entry.name.startswith(".")) and fnmatch.fnmatchcase(entry.name, part):
                    names.append(entry.name)
    except OSError:
        return []
    return sorted(names)


def _parent(directory: int, path: str, made: Optional[List[str]] = None) -> Tuple[Optional[int], str]:
    """A descriptor of ``path``'s parent beneath ``directory`` (``directory``
    itself for a plain name); the caller closes it unless it is
    ``directory``. With ``made``, the directories it lacks are made (and
    added to ``made``), else (None, name) where it is not there."""
    *parents, name = path.split("/")
    fd = directory
    try:
        for depth, part in enumerate(parents):
            if made is not None:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    made.append("/".join(parents[:depth + 1]))
                except FileExistsError:
                    pass
            inner = open_beneath(fd, part, _DIRECTORY)
            if fd != directory:
                os.close(fd)
            fd = inner
    except OSError as exc:
        if fd != directory:
            os.close(fd)
        if made is not None:
            raise FilesError(exc.errno, f"cannot write the job's file {path!r}: {'/'.join(parents)!r} is not a "
                                        f"directory of its own ({exc.strerror})") from None
        return None, name
    return fd, name


def _set_aside(parent: int, name: str, path: str, placed: Placed) -> None:
    """The caller's ``name`` (whatever it is), renamed within its directory
    to a name of its own -- random: a job cannot take it in advance --
    until the job ends."""
    try:
        os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    aside = f"{ASIDE_PREFIX}{secrets.token_hex(8)}-{name}"[:255]
    try:
        os.rename(name, aside, src_dir_fd=parent, dst_dir_fd=parent)
    except OSError as exc:
        raise FilesError(exc.errno, f"cannot set aside the caller's {path!r} for the job's: {exc.strerror}") from None
    placed.aside.append((path, os.path.join(os.path.dirname(path), aside)))
