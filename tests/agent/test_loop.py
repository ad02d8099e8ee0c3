"""The agent loop (SPEC §5) against a real, scripted HTTP server.

Every test talks to ``fake_openai.FakeOpenAI`` over real sockets, so httpx,
chunked transfer encoding, SSE parsing, connection drops and client
disconnects are the real thing. Waits use gates and deadlines; the few delays
left are the silences the heartbeat tests are about.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import pytest

from execpool.agent.loop import READER_THREAD_NAME, chat_with_tools
from tests.support.fake_openai import (
    DONE,
    DROP,
    HANDLER_THREAD_PREFIX,
    Delay,
    FakeOpenAI,
    Gate,
    Reply,
    chunk,
    closed_port,
    text_reply,
    tool_fragments,
    tool_reply,
)
from tests.support.helpers import alive, wait_for

USER = [{"role": "user", "content": "hi"}]
ECHO_TOOL = {
    "type": "function",
    "function": {
        "name": "echo",
        "description": "Echo lines back.",
        "parameters": {"type": "object", "properties": {"lines": {"type": "array"}}, "required": ["lines"]},
    },
}
TOOL_MESSAGE_KEYS = ["role", "name", "content", "tool_call_id"]
PROMPT = 1.0  # "promptly": close() and cancellation, with room for a loaded machine


def echo_args(*lines: str) -> str:
    return json.dumps({"lines": list(lines)})


def echo_streaming(name: str, arguments: str, output_callback) -> str:
    lines = json.loads(arguments)["lines"]
    for line in lines:
        output_callback(line + "\n")
    return f"{name}: " + "".join(line + "\n" for line in lines)


def echo_plain(name: str, arguments: str) -> str:
    lines = json.loads(arguments)["lines"]
    return f"{name}: " + "".join(line + "\n" for line in lines)


def chat(fake: FakeOpenAI, **kwargs):
    kwargs.setdefault("tools", [ECHO_TOOL])
    kwargs.setdefault("execute_tool", echo_streaming)
    return chat_with_tools(fake.base_url, kwargs.pop("messages", USER), **kwargs)


def loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate()
            if t.is_alive() and (t.name == READER_THREAD_NAME or t.name.startswith("tool-exec-"))]


def done_event(events: list[dict]) -> dict:
    assert events[-1]["type"] == "done", events
    assert [e["type"] for e in events].count("done") == 1
    return events[-1]


def tool_messages(body: dict) -> list[dict]:
    return [m for m in body["messages"] if m["role"] == "tool"]


@pytest.fixture
def fake():
    with FakeOpenAI() as server:
        yield server


@pytest.fixture(autouse=True)
def sandbox_root(tmp_path, monkeypatch):
    """The real tools' session directories go to the test's own tmp_path."""
    monkeypatch.setenv("EXECPOOL_SANDBOX_ROOT", str(tmp_path / "sandbox"))


@pytest.fixture(autouse=True)
def no_loop_threads_left():
    yield
    assert wait_for(lambda: not loop_threads(), timeout=3), loop_threads()


# --------------------------------------------------------------------------- the happy path


def test_plain_answer_streams_content_and_sends_the_openai_body(fake):
    fake.script(text_reply("Hel", "lo"))
    events = list(chat_with_tools(fake.base_url + "/", USER, model="m", tools=[ECHO_TOOL],
                                  execute_tool=echo_plain, extra_body={"temperature": 0}))
    assert events == [
        {"type": "content", "text": "Hel"},
        {"type": "content", "text": "lo"},
        {"type": "done", "messages": USER + [{"role": "assistant", "content": "Hello"}],
         "finish_reason": "stop", "stopped": None},
    ]
    (request,) = fake.requests
    assert request.path == "/v1/chat/completions"
    assert request.body == {"model": "m", "messages": USER, "stream": True, "tools": [ECHO_TOOL],
                            "temperature": 0}


def test_model_is_omitted_when_none_and_callers_list_is_not_mutated(fake):
    messages = list(USER)
    fake.script(text_reply("ok"))
    list(chat(fake, messages=messages))
    assert "model" not in fake.requests[0].body
    assert messages == USER


def test_tool_round_trip_event_order_and_the_messages_the_model_gets(fake):
    fake.script(tool_reply(("call_a", "echo", echo_args("one", "two"))), text_reply("done"))
    events = list(chat(fake))
    outputs = [e for e in events if e["type"] == "tool_output"]
    assert events == [
        {"type": "tool_start", "tool_name": "echo", "tool_call_id": "call_a", "arguments": echo_args("one", "two")},
        *outputs,  # chunks queued together arrive joined
        {"type": "tool_end", "tool_name": "echo", "tool_call_id": "call_a", "result": "echo: one\ntwo\n"},
        {"type": "content", "text": "done"},
        events[-1],
    ]
    assert outputs and all((e["tool_name"], e["tool_call_id"]) == ("echo", "call_a") for e in outputs)
    assert "".join(e["text"] for e in outputs) == "one\ntwo\n"
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "echo", "arguments": echo_args("one", "two")}}]}
    tool = {"role": "tool", "name": "echo", "content": "echo: one\ntwo\n", "tool_call_id": "call_a"}
    assert fake.requests[1].body["messages"] == USER + [assistant, tool]
    assert list(tool_messages(fake.requests[1].body)[0]) == TOOL_MESSAGE_KEYS
    assert done_event(events) == {"type": "done", "finish_reason": "stop", "stopped": None,
                                  "messages": USER + [assistant, tool, {"role": "assistant", "content": "done"}]}


def _tool_message_bytes(fake: FakeOpenAI, execute_tool) -> tuple[bytes, list[dict]]:
    fake.script(tool_reply(("call_a", "echo", echo_args("α", "", "b\tc"))), text_reply("ok"))
    events = list(chat(fake, execute_tool=execute_tool))
    raw = fake.requests[-1].raw
    start = raw.index(b'{"role": "tool"')
    return raw[start:raw.index(b"}", start) + 1], events


def test_tool_messages_are_byte_identical_with_and_without_streamed_output(fake):
    streamed, streamed_events = _tool_message_bytes(fake, echo_streaming)
    plain, plain_events = _tool_message_bytes(fake, echo_plain)
    assert streamed == plain
    assert "".join(e["text"] for e in streamed_events if e["type"] == "tool_output") == "α\n\nb\tc\n"
    # A tool that streams nothing yields no tool_output.
    assert [e["type"] for e in plain_events] == ["tool_start", "tool_end", "content", "done"]


def test_parallel_calls_with_arguments_in_many_fragments(fake):
    calls = [("call_a", "echo", echo_args("a1", "a2")), ("call_b", "echo", echo_args("b1")),
             ("call_c", "echo", echo_args("c1", "c2", "c3"))]
    fake.script(tool_reply(*calls, pieces=9), text_reply("ok"))
    events = list(chat(fake))
    tool_events = [e for e in events if e["type"].startswith("tool_")]
    for call_id, _, arguments in calls:
        mine = [i for i, e in enumerate(tool_events) if e["tool_call_id"] == call_id]
        # Contiguous: start, its outputs, end -- nothing of another call in between.
        assert mine == list(range(mine[0], mine[-1] + 1))
        assert tool_events[mine[0]] == {"type": "tool_start", "tool_name": "echo", "tool_call_id": call_id,
                                        "arguments": arguments}
        assert tool_events[mine[-1]]["type"] == "tool_end"
        assert {tool_events[i]["type"] for i in mine[1:-1]} == {"tool_output"}
    sent = fake.requests[1].body["messages"]
    assert [c["function"]["arguments"] for c in sent[1]["tool_calls"]] == [c[2] for c in calls]
    assert [(m["tool_call_id"], m["content"]) for m in tool_messages(fake.requests[1].body)] == [
        ("call_a", "echo: a1\na2\n"), ("call_b", "echo: b1\n"), ("call_c", "echo: c1\nc2\nc3\n")]


def test_server_that_puts_every_call_at_index_zero(fake):
    chunks = [chunk({"role": "assistant", "content": None})]
    chunks += tool_fragments(0, "call_x", "echo", echo_args("x"), pieces=4)
    chunks += tool_fragments(0, "call_y", "echo", echo_args("y"), pieces=4)
    fake.script(Reply(chunks + [chunk({}, "tool_calls"), DONE]), text_reply("ok"))
    events = list(chat(fake))
    assert [(e["type"], e["tool_call_id"]) for e in events if e["type"] in ("tool_start", "tool_end")] == [
        ("tool_start", "call_x"), ("tool_end", "call_x"), ("tool_start", "call_y"), ("tool_end", "call_y")]
    assert [m["content"] for m in tool_messages(fake.requests[1].body)] == ["echo: x\n", "echo: y\n"]


def test_calls_without_id_get_call_n_past_the_histories_calls(fake):
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "echo", "arguments": echo_args("old")}}]},
        {"role": "tool", "name": "echo", "content": "echo: old\n", "tool_call_id": "call_1"},
    ]
    fake.script(tool_reply((None, "echo", echo_args("a")), (None, "echo", echo_args("b"))), text_reply("ok"))
    list(chat(fake, messages=history))
    sent = fake.requests[1].body["messages"]
    assert [c["id"] for c in sent[3]["tool_calls"]] == ["call_2", "call_3"]
    assert [m["tool_call_id"] for m in tool_messages(fake.requests[1].body)] == ["call_1", "call_2", "call_3"]


def test_a_raising_tool_becomes_an_execution_error_and_the_loop_goes_on(fake):
    def broken(name, arguments):
        raise RuntimeError("disk on fire")

    fake.script(tool_reply(("call_a", "echo", echo_args("x"))), text_reply("sorry"))
    events = list(chat(fake, execute_tool=broken))
    end = next(e for e in events if e["type"] == "tool_end")
    assert end["result"] == "Execution error: RuntimeError: disk on fire"
    assert tool_messages(fake.requests[1].body)[0]["content"] == end["result"]
    assert done_event(events)["stopped"] is None


def test_malformed_arguments_reach_the_tool_raw_and_the_loop_goes_on(fake):
    seen = []

    def strict(name, arguments):
        seen.append(arguments)
        try:
            json.loads(arguments)
        except ValueError as exc:
            return f"Invalid JSON arguments for {name}: {exc}"
        return "ok"

    fake.script(tool_reply(("call_a", "echo", '{"lines": ["x"'), pieces=3), text_reply("retrying"))
    events = list(chat(fake, execute_tool=strict))
    assert seen == ['{"lines": ["x"']
    assert tool_messages(fake.requests[1].body)[0]["content"].startswith("Invalid JSON arguments for echo")
    assert done_event(events)["finish_reason"] == "stop"


def test_execute_tool_gets_only_the_keywords_it_declares(fake):
    got = {}

    def positional(name, arguments):
        got["positional"] = ()
        return "p"

    def some(name, arguments, *, cancel_event, session_id="default", timeout=99):
        got["some"] = (cancel_event, session_id, timeout)
        return "s"

    def everything(name, arguments, **kwargs):
        got["everything"] = kwargs
        return "e"

    pool = object()
    for tool in (positional, some, everything):
        fake.script(tool_reply(("call_a", "echo", echo_args("x"))), text_reply("ok"))
        list(chat(fake, execute_tool=tool, pool=pool, timeout=7))
    assert got["positional"] == ()
    cancel_event, session_id, timeout = got["some"]
    assert isinstance(cancel_event, threading.Event) and not cancel_event.is_set()
    assert (session_id, timeout) == ("default", 7)  # no session_id given: the tool's default stays
    assert sorted(got["everything"]) == ["cancel_event", "output_callback", "pool", "timeout"]
    assert got["everything"]["pool"] is pool


# --------------------------------------------------------------------------- max_tool_iterations


def test_a_model_that_never_stops_calling_tools_stops_at_max_tool_iterations(fake):
    fake.script(*[tool_reply((f"call_{i}", "echo", echo_args(str(i)))) for i in range(3)])
    events = list(chat(fake, max_tool_iterations=2, extra_body={"tool_choice": "auto", "top_p": 0.5}))
    assert len(fake.requests) == 3
    assert [("tools" in r.body, "tool_choice" in r.body, r.body["top_p"]) for r in fake.requests] == [
        (True, True, 0.5), (True, True, 0.5), (False, False, 0.5)]
    assert [e["tool_call_id"] for e in events if e["type"] == "tool_start"] == ["call_0", "call_1"]
    done = done_event(events)
    assert (done["stopped"], done["finish_reason"]) == ("max_tool_iterations", "tool_calls")
    # The unrun third call is not in the history, which stays valid to send again.
    assert done["messages"][-1] == {"role": "tool", "name": "echo", "content": "echo: 1\n", "tool_call_id": "call_1"}


def test_the_last_request_asks_for_the_answer_without_tools(fake):
    fake.script(tool_reply(("call_a", "echo", echo_args("x"))), text_reply("answer"))
    events = list(chat(fake, max_tool_iterations=1))
    assert ["tools" in r.body for r in fake.requests] == [True, False]
    assert done_event(events)["stopped"] is None
    assert done_event(events)["messages"][-1] == {"role": "assistant", "content": "answer"}


def test_zero_iterations_never_offers_tools(fake):
    fake.script(text_reply("plain"))
    list(chat(fake, max_tool_iterations=0))
    assert "tools" not in fake.requests[0].body


# --------------------------------------------------------------------------- completions cut off by "length"


def recording(ran: list):
    """An execute_tool that only notes that it was called."""
    def execute_tool(name, arguments):
        ran.append((name, arguments))
        return f"{name} ran"
    return execute_tool


CUT = {"type": "done", "messages": USER, "finish_reason": "length", "stopped": "length"}


@pytest.mark.parametrize("arguments", ['{"lines": ["print(1', echo_args("one", "two")],
                         ids=["cut_mid_json", "cut_that_looks_whole"])
def test_a_tool_call_cut_off_by_length_is_never_run(fake, arguments):
    ran = []
    fake.script(tool_reply(("call_a", "echo", arguments), pieces=3, finish_reason="length"),
                text_reply("never asked"))
    events = list(chat(fake, execute_tool=recording(ran)))
    assert ran == []
    # No tool events, no error, and the unrun call is not left in the history.
    assert events == [CUT]
    assert len(fake.requests) == 1


def test_llama_server_quirks_with_calls_cut_off_by_length(fake):
    timings = {"prompt_n": 5, "predicted_n": 64, "predicted_per_second": 40.0}
    calls = (tool_fragments(0, "call_x", "echo", echo_args("x"), pieces=2)
             + tool_fragments(0, "call_y", "echo", '{"lines": ["y', pieces=2))
    ran = []
    fake.script(Reply([
        chunk({"role": "assistant", "content": None}),
        chunk({"reasoning_content": "Two "}),
        chunk({"reasoning_content": "calls."}),
        *[dict(c, timings=timings) for c in calls],
        chunk({"content": None}, "length", timings=timings),
        {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "choices": [],
         "usage": {"prompt_tokens": 5, "completion_tokens": 64}, "timings": timings},
        ": keep-alive comment\n\n",
        DONE,
    ]), text_reply("never asked"))
    events = list(chat(fake, execute_tool=recording(ran)))
    # Not even call_x, whole before the cut: nothing of a cut completion runs.
    assert ran == []
    assert events == [{"type": "reasoning", "text": "Two "}, {"type": "reasoning", "text": "calls."}, CUT]
    assert len(fake.requests) == 1


def test_text_before_the_cut_is_kept_without_the_unrun_call(fake):
    ran = []
    fake.script(tool_reply(("call_a", "echo", '{"lines": ["a'), text="Let me run it.", finish_reason="length"),
                text_reply("never asked"))
    events = list(chat(fake, execute_tool=recording(ran)))
    assert ran == []
    assert events == [{"type": "content", "text": "Let me run it."},
                      dict(CUT, messages=USER + [{"role": "assistant", "content": "Let me run it."}])]


def test_a_finished_call_runs_in_the_conversation_a_cut_call_ends(fake):
    ran = []
    fake.script(tool_reply(("call_a", "echo", echo_args("a"))),
                tool_reply(("call_b", "echo", echo_args("b")), finish_reason="length"),
                text_reply("never asked"))
    events = list(chat(fake, execute_tool=recording(ran)))
    assert ran == [("echo", echo_args("a"))]
    assert [(e["type"], e["tool_call_id"]) for e in events if e["type"].startswith("tool_")] == [
        ("tool_start", "call_a"), ("tool_end", "call_a")]
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "echo", "arguments": echo_args("a")}}]}
    tool = {"role": "tool", "name": "echo", "content": "echo ran", "tool_call_id": "call_a"}
    assert done_event(events) == dict(CUT, messages=USER + [assistant, tool])
    assert len(fake.requests) == 2


def test_an_answer_cut_off_by_length_says_so(fake):
    fake.script(text_reply("Once upon", finish_reason="length"))
    events = list(chat(fake))
    assert done_event(events) == dict(CUT, messages=USER + [{"role": "assistant", "content": "Once upon"}])


# --------------------------------------------------------------------------- server dialects and failures


def test_llama_server_quirks(fake):
    timings = {"prompt_n": 5, "predicted_n": 2, "predicted_per_second": 40.0}
    fake.script(Reply([
        chunk({"role": "assistant", "content": None}),
        chunk({"reasoning_content": "Let me "}),
        chunk({"reasoning_content": "think."}),
        chunk({"content": "Hi"}, timings=timings),
        chunk({"content": None}, "stop", timings=timings),
        {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "choices": [],
         "usage": {"prompt_tokens": 5, "completion_tokens": 2}, "timings": timings},
        ": keep-alive comment\n\n",
        DONE,
    ]))
    events = list(chat(fake))
    assert events[:-1] == [{"type": "reasoning", "text": "Let me "}, {"type": "reasoning", "text": "think."},
                           {"type": "content", "text": "Hi"}]
    assert done_event(events)["messages"][-1] == {"role": "assistant", "content": "Hi"}


def test_finish_reason_without_done_line_is_a_complete_answer(fake):
    fake.script(Reply([chunk({"content": "ok"}), chunk({}, "stop")]))
    events = list(chat(fake))
    assert [e["type"] for e in events] == ["content", "done"]


def _error_run(fake: FakeOpenAI, reply: Reply | None = None, **kwargs) -> tuple[list[dict], str]:
    if reply is not None:
        fake.script(reply)
    started = time.monotonic()
    events = list(chat(fake, **kwargs))
    assert time.monotonic() - started < 5
    errors = [e for e in events if e["type"] == "error"]
    assert len(errors) == 1 and events[-2] is errors[0], events
    done = done_event(events)
    assert (done["stopped"], done["messages"]) == ("error", USER)
    return events, errors[0]["message"]


def test_in_band_error_chunk(fake):
    events, message = _error_run(fake, Reply([
        chunk({"content": "par"}),
        {"error": {"code": 400, "message": "the request exceeds the available context size", "type": "x"}},
        DONE]))
    assert events[0] == {"type": "content", "text": "par"}
    assert message == "server error: the request exceeds the available context size (code 400) (from " \
                      f"{fake.base_url}/chat/completions)"


def test_http_500_names_status_and_body(fake):
    _, message = _error_run(fake, Reply(status=500, body='{"error": {"message": "model crashed"}}'))
    assert message.startswith(f"HTTP 500 Internal Server Error from {fake.base_url}/chat/completions: ")
    assert "model crashed" in message


def test_connection_drop_mid_stream(fake):
    events, message = _error_run(fake, Reply([chunk({"content": "par"}), DROP]))
    assert events[0] == {"type": "content", "text": "par"}
    assert "lost mid-stream" in message


def test_connection_refused():
    url = f"http://127.0.0.1:{closed_port()}/v1"
    events = list(chat_with_tools(url, USER, tools=[ECHO_TOOL], execute_tool=echo_plain))
    assert events[0]["type"] == "error" and events[0]["message"].startswith(f"cannot connect to {url}/chat")
    assert done_event(events)["stopped"] == "error"


def test_read_timeout_of_an_injected_client(fake):
    gate = threading.Event()
    with httpx.Client(timeout=httpx.Timeout(5.0, read=0.2)) as client:
        _, message = _error_run(fake, Reply([chunk({"content": "par"}), Gate(gate)]), http_client=client)
        assert not client.is_closed  # the caller's client is the caller's to close
    assert message.startswith("timed out waiting for")


@pytest.mark.parametrize("line, expected", [
    ("data: {not json\n\n", "malformed JSON chunk"),
    ('data: [1, 2]\n\n', "chunk is not a JSON object"),
    ('data: {"choices": [{"index": 0, "delta": "x"}]}\n\n', "'delta' is not an object"),
    ('event: error\ndata: {"message": "overloaded"}\n\n', "server error"),
])
def test_malformed_chunks(fake, line, expected):
    _, message = _error_run(fake, Reply([chunk({"content": "a"}), line, chunk({"content": "never"}), DONE]))
    assert message.startswith(expected)


def test_stream_ending_before_the_completion(fake):
    _, message = _error_run(fake, Reply([chunk({"content": "a"})]))
    assert "ended before the completion did" in message


def test_a_json_answer_instead_of_a_stream(fake):
    _, message = _error_run(fake, Reply(body='{"choices": []}'))
    assert "did not answer with an event stream" in message and '{"choices": []}' in message


def test_error_after_a_tool_round_keeps_the_messages_so_far(fake):
    fake.script(tool_reply(("call_a", "echo", echo_args("x"))), Reply(status=503, body="busy"))
    events = list(chat(fake))
    done = done_event(events)
    assert done["stopped"] == "error"
    assert [m["role"] for m in done["messages"]] == ["user", "assistant", "tool"]


# --------------------------------------------------------------------------- heartbeats


@pytest.mark.parametrize("where", ["before_headers", pytest.param("before_first_chunk", marks=pytest.mark.slow)])
def test_heartbeats_while_the_model_is_silent(fake, where):
    reply = text_reply("late")
    if where == "before_headers":
        reply.before_headers = Delay(0.3)
    else:
        reply.chunks.insert(0, Delay(0.3))
    fake.script(reply)
    events = list(chat(fake, heartbeat_interval_s=0.05))
    first_content = next(i for i, e in enumerate(events) if e["type"] == "content")
    assert events[first_content:] == [{"type": "content", "text": "late"}, events[-1]]
    assert events[:first_content] == [{"type": "heartbeat"}] * first_content
    assert first_content >= 3


def test_heartbeats_while_tool_call_arguments_stream_in(fake):
    chunks = [chunk({"role": "assistant", "content": None})]
    for fragment in tool_fragments(0, "call_a", "echo", echo_args("x"), pieces=3):
        chunks += [fragment, Delay(0.12)]
    fake.script(Reply(chunks + [chunk({}, "tool_calls"), DONE]), text_reply("ok"))
    events = list(chat(fake, heartbeat_interval_s=0.05))
    start = next(i for i, e in enumerate(events) if e["type"] == "tool_start")
    assert events[:start].count({"type": "heartbeat"}) >= 4


# --------------------------------------------------------------------------- cancellation and close()


def _wait_threads_settled(before: set[threading.Thread]) -> list[threading.Thread]:
    def extra() -> list[threading.Thread]:
        return [t for t in threading.enumerate()
                if t not in before and t.is_alive() and not t.name.startswith(HANDLER_THREAD_PREFIX)]
    wait_for(lambda: not extra(), timeout=3)
    return extra()


@pytest.mark.parametrize("client", ["own", "injected"])
def test_close_mid_stream_returns_promptly_and_closes_the_connection(fake, client):
    gate = threading.Event()
    fake.script(Reply([chunk({"content": "a"}), Gate(gate), chunk({"content": "never"}), DONE]))
    before = set(threading.enumerate())
    with httpx.Client() as http_client:
        gen = chat(fake, http_client=http_client if client == "injected" else None)
        assert next(gen) == {"type": "content", "text": "a"}
        started = time.monotonic()
        gen.close()
        assert time.monotonic() - started < 0.5
        assert fake.requests[0].client_gone.wait(2)
    assert _wait_threads_settled(before) == []


def test_close_while_the_server_has_not_sent_headers(fake):
    gate = threading.Event()
    fake.script(Reply([DONE], before_headers=Gate(gate)))
    before = set(threading.enumerate())
    gen = chat(fake, heartbeat_interval_s=0.05)
    assert next(gen) == {"type": "heartbeat"}
    started = time.monotonic()
    gen.close()
    assert time.monotonic() - started < 0.5
    assert fake.requests[0].client_gone.wait(2)
    assert _wait_threads_settled(before) == []


def test_cancel_event_mid_stream_ends_with_a_cancelled_done(fake):
    gate = threading.Event()
    cancel = threading.Event()
    fake.script(Reply([chunk({"content": "a"}), Gate(gate)]))
    gen = chat(fake, cancel_event=cancel)
    assert next(gen) == {"type": "content", "text": "a"}
    cancel.set()
    started = time.monotonic()
    rest = list(gen)
    assert time.monotonic() - started < PROMPT
    assert rest == [{"type": "done", "messages": USER, "finish_reason": None, "stopped": "cancelled"}]
    assert fake.requests[0].client_gone.wait(2)


def test_cancel_event_during_a_tool_stops_it_and_the_loop(fake):
    cancel = threading.Event()
    told = []

    def waits(name, arguments, cancel_event):
        told.append(cancel_event.wait(30))
        return "Execution cancelled."

    fake.script(tool_reply(("call_a", "echo", echo_args("a")), ("call_b", "echo", echo_args("b"))))
    gen = chat(fake, execute_tool=waits, cancel_event=cancel)
    assert next(gen)["type"] == "tool_start"
    cancel.set()
    started = time.monotonic()
    rest = list(gen)
    assert time.monotonic() - started < PROMPT
    assert told == [True]  # the second call never ran
    assert [e["type"] for e in rest] == ["tool_end", "done"]
    done = rest[-1]
    assert done["stopped"] == "cancelled"
    assert [(m["tool_call_id"], m["content"]) for m in done["messages"] if m["role"] == "tool"] == [
        ("call_a", "Execution cancelled."), ("call_b", "Execution cancelled.")]
    assert len(fake.requests) == 1


def test_close_during_a_tool_tells_the_tool_and_leaves_no_thread(fake):
    told = threading.Event()

    def streams_then_waits(name, arguments, output_callback, cancel_event):
        output_callback("working\n")
        if cancel_event.wait(30):
            told.set()
        return "stopped"

    fake.script(tool_reply(("call_a", "echo", echo_args("a"))))
    before = set(threading.enumerate())
    gen = chat(fake, execute_tool=streams_then_waits)
    assert [next(gen)["type"], next(gen)["type"]] == ["tool_start", "tool_output"]
    started = time.monotonic()
    gen.close()
    assert time.monotonic() - started < 0.5
    assert told.wait(2)
    assert _wait_threads_settled(before) == []


def test_a_clean_finish_never_sets_the_callers_cancel_event(fake):
    cancel = threading.Event()
    fake.script(tool_reply(("call_a", "echo", echo_args("a"))), text_reply("ok"))
    assert done_event(list(chat(fake, cancel_event=cancel)))["stopped"] is None
    assert not cancel.is_set()


# --------------------------------------------------------------------------- misuse


@pytest.mark.parametrize("kwargs, error", [
    ({"messages": "hi"}, TypeError),
    ({"messages": []}, ValueError),
    ({"messages": [{"content": "no role"}]}, ValueError),
    ({"messages": [{"role": "user", "content": object()}]}, TypeError),
    ({"base_url": "127.0.0.1:8080/v1"}, ValueError),
    ({"base_url": b"http://x/v1"}, TypeError),
    ({"tools": {"type": "function"}}, TypeError),
    ({"max_tool_iterations": -1}, ValueError),
    ({"max_tool_iterations": "3"}, TypeError),
    ({"execute_tool": "python"}, TypeError),
    ({"heartbeat_interval_s": 0}, ValueError),
    ({"timeout": float("nan")}, ValueError),
    ({"extra_body": {"stream": False}}, ValueError),
    ({"extra_body": {"temperature": float("inf")}}, ValueError),
    ({"cancel_event": True}, TypeError),
    ({"http_client": httpx.AsyncClient}, TypeError),
    ({"session_id": 3}, TypeError),
])
def test_misuse_raises_at_call_time(fake, kwargs, error):
    args = {"base_url": fake.base_url, "messages": USER, "tools": [ECHO_TOOL], "execute_tool": echo_plain}
    args.update(kwargs)
    with pytest.raises(error):
        chat_with_tools(args.pop("base_url"), args.pop("messages"), **args)
    assert fake.requests == []


def test_a_closed_http_client_is_misuse(fake):
    client = httpx.Client()
    client.close()
    with pytest.raises(ValueError, match="http_client is closed"):
        chat(fake, http_client=client)


# --------------------------------------------------------------------------- the real python and terminal tools


@pytest.fixture
def tools():
    return pytest.importorskip("execpool.tools", reason="execpool.tools is not there yet")


def test_default_tools_run_real_code_with_results_identical_to_execute_tool(fake, pool, tools):
    session = f"loop-{uuid.uuid4().hex[:8]}"
    python_args = json.dumps({"code": "import sys\nfor i in range(3):\n    print('line', i)\n"
                                      "print('to stderr', file=sys.stderr)\nsys.exit(2)"})
    terminal_args = json.dumps({"command": "echo hi; echo err >&2; printf 'no newline'"})
    fake.script(tool_reply(("call_py", "python", python_args), ("call_sh", "terminal", terminal_args)),
                text_reply("ok"))
    events = list(chat_with_tools(fake.base_url, USER, pool=pool, session_id=session, timeout=30))
    assert fake.requests[0].body["tools"] == [tools.PYTHON_TOOL, tools.TERMINAL_TOOL]
    expected = {
        "call_py": tools.execute_tool("python", python_args, pool=pool, session_id=session, timeout=30),
        "call_sh": tools.execute_tool("terminal", terminal_args, pool=pool, session_id=session, timeout=30),
    }
    assert expected["call_py"].startswith("Exit code 2:\n")
    sent = tool_messages(fake.requests[1].body)
    assert [list(m) for m in sent] == [TOOL_MESSAGE_KEYS] * 2
    assert {m["tool_call_id"]: m["content"] for m in sent} == expected
    assert [m["name"] for m in sent] == ["python", "terminal"]
    streamed = "".join(e["text"] for e in events if e["type"] == "tool_output" and e["tool_call_id"] == "call_py")
    assert "line 0\nline 1\nline 2\n" in streamed
    assert done_event(events)["stopped"] is None


def test_a_session_keeps_the_python_tool_s_state_across_calls_and_turns(fake, pool, tools):
    """One argument makes the python tool a stateful interpreter for the
    whole conversation: a later turn still has what an earlier one defined."""
    with tools.python_session(pool=pool) as session:
        fake.script(tool_reply(("call_a", "python", json.dumps({"code": "rows = [1, 2, 3]"}))),
                    tool_reply(("call_b", "python", json.dumps({"code": "sum(rows)"}))), text_reply("six"))
        first = done_event(list(chat_with_tools(fake.base_url, USER, pool=pool, session=session, timeout=30)))
        fake.script(tool_reply(("call_c", "python", json.dumps({"code": "rows.append(4)\nlen(rows)"}))),
                    text_reply("four"))
        history = first["messages"] + [{"role": "user", "content": "and now?"}]
        second = done_event(list(chat_with_tools(fake.base_url, history, pool=pool, session=session, timeout=30)))
    results = [m["content"] for m in second["messages"] if m["role"] == "tool"]
    assert results == ["(no output)", "6", "4"]


def test_default_tools_malformed_arguments_give_a_one_line_message(fake, pool, tools):
    fake.script(tool_reply(("call_a", "python", '{"code": "print(1)'), pieces=4), text_reply("retrying"))
    events = list(chat_with_tools(fake.base_url, USER, pool=pool))
    result = next(e for e in events if e["type"] == "tool_end")["result"]
    assert result == tools.execute_tool("python", '{"code": "print(1)', pool=pool)
    assert result and "\n" not in result
    assert tool_messages(fake.requests[1].body)[0]["content"] == result
    assert done_event(events)["messages"][-1] == {"role": "assistant", "content": "retrying"}


SLEEPER = json.dumps({"code": "import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(30)"})


def _sleeper_pid(gen) -> int:
    """Consume events up to the whole first line the sleeper prints: its pid.
    (While the model is slow to answer -- a loaded machine -- heartbeats
    come first.)"""
    event = next(gen)
    while event["type"] == "heartbeat":
        event = next(gen)
    assert event["type"] == "tool_start"
    printed = ""
    while not printed.endswith("\n"):  # print() may arrive as two writes
        event = next(gen)
        if event["type"] == "tool_output":
            printed += event["text"]
    return int(printed)


def test_cancel_event_stops_a_running_python_tool(fake, pool, tools):
    cancel = threading.Event()
    fake.script(tool_reply(("call_a", "python", SLEEPER)))
    gen = chat_with_tools(fake.base_url, USER, pool=pool, cancel_event=cancel, heartbeat_interval_s=0.05)
    pid = _sleeper_pid(gen)
    assert alive(pid)
    cancel.set()
    started = time.monotonic()
    rest = [e for e in gen if e["type"] != "heartbeat"]
    assert time.monotonic() - started < PROMPT
    assert [e["type"] for e in rest] == ["tool_end", "done"]
    assert rest[0]["result"] == "Execution cancelled."
    assert rest[1]["stopped"] == "cancelled"
    assert wait_for(lambda: not alive(pid), timeout=2)


def test_close_stops_a_running_python_tool(fake, pool, tools):
    fake.script(tool_reply(("call_a", "python", SLEEPER)))
    before = set(threading.enumerate())
    gen = chat_with_tools(fake.base_url, USER, pool=pool)
    pid = _sleeper_pid(gen)
    started = time.monotonic()
    gen.close()
    assert time.monotonic() - started < 0.5
    assert wait_for(lambda: not alive(pid), timeout=2)
    assert _wait_threads_settled(before) == []
