"""OUT, the output file of ``execpool batch``: one record per job, exactly
once, whatever killed an earlier run.

Runs in the command's process (execpool/cli/batch.py). A record is one
JSON line (execpool/formats/records.py); its resume key is its id (as
JSON), or the input line number for a line without a usable id. How a
rerun resumes, repairs and retries is in ``ResultsFile``'s docstring.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import sys
import time
from typing import Callable, Optional, Tuple

from ..formats.records import STATUSES
from ..shared.result import Status
from .jobs_file import line_key

#: A written record reaches the disk (fdatasync) before the batch next waits
#: for a job, and at the latest this long after it was written while results
#: keep pouring in.
MAX_UNSYNCED_S = 0.25


class RecordsError(Exception):
    """OUT cannot be used as asked (locked, not a batch's, unreadable): the
    command's usage error, with a message that says what to do."""


def record_key(raw: bytes) -> tuple[Optional[str], Optional[str]]:
    """The resume key and the status of one complete line of OUT; (None,
    None) when it is no record."""
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):
        return None, None
    if not isinstance(record, dict) or record.get("status") not in STATUSES or "id" not in record:
        return None, None
    ident = record["id"]
    if ident is None:
        number = record.get("line")
        if isinstance(number, int) and not isinstance(number, bool):
            return line_key(number), record["status"]
        return None, None
    return json.dumps(ident), record["status"]


def encoded(record: dict) -> bytes:
    """A record as one line of OUT: UTF-8, or ASCII escapes where the record
    holds what UTF-8 cannot encode (a lone surrogate)."""
    try:
        return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(record) + "\n").encode("ascii")


