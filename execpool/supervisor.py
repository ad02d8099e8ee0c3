"""The pool, as the caller's process runs it: ``ExecPool``.

::

    caller threads / asyncio tasks                  execpool's threads in this process
    ------------------------------                  -----------------------------------
    pool.submit(job, on_event, cancel_event)         dispatcher (execpool/pool/dispatch.py):
      -> Workers.assign: least-loaded worker  --->     worker messages -> the job's handle:
         Start sent; a JobFuture returned              on_event(JobOutput), then the future's
    run / stream / astream / map / CLI / service        Result
      are all built on submit                        cleanup (execpool/pool/workers.py), one per
    future.cancel() / cancel_event -> Cancel            dead worker: kill its trees, fail
                                                       only its jobs (INFRA), replace it
                                                     cancel watcher (execpool/pool/future.py):
                                                       cancel_events -> Cancels, while any

Who runs this: the caller's process -- typically a large, multithreaded
server. What it owns: a ``PoolConfig`` (execpool/pool/config.py), the worker
processes (execpool/pool/workers.py; each one an execpool/worker/event_loop.py process
running many tools at once), the one dispatcher thread that routes their
messages, and the pool's lifeline (execpool/lifeline/process.py). The caller's thread
count does not grow with the number of concurrent jobs.

``submit`` is the one entry point: it validates the job, sends it to the
least-loaded worker and returns a ``JobFuture`` (execpool/pool/future.py).
Everything above it -- ``run``, ``stream`` and ``astream`` (execpool/drain.py),
``map`` and ``imap_unordered`` (execpool/pool/mapping.py), the tool layer, the CLI,
the service -- is a client of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

from .pool.budget import DiskBudget, reserved
from .pool.code import CodeJobs
from .pool.compile_cache import CompileCacheStats
from .pool.config import PoolConfig
from .pool.dispatch import Dispatcher
from .pool.future import CancelWatcher, JobFuture, JobHandle, OnEvent
from .pool.runner import JobRunner
from .pool.sessions import DEFAULT_IDLE_TIMEOUT_S, Session, open_session
from .pool.stats import PoolStats, StatsRecorder
from .pool.workers import WorkerProcess, Workers
from .pool.workspaces import Workspace, workspace_job, workspace_options
from .shared import checks, worker_wire
from .shared.errors import PoolBrokenError, PoolClosedError
from .shared.files import File
from .shared.jobs import CodeJob, Job, Limits, PythonJob, ShellJob
from .shared.kernel import linux
from .shared.kernel.sandbox import Sandbox
from .shared.languages import Toolchain
from .shared.output import TOOL_OUTPUT_STREAM_MAX_CHARS
from .shared.result import NO_CODE_TEXT, NO_COMMAND_TEXT, Result, Status

__all__ = ["ExecPool"]

#: What ``ExecPool(...)`` takes besides ``workers``: PoolConfig's fields.
_OPTIONS = frozenset(field.name for field in dataclasses.fields(PoolConfig) if field.init) - {"workers"}


def _make_non_dumpable() -> None:
    """PR_SET_DUMPABLE 0 on the calling process: a tool running as the same
    user can then no longer read ``/proc/<caller>/environ`` or ptrace it
    (root still can). It applies to the whole process and disables its core
    dumps, which is why it is an option."""
    linux.prctl(linux.PR_SET_DUMPABLE, 0)


class ExecPool(JobRunner):
    """A pool of isolated worker processes running Python and shell jobs.

    ``ExecPool(workers=None, **options)``: ``options`` are the fields of
    ``PoolConfig`` -- the interpreter, default limits, environment, warm
    templates, sandbox and the rest, each documented there -- checked
    before anything starts. The constructor returns once every worker is
    ready (at most ``startup_timeout`` seconds); a pool whose workers
    cannot start raises ``PoolBrokenError``.

    Example::

        from concurrent.futures import as_completed
        from execpool import ExecPool, PythonJob, Status

        with ExecPool(workers=2) as pool:
            futures = [pool.submit(PythonJob(f"print({i} * {i})")) for i in range(4)]
            for future in as_completed(futures):
                result = future.result()
                assert result.status is Status.OK, result.text
                print(result.output, end="")
    """

    def __init__(self, workers: Optional[int] = None, **options: Any) -> None:
        unknown = sorted(set(options) - _OPTIONS)
        if unknown:
            raise TypeError(f"ExecPool got an unexpected option {unknown[0]!r} (its options are the fields of "
                            "execpool.PoolConfig)")
        self._open(PoolConfig(workers=workers, **options))

    @classmethod
    def from_config(cls, config: PoolConfig) -> "ExecPool":
        """A pool from a ``PoolConfig`` built (and validated) elsewhere."""
        if not isinstance(config, PoolConfig):
            raise TypeError(f"config must be an execpool.PoolConfig, not {type(config).__name__}")
        pool = cls.__new__(cls)
        pool._open(config)
        return pool

    def _open(self, config: PoolConfig) -> None:
        self.config = config
        if config.non_dumpable:
            _make_non_dumpable()
        self._ids = iter(range(1, 1 << 62))
        self._ids_lock = threading.Lock()
        self._closed = False
        self._watcher = CancelWatcher()
        self._stats = StatsRecorder()
        self._dispatcher = Dispatcher()
        self._code: Optional[CodeJobs] = None
        self._code_lock = threading.Lock()
        self._engine = _Engine(self)
        assert config.disk_budget is not None
        self.disk_budget = DiskBudget(config.disk_budget, config.disk_kept_for_jobs)
        try:
            self._workers = Workers(config, self._dispatcher.wake, self._dispatcher.job_started, self._stats)
        except BaseException:
            self._dispatcher.stop(0)
            raise
        # The dispatcher first: a worker that fails to start is then cleaned
        # up like any other that dies.
        self._dispatcher.start(self._workers)
        try:
            self._workers.start()
            self._workers.wait_ready(config.startup_timeout)
        except BaseException:
            self.close()
            raise

    # -- the entry point -----------------------------------------------------

    def submit(self, job: Job, *, on_event: Optional[OnEvent] = None,
               cancel_event: Optional[threading.Event] = None) -> JobFuture:
        """Start ``job`` on the least-loaded worker; its future's result is
        its ``Result``. Never waits for the job.

        ``on_event`` receives the job's ``JobOutput`` events as the tool
        prints (up to ``TOOL_OUTPUT_STREAM_MAX_CHARS`` characters, then one
        ``OutputCapped``), in order and all before the future is done. It is
        called on the pool's dispatcher thread, which serves every job: hand
        the event on (a queue, ``loop.call_soon_threadsafe``) and return. An
        exception it raises is logged and changes nothing. Without
        ``on_event`` the worker sends no live output at all.

        ``cancel_event`` (a ``threading.Event``) cancels the job when set, as
        ``future.cancel()`` does: the tree is killed and the Result is
        ``CANCELLED``. Misuse -- a job that is no job, a ``cwd`` that does not
        exist, a closed pool -- raises here (``TypeError``, ``ValueError``,
        ``PoolClosedError``).

        A ``CodeJob`` becomes a compile (once per program: the pool's
        compile cache) and a run, each a job of this pool
        (execpool/pool/code.py); its future is the run's, with the compile's
        Result in ``compile_result``.
        """
        return self._submit(job, on_event, cancel_event, None)

    def _submit(self, job: Job, on_event: Optional[OnEvent], cancel_event: Optional[threading.Event],
                workspace: Optional[Workspace]) -> JobFuture:
        """``submit``, in ``workspace`` where given (``Workspace.submit``)."""
        if not isinstance(job, (PythonJob, ShellJob, CodeJob)):
            raise TypeError(f"job must be an execpool.PythonJob, ShellJob or CodeJob, not {type(job).__name__}")
        if on_event is not None and not callable(on_event):
            raise TypeError(f"on_event must be callable, not {type(on_event).__name__}")
        checks.cancel_event(cancel_event)
        if workspace is not None:
            job = workspace_job(workspace, job)
        if job.cwd is not None and not os.path.isdir(job.cwd):
            raise ValueError(f"cwd {job.cwd!r} is not an existing directory")
        self._check_open()
        job_id = self._next_id()
        future = JobFuture(job_id)
        if isinstance(job, CodeJob):
            self._code_jobs().submit(job, future, on_event, workspace)
            if cancel_event is not None:
                self._watcher.watch(future, cancel_event)
            return future
        handle = JobHandle(future, on_event, job.kind, self._stats)
        if not job.source.strip():
            empty = NO_CODE_TEXT if isinstance(job, PythonJob) else NO_COMMAND_TEXT
            handle.finish(Result(status=Status.ERROR, empty_message=empty, timeout=job.timeout))
            return future
        config = self.config
        env = dict(config.tool_env)
        env.update(job.env or {})
        start = worker_wire.Start(
            job_id=job_id, argv_kind=job.kind, source=job.source,
            cwd=None if job.cwd is None else os.fspath(job.cwd), env=env,
            timeout=job.timeout, limits=job.limits or config.limits,
            live_cap=None if on_event is None else TOOL_OUTPUT_STREAM_MAX_CHARS,
            max_output_chars=job.max_output_chars or config.max_output_chars,
            keep_background=job.keep_background, python=config.python, stdin=job.stdin,  # type: ignore[arg-type]
            warm=getattr(job, "warm", False), network=job.network, separate_stderr=job.separate_stderr,
            sandbox=config.sandbox if job.sandbox is None else job.sandbox or None,  # type: ignore[arg-type]
            files=job.given_files, fetch=tuple(job.fetch), workspace=None if workspace is None else workspace.id,
        )
        size = 0 if workspace is not None else reserved(start.sandbox, start.limits)  # the workspace holds its own
        if not self.disk_budget.fits(size):
            raise ValueError(f"limits.disk is {size} bytes, more than the pool's whole disk_budget "
                             f"({self.disk_budget.total}): the job could never start")
        admission = _Admission(self, handle, start, size, None if workspace is None else workspace.worker)
        future._cancel = admission.cancel
        admission.token = self.disk_budget.acquire(size, admission.go)
        if cancel_event is not None:
            self._watcher.watch(future, cancel_event)
        return future

    def session(self, language: str = "python", *, sandbox: Union[None, bool, str, Sandbox] = None,
                limits: Optional[Limits] = None, idle_timeout: Optional[float] = DEFAULT_IDLE_TIMEOUT_S,
                cwd: Optional[Union[str, os.PathLike]] = None, env: Optional[Mapping[str, str]] = None,
                network: bool = True, files: Optional[Mapping[str, Union[bytes, File]]] = None,
                fetch: Sequence[str] = (), ipython: Optional[bool] = None) -> Session:
        """A live ``"python"`` interpreter or ``"bash"`` shell that keeps its
        state between cells (execpool/pool/sessions.py): ``session.run(code)``
        gives a ``CellResult``. It starts at once (Python's from the warm
        template) and lives until ``close()``, ``idle_timeout`` seconds
        without a cell (None: no limit), its pool's close, or its owner's
        death -- its whole tree with it. ``sandbox``, ``limits``, ``env``,
        ``network``, ``files`` and ``fetch`` are a job's, for the session's
        life (what ``fetch`` finds is ``session.files`` once it ended); its
        directory is a fresh private one, removed at its end, unless ``cwd``
        names one. A sandboxed session takes its disk bound from the pool's
        ``disk_budget`` for its life: ``DiskBudgetError`` when it does not
        fit now. A Python session speaks IPython, as a Jupyter kernel does
        (magics, ``!`` commands, ``display``, inline figures), when
        ``ipython`` is True (ImportError naming the ``jupyter`` extra where
        the pool's Python lacks it) or None and the pool's Python has it;
        plain Python when False."""
        self._check_open()
        return open_session(self._engine, language, sandbox=sandbox, limits=limits, idle_timeout=idle_timeout,
                            cwd=cwd, env=env, network=network, files=files, fetch=fetch, ipython=ipython)

    def workspace(self, disk: Optional[int] = None, *, sandbox: Union[None, str, Sandbox] = None) -> Workspace:
        """A space that outlives jobs (execpool/pool/workspaces.py): the jobs
        and sessions run in it (``ws.submit``, ``ws.run``, ``ws.session``)
        share its files, its ``/tmp`` and ``/dev/shm``, all within ``disk``
        bytes (default: the pool's ``limits.disk``), which it holds of the
        pool's disk budget until ``close()`` (``DiskBudgetError`` when it
        does not fit now). Its jobs run in ``sandbox`` (the pool's, else
        the strict one)."""
        self._check_open()
        disk, box = workspace_options(self.config, disk, sandbox)
        return Workspace(self._engine, disk, box)

    def _next_id(self) -> int:
        with self._ids_lock:
            return next(self._ids)

    def languages(self, wait: bool = False) -> list[Toolchain]:
        """Each language of the table (execpool/shared/languages.py) and
        whether it runs in this pool: its hello-world compiled and ran in
        the pool's sandbox with its tools (execpool/pool/toolchains.py) --
        its toolchain's version -- or why not. The first call starts the
        checks and answers at once: a row not known yet is ``checking``
        (``wait``: answer once every row is known). Each toolchain is
        checked once per process, but a check the machine failed is tried
        again on the next call."""
        return self._code_jobs().languages(wait)

    @property
    def compile_cache(self) -> CompileCacheStats:
        """What the compile cache has done: hits (a job whose program was
        compiled, or compiling, already), misses, seconds spent compiling."""
        with self._code_lock:
            code = self._code
        if code is None:
            return CompileCacheStats(0, 0, 0.0)
        return CompileCacheStats(code.cache.hits, code.cache.misses, code.cache.compile_seconds)

    def _code_jobs(self) -> CodeJobs:
        with self._code_lock:
            self._check_open()
            if self._code is None:
                self._code = CodeJobs(self, self.scratch_dir(), self.config.compile_cache_mb << 20)
            return self._code

    @property
    def default_max_in_flight(self) -> int:
        """Two jobs per CPU of this machine."""
        return 2 * (os.cpu_count() or 2)

    @contextlib.contextmanager
    def on_loop(self) -> Iterator[None]:
        """For an asyncio server that owns the pool: within the block, the
        pool reads its workers' messages (output, Results) on the running
        event loop's thread, not on a thread of its own. A job then costs
        the server two thread switches less: the thread no longer wakes for
        each message, waits for the interpreter's lock the loop holds, and
        wakes the loop to hand the Result over (``execpool serve`` runs in
        one). Enter and leave it on the loop's thread, which must not block
        meanwhile -- a blocked loop holds up every job's Result; jobs may be
        submitted from any thread. ``RuntimeError`` without a running loop,
        or if the pool is already on one."""
        loop = asyncio.get_running_loop()
        self._check_open()
        self._dispatcher.attach(loop)
        try:
            yield
        finally:
            self._dispatcher.release(5.0)

    # -- the pool's life -----------------------------------------------------

    def close(self, timeout: float = 5.0) -> None:
        """Kill every tool tree, stop the workers and the dispatcher; bounded
        by ``timeout`` per phase, after which workers are SIGKILLed. Jobs
        still running end as ``INFRA`` ("the pool was closed")."""
        with self._ids_lock:
            if self._closed:
                return
            self._closed = True
        self._dispatcher.release(timeout)
        for waiting in self.disk_budget.close():
            waiting()  # finds the pool closed: its job ends INFRA
        self._workers.close(timeout)
        with self._code_lock:
            code = self._code
        if code is not None:
            code.close()  # its jobs' last steps find the pool closed and end INFRA
        self._dispatcher.stop(timeout)
        self._watcher.close()
        # Last: whatever the cleanups have not done by now, the lifeline
        # does before it exits.
        self._workers.join_cleanups(timeout)

    @property
    def env(self) -> dict:
        """The environment every tool starts from: the allow-listed caller
        variables plus the pool's ``env`` (a job's own ``env`` goes on top)."""
        return dict(self.config.tool_env)

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> PoolStats:
        """What the pool has done so far: jobs ended by kind and status,
        their durations, jobs running now, workers replaced, output produced
        (execpool/pool/stats.py). The service's /metrics exports the same."""
        return self._stats.snapshot(self.running_jobs)

    def scratch_dir(self) -> str:
        """A new private directory that lasts as long as the pool: for files
        a caller puts in front of its jobs or reads back after them (a job
        gets it as ``cwd=``). It is removed when the pool closes and, should
        this process die without closing it, by the pool's lifeline -- a
        ``tempfile`` directory would outlive a SIGKILLed owner."""
        self._check_open()
        return self._workers.scratch_dir()

    @property
    def running_jobs(self) -> int:
        """Jobs submitted to a worker and not yet ended."""
        with self._workers.lock:
            return self._workers.running_jobs

    @property
    def worker_pids(self) -> list[int]:
        with self._workers.lock:
            return [w.pid for w in self._workers.all]

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("this ExecPool is closed")
        if self._workers.broken is not None:
            raise PoolBrokenError(self._workers.broken)


