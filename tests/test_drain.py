"""Tests for the generic (non-pool) streaming helpers in ``execpool.drain``:
``drain_queue``, ``accepts_output_callback``, ``stream_tool_execution`` and
``TOOL_OUTPUT_STREAM_MAX_CHARS``.

Concurrency is coordinated with ``threading.Event`` gates; the few sleeps left
are the ones the contract itself is about (steady output every 10 ms, a
callable that keeps emitting while heartbeats flow).
"""

from __future__ import annotations

import functools
import gc
import inspect
import json
import math
import os
import queue
import threading
import time
import types
import uuid

import pytest

import execpool
from execpool import drain
from execpool.drain import accepts_output_callback, drain_queue, stream_tool_execution
from execpool.shared.output import TOOL_OUTPUT_STREAM_MAX_CHARS
from tests.support.helpers import collect

CAP = TOOL_OUTPUT_STREAM_MAX_CHARS
NOTICE = "\n... (further live output not streamed)\n"
THREAD_PREFIX = "tool-exec-"


# --------------------------------------------------------------------------- helpers


def _unique(label: str = "tool") -> str:
    return f"{label}-{uuid.uuid4().hex[:10]}"


def _threads_named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def _wait_threads_gone(name: str, timeout: float = 5.0) -> list[threading.Thread]:
    """Poll until no live thread carries ``name``; return the stragglers."""
    deadline = time.monotonic() + timeout
    while True:
        left = [t for t in _threads_named(name) if t.is_alive()]
        if not left or time.monotonic() >= deadline:
            return left
        for t in left:
            t.join(timeout=max(0.0, min(0.05, deadline - time.monotonic())))


def _texts(events) -> list[str]:
    return [e["text"] for e in events if e["type"] == "tool_output"]


def _heartbeats(events) -> list[dict]:
    return [e for e in events if e["type"] == "heartbeat"]


