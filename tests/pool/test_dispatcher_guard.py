"""The dispatcher against its own workers: one thread routes every worker's
messages, so nothing one worker sends or fails to do may stop the others.

- A worker that writes garbage into its channel -- ill-typed fields,
  unknown job ids, a Result of the wrong shape, half a message -- is treated
  as dead: killed, its jobs ended with an ``Execution error``, replaced,
  while a job on another worker runs on to its normal end.
- A worker its tool has SIGSTOPped is continued, whatever the timeouts of
  the jobs in flight, so a later job's timeout still holds.

The forgeries are written the way a tool that got hold of the pipe would
write them: straight into the worker's end, found through ``/proc`` (which
needs the permission to look at another process's descriptors -- root, here).
"""

from __future__ import annotations

import ctypes
import os
import pickle
import queue
import signal
import struct
import time
from typing import Callable

import psutil
import pytest

from execpool import ExecPool, Limits, Result, ShellJob, Status
from execpool.shared import worker_wire
from tests.support.helpers import alive, pids_in, remember, state, wait_for, worker_records

pytestmark = pytest.mark.hostile

#: How long a job that must end may take to end, here.
DEADLINE_S = 10.0


class Running:
    """A job submitted with ``pool.submit``, read with deadlines: a dead
    dispatcher makes a test fail, never hang. ``worker`` is the pool's record
    of the worker that runs it."""

    def __init__(self, pool: ExecPool, job: ShellJob) -> None:
        self._messages: queue.SimpleQueue = queue.SimpleQueue()
        self.future = pool.submit(job, on_event=self._messages.put)
        self.future.add_done_callback(self._messages.put)
        self._pool = pool
        self.output = ""
        self.result = None

    @property
    def worker(self):
        """Looked up while the job runs (a quick job may be done, and in no
        worker's records, by the time submit returns: under load it was)."""
        assert self.result is None, "the job has ended: no worker runs it"
        return next(w for w in worker_records(self._pool) if self.future.job_id in w.jobs)

    def _next(self, deadline: float) -> None:
        try:
            msg = self._messages.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no word from the job within its deadline; output so far {self.output!r}") from None
        if msg is self.future:
            self.result = msg.result()
        else:
            assert isinstance(msg.text, str), f"the job got a non-text output: {msg.text!r}"
            self.output += msg.text

    def wait_output(self, text: str, timeout: float = DEADLINE_S) -> str:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            assert self.result is None, f"the job ended before writing {text!r}: {self.result}"
            self._next(deadline)
        return self.output

    def wait_result(self, timeout: float = DEADLINE_S) -> Result:
        deadline = time.monotonic() + timeout
        while self.result is None:
            self._next(deadline)
        return self.result


#: The system call that copies another process's descriptor (Linux 5.6+,
#: the same number on every architecture).
PIDFD_GETFD = 438


def frame(payload: bytes) -> bytes:
    """``multiprocessing.connection``'s framing: a signed 32-bit length first."""
    return struct.pack("!i", len(payload)) + payload


def forge(worker, data: bytes) -> None:
    """Write ``data`` into the channel from ``worker`` to the supervisor,
    through a copy of the worker's own descriptor (``pidfd_getfd``, which
    needs the right to trace the worker: root here), as a tool that got hold
    of it would. ``/proc/<pid>/fd`` cannot reopen a socket."""
    write_fd = int(psutil.Process(worker.proc.pid).cmdline()[4])  # -m execpool.worker READ_FD WRITE_FD ...
    pidfd = os.pidfd_open(worker.proc.pid)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        out = libc.syscall(PIDFD_GETFD, pidfd, write_fd, 0)
        if out < 0:
            errno = ctypes.get_errno()
            if errno in (1, 13):  # EPERM, EACCES
                pytest.skip("no right to copy another process's descriptors here (not root)")
            raise OSError(errno, os.strerror(errno))
    finally:
        os.close(pidfd)
    try:
        os.write(out, data)
    finally:
        os.close(out)


def _start() -> worker_wire.Start:
    return worker_wire.Start(job_id=1, argv_kind="shell", source="true", cwd=None, env={}, timeout=None,
                         limits=Limits(), live_cap=None, max_output_chars=100, keep_background=False,
                         python="/bin/false", stdin=None, warm=False, network=True)


