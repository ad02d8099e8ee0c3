"""The pool, as the caller's process runs it.

::

    caller threads / asyncio tasks           dispatcher thread (one per pool)
    ------------------------------           --------------------------------
    pool.run / stream / astream              connection.wait(worker pipes + wake pipe)
      -> _submit: pick least-loaded  ---->   worker messages -> the job's sink
         worker, send Start                  (a queue.SimpleQueue, or an asyncio
      <- the job's sink: Output, Finished      queue fed with call_soon_threadsafe)
      -> close()/cancel: send Cancel          EOF on a worker pipe -> the worker died:
                                               kill its trees, fail only its jobs,
                                               start a replacement

Who runs this: the caller's process -- typically a large, multithreaded
server. It owns N worker processes (execpool/worker.py), each started as a
fresh interpreter (``sys.executable -m execpool.worker``) with its channel on
two inherited pipes and a scrubbed environment: never forked from the caller
(fork copies a big server's page tables, ~24 ms per GiB) and never through
multiprocessing's spawn (it re-imports the caller's ``__main__``).

What it owns: the worker processes, one pipe pair each, and ONE dispatcher
thread that routes every worker's messages to per-job sinks, however many jobs
run: the caller's thread count does not grow with concurrency. That thread is
what every job depends on, so nothing a worker sends can stop it: it reads
without blocking, whole frames only, and a worker whose message is not what
the channel allows (execpool/channel.py checks every field) or cannot be
handled is treated as dead. The pool records every process group a worker
reports, so when a worker dies (even by SIGKILL) the supervisor kills those
groups and every process carrying that worker's marker, fails only that
worker's jobs (``Result.error``), and starts a replacement. Workers are
recycled after ``max_jobs_per_worker`` jobs.

Where a cgroup v2 hierarchy is writable each worker also runs in a group of
its own (execpool/cgroups.py, ``WorkerGroup``), killed whole when the worker
exits for any reason -- before its directory is removed -- so that nothing
its jobs started outlives it, not even a daemon that left its session and
cleared its environment; elsewhere this falls back to process groups and
markers. When the caller's process dies, the workers see EOF on their
control pipe and kill everything they own, and the pool's lifeline
(execpool/lifeline.py, one small process per pool) continues and kills the
workers that cannot (a tool can SIGSTOP its worker), kills their groups and
removes their directories.

Two more things run here, each bounded whatever the concurrency: while jobs
run, the dispatcher doubles as a watchdog (a worker a tool has SIGSTOPped
runs nothing, enforces no timeout and sees no EOF; see ``_watchdog``), and
while jobs with a ``cancel_event`` run, one ``execpool-cancel-watcher``
thread turns those events into Cancels within milliseconds.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Callable, Iterable, Iterator, Optional

from . import _linux, cgroups, channel, drain, lifeline
from .jobs import Limits, PythonJob, ShellJob
from .proctree import JOB_MARKER_ENV, is_stopped, kill_tree, stat_fields
from .result import NO_CODE_TEXT, NO_COMMAND_TEXT, Result, describe_exit

#: Variables a tool may see from the caller's environment. Everything else --
#: API keys, tokens, cloud credentials -- stays in the caller.
DEFAULT_ENV_ALLOWLIST = (
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "TERM", "TMPDIR",
)

#: Warm spares each worker keeps parked once idle: two, so back-to-back warm
#: jobs find one while the next is being made.
DEFAULT_WARM_SPARES = 2
MAX_WARM_SPARES = 64

#: How much output a Result keeps by default (the full length is always counted).
DEFAULT_MAX_OUTPUT_CHARS = 1_000_000

#: A worker that dies before saying Ready this many times in a row means the
#: interpreter or the package is broken: stop respawning and say so.
MAX_STARTUP_FAILURES = 3

#: Whether the C extension was built, asked without loading it here: it is
#: the workers' to load, not the caller's.
_DEFAULT_SPAWN_METHOD = "vfork" if importlib.util.find_spec("execpool._spawn") is not None else "fork"

#: Characters reserved for a job marker (a 12-character token, "/", a job id).
_MARKER_ROOM = 48

#: While jobs run, how often the dispatcher looks for a stopped worker (and
#: continues it) and for jobs past their timeout, and how late a job may be
#: before its worker is killed.
WATCHDOG_PERIOD_S = 0.25
WATCHDOG_KILL_S = 10.0

#: How long an exited worker's group may take to empty after cgroup.kill
#: (a dying process leaves it within milliseconds; one stuck in the kernel
#: may take longer, and then the group stays until the lifeline's turn).
GROUP_EMPTY_TIMEOUT_S = 2.0

#: How often the pool looks at the cancel_events of running jobs.
CANCEL_WATCH_INTERVAL_S = 0.002

#: No honest worker message comes near this (live output is capped, a
#: Result keeps max_output_chars); a longer one means the pipe was tampered
#: with, and the worker is treated as dead.
_MAX_MESSAGE_BYTES = 1 << 30

#: Bytes the dispatcher reads from one worker before it looks at the others.
_DISPATCH_BUDGET = 256 * 1024

_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

logger = logging.getLogger("execpool")


class PoolClosedError(ValueError, RuntimeError):
    """The pool was closed: a ValueError like I/O on a closed file, and a
    RuntimeError like submitting to a shut-down executor."""


class _Worker:
    """The supervisor's record of one worker process."""

    def __init__(self, proc: subprocess.Popen, send: Connection, recv: Connection, token: str,
                 jobs_dir: str, group: Optional[cgroups.WorkerGroup]) -> None:
        self.proc = proc
        self.send_conn = send
        self.recv = recv
        self.frames = channel.FrameReader(recv.fileno(), _MAX_MESSAGE_BYTES)
        self.token = token
        self.jobs_dir = jobs_dir
        self.group = group
        self.send_lock = threading.Lock()
        self.jobs: dict[int, _JobHandle] = {}
        self.pgids: dict[int, int] = {}
        self.started = 0
        self.ready = threading.Event()
        self.retiring = False
        # Why the supervisor killed it, when it broke the channel protocol.
        self.fault: Optional[str] = None
        self.stopped_seen = False

    def send(self, msg: channel.ToWorker) -> bool:
        try:
            with self.send_lock:
                channel.send(self.send_conn, msg)
            return True
        except OSError:
            return False  # it died; the dispatcher sees the EOF and fails its jobs


