"""What ``ExecPool.submit`` gives back: a future, and the job's events.

Runs in the caller. A submitted job is a :class:`JobFuture` -- a
``concurrent.futures.Future`` whose result is the job's ``Result`` -- plus,
if the caller asked for them, events delivered to its ``on_event`` callback
as the job runs. Both are fed by the pool's one dispatcher thread
(execpool/pool/dispatch.py), so a job's events arrive in order, from one thread,
and all of them before its future is done.

The events are the caller's own types, not the messages on the wire
(execpool/shared/worker_wire.py): the wire may change with the worker, these are the
public API.

Where this differs from the standard library: ``JobFuture.cancel()`` works on
a *running* job -- every submitted job is running as far as a future can
tell, since it is sent to a worker at once -- and it kills the job's process
tree. The future then completes normally, once the worker has confirmed the
tree is dead, with a Result whose status is ``CANCELLED``: a cancelled job is
an outcome, as a timeout is, not an exception. ``cancelled()`` stays False.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Callable, Optional, Union

from ..shared.output import LiveBudget
from ..shared.result import Result
from .lazy_thread import OnDemandThread
from .stats import StatsRecorder

#: How often the pool looks at the cancel_events of running jobs.
CANCEL_WATCH_INTERVAL_S = 0.002

logger = logging.getLogger("execpool")


@dataclass(frozen=True)
class JobOutput:
    """A piece of the tool's output, as it was produced: its merged
    stdout/stderr, or -- for a job with ``separate_stderr`` -- one of the two,
    as ``stream`` says."""

    text: str
    stream: str = "stdout"


@dataclass(frozen=True)
class OutputCapped:
    """The job printed more than the live-output cap; nothing more is
    delivered live (``streamed`` characters were). Its Result is not capped."""

    streamed: int


JobEvent = Union[JobOutput, OutputCapped]
OnEvent = Callable[[JobEvent], object]


class JobFuture(Future):
    """The future of one submitted job: ``result()`` is its ``Result``.

    ``concurrent.futures.wait``/``as_completed`` and ``asyncio.wrap_future``
    take it as they take any future. ``cancel()`` kills a running job (see
    the module docstring for how that differs from the standard library).
    """

    def __init__(self, job_id: int) -> None:
        super().__init__()
        self.job_id = job_id
        self._cancel: Callable[[], None] = lambda: None
        self.set_running_or_notify_cancel()

    def cancel(self) -> bool:
        """Ask the job's worker to kill its tree; True unless the job had
        already ended. Returns at once; the future completes with a
        ``CANCELLED`` Result once the tree is dead."""
        if self.done():
            return False
        self._cancel()
        return True


class JobHandle:
    """The pool's side of one job: where its messages go.

    Called from the dispatcher thread only (and, for a job that ends before
    it reaches a worker, from ``submit``'s), so its counts need no lock.
    """

    __slots__ = ("future", "on_event", "kind", "stats", "live", "worker", "deadline")

    def __init__(self, future: JobFuture, on_event: Optional[OnEvent], kind: str, stats: StatsRecorder) -> None:
        self.future = future
        self.on_event = on_event
        self.kind = kind
        self.stats = stats
        self.live = LiveBudget()
        # Set by the pool when a worker takes the job.
        self.worker: Optional[object] = None
        self.deadline: Optional[float] = None

    @property
    def job_id(self) -> int:
        return self.future.job_id

    def cell_done(self, reply: bytes, interrupted: bool, printed: int) -> bool:
        """A session's cell ended (execpool/pool/sessions.py); False: this
        job is no session, and its worker had no business saying so."""
        return False

    def output(self, text: str, stream: str = "stdout") -> None:
        if self.on_event is None or self.live.capped:
            return
        piece = self.live.take(text)
        if piece:
            self._emit(JobOutput(piece, stream))
        if self.live.capped:
            self._emit(OutputCapped(self.live.sent))

    def finish(self, result: Result) -> None:
        self.stats.job(self.kind, result)
        try:
            self.future.set_result(result)
        except InvalidStateError:
            # Cannot happen while a job's handle is taken from its worker
            # under the pool's lock exactly once; said loudly if it does
            # (benchmarks/chaos.py counts these), never raised at the
            # dispatcher, which serves every other job.
            logger.error("execpool: job %d ended twice; the second Result is dropped", self.job_id)

    def _emit(self, event: JobEvent) -> None:
        """A consumer's failure is its own: the dispatcher thread
        serves every other job and must not die of it, nor this job."""
        try:
            if self.on_event is not None:
                self.on_event(event)
        except Exception as exc:
            logger.error("execpool: on_event of job %d raised", self.job_id, exc_info=exc)


class CancelWatcher(OnDemandThread):
    """Turns a caller's ``threading.Event`` into an immediate cancel.

    An Event has no file descriptor to wait on and no callback, so something
    has to look at it. Polling it from each consumer every ``poll_interval_s``
    costs that interval in latency (a 0.2 s watcher adds ~110 ms); this is one
    thread per pool -- not per job -- that checks every registered event each
    ``CANCEL_WATCH_INTERVAL_S`` while any is registered, and exists only then.
    """

    _name = "execpool-cancel-watcher"

    def __init__(self) -> None:
        super().__init__()
        # By the future's id(): a job's or a session's cell; each is
        # forgotten once done, so no id is reused while it is here.
        self._watched: dict[int, tuple[threading.Event, Future]] = {}

    def watch(self, future: Future, event: threading.Event) -> None:
        with self._cond:
            if self._closed:
                return
            self._watched[id(future)] = (event, future)
            self._wake()
        future.add_done_callback(self._forget)

    @property
    def watching(self) -> int:
        with self._cond:
            return len(self._watched)

    def _forget(self, future: Future) -> None:
        with self._cond:
            self._watched.pop(id(future), None)

    def _drop(self) -> None:
        self._watched.clear()  # the pool closed: its jobs end without a watcher

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed or not self._watched:
                    # Nothing to watch: end, so an idle pool holds no thread
                    # beyond its dispatcher; the next watch() starts another.
                    self._thread = None
                    return
                fired = [key for key, (event, _) in self._watched.items() if event.is_set()]
                futures = [self._watched.pop(key)[1] for key in fired]
            for future in futures:
                future.cancel()
            with self._cond:
                if self._watched and not self._closed:
                    self._cond.wait(CANCEL_WATCH_INTERVAL_S)
