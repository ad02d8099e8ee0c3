"""The compile cache: what a compile left for its run, by content,
bounded on disk and in memory, one compile at a time per program.

Runs in the caller (the pool's process), for CodeJobs (execpool/pool/code.py),
which claim a program's artifact, compile it when nobody has, settle the
cache with what the compile left, and copy an artifact into a run's
directory. The artifacts live under the pool's scratch directory: a
sandboxed job sees none of it, and each copy is checked against the hash
taken when the compile was stored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import os
import stat
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Callable, Dict, List, Optional, Tuple

from ..shared.result import Result, Status
from .future import JobFuture

#: A compile is kept with at most this much of its output (the Result
#: says how much there was), and the compiles kept take at most
#: MEMORY_MAX_BYTES of the pool's memory for their Results -- apart from
#: the artifacts' budget, which is disk.
KEPT_OUTPUT_CHARS = 32 * 1024
MEMORY_MAX_BYTES = 32 << 20

#: A failed compile, confirmed, is served from the cache this long; then
#: the program is compiled again (the failure may have been the machine's
#: twice over).
FAILURE_KEPT_S = 600.0

#: What one compile may leave for its run, in bytes (a sparse file counts
#: whole: every run gets a full copy) and in files -- whatever the cache
#: keeps. A real program's build is far below both; past them the compile
#: fails, saying so, rather than filling the disk a copy per run.
ARTIFACT_MAX_BYTES = 256 << 20
ARTIFACT_MAX_FILES = 1_000


@dataclasses.dataclass(frozen=True)
class CompileCacheStats:
    """``ExecPool.compile_cache``: jobs whose program was compiled (or was
    compiling) already, jobs that compiled it, and the seconds compiles took."""

    hits: int
    misses: int
    compile_seconds: float


@dataclasses.dataclass(frozen=True)
class Artifact:
    """One compile as the cache keeps it: its Result, and for a successful
    one the files the run gets -- (relative path, sha256, mode) -- under
    ``directory``."""

    result: Result
    directory: Optional[str] = None
    files: Tuple[Tuple[str, str, int], ...] = ()
    #: Bytes of its files on disk.
    size: int = 0
    #: Bytes its Result takes in memory (a str up to 4 bytes a character).
    memory: int = 0
    #: A failed compile is served from the cache only once a second
    #: compile failed the same way: a first failure may be the machine's
    #: (a disk another job filled, an out-of-memory kill), not the program's.
    confirmed: bool = False
    #: When it was kept (time.monotonic()): a confirmed failure expires.
    kept_at: float = 0.0

    @property
    def compiled(self) -> bool:
        return self.result.status is Status.OK

    @property
    def definitive(self) -> bool:
        """Whether it may say something about the program: success, or the
        compiler's own failure -- not a timeout, a cancel, an INFRA or a
        compiler killed by a signal."""
        result = self.result
        killed = result.exit_code is not None and result.exit_code < 0
        return self.compiled or (result.status is Status.ERROR and not result.timed_out and not killed)

    def served(self, now: float) -> bool:
        """Whether a job takes it from the cache without compiling."""
        return self.compiled or (self.confirmed and now < self.kept_at + FAILURE_KEPT_S)

    def same_failure(self, other: "Artifact") -> bool:
        a, b = self.result, other.result
        return (not self.compiled and not other.compiled and a.exit_code == b.exit_code
                and (a.output, a.stderr, a.error) == (b.output, b.stderr, b.error))


def kept(result: Result, **artifact: object) -> Artifact:
    """A compile as the cache keeps it: the head of its output, and the
    memory that takes."""
    output, stderr = result.output[:KEPT_OUTPUT_CHARS], result.stderr[:KEPT_OUTPUT_CHARS]
    trimmed = dataclasses.replace(result, output=output, stderr=stderr,
                                  output_chars=max(result.output_chars, len(result.output)),
                                  stderr_chars=max(result.stderr_chars, len(result.stderr)))
    memory = 4 * (len(output) + len(stderr) + len(result.error or "")) + 1024
    return Artifact(trimmed, memory=memory, **artifact)  # type: ignore[arg-type]


@dataclasses.dataclass
class _Pending:
    """A compile under way: the jobs waiting for it, its step, and whether
    the job that started it has left (cancelled) -- then the compile lives
    only as long as a waiter does."""

    future: "Future[Artifact]"
    waiters: int = 0
    step: Optional[JobFuture] = None
    owner_left: bool = False


class CompileCache:
    """Artifacts by key, bounded in bytes, least recently used first out;
    one compile at a time per key, the others waiting for it."""

    def __init__(self, root: str, max_bytes: int, remove: Callable[[Optional[str]], None]) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._remove = remove
        self._lock = threading.Lock()
        self._entries: "OrderedDict[str, Artifact]" = OrderedDict()
        self._pending: Dict[str, _Pending] = {}
        # Compiled programs too big to keep: their directories, and how many
        # jobs are still to copy them (the compile's own and its waiters).
        self._transient: Dict[str, int] = {}
        self._bytes = 0  # of the compiled programs' files, on disk
        self._memory = 0  # of the compiles' Results, in memory
        self.hits = 0
        self.misses = 0
        self.compile_seconds = 0.0

    def claim(self, key: str) -> Tuple[Optional[Artifact], Optional["Future[Artifact]"]]:
        """The cached artifact; else the future of the compile under way
        for ``key``; else (None, None): the caller compiles and settles."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.served(time.monotonic()):
                self._entries.move_to_end(key)
                self.hits += 1
                return entry, None
            pending = self._pending.get(key)
            if pending is not None:
                pending.waiters += 1
                self.hits += 1
                return None, pending.future
            self._pending[key] = _Pending(Future())
            self.misses += 1
            return None, None

    def waiters(self) -> int:
        """Jobs waiting for a compile another job started."""
        with self._lock:
            return sum(pending.waiters for pending in self._pending.values())

    def compiling(self, key: str, step: JobFuture) -> None:
        """The step that compiles ``key``."""
        with self._lock:
            pending = self._pending.get(key)
            if pending is not None:
                pending.step = step

    def owner_leaves(self, key: str) -> bool:
        """The job that started the compile of ``key`` was cancelled: True
        if others wait for it (it goes on for them, and ends with the last
        of them), False if none does (the caller cancels it)."""
        with self._lock:
            pending = self._pending.get(key)
            if pending is None or not pending.waiters:
                return False
            pending.owner_left = True
            return True

    def leave(self, key: str, compile: "Future[Artifact]") -> bool:
        """A waiter no longer waits for ``compile`` (it was cancelled, or
        its own compile_timeout came): whether it was still counted (not
        once the compile settled). The last one out of a compile its owner
        left cancels it."""
        with self._lock:
            pending = self._pending.get(key)
            if pending is None or pending.future is not compile or not pending.waiters:
                return False
            pending.waiters -= 1
            orphan = pending.step if pending.owner_left and not pending.waiters else None
        if orphan is not None:
            orphan.cancel()
        return True

    def settle(self, key: str, artifact: Artifact) -> None:
        """The compile of ``key`` is done: keep it if it is definitive,
        evict what no longer fits, wake the waiters."""
        evicted: List[Artifact] = []
        with self._lock:
            pending = self._pending.pop(key, None)
            if pending is None:
                return  # settled already: the pool closed while it compiled
            self.compile_seconds += artifact.result.duration_s
            if artifact.definitive and artifact.size <= self.max_bytes and artifact.memory <= self._memory_bound:
                earlier = self._entries.pop(key, None)
                if earlier is not None:
                    self._forget(earlier)
                    evicted.append(earlier)
                confirmed = earlier is not None and artifact.same_failure(earlier) and not earlier.confirmed
                artifact = dataclasses.replace(artifact, confirmed=confirmed, kept_at=time.monotonic())
                self._entries[key] = artifact
                self._bytes += artifact.size
                self._memory += artifact.memory
                evicted += self._evict()
            elif artifact.directory is not None:
                self._transient[artifact.directory] = 1 + pending.waiters
        for old in evicted:
            self._remove(old.directory)
        pending.future.set_result(artifact)

    @property
    def _memory_bound(self) -> int:
        return min(self.max_bytes, MEMORY_MAX_BYTES)

    def settle_all(self, artifact: Artifact) -> None:
        """Every compile still pending ends with ``artifact`` (the pool closed)."""
        with self._lock:
            keys = list(self._pending)
        for key in keys:
            self.settle(key, artifact)

    def _forget(self, artifact: Artifact) -> None:
        """(Under the lock.) Its bytes are no longer the cache's."""
        self._bytes -= artifact.size
        self._memory -= artifact.memory

    def _evict(self) -> List[Artifact]:
        """(Under the lock.) The least recently used first, while the files
        are over the disk budget (only an entry with files helps) or the
        Results over the memory budget (any entry helps)."""
        evicted = []
        for key in list(self._entries):
            disk_over, memory_over = self._bytes > self.max_bytes, self._memory > self._memory_bound
            if not (disk_over or memory_over):
                break
            old = self._entries[key]
            if memory_over or old.size:
                del self._entries[key]
                self._forget(old)
                evicted.append(old)
        return evicted

    def release(self, artifact: Artifact) -> None:
        """A job is done with ``artifact`` (copied it, or gave up): one not
        kept goes with the last of its jobs."""
        with self._lock:
            left = self._transient.get(artifact.directory or "")
            if left is None:
                return
            if left > 1:
                self._transient[artifact.directory or ""] = left - 1
                return
            del self._transient[artifact.directory or ""]
        self._remove(artifact.directory)

    def drop(self, key: str, artifact: Artifact) -> None:
        """Forget ``artifact`` (its files went or changed): the next job
        with its program compiles again."""
        with self._lock:
            if self._entries.get(key) is artifact:
                del self._entries[key]
                self._forget(artifact)
            else:
                return
        self._remove(artifact.directory)

    def store(self, key: str, compiled: Result, directory: str, patterns: Tuple[str, ...]) -> Artifact:
        """What a successful compile left in ``directory`` that ``patterns``
        match, copied into a directory of its own in the cache with each
        file's hash and mode (made read-only), as an Artifact -- or, past
        ARTIFACT_MAX_BYTES or ARTIFACT_MAX_FILES, a failed compile saying so."""
        found = matches(directory, patterns)
        size = 0
        listed = self.listed(directory, found)
        if len(found) > ARTIFACT_MAX_FILES or listed > ARTIFACT_MAX_BYTES:
            return self._too_big(compiled, len(found), listed)
        target = tempfile.mkdtemp(prefix=f"{key[:16]}-", dir=self.root)
        files = []
        try:
            for path in found:
                source = os.path.join(directory, path)
                mode = stat.S_IMODE(os.lstat(source).st_mode) & 0o555
                # What is copied counts, not what was listed: a file may
                # have grown since (a process the compile left, where no
                # cgroup ended them all with it).
                digest, copied = _copy(source, os.path.join(target, path), mode, ARTIFACT_MAX_BYTES - size)
                size += copied
                files.append((path, digest, mode))
        except _TooBig:
            self._remove(target)
            return self._too_big(compiled, len(found), ARTIFACT_MAX_BYTES + 1)
        except BaseException:
            self._remove(target)
            raise
        return kept(compiled, directory=target, files=tuple(files), size=size)

    @staticmethod
    def listed(directory: str, found: List[str]) -> int:
        """The bytes of what a compile left, as listed (its copy may differ)."""
        return sum(os.lstat(os.path.join(directory, path)).st_size for path in found)

    @staticmethod
    def _too_big(compiled: Result, files: int, size: int) -> Artifact:
        failed = dataclasses.replace(compiled, status=Status.ERROR, exit_code=None, error=(
            f"the compile left {files} files of {'over ' if size > ARTIFACT_MAX_BYTES else ''}"
            f"{min(size, ARTIFACT_MAX_BYTES)} bytes for the run; execpool keeps at most {ARTIFACT_MAX_FILES} "
            f"files and {ARTIFACT_MAX_BYTES} bytes"))
        return kept(failed)