def _missing_field(job_id: int) -> object:
    msg = worker_wire.Output.__new__(worker_wire.Output)
    object.__setattr__(msg, "job_id", job_id)
    return msg


#: What a worker might send instead of an honest message; each takes the id
#: of the job running on it and the pid of another worker's tool.
FORGERIES: dict[str, Callable[[int, int], bytes]] = {
    "Finished naming an unhashable job id": lambda job, other: pickle.dumps(worker_wire.Finished([job], Result(Status.OK))),
    "Spawned naming an unhashable job id": lambda job, other: pickle.dumps(worker_wire.Spawned({}, 1, 1)),
    "Finished whose Result has ill-typed fields": lambda job, other: pickle.dumps(
        worker_wire.Finished(job, Result(Status.OK, output=5, exit_code="0", error_lines=[b"x"]))),
    "Finished whose status is a plain string": lambda job, other: pickle.dumps(
        worker_wire.Finished(job, Result("ok"))),
    "Output carrying bytes": lambda job, other: pickle.dumps(worker_wire.Output(job, b"bytes")),
    "Output naming a bool for a job id": lambda job, other: pickle.dumps(worker_wire.Output(True, "x")),
    "Output for a job this worker does not run": lambda job, other: pickle.dumps(worker_wire.Output(job + 1000, "x")),
    "Finished for a job this worker does not run": lambda job, other: pickle.dumps(
        worker_wire.Finished(job + 1000, Result(Status.OK))),
    "Spawned naming another worker's process group": lambda job, other: pickle.dumps(
        worker_wire.Spawned(job, other, other)),
    "Spawned whose group is not its leader's": lambda job, other: pickle.dumps(worker_wire.Spawned(job, 12345, other)),
    "a Start, which only the supervisor sends": lambda job, other: pickle.dumps(_start()),
    "Ready naming another process": lambda job, other: pickle.dumps(worker_wire.Ready(1)),
    "a Result that is no message": lambda job, other: pickle.dumps(Result(Status.OK)),
    "a message missing a field": lambda job, other: pickle.dumps(_missing_field(job)),
    "a pickle naming a class outside the channel": lambda job, other: pickle.dumps(os.getpid),
    "not a pickle": lambda job, other: b"\x80\x05 garbage",
}

#: The job on the worker that goes rogue; it never ends by itself.
VICTIM = 'echo "PIDS $$"; exec sleep 100'
#: The job on the other worker, which must end normally meanwhile.
BYSTANDER = 'echo "PIDS $$"; sleep 1; echo done'


def _two_jobs(pool: ExecPool, doomed: list) -> tuple:
    """One job per worker (dispatch goes to the least loaded); returns them
    with the victim's worker record and the bystander's leader pid."""
    victim = Running(pool, ShellJob(VICTIM, timeout=None))
    bystander = Running(pool, ShellJob(BYSTANDER, timeout=30))
    remember(doomed, pids_in(victim.wait_output("PIDS")) + pids_in(bystander.wait_output("PIDS")))
    worker = victim.worker
    assert worker is not bystander.worker, "each job went to a worker of its own"
    return victim, bystander, worker, pids_in(bystander.output)[0]


def _assert_rogue_worker_was_replaced(pool: ExecPool, worker, victim: Running, bystander: Running) -> None:
    result = victim.wait_result()
    assert result.text.startswith("Execution error: "), result
    assert "channel" in result.error, result.error
    assert wait_for(lambda: not any(alive(pid) for pid in pids_in(victim.output)), 2.0)
    assert wait_for(lambda: worker.proc.poll() is not None, 2.0), "the rogue worker still runs"
    assert bystander.wait_result().text.endswith("done\n"), bystander.result
    assert wait_for(lambda: len(pool.worker_pids) == 2 and worker.proc.pid not in pool.worker_pids, DEADLINE_S)
    again = Running(pool, ShellJob("echo again", timeout=30)).wait_result()
    assert again.text == "again\n", again


@pytest.mark.slow
@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_worker_that_sends_garbage_is_treated_as_dead(forgery, doomed):
    with ExecPool(workers=2) as pool:
        victim, bystander, worker, other = _two_jobs(pool, doomed)
        forge(worker, frame(FORGERIES[forgery](victim.future.job_id, other)))
        _assert_rogue_worker_was_replaced(pool, worker, victim, bystander)


