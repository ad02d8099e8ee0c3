"""SPEC §2 rule 7: a job printing a flood (1 GB) keeps only what its Result needs."""

from __future__ import annotations

import threading

import psutil
import pytest

from execpool import ExecPool, ShellJob

GB = 1 << 30
MiB = 1 << 20


@pytest.mark.parametrize("size", [64 * MiB, pytest.param(GB, marks=pytest.mark.slow)], ids=["64MiB", "1GiB"])
def test_a_flood_keeps_caller_and_worker_memory_bounded(size):
    """What a flood may cost is the same whatever its size; a gigabyte
    shows it beyond doubt, 64 MiB in the fast tier (a Result keeps
    ``max_output_chars``, the stream a bounded live share)."""
    with ExecPool(workers=1) as pool:
        caller, worker = psutil.Process(), psutil.Process(pool.worker_pids[0])
        pool.run(ShellJob("yes 0123456789abcdef | head -c 10000000"))  # warm both sides up
        base = {"caller": caller.memory_info().rss, "worker": worker.memory_info().rss}
        peak = dict(base)
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.005):
                peak["caller"] = max(peak["caller"], caller.memory_info().rss)
                peak["worker"] = max(peak["worker"], worker.memory_info().rss)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            stream = pool.stream(ShellJob(f"yes 0123456789abcdef | head -c {size}", timeout=120))
            streamed = 0
            try:
                while True:
                    streamed += len(next(stream).get("text", ""))
            except StopIteration as stop:
                result = stop.value
        finally:
            done.set()
            sampler.join()
    assert result.exit_code == 0 and result.output_chars == size
    assert len(result.output) == pool.config.max_output_chars
    assert streamed < 500_000
    assert peak["worker"] - base["worker"] < 32 * MiB, peak
    assert peak["caller"] - base["caller"] < 32 * MiB, peak
