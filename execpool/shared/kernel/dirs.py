"""Removing a directory a job filled, however it filled it.

Shared: the worker removes its jobs' directories, the pool and the lifeline
a dead worker's, the service its requests'. A job decides what is in them:
Python 3.11's ``shutil.rmtree`` recurses once per level, so a job that made
a tree 3000 directories deep made it raise ``RecursionError`` -- which
``ignore_errors`` does not catch -- in the worker (killing it, and every
other job it ran) and in the pool's cleanup. ``remove_tree`` instead hoists
the contents of each subdirectory one level up and removes it, pass after
pass: no recursion, two descriptors open at a time (one more for each
removal a caller keeps in flight), no path longer than a name, and never a
symlink followed.
"""

from __future__ import annotations

import errno
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

#: In a worker's ``jobs_dir``: where its jobs' directories go when they end,
#: for its remover to delete (execpool/worker/jobdirs.py) -- and a dead
#: worker's whole ``jobs_dir``, handed over by the pool to a live one
#: (execpool/pool/workers.py).
TRASH = ".trash"

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: A handle on a directory that says what it is without reading it.
_HANDLE_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: str, in_flight: int = 1) -> bool:
    """Remove ``path`` and everything in it; False if something stayed
    (the caller logs or leaves it for a later sweep, never raises). A job
    may have left its own directory unreadable (mode 0); its owner, the
    same user, undoes that first. ``in_flight``: how many subdirectories
    are removed at once, each by a thread of its own."""
    try:
        top = _open_own(path, None)
    except FileNotFoundError:
        return True
    except OSError:
        return _quietly(os.unlink, path)
    try:
        while True:
            subdirs = []
            with os.scandir(top) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        subdirs.append(entry.name)
                    else:
                        _quietly(os.unlink, entry.name, dir_fd=top)
            if not subdirs:
                break
            if not _hoist_all(top, subdirs, in_flight):
                return False
    except OSError:
        return False
    finally:
        os.close(top)
    return _quietly(os.rmdir, path)


def _hoist_all(top: int, names: List[str], in_flight: int) -> bool:
    """:func:`_hoist` each of ``names``, ``in_flight`` at a time; False
    once one fails (its thread stops there, the others finish theirs)."""

    def hoist(share: List[str]) -> bool:
        return all(_hoist(top, name) for name in share)

    if in_flight < 2 or len(names) < 2:
        return hoist(names)
    with ThreadPoolExecutor(in_flight) as threads:
        return all(list(threads.map(hoist, [names[i::in_flight] for i in range(in_flight)])))


def _hoist(top: int, name: str) -> bool:
    """Move what ``name`` holds up into ``top`` and remove ``name``; a job
    may have left it unreadable (mode 0), which its owner can undo."""
    try:
        inner = _open_own(name, top)
    except OSError:
        return False
    try:
        with os.scandir(inner) as entries:
            children = [entry.name for entry in entries]
        for child in children:
            _rename_up(inner, child, top)
    except OSError:
        return False
    finally:
        os.close(inner)
    return _quietly(os.rmdir, name, dir_fd=top)


def _open_own(name: str, top: Optional[int]) -> int:
    """Open the directory ``name`` (in ``top``, or a path), making it
    readable and writable if its owner -- the job, the same user -- took
    that away."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=top)
    except PermissionError:
        make_own(name, top)
        fd = os.open(name, _DIR_FLAGS, dir_fd=top)
    # Readable but not writable (``chmod 500``): nothing in it could be
    # unlinked or moved up.
    if os.fstat(fd).st_mode & 0o700 != 0o700:
        _quietly(os.fchmod, fd, 0o700)
    return fd


def make_own(name: str, top: Optional[int]) -> None:
    """Give the directory ``name`` back its owner's rights. Its mode is
    changed through a descriptor that cannot be a symlink's: on Linux,
    ``chmod`` with ``follow_symlinks=False`` on a symlink raises an error
    that is not an OSError (ValueError with ``dir_fd``), and a job that
    swapped the directory for a symlink at the right moment made that crash
    the worker."""
    handle = os.open(name, _HANDLE_FLAGS, dir_fd=top)
    try:
        os.chmod(f"/proc/self/fd/{handle}", 0o700)
    finally:
        os.close(handle)


def _rename_up(inner: int, child: str, top: int) -> None:
    """``child`` into ``top`` under a fresh name. The job chose the tree's
    names, so the fresh ones are random: names counted from 0 it took in
    advance (64 of them made the tree impossible to remove)."""
    for _ in range(64):
        try:
            os.rename(child, f".execpool-hoisted-{secrets.token_hex(8)}", src_dir_fd=inner, dst_dir_fd=top)
            return
        except (FileExistsError, IsADirectoryError, NotADirectoryError):
            continue
        except PermissionError:
            make_own(child, inner)  # a directory moves only with the right to rewrite its ".."
            continue
        except OSError as exc:
            if exc.errno != errno.ENOTEMPTY:
                raise
    raise OSError(errno.EEXIST, "no free name to hoist into", child)


def _quietly(call, *args, **kwargs) -> bool:
    try:
        call(*args, **kwargs)
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False