class ResultsFile:
    """OUT, appended to one whole record per write.

    How resume stays exact:

    * Each record is one ``os.write`` of one complete line (looped only if
      the kernel takes part of it), with SIGINT/SIGTERM held off meanwhile.
      Once ``write`` returns, the line is in the kernel's page cache and
      survives the death of this process, SIGKILL included.
    * Power loss needs the disk: records are fdatasync'ed before the batch
      waits for the next job, and at the latest ``MAX_UNSYNCED_S`` after
      they were written (``--no-fsync`` turns this off). Creating OUT also
      syncs its directory, so the file itself survives.
    * A run killed in the middle of a write leaves a torn last line: one
      without its newline, or that does not parse. The next run truncates it
      away and runs that job again. A bad line *followed by* good ones was not
      written by a killed run; OUT is then refused rather than repaired.
    * An exclusive ``flock`` keeps two runs from appending to the same OUT.
    * A record whose status is ``infra`` (execpool failed, not the job) is
      run again by default: before anything runs, OUT is rewritten without
      those records -- a new file, locked, synced, then renamed over OUT, so
      at every moment each id is in OUT at most once -- and their jobs run
      like the ones never tried. ``--no-retry-infra`` keeps them.
    """

    def __init__(self, path: str, fsync: bool, retry_infra: bool = True,
                 key: Callable[[bytes], Tuple[Optional[str], Optional[str]]] = record_key,
                 what: str = "execpool batch") -> None:
        """``key`` reads a line of OUT as ``record_key`` does (``execpool
        eval``'s records are keyed by their sample's line); ``what`` names
        the command in messages."""
        self.path = path
        self.key = key
        self.what = what
        self.fsync = fsync
        self.retry_infra = retry_infra
        self.fd: Optional[int] = None
        # key -> the same key: the scan of the input reuses these strings, so
        # a resumed million-line batch holds each id once, not twice.
        self.done: dict[str, str] = {}
        # Keys of infra records to run again (and drop from OUT first).
        self.retried: set[str] = set()
        self.torn_bytes = 0
        self._good_size = 0
        self._dirty_since: Optional[float] = None
        self.written = 0
        if os.path.exists(path):
            self.fd = self._open(os.O_RDWR | os.O_APPEND)
            self._read_done()

    def _out(self) -> int:
        """OUT's descriptor: every use comes after it was opened."""
        if self.fd is None:
            raise RecordsError(f"{self.path} is not open")
        return self.fd

    def _open(self, flags: int) -> int:
        try:
            fd = os.open(self.path, flags | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise RecordsError(f"cannot open {self.path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RecordsError(f"{self.path} is being written by another {self.what}; "
                              "wait for it or pass another -o") from None
        return fd

    def _read_done(self) -> None:
        bad_line: Optional[int] = None
        with os.fdopen(os.dup(self._out()), "rb") as f:
            for number, raw in enumerate(f, 1):
                if bad_line is not None:
                    raise RecordsError(f"{self.path} line {bad_line} is not an {self.what} record, and "
                                      "more records follow it; fix or move the file, then run again")
                key, status = self.key(raw) if raw.endswith(b"\n") else (None, None)
                if key is None:
                    bad_line = number
                    continue
                if self.retry_infra and status == Status.INFRA.value:
                    self.retried.add(key)
                else:
                    self.done[key] = key
                self._good_size += len(raw)
        self.torn_bytes = os.fstat(self._out()).st_size - self._good_size

    def prepare(self) -> None:
        """Create OUT, or cut a torn last line off it: the first change made."""
        if self.fd is None:
            try:
                self.fd = self._open(os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL)
            except RecordsError:
                if os.path.exists(self.path):
                    raise RecordsError(f"{self.path} appeared while the input was being checked; "
                                      "run again") from None
                raise
            self._sync_directory()
        elif self.retried:
            self._rewrite_without_retried()
        elif self.torn_bytes:
            os.ftruncate(self.fd, self._good_size)
            os.fsync(self.fd)

    def _rewrite_without_retried(self) -> None:
        """OUT without the records to retry (and without a torn tail),
        replacing OUT in one rename. The new file is locked before it gets
        OUT's name, so no other run can append to it in between."""
        directory, name = os.path.split(os.path.abspath(self.path))
        tmp = os.path.join(directory, f".{name}.{os.getpid()}.retry")
        fd = os.open(tmp, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with os.fdopen(os.dup(self._out()), "rb") as old, os.fdopen(os.dup(fd), "wb") as new:
                old.seek(0)
                remaining = self._good_size
                while remaining > 0:
                    raw = old.readline(remaining)
                    remaining -= len(raw)
                    if self.key(raw)[0] not in self.retried:
                        new.write(raw)
                new.flush()
                os.fsync(new.fileno())
            os.rename(tmp, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(self._out())
        self.fd = fd
        self._sync_directory()

    def _sync_directory(self) -> None:
        if not self.fsync:
            return
        dir_fd = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._out(), view):]
        self.written += 1
        if self._dirty_since is None:
            self._dirty_since = time.monotonic()
        elif time.monotonic() - self._dirty_since > MAX_UNSYNCED_S:
            self.sync()

    def sync(self) -> None:
        if self._dirty_since is not None and self.fsync:
            os.fdatasync(self._out())
        self._dirty_since = None

    def close(self) -> None:
        if self.fd is not None:
            self.sync()
            os.close(self.fd)
            self.fd = None



class Stop(KeyboardInterrupt):
    """SIGINT or SIGTERM: a KeyboardInterrupt, so no ``except Exception``
    between the signal and the batch loop swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class StdoutResults:
    """``-o -``: records to stdout, as a pipe's reader wants them; no resume."""

    path = "-"
    done: dict = {}
    retried: frozenset = frozenset()
    torn_bytes = 0

    def __init__(self) -> None:
        self.written = 0

    def prepare(self) -> None:
        pass

    def write(self, data: bytes) -> None:
        try:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
        except BrokenPipeError:
            # The reader left (``| head``): stop as a shell pipeline would, and
            # point stdout at /dev/null so the exit flush stays quiet.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            raise Stop(signal.SIGPIPE) from None
        self.written += 1

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass

