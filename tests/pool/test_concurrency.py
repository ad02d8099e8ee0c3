"""Many jobs at once: correct results, and the caller's threads do not grow."""

from __future__ import annotations

import asyncio
import threading

import pytest

from execpool import ExecPool, PythonJob, ShellJob
from tests.support.helpers import collect, joined_output

N = 256


def job(i: int):
    # Everyone sleeps together, so all N really are in flight at once.
    if i % 2:
        return ShellJob(f"echo start {i}; sleep 1; echo end {i}; exit {i % 7}")
    return PythonJob(f"import time\nprint('start', {i})\ntime.sleep(1)\nprint('end', {i})\nraise SystemExit({i % 7})")


def check(i: int, events, result) -> None:
    expected = f"start {i}\nend {i}\n"
    assert result.output == expected and result.exit_code == i % 7
    assert joined_output(events) == expected


@pytest.mark.slow
def test_256_streams_consumed_from_threads():
    with ExecPool(workers=2) as pool:
        failures = []
        barrier = threading.Barrier(N)

        def consume(i: int) -> None:
            barrier.wait()
            try:
                check(i, *collect(pool.stream(job(i), heartbeat_interval_s=0.5)))
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append((i, exc))

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(N)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not failures, failures[:3]


@pytest.mark.slow
def test_256_streams_from_asyncio_without_extra_threads():
    peak = {}

    async def consume(pool, i, in_flight):
        events = []
        stream = pool.astream(job(i), heartbeat_interval_s=0.5)
        async for event in stream:
            events.append(event)
            if len(events) == 1:
                in_flight.add(i)
                if len(in_flight) == N:
                    peak["threads"] = threading.active_count()
        check(i, events, stream.result)

    async def main(pool, n):
        in_flight = set()
        await asyncio.gather(*(consume(pool, i, in_flight) for i in range(n)))

    with ExecPool(workers=2) as pool:
        baseline = threading.active_count()
        asyncio.run(main(pool, N))
    # All N jobs were streaming at once, on no more threads than an idle pool has.
    assert peak["threads"] == baseline


def test_caller_thread_count_does_not_depend_on_concurrency():
    with ExecPool(workers=2) as pool:
        idle = threading.active_count()
        streams = [pool.stream(ShellJob("echo up; sleep 100"), heartbeat_interval_s=60) for _ in range(N)]
        for stream in streams:
            assert next(stream)["text"] == "up\n"
        assert threading.active_count() == idle
        for stream in streams:
            stream.close()