@pytest.mark.slow
def test_half_a_message_holds_up_no_other_worker(doomed):
    """A frame whose length promises more than ever comes: the dispatcher
    must not sit in a read for the rest while other workers wait."""
    with ExecPool(workers=2) as pool:
        victim, bystander, worker, _ = _two_jobs(pool, doomed)
        forge(worker, struct.pack("!i", 20) + b"0123456789")
        assert bystander.wait_result().text.endswith("done\n"), bystander.result
        again = Running(pool, ShellJob("echo again", timeout=30)).wait_result()
        assert again.text == "again\n", again
        # The worker's own next message completes the frame into garbage.
        victim.future.cancel()
        result = victim.wait_result()
        assert result.error is not None and "channel" in result.error, result
        assert wait_for(lambda: len(pool.worker_pids) == 2 and worker.proc.pid not in pool.worker_pids, DEADLINE_S)


@pytest.mark.slow
def test_an_exception_while_routing_kills_that_worker_not_the_dispatcher(doomed, monkeypatch):
    """Whatever validation misses: a failure handling one worker's message
    costs that worker, never the one thread every job depends on."""
    with ExecPool(workers=2) as pool:
        victim, bystander, worker, _ = _two_jobs(pool, doomed)
        route = pool._dispatcher._route

        def faulty(workers, source, msg):
            if source is worker and isinstance(msg, worker_wire.Output):
                raise RuntimeError("a bug in routing")
            return route(workers, source, msg)

        monkeypatch.setattr(pool._dispatcher, "_route", faulty)
        forge(worker, frame(pickle.dumps(worker_wire.Output(victim.future.job_id, "forged"))))
        _assert_rogue_worker_was_replaced(pool, worker, victim, bystander)


#: Keeps its worker stopped: stops it again 50 ms after anyone continues it.
STOPPER = 'echo "PIDS $$"; while :; do kill -STOP $PPID; sleep 0.05; done'


@pytest.mark.slow
def test_a_stopped_worker_does_not_stall_a_later_timed_job(doomed):
    """Only untimed jobs in flight used to mean no watchdog at all: the
    dispatcher slept until a message came, and a stopped worker sends none."""
    with ExecPool(workers=1) as pool:
        worker = pool.worker_pids[0]
        try:
            stopper = Running(pool, ShellJob(STOPPER, timeout=None))
            remember(doomed, pids_in(stopper.wait_output("PIDS")))
            assert wait_for(lambda: state(worker) == "T", DEADLINE_S), "the tool never stopped its worker"
            started = time.monotonic()
            timed = Running(pool, ShellJob("sleep 30", timeout=2)).wait_result(timeout=8.0)
            took = time.monotonic() - started
            assert timed.timed_out or timed.error is not None, timed
            assert took < 6.0, f"a 2 s timeout took {took:.1f} s"
        finally:
            os.kill(worker, signal.SIGCONT)


@pytest.mark.parametrize("idle_watch_s", [0.0, pytest.param(60.0, marks=pytest.mark.slow)],
                         ids=["asleep", "still-watching"])
def test_a_job_sent_to_a_stopped_idle_worker_still_times_out(monkeypatch, idle_watch_s):
    """After its last job the dispatcher keeps watching for a while and
    then sleeps until a message comes; a stopped worker sends none, so the
    first job either finds it watching or wakes it. Run as the test's user
    (root here), who stops the worker while no job runs."""
    from execpool.pool import dispatch

    monkeypatch.setattr(dispatch, "IDLE_WATCH_S", idle_watch_s)
    with ExecPool(workers=1) as pool:
        assert pool.run(ShellJob("true")).ok
        worker = pool.worker_pids[0]
        os.kill(worker, signal.SIGSTOP)
        try:
            assert wait_for(lambda: state(worker) == "T", DEADLINE_S)
            started = time.monotonic()
            timed = Running(pool, ShellJob("sleep 30", timeout=1)).wait_result(timeout=8.0)
            assert timed.timed_out, timed
            assert time.monotonic() - started < 6.0
        finally:
            os.kill(worker, signal.SIGCONT)