def matches(directory: str, patterns: Tuple[str, ...]) -> List[str]:
    """The regular files (no symlinks) in ``directory`` that ``patterns``
    match, relative to it."""
    found = []
    for pattern in patterns:
        for path in glob.glob(pattern, root_dir=directory):
            if stat.S_ISREG(os.lstat(os.path.join(directory, path)).st_mode):
                found.append(path)
    return sorted(set(found))


class _TooBig(Exception):
    """A copy went past the bytes it was allowed."""


def _copy(source: str, target: str, mode: int, budget: Optional[int] = None) -> Tuple[str, int]:
    """Copy the regular file ``source`` to a new file ``target`` with
    ``mode``; its sha256 and size, ``_TooBig`` past ``budget`` bytes. What a
    compile left may have been swapped since it was listed (a job's stray):
    a link is not followed, and a FIFO or device is refused rather than read."""
    digest = hashlib.sha256()
    copied = 0
    fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb") as reader:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{source} is not a regular file")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with open(os.open(target, flags, mode | 0o200), "wb") as writer:
            while chunk := reader.read(1 << 20):
                copied += len(chunk)
                if budget is not None and copied > budget:
                    raise _TooBig
                digest.update(chunk)
                writer.write(chunk)
    os.chmod(target, mode)
    return digest.hexdigest(), copied


def materialize(artifact: Artifact, directory: str) -> bool:
    """Copy the artifact's files into a run's directory, each checked
    against its hash; False if one is gone or changed."""
    for path, digest, mode in artifact.files:
        target = os.path.join(directory, path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)  # the compiled file replaces one of the same name the job brought
        try:
            if _copy(os.path.join(artifact.directory or "", path), target, mode | 0o200)[0] != digest:
                return False
        except OSError:
            return False
    return True
