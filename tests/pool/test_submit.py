"""The public entry point, ``pool.submit``, and the outcomes it gives:
futures that the standard library's tools take, events in order from one
thread, cancel that kills, and a ``Status`` that keeps execpool's failures
apart from the program's."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, as_completed, wait

import pytest

import execpool
from execpool import (
    ExecPool,
    JobFuture,
    JobOutput,
    Limits,
    PoolClosedError,
    PoolConfig,
    PythonJob,
    Result,
    ShellJob,
    Status,
)
from tests.support import hostile
from tests.support.helpers import all_dead, pids_in, wait_for, worker_records

DEADLINE_S = 10.0


@pytest.fixture(scope="module")
def pool():
    with ExecPool(workers=2) as p:
        yield p


def test_a_future_of_a_result_that_the_standard_tools_take(pool, tmp_path):
    gate = tmp_path / "gate"
    held = f"import os, time\nwhile not os.path.exists({str(gate)!r}):\n    time.sleep(0.01)\n"
    futures = [pool.submit(PythonJob(held + "print(0)")), pool.submit(PythonJob(held + "print(1)")),
               pool.submit(PythonJob("print(2)"))]
    assert all(isinstance(f, Future) and isinstance(f, JobFuture) for f in futures)
    done, pending = wait(futures, timeout=DEADLINE_S, return_when=FIRST_COMPLETED)
    assert done == {futures[2]} and len(pending) == 2, "only the job that waits for nothing has ended"
    gate.touch()
    order = [f.result().output for f in as_completed(futures, timeout=DEADLINE_S)]
    assert order[0] == "2\n" and sorted(order) == ["0\n", "1\n", "2\n"]
    assert all(isinstance(f.result(), Result) and f.result().status is Status.OK for f in futures)


def test_asyncio_awaits_a_job_through_wrap_future(pool):
    async def main():
        return await asyncio.wrap_future(pool.submit(ShellJob("echo from asyncio")))

    assert asyncio.run(main()).output == "from asyncio\n"


def test_cancelling_the_awaiting_task_kills_the_job(pool):
    seen = threading.Event()
    text = []

    def on_event(event):
        text.append(event.text)
        seen.set()

    async def main():
        future = pool.submit(ShellJob(hostile.FORK_TREE, timeout=None), on_event=on_event)
        task = asyncio.ensure_future(asyncio.wrap_future(future))
        await asyncio.get_running_loop().run_in_executor(None, seen.wait, DEADLINE_S)
        while len(pids_in("".join(text))) < 9:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return future

    future = asyncio.run(main())
    assert future.result(DEADLINE_S).status is Status.CANCELLED
    assert all_dead(pids_in("".join(text)), timeout=1.0)


def test_events_arrive_in_order_from_one_thread_and_before_the_result(pool):
    events, threads, done_already = [], set(), []
    box: list = []

    def on_event(event):
        threads.add(threading.get_ident())
        events.append(event)
        done_already.append(bool(box) and box[0].done())

    box.append(pool.submit(ShellJob("for i in $(seq 1 200); do echo line $i; done"), on_event=on_event))
    result = box[0].result(DEADLINE_S)
    assert all(isinstance(e, JobOutput) for e in events)
    assert "".join(e.text for e in events) == result.output
    assert len(threads) == 1 and threading.get_ident() not in threads
    assert not any(done_already)


def test_cancel_on_a_running_job_kills_its_tree_and_the_result_says_cancelled(pool):
    text = []
    future = pool.submit(ShellJob(hostile.FORK_TREE, timeout=None), on_event=lambda e: text.append(e.text))
    assert wait_for(lambda: len(pids_in("".join(text))) >= 9, DEADLINE_S)
    assert future.cancel() is True
    result = future.result(DEADLINE_S)
    assert result.status is Status.CANCELLED and result.text == "Execution cancelled."
    assert not future.cancelled(), "a cancelled job is an outcome, as a timeout is"
    assert all_dead(pids_in("".join(text)), timeout=1.0)
    assert future.cancel() is False, "an ended job cannot be cancelled"


def test_a_cancel_event_cancels_like_future_cancel(pool):
    cancel = threading.Event()
    text = []
    future = pool.submit(ShellJob("echo up; sleep 30"), cancel_event=cancel, on_event=lambda e: text.append(e.text))
    assert wait_for(lambda: text, DEADLINE_S)
    cancel.set()
    assert future.result(DEADLINE_S).status is Status.CANCELLED


@pytest.mark.parametrize("job, status", [
    (ShellJob("exit 0"), Status.OK),
    (ShellJob("exit 3"), Status.ERROR),
    (ShellJob("kill -SEGV $$"), Status.ERROR),
    (ShellJob("sleep 10", timeout=0.2), Status.TIMEOUT),
    (ShellJob("   "), Status.ERROR),
    (PythonJob("import os; [os.fork() for _ in range(8)]; import time; time.sleep(5)",
               limits=Limits(processes=4)), Status.ERROR),
])
def test_each_ending_has_its_status_and_the_text_is_unchanged(pool, job, status):
    result = pool.submit(job).result(DEADLINE_S)
    assert result.status is status, result
    assert result.ok is (status is Status.OK)
    assert str(result.status) == status.value


def test_a_job_that_cannot_start_is_infra_not_the_programs_error():
    with ExecPool(workers=1, cgroups=False) as pool:
        result = pool.submit(ShellJob("echo never", limits=Limits(memory=1 << 30))).result(DEADLINE_S)
    assert result.status is Status.INFRA, result
    assert result.text.startswith("Execution error: cannot start the tool")


def test_a_dead_worker_is_infra_with_its_pid_and_signal():
    with ExecPool(workers=1) as pool:
        text = []
        future = pool.submit(ShellJob("echo up; sleep 30"), on_event=lambda e: text.append(e.text))
        assert wait_for(lambda: text, DEADLINE_S)
        worker = pool.worker_pids[0]
        os.kill(worker, signal.SIGKILL)
        result = future.result(DEADLINE_S)
    assert result.status is Status.INFRA
    assert (result.worker_pid, result.worker_exit_code, result.worker_signal) == (worker, -9, "SIGKILL")
    assert result.text.startswith("Execution error: worker process ")


def test_a_job_running_when_the_pool_closes_is_infra():
    pool = ExecPool(workers=1)
    text = []
    future = pool.submit(ShellJob("echo up; sleep 30"), on_event=lambda e: text.append(e.text))
    assert wait_for(lambda: text, DEADLINE_S)
    pool.close()
    result = future.result(0)
    assert result.status is Status.INFRA and "the pool was closed" in result.error


def test_an_on_event_that_raises_changes_nothing(pool):
    def on_event(event):
        raise RuntimeError("consumer bug")

    assert pool.submit(ShellJob("echo a; echo b"), on_event=on_event).result(DEADLINE_S).output == "a\nb\n"
    assert pool.run(ShellJob("echo next")).output == "next\n"


def test_misuse_raises_at_submit(pool):
    with pytest.raises(TypeError, match="job must be"):
        pool.submit("echo hi")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="on_event must be callable"):
        pool.submit(ShellJob("true"), on_event="print")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cancel_event"):
        pool.submit(ShellJob("true"), cancel_event=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not an existing directory"):
        pool.submit(ShellJob("true", cwd="/nonexistent/dir"))
    closed = ExecPool(workers=1)
    closed.close()
    with pytest.raises(PoolClosedError) as caught:
        closed.submit(ShellJob("true"))
    assert isinstance(caught.value, execpool.ExecPoolError)
    with pytest.raises(TypeError, match="unexpected option 'worker'"):
        ExecPool(worker=2)


def test_a_pool_whose_workers_do_not_start_says_so_with_a_broken_pool_error():
    """A worker takes tens of milliseconds to be ready: none is in one."""
    with pytest.raises(execpool.PoolBrokenError, match="did not start within") as caught:
        ExecPool(workers=1, startup_timeout=0.001)
    assert isinstance(caught.value, execpool.ExecPoolError) and isinstance(caught.value, RuntimeError)


def test_a_pool_from_a_config_built_elsewhere():
    config = PoolConfig(workers=1, env={"GREETING": "hello"}, warm_spares=0)
    assert config.workers == 1 and config.tool_env["GREETING"] == "hello"
    with ExecPool.from_config(config) as pool:
        assert pool.config is config
        assert pool.run(ShellJob("echo $GREETING")).output == "hello\n"


@pytest.mark.parametrize("kwargs, error", [
    ({"workers": 0}, ValueError), ({"workers": True}, TypeError), ({"max_output_chars": -1}, ValueError),
    ({"warm_spares": 65}, ValueError), ({"preload": "numpy"}, TypeError), ({"preload": ["no-such name"]}, ValueError),
    ({"spawn_method": "posix_spawn"}, ValueError), ({"cgroups": 1}, TypeError), ({"startup_timeout": 0}, ValueError),
    ({"python": "/nonexistent/python"}, ValueError), ({"limits": {}}, TypeError),
    ({"env": {"A": "x\x00"}}, ValueError),
])
def test_the_configuration_is_checked_before_anything_starts(kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs)) if next(iter(kwargs)) not in ("limits", "env", "python")
                       else None):
        PoolConfig(**kwargs)


def test_a_dead_workers_cleanup_does_not_pause_another_workers_stream(monkeypatch):
    """Cleaning up after a dead worker (waiting for it, killing its groups,
    scanning the host for its markers, removing its directories) once ran
    on the dispatcher thread: while it ran, every other job's output waited.
    Here the cleanup is held -- its last step waits on a gate -- until the
    job on the other worker has delivered ten more lines (it prints one
    every 20 ms); with the cleanup on the dispatcher, not one would come."""
    with ExecPool(workers=2) as pool:
        held, gate = threading.Event(), threading.Event()
        release = pool._workers._release

        def held_release(worker, had_jobs):
            held.set()
            gate.wait(DEADLINE_S)
            release(worker, had_jobs)

        monkeypatch.setattr(pool._workers, "_release", held_release)
        victim_text = []
        victim = pool.submit(ShellJob("echo up; sleep 60", timeout=None), on_event=lambda e: victim_text.append(e))
        assert wait_for(lambda: victim_text, DEADLINE_S)
        victim_worker = next(w.pid for w in worker_records(pool) if victim.job_id in w.jobs)
        arrivals = []
        steady = pool.submit(ShellJob("for i in $(seq 1 500); do echo $i; sleep 0.02; done"),
                             on_event=lambda e: arrivals.append(time.monotonic()))
        assert wait_for(lambda: len(arrivals) >= 5, DEADLINE_S)
        os.kill(victim_worker, signal.SIGKILL)
        try:
            assert held.wait(DEADLINE_S), "the dead worker was never cleaned up"
            seen = len(arrivals)
            assert wait_for(lambda: len(arrivals) >= seen + 10, DEADLINE_S), \
                "the other worker's output stopped while the dead one was being cleaned up"
            assert not victim.done(), "a job's INFRA result comes only after its tree is dead"
        finally:
            gate.set()
        assert victim.result(DEADLINE_S).status is Status.INFRA
        steady.cancel()
        assert steady.result(DEADLINE_S).status is Status.CANCELLED


def test_stats_count_what_the_pool_did():
    with ExecPool(workers=1) as pool:
        assert pool.stats().jobs_total == 0
        pool.run(ShellJob("printf 12345"))
        pool.run(ShellJob("exit 3"))
        slept = pool.run(PythonJob("import time; time.sleep(0.06)"))
        assert slept.status is Status.OK, slept.text  # what went wrong, should it ever
        text = []
        future = pool.submit(ShellJob("echo up; sleep 30"), on_event=lambda e: text.append(e.text))
        assert wait_for(lambda: text, DEADLINE_S)
        assert pool.stats().in_flight == 1
        os.kill(pool.worker_pids[0], signal.SIGKILL)
        assert future.result(DEADLINE_S).status is Status.INFRA
        assert wait_for(lambda: pool.stats().worker_restarts == 1, DEADLINE_S)
        stats = pool.stats()
    assert stats.jobs == {("shell", "ok"): 1, ("shell", "error"): 1, ("python", "ok"): 1, ("shell", "infra"): 1}
    assert stats.in_flight == 0 and stats.output_bytes == 5
    python = stats.durations["python"]
    assert python.count == 1 and python.sum >= 0.06
    assert python.counts[-1] == 1 and python.counts[python.buckets.index(0.05)] == 0, "0.06 s is past 0.05"