class _Engine:
    """The pool's workers as sessions and workspaces reach them
    (execpool/pool/engine.py): the few of the pool's insides they need."""

    def __init__(self, pool: ExecPool) -> None:
        self._pool = pool

    @property
    def config(self) -> PoolConfig:
        return self._pool.config

    @property
    def disk_budget(self) -> DiskBudget:
        return self._pool.disk_budget

    @property
    def stats(self) -> StatsRecorder:
        return self._pool._stats

    def next_id(self) -> int:
        return self._pool._next_id()

    def assign(self, handle: JobHandle, deadline: Optional[float], worker: Optional[WorkerProcess]) -> WorkerProcess:
        return self._pool._workers.assign(handle, deadline, worker)

    def hold_workspace(self, ident: int) -> WorkerProcess:
        return self._pool._workers.hold_workspace(ident)

    def let_go_workspace(self, worker: WorkerProcess, ident: int) -> None:
        self._pool._workers.let_go_workspace(worker, ident)

    def watch(self, future: Future, cancel_event: threading.Event) -> None:
        self._pool._watcher.watch(future, cancel_event)

    def submit_in(self, workspace: Workspace, job: Job, on_event: Optional[OnEvent],
                  cancel_event: Optional[threading.Event]) -> JobFuture:
        return self._pool._submit(job, on_event, cancel_event, workspace)

    def session_in(self, workspace: Workspace, language: str, **options: Any) -> Session:
        self._pool._check_open()
        return open_session(self, language, workspace=workspace, **options)


