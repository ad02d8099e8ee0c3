"""The compile cache: what a compile left for its run, by content,
bounded on disk and in memory, one compile at a time per program.

Runs in the caller (the pool's process), for CodeJobs (execpool/pool/code.py),
which claim a program's artifact, compile it when nobody has, settle the
cache with what the compile left -- the files its job brought back
(``fetch``), never read from a directory a job could change -- and read an
artifact back for a run's ``files``. The artifacts live under the pool's
scratch directory: a sandboxed job sees none of it, and each read is
checked against the hash taken when the compile was stored.

What is cached is what the program deserves: a success, or the compiler's
own verdict on the program. A compile that timed out, was cancelled, was
killed by a signal, met an execpool failure, or failed for want of space or
memory says nothing about the program, and is never kept -- a tenant
filling the disk once made a neighbour's correct program answer
"Compilation failed" from the cache for ten minutes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Callable, Dict, List, Optional, Tuple

from ..shared.files import FETCH_MAX_BYTES, FETCH_MAX_FILES, File, sizes
from ..shared.languages import MACHINE_FAILURE
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

#: What one compile may leave for its run, in bytes and in files: what a
#: job brings back of its directory (execpool/shared/files.py), and what
#: every run of it is given. A real program's build is far below both;
#: past them the compile fails, saying so.
ARTIFACT_MAX_BYTES = FETCH_MAX_BYTES
ARTIFACT_MAX_FILES = FETCH_MAX_FILES



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
        compiler's own failure -- not a timeout, a cancel, an INFRA, a
        compiler killed by a signal, or one that ran out of space or memory."""
        result = self.result
        killed = result.exit_code is not None and result.exit_code < 0
        machine = MACHINE_FAILURE.search(result.output) or MACHINE_FAILURE.search(result.stderr)
        return self.compiled or (result.status is Status.ERROR and not result.timed_out and not killed
                                 and not machine)

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
    trimmed = dataclasses.replace(result, output=output, stderr=stderr, files={}, files_left_out=(),
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

    def store(self, key: str, compiled: Result) -> Artifact:
        """What a successful compile brought back (``compiled.files``),
        written into a directory of its own in the cache with each file's
        hash and mode (made read-only), as an Artifact -- or, past
        ARTIFACT_MAX_BYTES or ARTIFACT_MAX_FILES, a failed compile saying so."""
        found = compiled.files
        size = sizes(found)
        if len(found) > ARTIFACT_MAX_FILES or size > ARTIFACT_MAX_BYTES or compiled.files_left_out:
            return self._too_big(compiled, len(found) + len(compiled.files_left_out), size,
                                 over=bool(compiled.files_left_out))
        target = tempfile.mkdtemp(prefix=f"{key[:16]}-", dir=self.root)
        files = []
        try:
            for path, file in sorted(found.items()):
                mode = file.mode & 0o555
                _write(os.path.join(target, path), file.data, mode)
                files.append((path, hashlib.sha256(file.data).hexdigest(), mode))
        except BaseException:
            self._remove(target)
            raise
        return kept(compiled, directory=target, files=tuple(files), size=size)

    @staticmethod
    def _too_big(compiled: Result, files: int, size: int, over: bool) -> Artifact:
        failed = dataclasses.replace(compiled, status=Status.ERROR, exit_code=None, error=(
            f"the compile left {files} files of {'over ' if over or size > ARTIFACT_MAX_BYTES else ''}"
            f"{min(size, ARTIFACT_MAX_BYTES)} bytes for the run; execpool keeps at most {ARTIFACT_MAX_FILES} "
            f"files and {ARTIFACT_MAX_BYTES} bytes"))
        return kept(failed)


def _write(path: str, data: bytes, mode: int) -> None:
    """A new file in the cache's own directory (its parents made)."""
    os.makedirs(os.path.dirname(path), 0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with open(fd, "wb") as f:
        f.write(data)
        os.fchmod(f.fileno(), mode)


def read_back(artifact: Artifact) -> Optional[Dict[str, File]]:
    """The artifact's files, for a run's ``files``, each checked against
    its hash; None if one is gone or changed (the caller compiles again)."""
    found: Dict[str, File] = {}
    for path, digest, mode in artifact.files:
        try:
            fd = os.open(os.path.join(artifact.directory or "", path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return None
        with open(fd, "rb") as f:
            data = f.read(ARTIFACT_MAX_BYTES + 1)
        if hashlib.sha256(data).hexdigest() != digest:
            return None
        found[path] = File(data, mode)
    return found