class _JobHandle:
    """The caller's side of one submitted job."""

    __slots__ = ("job_id", "worker", "sink", "deadline")

    def __init__(self, job_id: int, worker: Optional[_Worker], sink: Callable[[object], None],
                 deadline: Optional[float] = None) -> None:
        self.job_id = job_id
        self.worker = worker
        self.sink = sink
        self.deadline = deadline

    def cancel(self) -> None:
        worker = self.worker
        if worker is not None and self.job_id in worker.jobs:
            worker.send(channel.Cancel(self.job_id))


class _CancelWatcher:
    """Turns a caller's ``threading.Event`` into an immediate Cancel.

    An Event has no file descriptor to wait on and no callback, so something
    has to look at it. Polling it from each consumer every ``poll_interval_s``
    costs that interval in latency (a 0.2 s watcher adds ~110 ms); this is one
    thread per pool -- not per job -- that checks every registered event each
    ``CANCEL_WATCH_INTERVAL_S`` while any is registered, and exists only then.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._watched: dict[int, tuple[threading.Event, "_JobHandle"]] = {}
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def watch(self, handle: "_JobHandle", event: threading.Event) -> None:
        with self._cond:
            if self._closed:
                return
            self._watched[handle.job_id] = (event, handle)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="execpool-cancel-watcher", daemon=True)
                self._thread.start()
            self._cond.notify()

    def forget(self, job_id: int) -> None:
        with self._cond:
            self._watched.pop(job_id, None)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed or not self._watched:
                    # Nothing to watch: end, so an idle pool holds no thread
                    # beyond its dispatcher; the next watch() starts another.
                    self._thread = None
                    return
                fired = [job_id for job_id, (event, _) in self._watched.items() if event.is_set()]
                handles = [self._watched.pop(job_id)[1] for job_id in fired]
            for handle in handles:
                handle.cancel()
            with self._cond:
                if self._watched and not self._closed:
                    self._cond.wait(CANCEL_WATCH_INTERVAL_S)


def _make_non_dumpable() -> None:
    """PR_SET_DUMPABLE 0 on the calling process: a tool running as the same
    user can then no longer read ``/proc/<caller>/environ`` or ptrace it
    (root still can). It applies to the whole process and disables its core
    dumps, which is why it is an option."""
    _linux.prctl(_linux.PR_SET_DUMPABLE, 0)


def _deliver(handle: _JobHandle, msg: object) -> None:
    """Hand a message to its job's consumer. A consumer's failure is its own:
    the dispatcher thread serves every other job and must not die of it."""
    try:
        handle.sink(msg)
    except Exception as exc:  # noqa: BLE001
        logger.error("execpool: dropped a message for job %d", handle.job_id, exc_info=exc)


class ExecPool:
    """A pool of isolated worker processes running Python and shell jobs.

    ``workers`` defaults to the number of CPUs; each worker runs any number of
    jobs at once, so this bounds the pool's processes, not its concurrency.
    ``python`` is the interpreter for Python tools (default ``sys.executable``),
    ``limits`` the default rlimits for every job, ``env`` variables every tool
    gets, and ``env_allowlist`` the names copied from the caller's environment.
    ``spawn_method`` chooses how workers start tools: ``"vfork"`` through the
    small C extension ``execpool._spawn`` (the default where it was built) or
    ``"fork"``, pure Python and a few milliseconds slower per tool; both set
    the session, rlimits and parent-death signal before the tool's first
    instruction. ``preload`` names modules every worker's warm template
    imports, so warm jobs (``PythonJob(warm=True)``) that import them start
    fast. The
    constructor returns once every worker is ready. ``non_dumpable=True``
    makes the calling process non-dumpable, so tools running as the same user
    cannot read its environment (its secrets) through ``/proc``.
    ``cgroups=False`` keeps execpool from creating cgroups even where it could:
    process caps are then kept by the worker counting, memory caps refused,
    and workers get no group of their own (so a daemon that leaves its
    session and clears its environment can outlive its worker).
    ``warm_spares`` is how many spares -- clones of the worker's warm
    template, about 2 MB each -- a worker keeps parked for its next warm jobs
    once it had one (0: each warm job waits for a spare made for it; see
    execpool/template.py).
    """

    def __init__(
        self,
        workers: Optional[int] = None,
        *,
        python: Optional[str] = None,
        limits: Limits = Limits(),
        env: Optional[dict] = None,
        env_allowlist: Iterable[str] = DEFAULT_ENV_ALLOWLIST,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
        max_jobs_per_worker: int = 1000,
        startup_timeout: float = 30.0,
        spawn_method: str = "auto",
        preload: Iterable[str] = (),
        non_dumpable: bool = False,
        cgroups: bool = True,
        warm_spares: int = DEFAULT_WARM_SPARES,
    ) -> None:
        if workers is None:
            workers = os.cpu_count() or 2
        for name, value in (("workers", workers), ("max_output_chars", max_output_chars),
                            ("max_jobs_per_worker", max_jobs_per_worker)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, not {type(value).__name__}")
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if spawn_method == "auto":
            spawn_method = _DEFAULT_SPAWN_METHOD
        if spawn_method not in ("vfork", "fork"):
            raise ValueError(f"spawn_method must be 'auto', 'vfork' or 'fork', not {spawn_method!r}")
        if spawn_method == "vfork" and _DEFAULT_SPAWN_METHOD != "vfork":
            raise ValueError("spawn_method='vfork' needs the execpool._spawn extension, which is not built here")
        self.spawn_method = spawn_method
        if isinstance(preload, str):
            raise TypeError("preload must be a list of module names, not one string")
        self.preload = tuple(preload)
        for name in self.preload:
            if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
                raise ValueError(f"preload entry {name!r} is not a module name")
        self._preload_errors: tuple = ()
        if not isinstance(non_dumpable, bool):
            raise TypeError("non_dumpable must be a bool")
        if not isinstance(cgroups, bool):
            raise TypeError("cgroups must be a bool")
        self.cgroups = cgroups
        if isinstance(warm_spares, bool) or not isinstance(warm_spares, int):
            raise TypeError(f"warm_spares must be an int, not {type(warm_spares).__name__}")
        if not 0 <= warm_spares <= MAX_WARM_SPARES:
            raise ValueError(f"warm_spares must be between 0 and {MAX_WARM_SPARES}, got {warm_spares}")
        self.warm_spares = warm_spares
        if non_dumpable:
            _make_non_dumpable()
        if not isinstance(limits, Limits):
            raise TypeError(f"limits must be an execpool.Limits, not {type(limits).__name__}")
        self.python = os.path.abspath(python) if python is not None else sys.executable
        if not os.access(self.python, os.X_OK):
            raise ValueError(f"python interpreter {self.python!r} is not an executable file")
        # Validated the same way a job's env is.
        self._base_env = {k: os.environ[k] for k in env_allowlist if k in os.environ}
        self._base_env.update(PythonJob("pass", env=env or {}).env)
        self.limits = limits
        self.max_output_chars = max_output_chars
        self.max_jobs_per_worker = max_jobs_per_worker
        self._size = workers
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._workers: list[_Worker] = []
        self._closed = False
        self._broken: Optional[str] = None
        self._startup_failures = 0
        self._wake_r, self._wake_w = channel.pipe()
        os.set_blocking(self._wake_w, False)  # a full wake pipe is awake enough
        self._watcher = _CancelWatcher()
        self._running_jobs = 0
        self._next_watchdog = 0.0
        # Before any worker, so that it is in none of their groups and knows them all.
        self._lifeline = lifeline.Lifeline(self._process_env())
        with self._lock:
            for _ in range(workers):
                self._workers.append(self._spawn_worker())
        self._dispatcher = threading.Thread(target=self._dispatch, name="execpool-dispatcher", daemon=True)
        self._dispatcher.start()
        self._wait_ready(startup_timeout)

    # -- public API --------------------------------------------------------

    def run(self, job: PythonJob | ShellJob, *, cancel_event: Optional[threading.Event] = None,
            poll_interval_s: float = 0.25) -> Result:
        """Run ``job`` to its end and return its Result (never raises for the
        tool's own failures: non-zero exit, timeout, cancellation)."""
        return drain.run_job(self._submit, job, cancel_event=cancel_event, poll_interval_s=poll_interval_s)

    def stream(self, job: PythonJob | ShellJob, *, tool_name: str = "", tool_call_id: str = "",
               cancel_event: Optional[threading.Event] = None, heartbeat_interval_s: float = 10.0,
               poll_interval_s: float = 0.25) -> drain.EventStream:
        """A generator of ``tool_output`` / ``heartbeat`` events that returns
        the job's Result; ``close()`` cancels the job (SPEC §1)."""
        self._check_open()
        return drain.stream_job(self._submit, job, tool_name=tool_name, tool_call_id=tool_call_id,
                                cancel_event=cancel_event, heartbeat_interval_s=heartbeat_interval_s,
                                poll_interval_s=poll_interval_s)

    def astream(self, job: PythonJob | ShellJob, *, tool_name: str = "", tool_call_id: str = "",
                cancel_event: Optional[threading.Event] = None, heartbeat_interval_s: float = 10.0,
                poll_interval_s: float = 0.25) -> drain.AsyncJobStream:
        """The asyncio form of :meth:`stream`: ``async for event in ...``, then
        ``.result``. Cancelling the consuming task cancels the job."""
        self._check_open()
        return drain.AsyncJobStream(self._submit, job, tool_name=tool_name, tool_call_id=tool_call_id,
                                    cancel_event=cancel_event, heartbeat_interval_s=heartbeat_interval_s,
                                    poll_interval_s=poll_interval_s)

    def map(self, jobs: Iterable[PythonJob | ShellJob], *,
            max_in_flight: Optional[int] = None) -> Iterator[Result]:
        """Results of ``jobs`` in input order, as an iterator. Jobs are taken
        from the iterable lazily and at most ``max_in_flight`` run at once
        (default: two per CPU), so a million-job generator is fine; closing
        the iterator early cancels what is still running."""
        from .batch import map_jobs

        self._check_open()
        return map_jobs(self._submit, jobs, self._in_flight(max_in_flight))

    def imap_unordered(self, jobs: Iterable[PythonJob | ShellJob], *,
                       max_in_flight: Optional[int] = None) -> Iterator[tuple[int, Result]]:
        """``(index, Result)`` pairs as jobs finish, ``index`` being the job's
        position in ``jobs``; otherwise like :meth:`map`."""
        from .batch import imap_unordered_jobs

        self._check_open()
        return imap_unordered_jobs(self._submit, jobs, self._in_flight(max_in_flight))

    def _in_flight(self, max_in_flight: Optional[int]) -> int:
        if max_in_flight is None:
            return 2 * (os.cpu_count() or 2)
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int):
            raise TypeError(f"max_in_flight must be an int, not {type(max_in_flight).__name__}")
        if max_in_flight <= 0:
            raise ValueError(f"max_in_flight must be positive, got {max_in_flight}")
        return max_in_flight

    def close(self, timeout: float = 5.0) -> None:
        """Kill every tool tree, stop the workers and the dispatcher; bounded
        by ``timeout`` per phase, after which workers are SIGKILLed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = list(self._workers)
        for worker in workers:
            worker.send(channel.Shutdown())
        for worker in workers:
            try:
                worker.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                worker.proc.kill()
        self._wake()
        self._dispatcher.join(timeout)
        self._watcher.close()
        # Last: whatever the dispatcher has not cleaned up by now, the
        # lifeline does before it exits.
        self._lifeline.close(timeout)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wait_ready(self, timeout: float) -> None:
        """Block until every worker can take a job, so the first job's latency
        is a job's latency and a broken interpreter fails here, loudly."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                pending = [w for w in self._workers if not w.ready.is_set()]
            if self._broken is not None:
                self.close()
                raise RuntimeError(self._broken)
            if self._preload_errors:
                self.close()
                raise ValueError("cannot preload in the workers: " + "; ".join(self._preload_errors))
            if not pending:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.close()
                raise RuntimeError(f"execpool workers did not start within {timeout} s")
            pending[0].ready.wait(min(remaining, 0.1))

    @property
    def env(self) -> dict:
        """The environment every tool starts from: the allow-listed caller
        variables plus the pool's ``env`` (a job's own ``env`` goes on top)."""
        return dict(self._base_env)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def worker_pids(self) -> list[int]:
        with self._lock:
            return [w.proc.pid for w in self._workers]

    def __enter__(self) -> "ExecPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- submission ----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("this ExecPool is closed")
        if self._broken is not None:
            raise RuntimeError(self._broken)

    def _submit(self, job: PythonJob | ShellJob, sink: Callable[[object], None],
                live_cap: Optional[int], cancel_event: Optional[threading.Event] = None) -> _JobHandle:
        if not isinstance(job, (PythonJob, ShellJob)):
            raise TypeError(f"job must be an execpool.PythonJob or ShellJob, not {type(job).__name__}")
        if job.cwd is not None and not os.path.isdir(job.cwd):
            raise ValueError(f"cwd {job.cwd!r} is not an existing directory")
        self._check_open()
        job_id = next(self._ids)
        if not job.source.strip():
            empty = NO_CODE_TEXT if isinstance(job, PythonJob) else NO_COMMAND_TEXT
            sink(channel.Finished(job_id, Result(empty_message=empty, timeout=job.timeout)))
            return _JobHandle(job_id, None, sink)
        env = dict(self._base_env)
        env.update(job.env or {})
        start = channel.Start(
            job_id=job_id, argv_kind=job.kind, source=job.source, cwd=job.cwd, env=env,
            timeout=job.timeout, limits=job.limits or self.limits, live_cap=live_cap,
            max_output_chars=job.max_output_chars or self.max_output_chars,
            keep_background=job.keep_background, python=self.python, stdin=job.stdin,
            warm=getattr(job, "warm", False), network=job.network,
        )
        with self._lock:
            self._check_open()
            candidates = [w for w in self._workers if not w.retiring]
            if not candidates:
                raise RuntimeError(self._broken or "execpool has no worker to run this job")
            worker = min(candidates, key=lambda w: len(w.jobs))
            deadline = None if job.timeout is None else time.monotonic() + job.timeout
            handle = _JobHandle(job_id, worker, sink, deadline)
            worker.jobs[job_id] = handle
            if not self._running_jobs:
                self._wake()  # the dispatcher sleeps without a timeout while no job runs
            self._running_jobs += 1
            worker.started += 1
            if worker.started >= self.max_jobs_per_worker:
                worker.retiring = True
                self._workers.append(self._spawn_worker())
        worker.send(start)
        if cancel_event is not None:
            with self._lock:
                # Under the lock that _route pops finished jobs with, so a job
                # that already ended is never watched (and never leaks an entry).
                if job_id in worker.jobs:
                    self._watcher.watch(handle, cancel_event)
        return handle

    # -- workers -------------------------------------------------------------

    def _process_env(self) -> dict:
        """The whole environment of a worker or the lifeline: enough to run
        Python and find this package, none of the caller's secrets."""
        env = {k: v for k, v in self._base_env.items() if k in ("PATH", "LANG", "LC_ALL", "LC_CTYPE")}
        env["PYTHONPATH"] = _PACKAGE_PARENT
        return env

    def _spawn_worker(self) -> _Worker:
        """Called with the lock held."""
        token = secrets.token_hex(6)
        env = self._process_env()
        # Blank room in the worker's environment block, which a warm job
        # overwrites with its own marker (execpool/warm.py).
        env[JOB_MARKER_ENV] = " " * _MARKER_ROOM
        # The worker makes each job's private directory in here; whatever a
        # dead worker left behind goes with it (see _release).
        jobs_dir = tempfile.mkdtemp(prefix=f"execpool-{token}-")
        group = cgroups.WorkerGroup.create(token) if self.cgroups else None
        self._lifeline.worker(token, None if group is None else group.path, jobs_dir)
        to_worker_r, to_worker_w = channel.pipe()
        from_worker_r, from_worker_w = channel.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "execpool.worker", str(to_worker_r), str(from_worker_w), token,
                 self.spawn_method, ",".join(self.preload), "cgroups" if self.cgroups else "no-cgroups",
                 jobs_dir, str(self.warm_spares)],
                pass_fds=(to_worker_r, from_worker_w), env=env, cwd="/", start_new_session=True,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            )
        except BaseException:
            os.close(to_worker_w)
            os.close(from_worker_r)
            if group is not None:
                group.remove()
            shutil.rmtree(jobs_dir, ignore_errors=True)
            self._lifeline.gone(token)
            raise
        finally:
            os.close(to_worker_r)
            os.close(from_worker_w)
        # Now, before it is sent any job: the worker forks nothing until its
        # first one, so every process of every job is born in the group.
        if group is not None and not group.add(proc.pid):
            logger.warning("execpool: cannot move worker %d into its cgroup %s; it runs without one",
                           proc.pid, group.path)
            group.remove()
            group = None
        self._lifeline.started(token, proc.pid)
        self._wake()
        return _Worker(proc, Connection(to_worker_w, readable=False),
                       Connection(from_worker_r, writable=False), token, jobs_dir, group)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _dispatch(self) -> None:
        """The one thread that reads every worker's messages."""
        while True:
            with self._lock:
                by_conn = {w.recv: w for w in self._workers}
                if self._closed and not by_conn:
                    return
                watching = self._running_jobs > 0
            ready_list = wait([self._wake_r, *by_conn], WATCHDOG_PERIOD_S if watching else None)
            if watching and time.monotonic() >= self._next_watchdog:
                self._next_watchdog = time.monotonic() + WATCHDOG_PERIOD_S
                self._watchdog()
            for ready in ready_list:
                if ready == self._wake_r:
                    os.read(self._wake_r, 4096)
                else:
                    self._serve(by_conn[ready])

    def _serve(self, worker: _Worker) -> None:
        """Route what one worker sent (a bounded amount, so one flooding
        worker cannot starve the others). Whatever goes wrong doing so is
        that worker's fault -- it is killed and replaced -- never the
        dispatcher's, which every other job depends on."""
        try:
            for frame in worker.frames.frames(_DISPATCH_BUDGET):
                self._route(worker, channel.decode(frame, channel.FROM_WORKER))
        except EOFError:
            self._on_worker_exit(worker)
        except Exception as exc:  # noqa: BLE001 - a broken or forged channel, or a bug handling it
            self._condemn(worker, exc)

    def _condemn(self, worker: _Worker, exc: Exception) -> None:
        if isinstance(exc, channel.ChannelError):
            worker.fault = str(exc)
            logger.warning("execpool: killing worker %d, which broke the channel protocol: %s", worker.proc.pid,
                           worker.fault)
        else:
            worker.fault = f"handling its message failed: {exc!r}"
            logger.error("execpool: killing worker %d: handling its message failed", worker.proc.pid, exc_info=exc)
        worker.proc.kill()
        self._on_worker_exit(worker)

    def _watchdog(self) -> None:
        """A worker enforces its jobs' timeouts, answers Cancels and sees its
        owner's end only while it runs -- and a tool runs as the worker's
        user and can SIGSTOP it. While any job runs, a busy worker found
        stopped is continued (its tool may stop it again, for at most a
        period each time), and one with a job overdue by WATCHDOG_KILL_S --
        stopped, wedged or looping -- is killed: its jobs fail with an
        Execution error and a fresh worker takes over. The lifeline, which
        tools can stop or kill too, is continued or replaced. Reads one
        ``/proc/PID/stat`` per busy worker (and the lifeline's) per period,
        none while idle."""
        now = time.monotonic()
        with self._lock:
            busy = [(w, max((now - h.deadline for h in w.jobs.values() if h.deadline is not None), default=0.0))
                    for w in self._workers if w.jobs]
        for worker, late in busy:
            if late > WATCHDOG_KILL_S:
                worker.proc.kill()
            elif is_stopped(worker.proc.pid):
                if not worker.stopped_seen:
                    worker.stopped_seen = True
                    logger.warning("execpool: worker %d was stopped (by one of its tools?); continuing it",
                                   worker.proc.pid)
                worker.proc.send_signal(signal.SIGCONT)
        self._lifeline.watch()

    def _route(self, worker: _Worker, msg: channel.FromWorker) -> None:
        """Hand one message to its job; ChannelError for one that this worker
        had no business sending, which the fields' types alone do not show."""
        if isinstance(msg, channel.Output):
            handle = worker.jobs.get(msg.job_id)
            if handle is None:
                raise channel.ChannelError(f"output for job {msg.job_id}, which it does not run")
            _deliver(handle, msg)
        elif isinstance(msg, channel.Finished):
            with self._lock:
                handle = worker.jobs.pop(msg.job_id, None)
                if handle is not None:
                    worker.pgids.pop(msg.job_id, None)
                    self._running_jobs -= 1
                retire = worker.retiring and not worker.jobs
            if handle is None:
                raise channel.ChannelError(f"a result for job {msg.job_id}, which it does not run")
            self._watcher.forget(msg.job_id)
            _deliver(handle, msg)
            if retire:
                worker.send(channel.Shutdown())
        elif isinstance(msg, channel.Spawned):
            if msg.job_id not in worker.jobs:
                raise channel.ChannelError(f"a tool for job {msg.job_id}, which it does not run")
            # The group is killed when the worker dies: it must be a tool's
            # own (a tool leads a session of its own), never someone else's.
            if msg.pid <= 1 or msg.pgid != msg.pid or _parent(msg.pid) not in (worker.proc.pid, None):
                raise channel.ChannelError(f"process group {msg.pgid} for job {msg.job_id}, "
                                           f"which is not its tool's")
            worker.pgids[msg.job_id] = msg.pgid
        elif isinstance(msg, channel.Ready):
            if msg.pid != worker.proc.pid:
                raise channel.ChannelError(f"a Ready naming process {msg.pid}")
            self._preload_errors = self._preload_errors or msg.preload_errors
            worker.ready.set()
            self._startup_failures = 0

    def _on_worker_exit(self, worker: _Worker) -> None:
        with self._lock:
            if worker in self._workers:
                self._workers.remove(worker)
            lost, worker.jobs = worker.jobs, {}
            self._running_jobs -= len(lost)
            replace = not self._closed and not worker.retiring
            if replace and not worker.ready.is_set():
                self._startup_failures += 1
                if self._startup_failures >= MAX_STARTUP_FAILURES:
                    self._broken = (f"execpool workers cannot start: {sys.executable} -m execpool.worker "
                                    f"exited with {describe_exit(worker.proc.poll())} before it was ready")
                    replace = False
            if replace:
                try:
                    self._workers.append(self._spawn_worker())
                except OSError as exc:
                    logger.error("execpool: cannot start a replacement worker: %s", exc)
                    if not self._workers:
                        self._broken = f"execpool cannot start a worker: {exc}"
        try:
            code = worker.proc.wait(1.0)
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            code = worker.proc.wait()
        self._release(worker, bool(lost))
        if worker.fault is not None:
            cause = f"it broke the channel protocol ({worker.fault}) and was killed"
        else:
            cause = "the pool was closed" if self._closed else "it died unexpectedly"
        for job_id, handle in lost.items():
            self._watcher.forget(job_id)
            error = (f"worker process {worker.proc.pid} running this job exited with "
                     f"{describe_exit(code)}: {cause}; its process tree was killed")
            _deliver(handle, channel.Finished(job_id, Result(error=error)))
        worker.send_conn.close()
        worker.recv.close()

    def _release(self, worker: _Worker, had_jobs: bool) -> None:
        """Whatever an exited worker's jobs left, gone before their directory
        is: its cgroup killed whole (daemons that left their session and
        cleared their environment too), the process groups it reported and
        its marker swept, its per-job groups removed. The lifeline is told
        the worker is gone only once its group is: until then it is the
        lifeline's to kill, should this process die."""
        destroyed = worker.group is None or worker.group.destroy(GROUP_EMPTY_TIMEOUT_S)
        if not destroyed:
            logger.warning("execpool: the cgroup %s of worker %d is not empty %s s after cgroup.kill",
                           worker.group.path, worker.proc.pid, GROUP_EMPTY_TIMEOUT_S)
        if had_jobs or worker.pgids:
            kill_tree(worker.pgids.values(), marker=worker.token)
        cgroups.remove_tree(cgroups.worker_bases(worker.token))
        shutil.rmtree(worker.jobs_dir, ignore_errors=True)
        if destroyed:
            self._lifeline.gone(worker.token)


def _parent(pid: int) -> Optional[int]:
    """The parent of a live process; None once it has ended (a tool may
    have ended, even been reaped, before its Spawned is read; one being
    reaped shows state X and parent 0)."""
    fields = stat_fields(pid)
    return int(fields[1]) if fields and fields[0] not in (b"Z", b"X", b"x") else None
