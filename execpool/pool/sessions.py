"""Sessions, as the caller holds them: an interpreter or a shell that keeps
its state between cells.

::

    caller threads                        dispatcher thread          worker
    --------------                        -----------------          ------
    pool.session() -> Session    Start(session=True) ------------->  runtime started (warm for
    session.submit(code)  -> one cell at a time: Cell ------------>  Python), its stdin a socket
      a CellFuture            Output  -> the running cell's output <-  the cell's stdout, stderr
                              CellDone -> its CellResult;          <-  the runtime's reply
                                          the next cell goes down
    session.close()       -> Cancel: the session's tree dies; Finished ends it

Runs in the caller. A session is one long job of the pool (its Result is
the session's end) whose tool is a runtime of execpool's
(execpool/worker/sessions/) -- sandboxed, limited and killed like any
job's, with its worker, its pool and its owner (the lifeline's rules). The
pool's dispatcher thread calls the session's handle; the session's lock
keeps its queue of cells.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, Mapping, Optional, Sequence, Tuple, Union

from ..shared import checks, worker_wire
from ..shared.cells import FORK_TIMEOUT_S, SESSION_LANGUAGES, CellResult, Printed, read_reply
from ..shared.errors import DiskBudgetError, ExecPoolError, SessionClosedError, SessionForkError
from ..shared.files import File, fetch_patterns, job_files
from ..shared.jobs import Limits, Number
from ..shared.kernel.sandbox import Sandbox, job_sandbox
from ..shared.output import RESULT_HEAD_CHARS, LiveBudget
from ..shared.result import Result, Status
from .budget import reserved
from .future import JobFuture, JobHandle, JobOutput, OnEvent, OutputCapped
from .stats import StatsRecorder

if TYPE_CHECKING:
    from .engine import Engine
    from .workers import WorkerProcess
    from .workspaces import Workspace

#: A cell's timeout unless the call says, as a job's.
DEFAULT_CELL_TIMEOUT_S = 300.0

#: A session without a cell this long ends, unless told otherwise.
DEFAULT_IDLE_TIMEOUT_S = 600.0

#: What brings IPython to the pool's Python, for sessions that speak it.
JUPYTER_EXTRA = "pip install 'execpool[jupyter]'"

#: Past a running cell's timeout, how long the pool waits for its worker to
#: have interrupted it (and, past the grace, killed the session) before the
#: watchdog treats the worker as wedged.
_CELL_SLACK_S = 5.0

class CellFuture(Future):
    """A cell's future: its result is a CellResult. ``cancel()`` takes a
    queued cell off the queue, or interrupts a running one and kills the
    processes it started (as a job's cancel kills its tree) -- which then
    ends ``cancelled`` with the session alive, or, if it does not stop
    within the grace, with the session killed."""

    def __init__(self, session: "Session") -> None:
        super().__init__()
        self._session = session

    def cancel(self) -> bool:
        if self.done():
            return False
        return self._session._cancel(self)


@dataclass
class _Cell:
    """A cell in a session's queue -- or a fork, which takes its turn as a
    cell does (``fork``: the copy to make; its future's result is it)."""

    code: str
    timeout: Optional[float]
    future: Future
    on_event: Optional[OnEvent]
    printed: Printed
    started: float = 0.0
    cancelled: bool = False
    fork: Optional["Session"] = None


class SessionHandle(JobHandle):
    """The dispatcher's side of a session: its output, replies and end go
    to the Session."""

    __slots__ = ("session",)

    def __init__(self, future: JobFuture, session: "Session", stats: StatsRecorder) -> None:
        super().__init__(future, None, "session", stats)
        self.session = session

    def output(self, text: str, stream: str = "stdout") -> None:
        self.session._output(text, stream)

    def cell_done(self, reply: bytes, interrupted: bool, printed: int) -> bool:
        self.session._cell_done(reply, interrupted, printed)
        return True

    def finish(self, result: Result) -> None:
        self.session._ended(result)  # first: the session's own callbacks find it ended
        super().finish(result)


class Session:
    """A Python interpreter or a bash shell of the pool's that keeps its
    state -- variables, imports, functions; the shell's directory, exports
    and functions; the files in its directory -- from one cell to the next.

    Made by ``ExecPool.session`` (see there); a context manager that closes
    it. ``run`` and ``submit`` send cells, one running at a time in the
    order sent. ``SessionClosedError`` for a cell sent to a session that is
    closed or gone.
    """

    def __init__(self, engine: "Engine", language: str, start: worker_wire.Start, cwd: Optional[str]) -> None:
        """Not started: ``open_session`` starts it on a worker, or a fork
        makes it on its parent's."""
        #: Unguessable: a service hands it to its client as the session's name.
        self.id = secrets.token_urlsafe(16)
        self.language = language
        self.created = time.time()
        self.last_used = self.created
        self._lock = threading.Lock()
        self._queue: Deque[_Cell] = deque()
        self._running: Optional[_Cell] = None
        self._count = 0
        self._gone: Optional[str] = None  # why, once it is
        self._closing = False
        self._ready = False  # its runtime runs (for a copy: once the fork made it)
        self._ended_event = threading.Event()
        self._live = LiveBudget()
        self._engine = engine
        self._start = start
        #: Its directory when the caller gave one (None: a private one the
        #: worker made, removed with the session). A sandboxed copy of a
        #: session given one has a copy of it at the same path, in its own
        #: space (the copy sees it there; it is no path of the caller's).
        self.cwd = cwd
        #: What its ``fetch`` found in its working directory when it ended
        #: (empty until then): relative path to File.
        self.files: Dict[str, File] = {}
        self._future = JobFuture(start.job_id)
        self._handle = SessionHandle(self._future, self, engine.stats)
        self._future._cancel = self._kill
        self._worker: Optional["WorkerProcess"] = None
        #: What it holds of its pool's disk budget (execpool/pool/budget.py).
        self._reserved = 0
        #: The sessions it was forked from, nearest last: each can reach its
        #: copies' files (through /proc/<copy>/root) and hold one open.
        self._ancestors: Tuple[JobFuture, ...] = ()

    def _reserve(self) -> None:
        """Its disk bound taken from the pool's budget for as long as its
        space may live, or DiskBudgetError: a session does not wait for
        room. A fork's space lives while the fork does, and after, while an
        ancestor holds a file of it open: its share goes back once the
        fork and every one it came from have ended."""
        size = reserved(self._start.sandbox, self._start.limits)
        budget = self._engine.disk_budget
        if size and not budget.try_acquire(size):
            raise DiskBudgetError(f"a session's disk bound of {size} bytes does not fit the pool's disk budget now: "
                                  f"{budget.describe()}")
        self._reserved = size
        lives = (self._future, *self._ancestors)
        left, counting = [len(lives)], threading.Lock()

        def ended(_: Future) -> None:
            with counting:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._give_back()

        for future in lives:
            future.add_done_callback(ended)

    def _give_back(self) -> None:
        with self._lock:
            size, self._reserved = self._reserved, 0
        self._engine.disk_budget.release(size, lasting=True)

    # -- the caller's calls ------------------------------------------------------

    @property
    def ipython(self) -> bool:
        """Whether it speaks IPython: magics, ``!`` commands, ``display``
        and figures as a Jupyter kernel has them."""
        return self._start.ipython

    @property
    def alive(self) -> bool:
        """False once the session is closed or gone."""
        with self._lock:
            return self._gone is None

    def submit(self, code: str, *, timeout: Optional[Number] = DEFAULT_CELL_TIMEOUT_S,
               on_event: Optional[OnEvent] = None, cancel_event: Optional[threading.Event] = None) -> CellFuture:
        """Queue a cell; its future's result is its CellResult. ``on_event``
        gets its output live (``JobOutput``, with ``stream``; past
        TOOL_OUTPUT_STREAM_MAX_CHARS one ``OutputCapped``), on the pool's
        dispatcher thread, as ``ExecPool.submit``'s does; ``cancel_event``,
        when set, cancels the cell as ``future.cancel()`` does."""
        checks.text("code", code)
        checks.cancel_event(cancel_event)
        if timeout is not None:
            checks.seconds("timeout", timeout)
        if on_event is not None and not callable(on_event):
            raise TypeError(f"on_event must be callable, not {type(on_event).__name__}")
        future = CellFuture(self)
        self._enqueue(_Cell(code, None if timeout is None else float(timeout), future, on_event, Printed()))
        if cancel_event is not None:
            self._engine.watch(future, cancel_event)
        return future

    def run(self, code: str, *, timeout: Optional[Number] = DEFAULT_CELL_TIMEOUT_S,
            cancel_event: Optional[threading.Event] = None) -> CellResult:
        """Run a cell to its end; its CellResult. If the wait is interrupted
        (Ctrl-C), the cell is interrupted."""
        future = self.submit(code, timeout=timeout, cancel_event=cancel_event)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def interrupt(self) -> bool:
        """Cancel the running cell (``CellFuture.cancel``): interrupted, and
        what it started killed; False if none runs."""
        with self._lock:
            cell = self._running
        return cell is not None and cell.fork is None and self._cancel(cell.future)

    def fork(self, *, cwd: Optional[Union[str, os.PathLike]] = None) -> "Session":
        """A new session holding a copy of this one's state -- its
        interpreter, copy-on-write (milliseconds: its memory is not copied
        until one of them writes it) -- independent of this one from then
        on. Its directory: ``cwd`` if given (an existing directory, into
        which this session's directory is copied), else a fresh private copy
        of this session's private directory; a session given a ``cwd`` of
        the caller's shares that with its forks unless they are given one.
        Made in this session's turn: after the cells queued before, before
        those queued after. A sandboxed session's copy gets its own home,
        ``/tmp`` and ``/dev/shm``, copies of its parent's, at the same paths
        (a ``cwd`` is refused), within a budget of forks per family (the
        docs/library/sessions.md says which sandboxed sessions can fork).
        SessionForkError for a bash session or one that cannot be forked,
        or when the copy could not start; SessionClosedError when this
        session is gone; DiskBudgetError when the copy's disk bound does not
        fit its pool's disk budget now."""
        if self.language != "python":
            raise SessionForkError("only a Python session can be forked; a bash session cannot copy its shell")
        if self._start.workspace is not None:
            raise SessionForkError("a session in a workspace cannot be forked: its copy would share the workspace")
        if self._start.sandbox is not None and cwd is not None:
            raise SessionForkError("a sandboxed session's copy gets its own home, /tmp and /dev/shm at the paths "
                                   "its parent has them; it cannot be given a cwd")
        directory = self.cwd if cwd is None else _directory(cwd)
        # Its files are its parent's, copied: none is given again.
        child = Session(self._engine, self.language,
                        replace(self._start, job_id=self._engine.next_id(), cwd=directory, warm=False, files=()),
                        directory)
        child._ancestors = (*self._ancestors, self._future)
        child._reserve()
        made: "Future[Session]" = Future()
        made.add_done_callback(lambda done: child._give_back() if done.exception() is not None else None)
        self._enqueue(_Cell("", None, made, None, Printed(), fork=child))
        try:
            return made.result()
        except BaseException:
            # Interrupted while it forked: a copy made all the same is closed.
            made.add_done_callback(_close_unwanted)
            raise

    def close(self, timeout: float = 5.0) -> None:
        """End the session and everything it started; returns once its tree
        is dead (at most ``timeout`` seconds)."""
        with self._lock:
            if self._gone is None:
                self._gone = "this session was closed"
                self._closing = True
            self._drop_queue()
        self._future.cancel()
        self._ended_event.wait(timeout)

    def add_done_callback(self, fn: Callable[["Session"], object]) -> None:
        """``fn(session)`` once the session has ended, whatever ended it (at
        once if it has), on the thread that saw the end: hand it on and
        return, as ``on_event`` does."""
        self._future.add_done_callback(lambda _: fn(self))

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Session {self.language} {self.id[:8]} {'alive' if self.alive else 'gone'}>"

    # -- inside: under the lock, or on the dispatcher thread ---------------------

    def _enqueue(self, cell: _Cell) -> None:
        with self._lock:
            if self._gone is not None:
                raise SessionClosedError(self._gone)
            self._queue.append(cell)
            self.last_used = time.time()
            self._next()

    def _next(self) -> None:
        """(Under the lock.) Send the next queued cell (or fork), if none runs."""
        if self._running is not None or self._gone is not None or not self._ready:
            return
        while self._queue:
            cell = self._queue.popleft()
            if cell.future.set_running_or_notify_cancel():  # else cancelled while it waited
                if cell.fork is None or self._fork_starts(cell):
                    break
        else:
            return
        assert self._worker is not None
        self._running = cell
        cell.started = time.monotonic()
        if cell.fork is not None:
            self._handle.deadline = time.monotonic() + FORK_TIMEOUT_S + 2 * _CELL_SLACK_S
            self._worker.send(worker_wire.Fork(self._future.job_id, cell.fork._start))
            return
        self._live = LiveBudget()
        slack = None if cell.timeout is None else cell.timeout + _CELL_SLACK_S
        self._handle.deadline = None if slack is None else time.monotonic() + slack
        self._worker.send(worker_wire.Cell(self._future.job_id, cell.code, cell.timeout))

    def _fork_starts(self, cell: _Cell) -> bool:
        """(Under the lock.) The copy's job on this session's worker, or the
        fork's failure."""
        assert cell.fork is not None
        try:
            cell.fork._worker = self._engine.assign(cell.fork._handle, None, self._worker)
        except ExecPoolError as exc:
            cell.future.set_exception(SessionForkError(f"the session could not be forked: {exc}"))
            return False
        return True

    def _cancel(self, future: Future) -> bool:
        with self._lock:
            running = self._running
            if running is not None and running.future is future:
                if running.cancelled:
                    return True
                running.cancelled = True
                assert self._worker is not None
                self._worker.send(worker_wire.Interrupt(self._future.job_id))
                return True
            for cell in self._queue:
                if cell.future is future:
                    self._queue.remove(cell)
                    break
            else:
                return False
        return Future.cancel(future)

    def _kill(self) -> None:
        if self._worker is not None and self._future.job_id in self._worker.jobs:
            # A worker that does not end the session in time is wedged: the
            # watchdog replaces it, ending the session with it.
            self._handle.deadline = time.monotonic() + _CELL_SLACK_S
            self._worker.send(worker_wire.Cancel(self._future.job_id))

    def _output(self, text: str, stream: str) -> None:
        with self._lock:
            cell = self._running
        if cell is None:
            return  # a process the session started printed between cells: nobody's
        cell.printed.add(text, stream)
        if cell.on_event is None or self._live.capped:
            return
        piece = self._live.take(text)
        try:
            if piece:
                cell.on_event(JobOutput(piece, stream))
            if self._live.capped:
                cell.on_event(OutputCapped(self._live.sent))
        except Exception:  # noqa: BLE001 - a consumer's failure is its own
            pass

    def _cell_done(self, reply: bytes, interrupted: bool, printed: int) -> None:
        with self._lock:
            cell, self._running = self._running, None
            self._handle.deadline = None
            if cell is not None and cell.fork is None:
                self._count += 1
        if cell is None:
            return
        if cell.fork is not None:
            self._forked(cell, reply)
            with self._lock:
                self._next()
            return
        fields = read_reply(self.language, reply)
        if interrupted:
            fields["status"] = Status.CANCELLED if cell.cancelled else Status.TIMEOUT
        fields.setdefault("execution_count", self._count)
        self._settle(cell, CellResult(**fields, **cell.printed.fields(printed), duration_s=self._took(cell),
                                      timeout=cell.timeout))
        with self._lock:
            self._next()

    def _forked(self, cell: _Cell, reply: bytes) -> None:
        """The worker's word on a fork: the copy runs, or why not (its own
        Finished, in that case, came first)."""
        child = cell.fork
        assert child is not None
        try:
            said = json.loads(reply)
        except ValueError:
            said = {}
        if not isinstance(said, dict) or not isinstance(said.get("pid"), int):
            why = said.get("error") if isinstance(said, dict) else None
            cell.future.set_exception(SessionForkError(f"the session could not be forked: {why or 'no copy'}"))
            return
        with child._lock:
            child._ready = True
            child._next()
        cell.future.set_result(child)

    def _ended(self, result: Result) -> None:
        """The session's job ended: the cell running, if any, ends with it;
        queued ones, and every later call, raise SessionClosedError."""
        with self._lock:
            cell, self._running = self._running, None
            self.files = result.files
            if self._gone is None:
                self._gone = _why_gone(result, cell is not None)
            why = self._gone
            self._drop_queue()
        if cell is not None and cell.fork is not None:
            cell.future.set_exception(SessionClosedError(why))
        elif cell is not None:
            status = result.status if result.status in (Status.TIMEOUT, Status.CANCELLED, Status.INFRA) else (
                Status.ERROR)
            if cell.cancelled and status is not Status.INFRA:
                status = Status.CANCELLED
            self._settle(cell, CellResult(status=status, **cell.printed.fields(cell.printed.total), alive=False,
                                          message=why, exit_code=result.exit_code, duration_s=self._took(cell),
                                          timeout=cell.timeout))
        self._ended_event.set()

    def _drop_queue(self) -> None:
        """(Under the lock.) The queued cells will never run."""
        while self._queue:
            cell = self._queue.popleft()
            if not cell.future.done():
                cell.future.set_exception(SessionClosedError(self._gone or "the session is gone"))

    @staticmethod
    def _took(cell: _Cell) -> float:
        return round(time.monotonic() - cell.started, 6)

    @staticmethod
    def _settle(cell: _Cell, result: CellResult) -> None:
        try:
            cell.future.set_result(result)
        except InvalidStateError:
            pass  # cancelled while queued, a moment before it was sent


def _directory(cwd: Union[str, os.PathLike]) -> str:
    if not isinstance(cwd, (str, os.PathLike)):
        raise TypeError(f"cwd must be a path, not {type(cwd).__name__}")
    directory = os.path.abspath(os.fspath(cwd))
    if not os.path.isdir(directory):
        raise ValueError(f"cwd {directory!r} is not an existing directory")
    return directory


def _close_unwanted(made: "Future[Session]") -> None:
    """A fork whose caller stopped waiting: its copy, if made, is closed."""
    if made.exception() is None:
        made.result().close(0)


def _why_gone(result: Result, in_cell: bool) -> str:
    """What ended a session that its owner did not close, in words for the
    caller (and a model): its job's Result says."""
    if result.status is Status.INFRA:
        return f"the session is gone: {result.error or 'its worker died'}"
    if result.status is Status.TIMEOUT:
        if in_cell:
            return "the cell did not stop when interrupted; the session was killed with its processes"
        return "the session was idle past its idle timeout and was closed"
    if result.status is Status.CANCELLED:
        return "the cell did not stop when cancelled; the session was killed with its processes"
    if result.error:
        return f"the session was killed: {result.error}"
    return f"the session's process exited ({result.exit_code})"


@functools.lru_cache(maxsize=None)
def has_ipython(python: str) -> bool:
    """Whether ``python`` (a pool's interpreter) can import IPython; asked
    once per interpreter and process -- of another interpreter than this
    one, by starting it."""
    if python == sys.executable:
        return importlib.util.find_spec("IPython") is not None
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('IPython') is None)"
    try:
        return subprocess.run([python, "-c", probe], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=60, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def speaks_ipython(language: str, ipython: Optional[bool], python: str) -> bool:
    """Whether a session speaks IPython: ``ipython=None`` where the pool's
    Python has it; True demands it (ImportError naming the extra where it
    is missing); False, plain Python. A bash session never does."""
    if ipython is not None and not isinstance(ipython, bool):
        raise TypeError(f"ipython must be True, False or None, not {type(ipython).__name__}")
    if language != "python":
        if ipython:
            raise ValueError("ipython=True is for Python sessions; a bash session speaks bash")
        return False
    if ipython is False:
        return False
    found = has_ipython(python)
    if ipython and not found:
        raise ImportError(f"this session was asked to speak IPython, and the pool's Python ({python}) cannot "
                          f"import it: {JUPYTER_EXTRA} there, or pass ipython=False for plain Python",
                          name="IPython")
    return found


def open_session(engine: "Engine", language: str, *, sandbox: Union[None, bool, str, Sandbox] = None,
                 limits: Optional[Limits] = None, idle_timeout: Optional[Number] = DEFAULT_IDLE_TIMEOUT_S,
                 cwd: Optional[Union[str, os.PathLike]] = None, env: Optional[Mapping[str, str]] = None,
                 network: bool = True, files: Optional[Mapping[str, Union[bytes, File]]] = None,
                 fetch: Sequence[str] = (), workspace: Optional["Workspace"] = None,
                 ipython: Optional[bool] = None) -> Session:
    """``ExecPool.session``'s arguments checked, then the session started."""
    if language not in SESSION_LANGUAGES:
        raise ValueError(f"language must be one of {', '.join(SESSION_LANGUAGES)}, not {language!r}")
    config = engine.config
    speaks = speaks_ipython(language, ipython, config.python)  # type: ignore[arg-type]
    if limits is not None and not isinstance(limits, Limits):
        raise TypeError(f"limits must be an execpool.Limits, not {type(limits).__name__}")
    if idle_timeout is not None:
        checks.seconds("idle_timeout", idle_timeout)
    checks.flag("network", network)
    directory = None if cwd is None else _directory(cwd)
    env_all = dict(config.tool_env)
    env_all.update({} if env is None else checks.environment("env", env))
    chosen = job_sandbox(sandbox)
    start = worker_wire.Start(
        job_id=engine.next_id(), argv_kind="python" if language == "python" else "shell", source="", cwd=directory,
        env=env_all, timeout=None, limits=limits or config.limits, live_cap=RESULT_HEAD_CHARS,
        max_output_chars=config.max_output_chars, keep_background=False, python=config.python,  # type: ignore[arg-type]
        stdin=None, warm=language == "python", network=network, separate_stderr=True,
        sandbox=config.sandbox if chosen is None else chosen or None,  # type: ignore[arg-type]
        session=True, idle_timeout=None if idle_timeout is None else float(idle_timeout),
        files=tuple(job_files("files", files or {}).items()), fetch=fetch_patterns("fetch", fetch),
        workspace=None if workspace is None else workspace.id, ipython=speaks)
    session = Session(engine, language, start, directory)
    if workspace is None:
        session._reserve()  # a workspace's session writes the workspace, which holds its own bound
    try:
        session._worker = engine.assign(session._handle, None, None if workspace is None else workspace.worker)
    except BaseException:
        session._give_back()
        raise
    session._ready = True
    session._worker.send(start)
    return session
