"""SPEC §1 for pool jobs: pool.stream / pool.astream."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from execpool import TOOL_OUTPUT_STREAM_MAX_CHARS, JobOutput, OutputCapped, PythonJob, ShellJob
from execpool.shared.output import STREAM_CAP_NOTICE
from tests.support import hostile
from tests.support.helpers import (
    all_dead,
    collect,
    joined_output,
    marked_processes,
    open_fds,
    pids_in,
    wait_for,
    worker_records,
)

SAME_RESULT_JOBS = [
    PythonJob("print('hello')\nimport sys\nprint('err', file=sys.stderr)\nsys.exit(3)"),
    ShellJob("printf 'a\\r\\nb\\rc'; echo é; exit 0"),
    PythonJob(hostile.BINARY_GARBAGE),
    ShellJob("cat /mnt/data/nope.csv"),
    ShellJob("echo start; sleep 5", timeout=0.3),
    ShellJob("true"),
    PythonJob("print('x' * 2_000_000)", max_output_chars=1000),
]


@pytest.mark.parametrize("job", SAME_RESULT_JOBS, ids=lambda j: j.source[:30])
def test_streamed_result_is_identical_to_run(pool, job):
    plain = pool.run(job)
    events, streamed = collect(pool.stream(job, tool_name="t", tool_call_id="c1", heartbeat_interval_s=0.05))
    for field in ("text", "output", "exit_code", "timed_out", "cancelled", "output_chars", "error_lines"):
        assert getattr(streamed, field) == getattr(plain, field), field
    assert all(json.loads(json.dumps(e)) == e for e in events)
    if not plain.truncated and len(plain.output) <= TOOL_OUTPUT_STREAM_MAX_CHARS:
        assert joined_output(events) == plain.output


def test_events_carry_tool_name_and_call_id(pool):
    events, _ = collect(pool.stream(ShellJob("echo hi"), tool_name="terminal", tool_call_id="call_7"))
    assert events == [{"type": "tool_output", "tool_name": "terminal", "tool_call_id": "call_7", "text": "hi\n"}]


def test_result_is_the_generator_return_value(pool):
    def consumer():
        result = yield from pool.stream(ShellJob("echo 1; exit 4"))
        return result

    events, result = collect(consumer())
    assert result.exit_code == 4 and result.text == "Exit code 4:\n1\n"


def test_print_without_flush_arrives_while_the_tool_still_runs(pool, tmp_path):
    gate = tmp_path / "gate"
    code = f"import os, time\nprint('first')\nwhile not os.path.exists({str(gate)!r}):\n    time.sleep(0.01)\nprint('second')"
    stream = pool.stream(PythonJob(code, cwd=str(tmp_path)), heartbeat_interval_s=10)
    first = next(stream)
    assert first["text"].startswith("first")
    assert not gate.exists()  # the tool is provably still waiting on us
    gate.touch()
    events, result = collect(stream)
    assert (first["text"] + joined_output(events)) == "first\nsecond\n" == result.output


def test_heartbeats_while_silent(pool):
    events, result = collect(pool.stream(ShellJob("sleep 0.5"), heartbeat_interval_s=0.04))
    beats = [e for e in events if e == {"type": "heartbeat"}]
    assert len(beats) >= 5
    assert result.exit_code == 0


@pytest.mark.slow
def test_steady_output_resets_heartbeat_pacing(pool):
    """Output every 10 ms for three heartbeat intervals: none is due. (The
    interval leaves room for a loaded machine's scheduling stalls: at 0.1 s
    a suite sharing two CPUs with three others saw heartbeats here.)"""
    command = "for i in $(seq 0 149); do echo $i; sleep 0.01; done"
    events, _ = collect(pool.stream(ShellJob(command), heartbeat_interval_s=0.5))
    assert not [e for e in events if e["type"] == "heartbeat"]
    assert joined_output(events) == "".join(f"{i}\n" for i in range(150))


def test_live_cap_then_notice_once_and_result_unchanged(pool):
    job = PythonJob("import sys\nfor _ in range(10):\n    sys.stdout.write('y' * 100_000)")
    events, result = collect(pool.stream(job))
    texts = [e["text"] for e in events if e["type"] == "tool_output"]
    assert texts[-1] == STREAM_CAP_NOTICE and texts.count(STREAM_CAP_NOTICE) == 1
    assert "".join(texts[:-1]) == "y" * TOOL_OUTPUT_STREAM_MAX_CHARS
    assert result.output == "y" * 1_000_000 and result.output_chars == 1_000_000


def test_heartbeats_flow_after_the_cap_while_the_tool_keeps_printing(pool):
    code = ("import sys, time\nsys.stdout.write('z' * 500_000)\n"
            "for _ in range(60):\n    print('more')\n    time.sleep(0.01)")
    events, result = collect(pool.stream(PythonJob(code), heartbeat_interval_s=0.05))
    notice_at = next(i for i, e in enumerate(events) if e.get("text") == STREAM_CAP_NOTICE)
    after = events[notice_at + 1:]
    assert after and all(e == {"type": "heartbeat"} for e in after)
    assert len(after) >= 3
    assert result.output.endswith("more\n")


@pytest.mark.parametrize("command", [
    "head -c 10000000 /dev/zero | tr '\\0' x",  # one 10 MB line
    "python3 -c \"import sys\nfor _ in range(1_000_000): sys.stdout.write('.'); sys.stdout.flush()\"",
])
def test_producer_side_cap_bounds_what_crosses_the_pipe(pool, command):
    """The worker forwards at most the cap plus one character, whatever the
    consumer does; here the consumer reads nothing until the job has ended.
    on_event sees exactly the cap, then one OutputCapped."""
    events = []
    future = pool.submit(ShellJob(command), on_event=events.append)
    result = future.result(timeout=60)
    outputs = [e for e in events if isinstance(e, JobOutput)]
    assert sum(len(e.text) for e in outputs) == TOOL_OUTPUT_STREAM_MAX_CHARS
    assert events[-1] == OutputCapped(TOOL_OUTPUT_STREAM_MAX_CHARS)
    assert len(outputs) == len(events) - 1
    assert result.output_chars in (10_000_000, 1_000_000)


def test_close_cancels_kills_the_tree_and_sets_cancel_event(pool):
    cancel = threading.Event()
    stream = pool.stream(ShellJob(hostile.FORK_TREE), cancel_event=cancel)
    seen = ""
    while len(pids_in(seen)) < 9:
        seen += next(stream)["text"]
    started = time.monotonic()
    stream.close()
    assert time.monotonic() - started < 1.0
    assert cancel.is_set()
    assert all_dead(pids_in(seen), timeout=1.0)


def test_clean_finish_never_sets_cancel_event(pool):
    cancel = threading.Event()
    _, result = collect(pool.stream(ShellJob("echo ok"), cancel_event=cancel))
    assert result.text == "ok\n" and not cancel.is_set()


def test_cancel_event_set_elsewhere_cancels_within_half_a_second(pool):
    cancel = threading.Event()
    stream = pool.stream(ShellJob(hostile.GRANDCHILD_HOLDS_STDOUT, timeout=None), cancel_event=cancel)
    first = next(stream)
    set_at = time.monotonic()
    cancel.set()
    events, result = collect(stream)
    assert time.monotonic() - set_at < 0.5
    assert result.cancelled and result.text == "Execution cancelled."
    assert all_dead(pids_in(first["text"]))


@pytest.mark.slow
def test_thousand_streams_started_and_closed_leave_nothing(pool):
    def snapshot():
        return threading.active_count(), len(open_fds())

    collect(pool.stream(ShellJob("echo warm")))
    before = snapshot()
    for _ in range(1000):
        stream = pool.stream(ShellJob("echo go; sleep 100"))
        assert next(stream)["text"] == "go\n"
        stream.close()
    assert wait_for(lambda: snapshot() == before, timeout=5), (snapshot(), before)
    assert wait_for(lambda: pool.running_jobs == 0, timeout=5)
    assert wait_for(lambda: not any(marked_processes(w.token) for w in worker_records(pool)), timeout=2)


def test_unstarted_stream_runs_nothing(pool):
    stream = pool.stream(ShellJob("sleep 100"))
    stream.close()
    assert pool.running_jobs == 0


def test_stream_arguments_are_validated_eagerly(pool):
    with pytest.raises(ValueError):
        pool.stream(ShellJob("true"), heartbeat_interval_s=0)
    with pytest.raises(TypeError):
        pool.stream(ShellJob("true"), cancel_event="set")


def test_astream_yields_the_same_events_and_result(pool):
    async def main():
        stream = pool.astream(ShellJob("echo a; sleep 0.2; echo b; exit 2"), heartbeat_interval_s=0.05,
                              tool_name="terminal")
        events = [e async for e in stream]
        return events, stream.result

    events, result = asyncio.run(main())
    assert joined_output(events) == "a\nb\n"
    assert any(e["type"] == "heartbeat" for e in events)
    assert result.text == pool.run(ShellJob("echo a; sleep 0.2; echo b; exit 2")).text


def test_cancelling_the_consuming_task_cancels_the_job(pool):
    cancel = threading.Event()

    async def consume(stream, first_seen):
        async for event in stream:
            first_seen.set_result(event["text"])

    async def main():
        stream = pool.astream(ShellJob(hostile.GRANDCHILD_HOLDS_STDOUT, timeout=None), cancel_event=cancel)
        first_seen = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(consume(stream, first_seen))
        text = await first_seen
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return text

    text = asyncio.run(main())
    assert cancel.is_set()
    assert all_dead(pids_in(text))


def test_cancel_event_reaches_the_worker_without_waiting_for_a_poll_interval(pool):
    """Regression: a cancel_event was only looked at every poll_interval_s
    (0.25 s by default); the pool's watcher looks every few milliseconds."""
    cancel = threading.Event()
    stream = pool.stream(ShellJob("echo up; sleep 30"), cancel_event=cancel)
    assert next(stream)["text"] == "up\n"
    set_at = time.monotonic()
    cancel.set()
    events, result = collect(stream)
    assert result.cancelled
    assert time.monotonic() - set_at < 0.2


def test_run_with_a_shared_cancel_event_leaves_no_watch_behind(pool):
    cancel = threading.Event()
    for _ in range(20):
        assert pool.run(ShellJob("true"), cancel_event=cancel).exit_code == 0
    assert wait_for(lambda: pool._watcher.watching == 0, timeout=2)
