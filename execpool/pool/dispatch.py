"""The dispatcher: the one thread that reads every worker's messages.

::

    dispatcher thread (one per pool)
    --------------------------------
    epoll over worker channels + wake pipe
      Output   -> the job's handle -> on_event (JobOutput / OutputCapped)
      Finished -> the job's handle -> its future's result
      Spawned  -> the process groups to kill should the worker die
      Ready    -> the worker takes jobs
      EOF, or a message the channel does not allow -> Workers.lost(worker):
                  its cleanup and its jobs' INFRA results on a thread of their own
    every WATCHDOG_PERIOD_S while jobs run: continue stopped workers, kill
    wedged ones, keep the lifeline alive

Runs in the caller, on a thread of its own: the caller's thread count does
not grow with the number of concurrent jobs. Everything every job depends on
passes through here, so nothing a worker sends can stop it: it reads without
blocking, whole frames only, a bounded amount per worker per turn, and a
worker whose message is not what the channel allows (execpool/shared/worker_wire.py
checks every field) or cannot be handled is killed and treated as dead.
Nothing slow runs here either: a dead worker's cleanup is handed to
execpool/pool/workers.py at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import selectors
import signal
import threading
import time
from typing import Optional

from ..shared import worker_wire
from ..shared.kernel.proctree import is_stopped, stat_fields
from .workers import WorkerProcess, Workers

#: While jobs run, how often the dispatcher looks for a stopped worker (and
#: continues it) and for jobs past their timeout, and how late a job may be
#: before its worker is killed.
WATCHDOG_PERIOD_S = 0.25
WATCHDOG_KILL_S = 10.0

#: How long after its last job ended the dispatcher still looks every
#: WATCHDOG_PERIOD_S, rather than sleeping until a message comes: a job
#: submitted meanwhile need not wake it. Jobs that come one at a time (a
#: service's client, a sequential eval) would otherwise each cost a pipe
#: write and a switch to this thread, before the job is even sent.
IDLE_WATCH_S = 2.0

#: Bytes the dispatcher reads from one worker before it looks at the others.
_DISPATCH_BUDGET = 256 * 1024

logger = logging.getLogger("execpool")


class Dispatcher:
    """Routes worker messages to job handles; doubles as the watchdog."""

    def __init__(self) -> None:
        self._wake_r, self._wake_w = worker_wire.pipe()
        os.set_blocking(self._wake_w, False)  # a full wake pipe is awake enough
        os.set_blocking(self._wake_r, False)  # the loop's turn also comes on a timer
        self._next_watchdog = 0.0
        # Watch on a timeout until then; asleep: in a wait without one.
        self._watch_until = 0.0
        self._asleep = False
        # One selector for the pool's life, not one per wait (as
        # multiprocessing.connection.wait makes): two waits per job.
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._heard: set = set()
        self._thread: Optional[threading.Thread] = None
        # Set while an event loop reads the messages (attach), with its timer.
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._tick: Optional[asyncio.TimerHandle] = None
        self._leave = False  # the thread's to end, for attach
        self.workers: Optional[Workers] = None

    def start(self, workers: Workers) -> None:
        self.workers = workers
        self._start_thread()

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name="execpool-dispatcher", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """The workers or the running jobs changed: look again."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def job_started(self) -> None:
        """A job was assigned (under the workers' lock, as the dispatcher
        decides whether to sleep): its timeout must be watched."""
        if self._asleep:
            self._asleep = False
            self.wake()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the workers' messages on ``loop``, from its own thread (call
        it there), rather than on the dispatcher's thread: a service's loop
        then takes each job's messages as they come, where the thread would
        wake for each, wait for the interpreter's lock the loop holds, and
        wake the loop in turn to hand the Result over."""
        if self._loop is not None:
            raise RuntimeError("the pool already routes its messages on an event loop")
        self._leave = True
        self.wake()
        assert self._thread is not None
        self._thread.join()
        self._leave = False
        for worker in list(self._heard):
            self._forget(worker)
        self._loop = loop
        loop.add_reader(self._wake_r, self._loop_turn)
        self._loop_turn()

    def detach(self) -> None:
        """Back to the dispatcher's own thread (call it on the loop's thread,
        while it runs, or once it has stopped)."""
        loop = self._loop
        if loop is None:
            return
        for worker in list(self._heard):
            self._forget(worker)
        if not loop.is_closed():
            loop.remove_reader(self._wake_r)
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        self._loop = None
        self._start_thread()

    def release(self, timeout: float) -> None:
        """:meth:`detach`, from any thread: the pool is closing, and only
        the thread reads what its workers say as they stop."""
        loop = self._loop
        if loop is None:
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop or loop.is_closed() or not loop.is_running():
            self.detach()
            return
        detached = threading.Event()

        def give_back() -> None:
            self.detach()
            detached.set()

        loop.call_soon_threadsafe(give_back)
        if not detached.wait(timeout):
            logger.warning("execpool: the event loop did not give the pool's messages back within %g s", timeout)

    def stop(self, timeout: float) -> None:
        """After ``Workers.close``: the thread ends once every worker's
        channel has ended."""
        self.wake()
        if self._thread is not None:
            self._thread.join(timeout)
        self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _look(self, workers: Workers) -> Optional[bool]:
        """Listen to exactly the pool's workers; whether jobs run (the
        watchdog's to watch), or None once the pool is closed and every
        worker's channel has ended."""
        with workers.lock:
            listening = set(workers.all)
            if workers.closed and not listening:
                return None
            watching = workers.running_jobs > 0 or workers.cleanups_waiting
            now = time.monotonic()
            if watching:
                self._watch_until = now + IDLE_WATCH_S
            self._asleep = not watching and now >= self._watch_until
        for worker in self._heard - listening:
            self._forget(worker)
        for worker in listening - self._heard:
            self._listen(worker)
        return watching

    def _watch(self, workers: Workers, watching: bool) -> None:
        if watching and time.monotonic() >= self._next_watchdog:
            self._next_watchdog = time.monotonic() + WATCHDOG_PERIOD_S
            self._watchdog(workers)
            workers.start_cleanups()

    def _run(self) -> None:
        workers = self.workers
        assert workers is not None
        while not self._leave:
            watching = self._look(workers)
            if watching is None:
                return
            events = self._selector.select(None if self._asleep else WATCHDOG_PERIOD_S)
            self._watch(workers, watching)
            for key, _mask in events:
                if key.data is None:
                    self._drain_wake()
                elif key.data in self._heard:  # not lost earlier in this batch
                    self._serve(workers, key.data)

    def _loop_turn(self) -> None:
        """The thread's turn, on the loop: woken (or due), look again, and
        come back on a timer while there is something to watch."""
        workers = self.workers
        assert workers is not None and self._loop is not None
        self._drain_wake()
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        watching = self._look(workers)
        if watching is None:
            return
        self._watch(workers, watching)
        if not self._asleep:
            self._tick = self._loop.call_later(WATCHDOG_PERIOD_S, self._loop_turn)

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 4096)

    def _listen(self, worker: WorkerProcess) -> None:
        fd = worker.frames.fd
        if self._loop is None:
            self._selector.register(fd, selectors.EVENT_READ, worker)
        else:
            self._loop.add_reader(fd, self._serve_on_loop, worker)
        self._heard.add(worker)

    def _serve_on_loop(self, worker: WorkerProcess) -> None:
        assert self.workers is not None
        if worker in self._heard:
            self._serve(self.workers, worker)

    def _forget(self, worker: WorkerProcess) -> None:
        """Before the worker is lost, while its channel is still open: once
        closed, its descriptor's number may be a successor's."""
        if worker in self._heard:
            self._heard.discard(worker)
            if self._loop is None:
                self._selector.unregister(worker.frames.fd)
            elif not self._loop.is_closed():
                self._loop.remove_reader(worker.frames.fd)

    def _serve(self, workers: Workers, worker: WorkerProcess) -> None:
        """Route what one worker sent (a bounded amount, so one flooding
        worker cannot starve the others). Whatever goes wrong doing so is
        that worker's fault -- it is killed and replaced -- never the
        dispatcher's, which every other job depends on."""
        try:
            for frame in worker.frames.frames(_DISPATCH_BUDGET):
                self._route(workers, worker, worker_wire.decode_from_worker(frame))
        except EOFError:
            self._forget(worker)
            workers.lost(worker)
        except Exception as exc:
            if isinstance(exc, worker_wire.ChannelError):
                worker.fault = str(exc)
                logger.warning("execpool: killing worker %d, which broke the channel protocol: %s",
                               worker.pid, worker.fault)
            else:
                worker.fault = f"handling its message failed: {exc!r}"
                logger.error("execpool: killing worker %d: handling its message failed", worker.pid, exc_info=exc)
            worker.proc.kill()
            self._forget(worker)
            workers.lost(worker)

    def _route(self, workers: Workers, worker: WorkerProcess, msg: worker_wire.FromWorker) -> None:
        """Hand one message to its job; ChannelError for one that this worker
        had no business sending, which the fields' types alone do not show."""
        if isinstance(msg, worker_wire.Output):
            handle = worker.jobs.get(msg.job_id)
            if handle is None:
                raise worker_wire.ChannelError(f"output for job {msg.job_id}, which it does not run")
            handle.output(msg.text, msg.stream)
        elif isinstance(msg, worker_wire.Finished):
            handle = workers.finished(worker, msg.job_id)
            if handle is None:
                raise worker_wire.ChannelError(f"a result for job {msg.job_id}, which it does not run")
            handle.finish(msg.result)
        elif isinstance(msg, worker_wire.CellDone):
            handle = worker.jobs.get(msg.job_id)
            if handle is None or not handle.cell_done(msg.reply, msg.interrupted, msg.printed):
                raise worker_wire.ChannelError(f"a cell's end for job {msg.job_id}, which is no session it runs")
        elif isinstance(msg, worker_wire.Spawned):
            if msg.job_id not in worker.jobs:
                raise worker_wire.ChannelError(f"a tool for job {msg.job_id}, which it does not run")
            # The group is killed when the worker dies: it must be a tool's
            # own (a tool leads a session of its own), never someone else's.
            if msg.pid <= 1 or msg.pgid != msg.pid or _parent(msg.pid) not in (worker.pid, None):
                raise worker_wire.ChannelError(f"process group {msg.pgid} for job {msg.job_id}, "
                                           f"which is not its tool's")
            worker.pgids[msg.job_id] = msg.pgid
        elif isinstance(msg, worker_wire.Ready):
            if msg.pid != worker.pid:
                raise worker_wire.ChannelError(f"a Ready naming process {msg.pid}")
            workers.ready(worker, msg.preload_errors)

    def _watchdog(self, workers: Workers) -> None:
        """A worker enforces its jobs' timeouts, answers Cancels and sees its
        owner's end only while it runs -- and a tool runs as the worker's
        user and can SIGSTOP it. While any job runs, a busy worker found
        stopped is continued (its tool may stop it again, for at most a
        period each time), and one with a job overdue by WATCHDOG_KILL_S --
        stopped, wedged or looping -- is killed: its jobs fail as ``INFRA``
        and a fresh worker takes over. The lifeline, which tools can stop or
        kill too, is continued or replaced. Reads one ``/proc/PID/stat`` per
        busy worker (and the lifeline's) per period, none while idle."""
        now = time.monotonic()
        with workers.lock:
            busy = [(w, max((now - h.deadline for h in w.jobs.values() if h.deadline is not None), default=0.0))
                    for w in workers.all if w.jobs]
        for worker, late in busy:
            if late > WATCHDOG_KILL_S:
                worker.proc.kill()
            elif is_stopped(worker.pid):
                if not worker.stopped_seen:
                    worker.stopped_seen = True
                    logger.warning("execpool: worker %d was stopped (by one of its tools?); continuing it",
                                   worker.pid)
                worker.proc.send_signal(signal.SIGCONT)
        workers.lifeline.watch()


def _parent(pid: int) -> Optional[int]:
    """The parent of a live process; None once it has ended (a tool may
    have ended, even been reaped, before its Spawned is read; one being
    reaped shows state X and parent 0)."""
    fields = stat_fields(pid)
    return int(fields[1]) if fields and fields[0] not in (b"Z", b"X", b"x") else None