def _next_output(gen, timeout: float = 5.0) -> dict:
    """The next tool_output event, skipping heartbeats (the stream under test
    must use a short heartbeat interval so next() never blocks for long)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        event = next(gen)
        if event["type"] == "tool_output":
            return event
        assert event == {"type": "heartbeat"}
    raise AssertionError(f"no tool_output within {timeout}s")


def _read_output_until(gen, expected: str, timeout: float = 5.0) -> str:
    """Read output events until their joined text is ``expected``."""
    got = ""
    while got != expected:
        assert expected.startswith(got), (got[:80], expected[:80])
        got += _next_output(gen, timeout)["text"]
    return got


@pytest.fixture
def gates():
    """Make threading.Event gates; every one is released at teardown so no
    callable blocked on a gate outlives its test."""
    made: list[threading.Event] = []

    def make() -> threading.Event:
        ev = threading.Event()
        made.append(ev)
        return ev

    yield make
    for ev in made:
        ev.set()
    deadline = time.monotonic() + 5.0
    for t in threading.enumerate():
        if t.name.startswith(THREAD_PREFIX):
            t.join(timeout=max(0.0, deadline - time.monotonic()))


# ------------------------------------------------------------------- exports


def test_public_names_are_reexported_from_package():
    assert execpool.stream_tool_execution is drain.stream_tool_execution
    assert execpool.drain_queue is drain.drain_queue
    assert execpool.accepts_output_callback is drain.accepts_output_callback
    assert execpool.TOOL_OUTPUT_STREAM_MAX_CHARS == TOOL_OUTPUT_STREAM_MAX_CHARS == 400_000


# --------------------------------------------------------------- drain_queue


@pytest.fixture(params=[queue.Queue, queue.SimpleQueue], ids=["Queue", "SimpleQueue"])
def make_queue(request):
    def make(*items):
        q = request.param()
        for item in items:
            q.put(item)
        return q

    return make


def _remaining(q) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


SENTINEL = object()
CHUNKS = ["abc", "defgh", "", "ij", "k"]
JOINED = "".join(CHUNKS)  # "abcdefghijk", chunk boundaries after 3, 8, 10


@pytest.mark.parametrize("max_chars", [None, 1000])
def test_drain_empty_queue_returns_immediately(make_queue, max_chars):
    q = make_queue()
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", drain_queue(q, SENTINEL, max_chars)))
    t.start()
    t.join(timeout=2.0)
    assert not t.is_alive(), "drain_queue blocked on an empty queue"
    assert box["r"] == ("", False)


@pytest.mark.parametrize("max_chars", [None, 0, -5, 10])
def test_drain_sentinel_only(make_queue, max_chars):
    q = make_queue(SENTINEL)
    assert drain_queue(q, SENTINEL, max_chars) == ("", True)
    assert _remaining(q) == []


def test_drain_none_joins_every_chunk_in_order(make_queue):
    chunks = [f"<{i}>" * (i % 5 + 1) for i in range(300)] + ["héllo", "日本語", "🙂", "\n"]
    q = make_queue(*chunks)
    assert drain_queue(q, SENTINEL, None) == ("".join(chunks), False)
    assert _remaining(q) == []


def test_drain_none_stops_at_sentinel_and_leaves_later_items(make_queue):
    q = make_queue("ab", "cd", SENTINEL, "after", SENTINEL)
    assert drain_queue(q, SENTINEL, None) == ("abcd", True)
    assert _remaining(q) == ["after", SENTINEL]


def test_drain_sentinel_is_matched_by_identity_not_equality(make_queue):
    class EqualsEverything:
        def __eq__(self, other):
            return True

        __hash__ = object.__hash__

    # a sentinel that compares equal to every chunk must not end the drain early
    q = make_queue("x", "y")
    assert drain_queue(q, EqualsEverything(), None) == ("xy", False)
    marker = EqualsEverything()
    q = make_queue("x", "y", marker, "z")
    assert drain_queue(q, marker, 5) == ("xy", True)
    assert _remaining(q) == ["z"]


@pytest.mark.parametrize("max_chars", list(range(-3, len(JOINED) + 3)))
def test_drain_budget_keeps_one_char_past_budget(make_queue, max_chars):
    q = make_queue(*CHUNKS)
    text, hit = drain_queue(q, SENTINEL, max_chars)
    expected = JOINED[: max(max_chars, 0) + 1]
    assert text == expected
    assert JOINED.startswith(text)
    if max_chars < len(JOINED):
        assert len(text) == max(max_chars, 0) + 1
    assert hit is False
    assert _remaining(q) == [], "the rest must be discarded, not left queued"


@pytest.mark.parametrize(
    "max_chars, expected",
    [
        (2, "abc"),  # boundary inside the first chunk: one char past -> whole first chunk
        (3, "abcd"),  # budget ends exactly on a chunk boundary: one char of the next chunk
        (4, "abcde"),  # inside the second chunk
        (8, "abcdefghi"),  # exactly on the boundary before the empty chunk
        (10, "abcdefghijk"),  # exactly on the last boundary: one char past is the last char
        (11, "abcdefghijk"),  # budget equals the total: everything, nothing extra
        (0, "a"),  # budget already met
        (-1, "a"),  # negative budget
        (-10_000, "a"),
    ],
)
def test_drain_budget_named_boundaries(make_queue, max_chars, expected):
    q = make_queue(*CHUNKS)
    assert drain_queue(q, SENTINEL, max_chars) == (expected, False)


@pytest.mark.parametrize("max_chars, expected", [(0, "a"), (-2, "a"), (1, "ab"), (4, "abcde"), (100, "abcdef")])
def test_drain_budget_still_reports_sentinel_and_stops_there(make_queue, max_chars, expected):
    q = make_queue("abc", "def", SENTINEL, "not-this", SENTINEL)
    assert drain_queue(q, SENTINEL, max_chars) == (expected, True)
    assert _remaining(q) == ["not-this", SENTINEL]


def test_drain_budget_discards_a_large_backlog(make_queue):
    chunks = [chr(ord("a") + i % 26) * 10 for i in range(5000)]
    q = make_queue(*chunks, SENTINEL)
    text, hit = drain_queue(q, SENTINEL, 25)
    assert text == "".join(chunks)[:26]
    assert hit is True
    assert _remaining(q) == []


def test_drain_budget_with_one_huge_chunk(make_queue):
    big = "0123456789" * 100_000
    q = make_queue(big, "tail")
    text, hit = drain_queue(q, SENTINEL, 12_345)
    assert text == big[:12_346]
    assert hit is False
    assert _remaining(q) == []


# ---------------------------------------------------- accepts_output_callback


def _f_pos(output_callback):
    return output_callback


def _f_default(x, output_callback=None):
    return x


def _f_kwonly(x, *, output_callback):
    return x


def _f_kwargs(x, **kwargs):
    return x


def _f_both(output_callback, /, **kw):
    return kw


def _f_plain(x):
    return x


def _f_posonly(output_callback, /):
    return output_callback


def _f_args(*args):
    return args


def _f_other_name(x, *, outputcallback=None, callback=None):
    return x


def _f_none():
    return None


class _Tool:
    def run(self, query, output_callback=None):
        return query

    def run_kw(self, query, **kw):
        return query

    def run_plain(self, query):
        return query

    @classmethod
    def cls_run(cls, *, output_callback):
        return cls

    @staticmethod
    def static_run(output_callback):
        return output_callback


class _CallWithCallback:
    def __call__(self, query, output_callback):
        return query


class _CallWithKwargs:
    def __call__(self, **kwargs):
        return kwargs


class _CallPlain:
    def __call__(self, query):
        return query


class _CallPosOnly:
    def __call__(self, output_callback, /):
        return output_callback


def _accepting():
    return {
        "function positional-or-keyword": _f_pos,
        "function with default": _f_default,
        "function keyword-only": _f_kwonly,
        "function **kwargs": _f_kwargs,
        "positional-only name plus **kw": _f_both,
        "lambda named": lambda output_callback: None,
        "lambda kw-only": lambda *, output_callback=None: None,
        "lambda **kw": lambda **kw: None,
        "bound method": _Tool().run,
        "bound method **kw": _Tool().run_kw,
        "classmethod": _Tool.cls_run,
        "staticmethod": _Tool.static_run,
        "partial binding another arg": functools.partial(_f_default, 1),
        "partial of kwonly": functools.partial(_f_kwonly, 1),
        "partial binding the callback by keyword": functools.partial(_f_pos, output_callback=print),
        "partial of **kwargs": functools.partial(_f_kwargs, 1),
        "instance __call__ named": _CallWithCallback(),
        "instance __call__ **kwargs": _CallWithKwargs(),
    }


def _rejecting():
    return {
        "plain function": _f_plain,
        "positional-only output_callback": _f_posonly,
        "*args only": _f_args,
        "similar names": _f_other_name,
        "no parameters": _f_none,
        "lambda no params": lambda: None,
        "lambda other name": lambda cb: None,
        "lambda *args": lambda *a: None,
        "bound method without callback": _Tool().run_plain,
        "partial that consumed output_callback positionally": functools.partial(_f_pos, print),
        "partial of plain": functools.partial(_f_plain, 1),
        "instance __call__ plain": _CallPlain(),
        "instance __call__ positional-only": _CallPosOnly(),
    }


@pytest.mark.parametrize("name", sorted(_accepting()))
def test_accepts_output_callback_true(name):
    func = _accepting()[name]
    assert accepts_output_callback(func) is True


@pytest.mark.parametrize("name", sorted(_rejecting()))
def test_accepts_output_callback_false(name):
    func = _rejecting()[name]
    assert accepts_output_callback(func) is False


def test_accepts_output_callback_false_for_builtin_without_signature():
    # Make sure this builtin really is uninspectable on this Python, so the
    # test exercises the error path rather than a plain "no such parameter".
    with pytest.raises(ValueError):
        inspect.signature(max)
    assert accepts_output_callback(max) is False


def test_accepts_output_callback_false_for_invalid_signature_even_with_kwargs():
    class Broken:
        __signature__ = "not a signature"

        def __call__(self, output_callback=None, **kwargs):
            return kwargs

    obj = Broken()
    with pytest.raises((TypeError, ValueError)):
        inspect.signature(obj)
    # the __call__ would accept the callback, but the callable is uninspectable
    assert accepts_output_callback(obj) is False


def test_accepts_output_callback_false_for_non_callable():
    assert accepts_output_callback(42) is False


# ------------------------------------------------- stream_tool_execution: basics


def test_result_equals_what_invoke_returns_and_works_with_yield_from():
    payload = {"rows": [1, 2, 3], "text": "done"}

    def invoke(output_callback):
        output_callback("working...")
        return payload

    def outer():
        result = yield from stream_tool_execution(invoke, tool_name="search")
        return ("wrapped", result)

    events, value = collect(outer())
    assert value[0] == "wrapped"
    assert value[1] is payload
    assert "".join(_texts(events)) == "working..."


@pytest.mark.parametrize("returned", [None, 0, "", [], "full text"])
def test_result_is_passed_through_unchanged(returned):
    events, value = collect(stream_tool_execution(lambda cb: returned, tool_name="t"))
    assert value is returned
    assert _texts(events) == []


def test_output_events_shape_order_and_json(gates):
    chunks = [f"<{i}>" * (i % 7 + 1) for i in range(400)] + ["héllo ", "日本語", "🙂", "\n", "tab\t"]

    def invoke(cb):
        for chunk in chunks:
            cb(chunk)
        return "ok"

    events, value = collect(stream_tool_execution(invoke, tool_name="my_tool", tool_call_id="call_42"))
    assert value == "ok"
    outputs = [e for e in events if e["type"] == "tool_output"]
    assert "".join(e["text"] for e in outputs) == "".join(chunks)
    for event in events:
        assert type(event) is dict
        assert json.loads(json.dumps(event)) == event
        if event["type"] == "tool_output":
            assert set(event) == {"type", "tool_name", "tool_call_id", "text"}
            assert event["tool_name"] == "my_tool"
            assert event["tool_call_id"] == "call_42"
            assert isinstance(event["text"], str)
        else:
            assert event == {"type": "heartbeat"}


def test_tool_call_id_defaults_to_empty_string():
    events, _ = collect(stream_tool_execution(lambda cb: cb("x"), tool_name="t"))
    assert [e["tool_call_id"] for e in events if e["type"] == "tool_output"] == [""]


def test_worker_thread_is_named_after_tool(gates):
    name = _unique("named")
    gate = gates()
    seen = {}

    def invoke(cb):
        seen["thread"] = threading.current_thread()
        cb("in thread")
        gate.wait(10)
        return "r"

    gen = stream_tool_execution(invoke, tool_name=name, heartbeat_interval_s=0.05)
    assert _next_output(gen)["text"] == "in thread"
    worker = seen["thread"]
    assert worker is not threading.current_thread()
    assert worker.name == f"tool-exec-{name}"
    assert worker in _threads_named(f"tool-exec-{name}")
    gate.set()
    _, value = collect(gen)
    assert value == "r"
    assert _wait_threads_gone(f"tool-exec-{name}") == []


def test_chunk_reaches_consumer_while_callable_is_blocked(gates):
    gate = gates()
    state = {"blocked": False, "released": False}

    def invoke(cb):
        cb("first chunk")
        state["blocked"] = True
        released = gate.wait(10)
        state["released"] = released
        cb(" second chunk")
        return "end"

    gen = stream_tool_execution(invoke, tool_name="t", heartbeat_interval_s=0.05)
    event = _next_output(gen)
    assert event["text"] == "first chunk"
    # the callable has not been released: it is still blocked on the gate
    assert not gate.is_set()
    assert state["released"] is False
    gate.set()
    events, value = collect(gen)
    assert state["released"] is True
    assert "".join(_texts(events)) == " second chunk"
    assert value == "end"


def test_lock_step_chunks_arrive_one_by_one_in_order(gates):
    acks = [gates() for _ in range(15)]
    waited = []

    def invoke(cb):
        for i, ack in enumerate(acks):
            cb(f"chunk{i};")
            waited.append(ack.wait(10))
        return len(acks)

    gen = stream_tool_execution(invoke, tool_name="t", heartbeat_interval_s=0.05)
    for i, ack in enumerate(acks):
        _read_output_until(gen, f"chunk{i};")
        ack.set()
    events, value = collect(gen)
    assert _texts(events) == []
    assert value == 15
    assert waited == [True] * 15


def test_non_string_chunks_are_ignored():
    def invoke(cb):
        returned = []
        for chunk in (None, b"bytes", 42, 3.5, ["list"], {"d": 1}, object(), "ok", bytearray(b"x"), "!"):
            returned.append(cb(chunk))  # must not raise
        return returned

    events, value = collect(stream_tool_execution(invoke, tool_name="t"))
    assert value == [None] * 10
    assert "".join(_texts(events)) == "ok!"
    assert all(isinstance(t, str) for t in _texts(events))


def test_tool_name_is_used_verbatim_in_events():
    events, _ = collect(stream_tool_execution(lambda cb: cb("a"), tool_name="web.search", tool_call_id="id-1"))
    (event,) = [e for e in events if e["type"] == "tool_output"]
    assert event == {"type": "tool_output", "tool_name": "web.search", "tool_call_id": "id-1", "text": "a"}


# ------------------------------------------------------------------ validation


BAD_INTERVALS = [0, 0.0, -1, -0.25, math.nan, "1", "0.1"]


@pytest.mark.parametrize("param", ["heartbeat_interval_s", "poll_interval_s"])
@pytest.mark.parametrize("bad", BAD_INTERVALS, ids=repr)
@pytest.mark.parametrize("with_cancel", [False, True], ids=["no-cancel", "cancel"])
def test_bad_intervals_raise_at_call_time(param, bad, with_cancel):
    name = _unique("bad")
    called = []

    def invoke(cb):
        called.append(True)
        return None

    kwargs = {param: bad}
    if with_cancel:
        kwargs["cancel_event"] = threading.Event()
    with pytest.raises((ValueError, TypeError)):
        stream_tool_execution(invoke, tool_name=name, **kwargs)  # no iteration at all
    assert called == []
    assert _threads_named(f"tool-exec-{name}") == []


@pytest.mark.parametrize("param", ["heartbeat_interval_s", "poll_interval_s"])
def test_valid_small_intervals_are_accepted(param):
    events, value = collect(stream_tool_execution(lambda cb: "v", tool_name="t", **{param: 0.01}))
    assert value == "v"


# ------------------------------------------------------------------ heartbeats


def test_heartbeats_while_callable_is_silent(gates):
    gate = gates()
    interval = 0.04

    def invoke(cb):
        gate.wait(10)
        return "quiet"

    gen = stream_tool_execution(invoke, tool_name="t", heartbeat_interval_s=interval)
    start = time.monotonic()
    stamps = []
    for _ in range(8):
        event = next(gen)
        assert event == {"type": "heartbeat"}
        stamps.append(time.monotonic())
    elapsed = stamps[-1] - start
    # paced: not faster than the interval, and not wildly slower
    assert elapsed >= 8 * interval * 0.9, elapsed
    assert elapsed < 8 * interval + 3.0, elapsed
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert min(gaps) >= interval * 0.5, gaps
    gate.set()
    events, value = collect(gen)
    assert value == "quiet"
    assert _texts(events) == []


def test_heartbeat_pacing_is_not_driven_by_cancel_polling(gates):
    """With a cancel_event the stream wakes every poll_interval_s; heartbeats
    must still come only every heartbeat_interval_s."""
    gate = gates()
    interval, poll = 0.1, 0.005

    def invoke(cb):
        gate.wait(10)
        return None

    gen = stream_tool_execution(invoke, tool_name="t", cancel_event=threading.Event(),
                                heartbeat_interval_s=interval, poll_interval_s=poll)
    start = time.monotonic()
    beats = 0
    while beats < 4:
        assert next(gen) == {"type": "heartbeat"}
        beats += 1
    elapsed = time.monotonic() - start
    assert elapsed >= 4 * interval * 0.9, f"4 heartbeats in {elapsed:.3f}s with a {interval}s interval"
    gate.set()
    collect(gen)


def test_steady_output_yields_no_heartbeat_with_default_style_interval():
    """Contract example: output every 10 ms for ~0.5 s, 10 s interval -> none.
    A cancel_event with a fast poll makes the stream wake often, so a stream
    that beat on every wake-up would fail here."""

    def invoke(cb):
        end = time.monotonic() + 0.5
        n = 0
        while time.monotonic() < end:
            cb(f"{n},")
            n += 1
            time.sleep(0.01)
        return n

    events, n = collect(stream_tool_execution(invoke, tool_name="t", cancel_event=threading.Event(),
                                           heartbeat_interval_s=10.0, poll_interval_s=0.005))
    assert _heartbeats(events) == []
    assert "".join(_texts(events)) == "".join(f"{i}," for i in range(n))


def test_steady_output_resets_heartbeat_pacing():
    """Output every 10 ms for ~0.6 s against a 0.25 s interval: without the
    reset there would be about two heartbeats."""

    def invoke(cb):
        end = time.monotonic() + 0.6
        while time.monotonic() < end:
            cb(".")
            time.sleep(0.01)
        return "ok"

    events, value = collect(stream_tool_execution(invoke, tool_name="t", heartbeat_interval_s=0.25))
    assert value == "ok"
    assert len(_texts(events)) > 0
    assert _heartbeats(events) == []


def test_heartbeats_resume_after_output_stops(gates):
    gate = gates()

    def invoke(cb):
        cb("burst")
        gate.wait(10)
        return None

    gen = stream_tool_execution(invoke, tool_name="t", heartbeat_interval_s=0.04)
    assert _next_output(gen)["text"] == "burst"
    for _ in range(3):
        assert next(gen) == {"type": "heartbeat"}
    gate.set()
    collect(gen)


def test_heartbeats_keep_flowing_after_cap_while_callable_keeps_emitting(gates):
    stop = gates()
    counter = {"emits": 0}
    emitted = []

    def invoke(cb):
        first = "x" * (CAP + 10)
        cb(first)
        emitted.append(first)
        while not stop.is_set():
            cb("y")
            emitted.append("y")
            counter["emits"] += 1
            time.sleep(0.001)
        return "".join(emitted)

    gen = stream_tool_execution(invoke, tool_name="t", heartbeat_interval_s=0.05)
    streamed = []
    while NOTICE not in streamed:
        streamed.append(_next_output(gen)["text"])
    emits_at_notice = counter["emits"]
    beats = 0
    deadline = time.monotonic() + 5.0
    while beats < 4:
        assert time.monotonic() < deadline, "heartbeats stopped after the cap"
        event = next(gen)
        assert event == {"type": "heartbeat"}, "output after the cap notice"
        beats += 1
    emits_at_beats = counter["emits"]
    stop.set()
    events, value = collect(gen)
    assert _texts(events) == []
    # the callable really was emitting while those heartbeats were produced
    assert emits_at_beats > emits_at_notice
    assert "".join(streamed) == "x" * CAP + NOTICE
    assert value == "".join(emitted)
    assert len(value) > CAP + 10


# --------------------------------------------------------------- live-output cap


def test_cap_constant_and_notice():
    assert TOOL_OUTPUT_STREAM_MAX_CHARS == 400_000


def _assert_capped(events, full: str):
    texts = _texts(events)
    assert texts.count(NOTICE) == 1, "cap notice must appear exactly once"
    assert texts[-1] == NOTICE, "no output event may follow the cap notice"
    streamed = "".join(texts[:-1])
    assert streamed == full[:CAP]


def test_cap_with_many_small_chunks():
    chunks = [chr(ord("a") + i % 26) * 1000 for i in range(1000)]  # 1 000 000 chars
    full = "".join(chunks)

    def invoke(cb):
        for chunk in chunks:
            cb(chunk)
        return full

    events, value = collect(stream_tool_execution(invoke, tool_name="t"))
    _assert_capped(events, full)
    assert value == full


def test_cap_with_one_huge_chunk():
    big = "".join(chr(ord("A") + i % 26) for i in range(26)) * 400_000  # 10.4 MB

    def invoke(cb):
        cb(big)
        return big

    events, value = collect(stream_tool_execution(invoke, tool_name="t"))
    _assert_capped(events, big)
    assert value is big


def test_cap_across_separate_reads_boundary_inside_a_chunk(gates):
    gate = gates()

    def invoke(cb):
        cb("a" * 300_000)
        assert gate.wait(10)
        cb("b" * 200_000)
        cb("c" * 10)
        return "a" * 300_000 + "b" * 200_000 + "c" * 10

    gen = stream_tool_execution(invoke, tool_name="t", heartbeat_interval_s=0.05)
    first = _read_output_until(gen, "a" * 300_000)
    gate.set()
    events, value = collect(gen)
    texts = _texts(events)
    assert texts.count(NOTICE) == 1 and texts[-1] == NOTICE
    assert first + "".join(texts[:-1]) == "a" * 300_000 + "b" * 100_000
    assert value == "a" * 300_000 + "b" * 200_000 + "c" * 10


def test_cap_exactly_on_chunk_boundary(gates):
    gate = gates()

    def invoke(cb):
        cb("a" * CAP)
        assert gate.wait(10)
        cb("b")
        cb("c" * 50)
        return "done"

    gen = stream_tool_execution(invoke, tool_name="t", heartbeat_interval_s=0.05)
    _read_output_until(gen, "a" * CAP)
    gate.set()
    events, value = collect(gen)
    assert _texts(events) == [NOTICE]
    assert value == "done"


def test_output_of_exactly_cap_chars_is_streamed_whole():
    full = "".join(chr(ord("a") + i % 26) for i in range(CAP))

    def invoke(cb):
        for i in range(0, CAP, 4000):
            cb(full[i:i + 4000])
        return full

    events, value = collect(stream_tool_execution(invoke, tool_name="t"))
    texts = _texts(events)
    assert texts.count(NOTICE) <= 1
    assert "".join(t for t in texts if t != NOTICE) == full
    assert value == full


def test_under_cap_has_no_notice():
    full = "z" * (CAP - 1)

    def invoke(cb):
        cb(full[:1000])
        cb(full[1000:])
        return full

    events, value = collect(stream_tool_execution(invoke, tool_name="t"))
    assert "".join(_texts(events)) == full
    assert NOTICE not in _texts(events)


def test_cap_is_per_call():
    full = "q" * (CAP + 5)

    def invoke(cb):
        cb(full)
        return len(full)

    for _ in range(2):
        events, value = collect(stream_tool_execution(invoke, tool_name="t"))
        _assert_capped(events, full)
        assert value == CAP + 5


def test_million_one_char_chunks_stream_cap_and_return_full_text():
    def invoke(cb):
        parts = []
        for i in range(1_000_000):
            c = chr(ord("a") + i % 26)
            cb(c)
            parts.append(c)
        return "".join(parts)

    events, value = collect(stream_tool_execution(invoke, tool_name="t"))
    assert len(value) == 1_000_000
    _assert_capped(events, value)


# ------------------------------------------------- cap enforced at the producer


class _RecordingQueue:
    """Stands in for queue.SimpleQueue inside execpool.drain: records the most
    text ever pending, and holds the consumer's first read until the producer
    has put a non-text item (the end-of-call marker), so everything is emitted
    before anything is read."""

    def __init__(self) -> None:
        self._q = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.pending = 0
        self.max_pending = 0
        self.text_puts = 0
        self.end_put = threading.Event()
        self.gets = 0

    def put(self, item, block=True, timeout=None):
        if isinstance(item, str):
            with self._lock:
                self.pending += len(item)
                self.max_pending = max(self.max_pending, self.pending)
                self.text_puts += 1
        self._q.put(item)
        if not isinstance(item, str):
            self.end_put.set()

    def put_nowait(self, item):
        self.put(item, block=False)

    def get(self, block=True, timeout=None):
        # the gate: nothing is read until the callable has finished emitting
        assert self.end_put.wait(30), "producer never finished"
        item = self._q.get(block, timeout)
        with self._lock:
            self.gets += 1
            if isinstance(item, str):
                self.pending -= len(item)
        return item

    def get_nowait(self):
        return self.get(False)

    def empty(self):
        return self._q.empty()

    def qsize(self):
        return self._q.qsize()


@pytest.fixture
def recording_queues(monkeypatch):
    made: list[_RecordingQueue] = []

    def factory():
        rq = _RecordingQueue()
        made.append(rq)
        return rq

    fake_queue_module = types.SimpleNamespace(SimpleQueue=factory, Queue=queue.Queue, Empty=queue.Empty,
                                              Full=queue.Full)
    monkeypatch.setattr(drain, "queue", fake_queue_module)
    return made


@pytest.mark.slow
def test_producer_cap_bounds_queue_for_million_one_char_chunks(recording_queues):
    def invoke(cb):
        parts = []
        for i in range(1_000_000):
            c = chr(ord("a") + i % 26)
            cb(c)
            parts.append(c)
        return "".join(parts)

    events, value = collect(stream_tool_execution(invoke, tool_name="t"))
    assert len(recording_queues) == 1, "stream_tool_execution no longer uses queue.SimpleQueue"
    rq = recording_queues[0]
    # the recorder really observed the flood (not a vacuous pass) ...
    assert rq.max_pending >= CAP
    # ... and the producer stopped queueing about one chunk past the cap
    assert rq.max_pending <= CAP + 1, rq.max_pending
    assert rq.text_puts <= CAP + 1
    assert len(value) == 1_000_000
    _assert_capped(events, value)


def test_producer_cap_bounds_queue_for_ten_megabyte_chunks(recording_queues):
    big1 = "1234567890" * 1_000_000  # 10 MB
    big2 = "abcdefghij" * 1_000_000  # another 10 MB

    def invoke(cb):
        cb(big1)
        cb(big2)
        for _ in range(1000):
            cb("tail")
        return big1 + big2

    events, value = collect(stream_tool_execution(invoke, tool_name="t"))
    (rq,) = recording_queues
    # the flood reached the queue (not a vacuous pass), cut one character past the cap
    assert rq.max_pending == CAP + 1, rq.max_pending
    assert value == big1 + big2
    _assert_capped(events, big1)


def test_exception_after_fully_queued_output_still_yields_output_first(recording_queues):
    class Boom(Exception):
        pass

    err = Boom("late failure")
    chunks = [f"line {i}\n" for i in range(200)]

    def invoke(cb):
        for chunk in chunks:
            cb(chunk)
        raise err

    gen = stream_tool_execution(invoke, tool_name="t")
    received = []
    with pytest.raises(Boom) as info:
        while True:
            received.append(next(gen))
    assert info.value is err
    assert recording_queues[0].end_put.is_set()
    assert "".join(_texts(received)) == "".join(chunks)


# ------------------------------------------------------------------ exceptions


def test_exception_propagates_after_prior_output(gates):
    class Boom(RuntimeError):
        pass

    gate = gates()
    err = Boom("tool failed")

    def invoke(cb):
        cb("one ")
        cb("two")
        assert gate.wait(10)
        raise err

    gen = stream_tool_execution(invoke, tool_name="t", heartbeat_interval_s=0.05)
    _read_output_until(gen, "one two")
    gate.set()
    with pytest.raises(Boom) as info:
        while True:
            event = next(gen)
            assert event == {"type": "heartbeat"}
    assert info.value is err
    # the stream is finished afterwards
    with pytest.raises(StopIteration):
        next(gen)


def test_exception_without_output_propagates():
    def invoke(cb):
        raise KeyError("missing")

    with pytest.raises(KeyError, match="missing"):
        collect(stream_tool_execution(invoke, tool_name="t"))


def test_exception_after_cap_still_propagates():
    def invoke(cb):
        cb("e" * (CAP + 100))
        raise ValueError("after flood")

    gen = stream_tool_execution(invoke, tool_name="t")
    received = []
    with pytest.raises(ValueError, match="after flood"):
        while True:
            received.append(next(gen))
    _assert_capped(received, "e" * (CAP + 100))


# ---------------------------------------------------------- close / cancellation


def test_close_sets_cancel_event_promptly_even_if_callable_ignores_it(gates):
    gate = gates()
    name = _unique("ignore")
    cancel = threading.Event()
    finished = threading.Event()

    def invoke(cb):
        cb("working")
        gate.wait()  # ignores cancel_event entirely
        finished.set()
        return "late"

    gen = stream_tool_execution(invoke, tool_name=name, cancel_event=cancel)
    assert next(gen)["text"] == "working"
    assert not cancel.is_set()
    t0 = time.monotonic()
    gen.close()
    elapsed = time.monotonic() - t0
    assert elapsed < 0.5, f"close() took {elapsed:.3f}s"
    assert cancel.is_set()
    # close did not wait for the callable: it is still blocked
    assert not finished.is_set()
    assert any(t.is_alive() for t in _threads_named(f"tool-exec-{name}"))
    with pytest.raises(StopIteration):
        next(gen)
    gate.set()
    assert finished.wait(5)
    assert _wait_threads_gone(f"tool-exec-{name}") == []


def test_close_after_only_heartbeats_sets_cancel_event(gates):
    gate = gates()
    cancel = threading.Event()

    def invoke(cb):
        gate.wait(10)
        return None

    gen = stream_tool_execution(invoke, tool_name="t", cancel_event=cancel,
                                heartbeat_interval_s=0.03, poll_interval_s=0.01)
    assert next(gen) == {"type": "heartbeat"}
    t0 = time.monotonic()
    gen.close()
    assert time.monotonic() - t0 < 0.5
    assert cancel.is_set()


def test_close_without_cancel_event_is_prompt(gates):
    gate = gates()
    name = _unique("nocancel")

    def invoke(cb):
        cb("x")
        gate.wait()
        return None

    gen = stream_tool_execution(invoke, tool_name=name)
    assert next(gen)["text"] == "x"
    t0 = time.monotonic()
    gen.close()
    assert time.monotonic() - t0 < 0.5
    gate.set()
    assert _wait_threads_gone(f"tool-exec-{name}") == []


def test_cancel_honouring_callable_stops_after_close():
    name = _unique("honour")
    cancel = threading.Event()
    saw_cancel = threading.Event()

    def invoke(cb):
        cb("started")
        if cancel.wait(10):
            saw_cancel.set()
            return "cancelled"
        return "timed out"

    gen = stream_tool_execution(invoke, tool_name=name, cancel_event=cancel)
    assert next(gen)["text"] == "started"
    gen.close()
    assert saw_cancel.wait(2)
    assert _wait_threads_gone(f"tool-exec-{name}") == []


def test_clean_finish_never_sets_cancel_event(gates):
    gate = gates()
    cancel = threading.Event()

    def invoke(cb):
        cb("a")
        assert gate.wait(10)
        cb("b")
        return "fine"

    gen = stream_tool_execution(invoke, tool_name="t", cancel_event=cancel,
                                heartbeat_interval_s=0.03, poll_interval_s=0.01)
    assert _next_output(gen)["text"] == "a"
    # let some heartbeats/polls go by while the callable is blocked
    for _ in range(2):
        assert next(gen) == {"type": "heartbeat"}
    gate.set()
    events, value = collect(gen)
    assert value == "fine"
    assert "".join(_texts(events)) == "b"
    assert not cancel.is_set()
    gen.close()  # closing an exhausted stream is not a disconnect
    del gen
    gc.collect()
    assert not cancel.is_set()


def test_clean_finish_with_cap_never_sets_cancel_event():
    cancel = threading.Event()

    def invoke(cb):
        cb("w" * (CAP * 2))
        return "ok"

    events, value = collect(stream_tool_execution(invoke, tool_name="t", cancel_event=cancel,
                                               poll_interval_s=0.01))
    assert value == "ok"
    _assert_capped(events, "w" * (CAP * 2))
    assert not cancel.is_set()


# ------------------------------------------------------------------------ leaks


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_thousand_streams_leave_no_threads_and_no_fds():
    name = _unique("leak")
    thread_name = f"tool-exec-{name}"

    def fd_count() -> int:
        return len(os.listdir("/proc/self/fd"))

    def open_stream(i: int):
        cancel = threading.Event()

        def invoke(cb):
            cb(f"started {i}")
            cancel.wait(30)  # honours cancellation
            return i

        gen = stream_tool_execution(invoke, tool_name=name, tool_call_id=str(i), cancel_event=cancel)
        event = next(gen)
        assert event["text"] == f"started {i}"
        return gen, cancel

    # warm up anything lazily allocated, then take the baseline
    gen, cancel = open_stream(-1)
    gen.close()
    assert _wait_threads_gone(thread_name) == []
    fds_before = fd_count()

    for batch in range(10):
        opened = [open_stream(batch * 100 + i) for i in range(100)]
        alive = [t for t in _threads_named(thread_name) if t.is_alive()]
        assert len(alive) == 100, "each open stream should have exactly one named worker"
        for gen, cancel in opened:
            gen.close()
            assert cancel.is_set()

    left = _wait_threads_gone(thread_name, timeout=10.0)
    assert left == [], f"{len(left)} tool-exec threads left behind"
    assert not [t for t in threading.enumerate() if t.name == thread_name]
    fds_after = fd_count()
    assert fds_after - fds_before <= 3, (fds_before, fds_after)
