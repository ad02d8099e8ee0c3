"""CodeJobs: a program in a language of the table, compiled once, then run.

Runs in the caller (the pool's process). ``ExecPool.submit`` hands each
CodeJob (execpool/shared/jobs.py) to :class:`CodeJobs`, which makes it two
ordinary jobs of the same pool -- a ShellJob that compiles, a ShellJob (or
PythonJob) that runs -- each in a directory of its own that its worker
makes::

    submit(CodeJob) -> JobFuture ............................ Result (+ compile_result)
      |  executor: probe the toolchain (a failed hello-world in the pool's
      |            sandbox, execpool/pool/toolchains.py: INFRA at once), key =
      |            sha256(language, toolchain version, compile argv, source, files)
      |-- cache hit ----------------------------------------.
      |-- compiling already (same key): wait for that one --+
      |-- miss: submit the compile, the program as its -----+--> its fetched outputs into the cache
      |         ``files``, the language's outputs ``fetch``-ed
      v                                                     v
      executor: the artifact read back (hash checked)
      submit the run, program and artifact as its ``files`` -> its Result,
      with the compile's, on the JobFuture

A tool installed outside the system's directories (rustup's, nvm's) runs
by its absolute path in its install root (``Toolchain.commands``), which
each step's sandbox shows read-only (``Toolchain.roots``, as the step's
``Sandbox.read``) and whose ``bin`` is first on the step's PATH.

The pool never touches a job's directory: a program goes in as its job's
``files`` and what a compile left comes back as its ``fetch``, both by the
job's worker, by descriptor (execpool/worker/files.py). Done here, by path,
a ``chmod`` after a copy set a host file to 0755 for a tenant that swapped
the copy for a link. A run given a ``cwd`` of the caller's gets the
program's files there for its run: a file of the caller's of the same name
is set aside meanwhile and put back after, and nothing of the program's
stays.

No thread waits for a job: the steps chain through their futures' done
callbacks, and the file work between them (storing an artifact, reading it
back, removing an evicted one) goes to one small executor, so the
dispatcher thread (or a server's loop) never waits on a disk.

The compile cache (execpool/pool/compile_cache.py) keeps what a
successful compile left (the language's ``outputs``) and a failed
compile's Result, by content, bounded in bytes (least recently used go
first), under the pool's scratch directory: a sandboxed job sees none of
it, and every read is checked against the hash taken when it was stored,
so nothing a job does reaches an artifact another job will run. A compile
that timed out, was cancelled, met an execpool failure or ran out of space
or memory is not kept: it says nothing about the program.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Dict, List, Mapping, Optional, Tuple, Union

from ..shared import languages
from ..shared.files import File, sizes
from ..shared.jobs import CodeJob, Limits, PythonJob, ShellJob
from ..shared.kernel.dirs import remove_tree
from ..shared.kernel.sandbox import Sandbox, job_sandbox
from ..shared.languages import Language, Toolchain
from ..shared.result import Result, Status
from .compile_cache import Artifact, CompileCache, kept, read_back
from .deadlines import Deadlines
from .future import JobFuture, OnEvent
from .toolchains import Checks, command, known, program_files

if TYPE_CHECKING:
    from ..supervisor import ExecPool
    from .workspaces import Workspace

logger = logging.getLogger("execpool")

#: Threads doing the file work of CodeJobs: small artifacts stored and
#: read back, never a wait for a job; and, apart, the threads storing and
#: reading large ones, so that a job whose program is small never waits
#: behind another's tens of megabytes.
FILE_THREADS = 2
BULK_THREADS = 2
#: An artifact from this size up is stored and read on the bulk threads.
BULK_BYTES = 8 << 20

#: How many processes a compile may have at once: besides bounding a
#: compiler that forks without end, it gives the compile a cgroup where
#: the machine has one, so that nothing the compile started (a build
#: tool's daemon, an annotation processor's stray) outlives it to change
#: what it left after the cache has looked.
COMPILE_MAX_PROCESSES = 512

#: Times a run is tried again from the cache when its artifact went (evicted
#: while being copied) or no longer matches its hash.
_RETRIES = 1

class CodeJobs:
    """The pool's CodeJobs: its compile cache, the executor for their file
    work, and the toolchains' versions on the tools' PATH."""

    def __init__(self, pool: "ExecPool", root: str, cache_bytes: int) -> None:
        self._pool = pool
        self.path = languages.toolchains_path(pool.env)
        self._python = pool.config.python or languages.PYTHON
        self.cache = CompileCache(os.path.join(root, "compiled"), cache_bytes, self.remove_later)
        os.mkdir(self.cache.root, 0o700)
        self._executor = ThreadPoolExecutor(FILE_THREADS, thread_name_prefix="execpool-code")
        self._bulk = ThreadPoolExecutor(BULK_THREADS, thread_name_prefix="execpool-code-bulk")
        self.deadlines = Deadlines()
        # Evicted artifacts go on a thread of their own: the steps of every
        # other job must not wait behind a removal.
        self._remover = ThreadPoolExecutor(1, thread_name_prefix="execpool-code-remove")
        self.checks = Checks(self)

    @property
    def closing(self) -> bool:
        """The pool is closing or closed: what is still to do for it is not
        worth starting (a toolchain's probe, seconds for a JVM's)."""
        return self._pool.closed

    def language(self, name: str) -> languages.Language:
        """The row of ``name`` as this pool runs it: Python is its own."""
        return languages.with_python(languages.get(name), self._python)

    def toolchain(self, language: languages.Language) -> languages.Toolchain:
        return languages.probe(language, self.path)

    def languages(self, wait: bool = False) -> List[languages.Toolchain]:
        """Every row as this pool's checks know it now (execpool/pool/toolchains.py),
        starting them where none is under way; ``wait``: once they are done."""
        self.checks.start()
        if wait:
            self.checks.wait()
        return self.checks.rows()

    def check_key(self, row: Language, toolchain: Toolchain) -> tuple:
        """What a hello-world's outcome depends on: the row as this pool
        runs it, its toolchain (version, commands, install roots), the
        tools' PATH, and the pool's sandbox and limits."""
        config = self._pool.config
        return row, toolchain, self.path, repr(config.sandbox), repr(config.limits)

    @staticmethod
    def placed(language: Language, toolchain: Toolchain) -> Language:
        """``language`` with its tools by the paths they are run by (a tool
        installed outside the system's directories, by its install root's)."""
        if not toolchain.commands:
            return language
        return dataclasses.replace(language, run=toolchain.placed(language.run),
                                   compile=None if language.compile is None else toolchain.placed(language.compile))

    def sandbox_for(self, sandbox: Union[None, bool, str, Sandbox], toolchain: Toolchain,
                    workspace: Optional["Workspace"] = None) -> Union[None, bool, str, Sandbox]:
        """A step's sandbox: the job's (``sandbox``; its workspace's, or the
        pool's, for None), showing the toolchain's install roots read-only
        -- only those: nothing else of a home they sit in."""
        if not toolchain.roots:
            return sandbox
        box = workspace.sandbox_for(sandbox) if workspace is not None else job_sandbox(sandbox)
        if box is None:
            box = self._pool.config.sandbox
        if not isinstance(box, Sandbox):
            return sandbox  # no sandbox: the job sees the roots where they are
        return dataclasses.replace(box, read=tuple(dict.fromkeys((*box.read, *toolchain.roots))))

    def env_for(self, env: Optional[Mapping[str, str]], toolchain: Toolchain) -> Optional[Dict[str, str]]:
        """A step's environment: the job's, with the toolchain's install
        roots' ``bin`` first on PATH (what a tool runs by name)."""
        if not toolchain.bins:
            return None if env is None else dict(env)
        found = dict(env or {})
        found["PATH"] = os.pathsep.join((*toolchain.bins, found.get("PATH") or self.path))
        return found

    def submit(self, job: CodeJob, future: JobFuture, on_event: Optional[OnEvent],
               workspace: Optional["Workspace"] = None) -> None:
        """Start ``job``; its run (not its compile, which is the program's)
        in ``workspace`` where given."""
        run = _CodeRun(self, job, future, on_event, workspace)
        future._cancel = run.cancel
        self.later(run, run.begin)

    def later(self, run: "_CodeRun", step: Callable[..., None], *args: object, bulk: bool = False) -> None:
        """``step`` on the executor (the bulk one for large copies); a pool
        closing under the job ends it."""
        try:
            (self._bulk if bulk else self._executor).submit(run.guarded, step, *args)
        except RuntimeError:
            run.abandon()

    def compile_limits(self) -> Limits:
        """The pool's limits, with a process cap: a cgroup for the compile."""
        limits = self._pool.config.limits
        if limits.processes is not None:
            return limits
        return dataclasses.replace(limits, processes=COMPILE_MAX_PROCESSES)

    def sandbox_of(self, job: CodeJob) -> str:
        """The sandbox a job's steps run in, as its cache key holds it."""
        return repr(self._pool.config.sandbox if job.sandbox is None else job.sandbox)

    def submit_step(self, job: ShellJob | PythonJob, on_event: Optional[OnEvent] = None,
                    workspace: Optional["Workspace"] = None) -> JobFuture:
        if workspace is not None:
            return workspace.submit(job, on_event=on_event)
        return self._pool.submit(job, on_event=on_event)

    def remove_later(self, directory: Optional[str]) -> None:
        if directory is None:
            return
        try:
            self._remover.submit(_remove, directory)
        except RuntimeError:
            pass  # closing: the pool's scratch directory goes with it, this one inside

    def close(self) -> None:
        """After the pool's workers, and every Result they owed: the steps
        still queued run, find the pool closed, and end their jobs INFRA --
        none is dropped, and a compile still pending (its step's Result
        will never come) is settled INFRA for those waiting for it.
        Removals not begun are left to the pool's own, of its scratch
        directory."""
        self.deadlines.close()
        self.checks.close()
        self._executor.shutdown(wait=True)
        self._bulk.shutdown(wait=True)
        self.cache.settle_all(Artifact(Result(status=Status.INFRA, error="the pool was closed")))
        self._remover.shutdown(wait=True, cancel_futures=True)


class _Phase(enum.Enum):
    STARTING = "starting"
    WAITING = "waiting"  # for a compile another job started
    COMPILING = "compiling"
    RUNNING = "running"


class _CodeRun:
    """One CodeJob on its way: its phase, the step under way, its outer
    future. Steps run on the executor, one at a time; ``cancel`` comes from
    any thread."""

    def __init__(self, jobs: CodeJobs, job: CodeJob, future: JobFuture, on_event: Optional[OnEvent],
                 workspace: Optional["Workspace"]) -> None:
        self.jobs = jobs
        self.job = job
        self.workspace = workspace
        # The row as this pool runs it; its toolchain is asked of the row
        # itself, never of a program's variant (one probe per language).
        self.row = jobs.language(job.language)
        self.language = self.row.for_program(job.code)
        self.toolchain: Optional[languages.Toolchain] = None
        self.future = future
        self.on_event = on_event
        self._lock = threading.Lock()
        self._phase = _Phase.STARTING
        self._step: Optional[JobFuture] = None
        self._key: Optional[str] = None
        self._cancelled = False
        self._finished = False
        # The compile another job started that this one waits for, and
        # whether it left it (cancelled, or its own compile_timeout came)
        # while it was still counted among its waiters.
        self._waiting_for: Optional["Future[Artifact]"] = None
        self._left = False
        self._deadline: Optional[object] = None
        self._recompiled = False

    # -- steps (on the executor) ----------------------------------------------

    def guarded(self, step: Callable[..., None], *args: object) -> None:
        """A step that fails is the job's INFRA, never a lost future."""
        try:
            step(*args)
        except Exception as exc:
            logger.error("execpool: a %s CodeJob's step failed", self.language.name, exc_info=exc)
            self.finish(Result(status=Status.INFRA, error=f"the {self.language.name} job failed: {exc}"))

    def begin(self, retries: int = _RETRIES) -> None:
        if self.future.done():
            return
        toolchain = self.jobs.toolchain(self.row)
        if toolchain.runs and self.job.sandbox is None:
            # In the pool's sandbox, as its hello-world was: a failed one
            # is this job's answer, at once.
            toolchain = known(self.jobs.check_key(self.row, toolchain)) or toolchain
        if not toolchain.runs:
            self.finish(Result(status=Status.INFRA,
                               error=f"language {self.language.name!r} does not run here: {toolchain.why_not}"))
            return
        self.toolchain = toolchain
        self.language = self.jobs.placed(self.language, toolchain)
        if not self.language.compiles:
            self.run(None, False, retries)
            return
        key = self._cache_key(toolchain, self.jobs.sandbox_of(self.job))
        artifact, pending = self.jobs.cache.claim(key)
        if artifact is not None:
            self.jobs.later(self, self.compiled, key, artifact, True, retries, bulk=artifact.size >= BULK_BYTES)
        elif pending is not None:
            with self._lock:
                self._phase, self._key, self._step, self._waiting_for = _Phase.WAITING, key, None, pending
                cancelled = self._cancelled
            if cancelled:  # before it was counted as waiting: it leaves now
                self._leave_wait(key, pending)
                return
            self._deadline = self.jobs.deadlines.add(self.job.compile_timeout,
                                                     lambda: self._waited_too_long(key, pending))
            pending.add_done_callback(lambda done: self.jobs.later(self, self._waited, key, done, retries,
                                                                   bulk=done.result().size >= BULK_BYTES))
        else:
            self.compile(key, retries)

    def compile(self, key: str, retries: int) -> None:
        """Compile for the cache -- even for a job cancelled meanwhile:
        others may be waiting for this compile (``cancel`` kills it only
        when none is)."""
        self._enter(_Phase.COMPILING, key)
        try:
            toolchain = self.toolchain
            assert toolchain is not None  # begin found it
            command_job = ShellJob(command(self.language.compile), timeout=self.job.compile_timeout,
                                   files=self._program(), fetch=self.language.outputs, network=self.job.network,
                                   separate_stderr=True, sandbox=self.jobs.sandbox_for(self.job.sandbox, toolchain),
                                   env=self.jobs.env_for(None, toolchain), limits=self.jobs.compile_limits())
            step = self.jobs.submit_step(command_job)
        except BaseException as exc:
            failed = Result(status=Status.INFRA, error=f"the compile did not start: {exc}")
            self.jobs.cache.settle(key, Artifact(failed))
            raise
        self.jobs.cache.compiling(key, step)
        self._started(step)
        step.add_done_callback(lambda done: self.jobs.later(self, self._stored, key, done, retries))

    def _stored(self, key: str, done: "Future[Result]", retries: int, bulk: bool = False) -> None:
        """The compile ended: what it brought back goes into the cache (on
        the bulk threads when it is large), and the job runs."""
        compiled = done.result()
        if compiled.status is Status.OK and not bulk and sizes(compiled.files) >= BULK_BYTES:
            self.jobs.later(self, self._stored, key, done, retries, True, bulk=True)
            return
        artifact = Artifact(Result(status=Status.INFRA, error="the compiled program could not be kept"))
        try:
            artifact = self.jobs.cache.store(key, compiled) if compiled.status is Status.OK else kept(compiled)
        finally:
            self.jobs.cache.settle(key, artifact)
        self.compiled(key, artifact, False, retries)

    def _waited(self, key: str, done: "Future[Artifact]", retries: int) -> None:
        self.jobs.deadlines.cancel(self._deadline)
        with self._lock:
            if self._left:
                return  # it left the wait (its result is out), and was not counted for this artifact
            self._waiting_for = None
        artifact = done.result()
        result = artifact.result
        if result.status is Status.CANCELLED or (result.timed_out and self.job.compile_timeout > (result.timeout or 0)):
            # Cancelled, or timed out in a shorter compile_timeout than this
            # job's: never another's outcome. This job compiles (or waits) anew.
            self.begin(retries)
            return
        if result.status is Status.ERROR and not artifact.confirmed and not self._recompiled:
            # A first failure, which may be the machine's: the waiters
            # compile once more (one of them, the others wait for it).
            self._recompiled = True
            self.begin(retries)
            return
        if result.timed_out:  # within this job's own compile_timeout too: said as its own
            artifact = dataclasses.replace(artifact, result=dataclasses.replace(result,
                                                                                timeout=self.job.compile_timeout))
        self.compiled(key, artifact, True, retries)

    def _waited_too_long(self, key: str, compile: "Future[Artifact]") -> None:
        """This job's own compile_timeout came while it waited for another's
        compile: it ends as its own compile would have, timed out; the
        compile goes on for the others."""
        if not self._leave_wait(key, compile):
            return
        timeout = self.job.compile_timeout
        timed_out = Result(status=Status.TIMEOUT, timed_out=True, timeout=timeout, duration_s=timeout)
        self.finish(dataclasses.replace(timed_out, compile_result=timed_out, compile_cached=True))

    def compiled(self, key: str, artifact: Artifact, cached: bool, retries: int) -> None:
        if not artifact.compiled:
            self.finish(dataclasses.replace(artifact.result, compile_result=artifact.result, compile_cached=cached))
            return
        self.run((key, artifact), cached, retries)

    def run(self, compiled: Optional[Tuple[str, Artifact]], cached: bool, retries: int) -> None:
        artifact = None if compiled is None else compiled[1]
        try:
            if self.future.done():
                return
            self._enter(_Phase.RUNNING, None)
            built = {} if artifact is None else read_back(artifact)
            if built is not None:
                step = self.jobs.submit_step(self._run_job({**self._program(), **built}), self.on_event,
                                             self.workspace)
        finally:
            if artifact is not None and not self._left:
                self.jobs.cache.release(artifact)
        if built is None:
            self.jobs.cache.drop(*compiled)  # type: ignore[misc]
            if retries > 0:
                self.begin(retries - 1)
            else:
                self.finish(Result(status=Status.INFRA, error="the compiled program went missing from the cache"))
            return
        self._started(step)
        compile_result = None if compiled is None else compiled[1].result
        step.add_done_callback(lambda done: self.jobs.later(self, self._ran, done, compile_result, cached))

    def _ran(self, done: "Future[Result]", compile_result: Optional[Result], cached: bool) -> None:
        self.finish(dataclasses.replace(done.result(), compile_result=compile_result,
                                        compile_cached=cached and compile_result is not None))

    # -- the outer future -----------------------------------------------------

    def cancel(self) -> None:
        """Kill the step under way, and the job ends with its CANCELLED
        Result; a job waiting for another's compile, or whose compile others
        wait for, ends CANCELLED at once (the compile goes on for them)."""
        with self._lock:
            self._cancelled = True
            phase, step, key = self._phase, self._step, self._key
        if phase is _Phase.WAITING and key is not None:
            waiting_for = self._waiting_for
            if waiting_for is not None:
                self._leave_wait(key, waiting_for)
        elif step is not None and not (phase is _Phase.COMPILING and key is not None
                                       and self.jobs.cache.owner_leaves(key)):
            step.cancel()
            return
        self.finish(Result(status=Status.CANCELLED, cancelled=True, timeout=self.job.timeout))

    def _leave_wait(self, key: str, compile: "Future[Artifact]") -> bool:
        """Stop waiting for ``compile`` (cancelled, or its own deadline
        came), once whichever comes first: whether it left while still
        counted among its waiters."""
        with self._lock:
            if self._left or self._waiting_for is not compile:
                return False
            self._left = self.jobs.cache.leave(key, compile)
            left = self._left
        self.jobs.deadlines.cancel(self._deadline)
        return left

    def abandon(self) -> None:
        """The pool closed before this job's next step could be taken: it
        ends INFRA, and a compile it was storing for others is settled so
        that they end too."""
        self.finish(Result(status=Status.INFRA, error="the pool was closed"))
        with self._lock:
            phase, key = self._phase, self._key
        if phase is _Phase.COMPILING and key is not None:
            self.jobs.cache.settle(key, Artifact(Result(status=Status.INFRA, error="the pool was closed")))

    def finish(self, result: Result) -> None:
        """The job's Result, once: a cancel and a step's end may race. The
        future's callbacks run outside the lock (one may cancel or submit)."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
        self.future.set_result(result)

    def _enter(self, phase: _Phase, key: Optional[str]) -> None:
        with self._lock:
            self._phase, self._key, self._step = phase, key, None

    def _started(self, step: JobFuture) -> None:
        """The step under way; one the job was cancelled before it started
        is cancelled now."""
        with self._lock:
            self._step = step
            cancelled = self._cancelled
        if cancelled:
            self.cancel()

    # -- the program ----------------------------------------------------------

    def _cache_key(self, toolchain: languages.Toolchain, sandbox: str) -> str:
        """What a compile depends on: the language, its toolchain's version,
        the compile command, the network and the sandbox it had (what it
        could read it may have put in what it left), the program and every
        file beside it."""
        digest = hashlib.sha256()
        for part in (self.language.name, toolchain.version or "", "\0".join(self.language.compile or ()),
                     self.language.prologue, str(self.job.network), sandbox, self.job.code):
            digest.update(part.encode("utf-8") + b"\0\1")
        for path, file in sorted((self.job.files or {}).items()):
            assert isinstance(file, File)  # the job spec made them Files
            digest.update(path.encode("utf-8") + b"\0" + hashlib.sha256(file.data).digest() + b"%o" % file.mode)
        return digest.hexdigest()

    def _program(self) -> Dict[str, File]:
        """The program's files: the job's own, its source, the language's
        support files."""
        return program_files(self.language, self.job.code, self.job.files or {})  # type: ignore[arg-type]

    def _run_job(self, files: Dict[str, File]) -> ShellJob | PythonJob:
        job, toolchain = self.job, self.toolchain
        assert toolchain is not None  # begin found it
        common = dict(timeout=job.timeout, cwd=job.cwd, env=self.jobs.env_for(job.env, toolchain), limits=job.limits,
                      keep_background=job.keep_background, max_output_chars=job.max_output_chars, stdin=job.stdin,
                      network=job.network, separate_stderr=job.separate_stderr,
                      sandbox=self.jobs.sandbox_for(job.sandbox, toolchain, self.workspace), files=files,
                      fetch=job.fetch)
        if self.language.name == "python" and not job.args:
            return PythonJob(job.code, warm=job.warm, **common)  # type: ignore[arg-type]
        return ShellJob(command(self.language.run + tuple(job.args)), **common)  # type: ignore[arg-type]


def _remove(directory: Optional[str]) -> None:
    """An evicted artifact's directory, the cache's own."""
    if directory is not None:
        remove_tree(directory)