class _Admission:
    """A job on its way to a worker: waiting for the disk budget
    (execpool/pool/budget.py) until it fits, then sent; cancellable all
    along. What it took of the budget is given back when its future is done."""

    def __init__(self, pool: ExecPool, handle: JobHandle, start: worker_wire.Start, size: int,
                 worker: Optional[WorkerProcess]) -> None:
        self.pool = pool
        self.handle = handle
        self.start = start
        self.size = size
        #: Where it must run (its workspace's worker), or None: the least loaded.
        self.pinned = worker
        self.token: Optional[object] = None
        self._lock = threading.Lock()
        self._worker: Optional[WorkerProcess] = None
        self._cancelled = False

    def go(self) -> None:
        """Its turn (on the thread that made room, or the submitter's)."""
        pool, start = self.pool, self.start
        future = self.handle.future
        if self.size and not start.keep_background:  # else its daemons keep its space until the pool closes
            future.add_done_callback(lambda _: pool.disk_budget.release(self.size))
        with self._lock:
            if self._cancelled:
                self.handle.finish(Result(status=Status.CANCELLED, cancelled=True, timeout=start.timeout))
                return
        if pool.closed:
            self.handle.finish(Result(status=Status.INFRA, error="the pool was closed", timeout=start.timeout))
            return
        deadline = None if start.timeout is None else time.monotonic() + start.timeout
        try:
            worker = pool._workers.assign(self.handle, deadline, self.pinned)
        except Exception as exc:  # noqa: BLE001 - a job let in late has no caller to raise to: its Result says
            self.handle.finish(Result(status=Status.INFRA, error=str(exc), timeout=start.timeout))
            return
        worker.send(start)
        with self._lock:
            self._worker = worker
            cancelled = self._cancelled
        if cancelled:
            self.cancel()

    def cancel(self) -> None:
        with self._lock:
            worker = self._worker
            self._cancelled = True
        if worker is not None:
            if self.start.job_id in worker.jobs:
                worker.send(worker_wire.Cancel(self.start.job_id))
        elif self.token is not None and self.pool.disk_budget.leave(self.token):
            self.handle.finish(Result(status=Status.CANCELLED, cancelled=True, timeout=self.start.timeout))
