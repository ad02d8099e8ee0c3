"""``pool.on_loop()``: an asyncio server's loop reads the pool's messages
itself, and hands them back to the pool's thread on the way out. Every
wait has a deadline; run as the test's user (root here)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from execpool import ExecPool, PythonJob, ShellJob, Status
from execpool.pool import dispatch
from tests.support.helpers import state, wait_for

DEADLINE_S = 20.0


def _dispatcher_threads() -> list:
    return [t for t in threading.enumerate() if t.name == "execpool-dispatcher" and t.is_alive()]


def test_results_and_live_output_come_through_the_loop_and_the_thread_is_back_after():
    async def main(pool: ExecPool) -> None:
        with pool.on_loop():
            assert wait_for(lambda: not _dispatcher_threads(), DEADLINE_S)
            seen = []
            loop_thread = threading.get_ident()

            def on_event(event):
                seen.append((threading.get_ident(), getattr(event, "text", "")))

            futures = [asyncio.wrap_future(pool.submit(ShellJob(f"echo {i}", timeout=10), on_event=on_event))
                       for i in range(20)]
            results = await asyncio.wait_for(asyncio.gather(*futures), DEADLINE_S)
            assert [r.output for r in results] == [f"{i}\n" for i in range(20)]
            assert seen and {ident for ident, _ in seen} == {loop_thread}
        assert len(_dispatcher_threads()) == 1
        # And the thread serves the pool again, with no loop running it.
        result = await asyncio.to_thread(pool.run, PythonJob("print('after')", timeout=10))
        assert result.output == "after\n"

    with ExecPool(workers=2) as pool:
        asyncio.run(main(pool))
        assert pool.run(ShellJob("echo again", timeout=10)).output == "again\n"


def test_it_wants_a_running_loop_and_one_at_a_time():
    with ExecPool(workers=1) as pool:
        with pytest.raises(RuntimeError):
            with pool.on_loop():
                pass

        async def twice() -> None:
            with pool.on_loop():
                with pytest.raises(RuntimeError, match="already"):
                    with pool.on_loop():
                        pass

        asyncio.run(twice())
        assert pool.run(ShellJob("echo ok", timeout=10)).ok


def test_closing_the_pool_inside_the_block_ends_its_running_jobs():
    async def main() -> None:
        pool = ExecPool(workers=1)
        with pool.on_loop():
            future = pool.submit(ShellJob("sleep 30", timeout=60))
            assert wait_for(lambda: pool.running_jobs == 1, DEADLINE_S)
            await asyncio.wait_for(asyncio.to_thread(pool.close), DEADLINE_S)
            assert future.result(timeout=DEADLINE_S).status is Status.INFRA

    asyncio.run(main())


def test_a_dead_worker_is_replaced_while_the_loop_reads(monkeypatch):
    async def main(pool: ExecPool) -> None:
        with pool.on_loop():
            victim = pool.worker_pids[0]
            future = asyncio.wrap_future(pool.submit(ShellJob("sleep 30", timeout=60)))
            assert await asyncio.to_thread(wait_for, lambda: pool.running_jobs == 1, DEADLINE_S)
            os.kill(victim, signal.SIGKILL)
            result = await asyncio.wait_for(future, DEADLINE_S)
            assert result.status is Status.INFRA
            assert await asyncio.to_thread(
                wait_for, lambda: len(pool.worker_pids) == 1 and victim not in pool.worker_pids, DEADLINE_S)
            again = await asyncio.wait_for(asyncio.wrap_future(pool.submit(ShellJob("echo up", timeout=10))),
                                           DEADLINE_S)
            assert again.output == "up\n"

    with ExecPool(workers=1) as pool:
        asyncio.run(main(pool))


@pytest.mark.slow
@pytest.mark.parametrize("idle_watch_s", [0.0, 60.0], ids=["asleep", "still-watching"])
def test_the_loop_keeps_the_watchdog_a_stopped_worker_still_times_out(monkeypatch, idle_watch_s):
    monkeypatch.setattr(dispatch, "IDLE_WATCH_S", idle_watch_s)

    async def main(pool: ExecPool) -> None:
        with pool.on_loop():
            first = await asyncio.wrap_future(pool.submit(ShellJob("true", timeout=10)))
            assert first.ok
            worker = pool.worker_pids[0]
            os.kill(worker, signal.SIGSTOP)
            try:
                assert await asyncio.to_thread(wait_for, lambda: state(worker) == "T", DEADLINE_S)
                timed = await asyncio.wait_for(asyncio.wrap_future(pool.submit(ShellJob("sleep 30", timeout=1))),
                                               8.0)
                assert timed.status is Status.TIMEOUT, timed
            finally:
                os.kill(worker, signal.SIGCONT)

    with ExecPool(workers=1) as pool:
        asyncio.run(main(pool))
