"""The tool-calling loop against an OpenAI-compatible streaming server.

Who runs this: the caller's thread that iterates ``chat_with_tools`` (an SSE
route, a CLI, a batch harness). Per completion it starts ONE reader thread
(``chat-completion-reader``) that reads the HTTP response and hands parsed SSE
events over a bounded queue, so the generator can yield heartbeats and notice
cancellation while the server is silent (prefill, long gaps between deltas).
Per tool call, ``stream_tool_execution`` runs the call on a
``tool-exec-<name>`` thread and gives its live output the same cap and pacing
as pool jobs.

Why a thread and not read timeouts: httpx cannot resume a response after a
read timeout, so a short timeout used as a heartbeat tick would kill the
stream. Why the socket is shut down on cancellation: closing a socket does not
wake a thread blocked in ``recv`` on Linux; ``shutdown`` does, so close()
returns at once and the reader thread ends instead of waiting for the server.

What it talks to: the server over httpx (an injected ``http_client`` or one it
creates and closes), and the tool layer (``execpool.tools.execute_tool`` by
default, imported lazily so the loop carries no tool-layer import cost when a
caller brings its own ``execute_tool``).
"""

from __future__ import annotations

import inspect
import json
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Optional

import httpx
from httpx_sse import ServerSentEvent, connect_sse

from ..drain import stream_tool_execution
from ..shared import checks
from ..shared.result import CANCELLED_TEXT, ERROR_PREFIX

#: HTTP timeouts of the client the loop creates when none is injected. The
#: read timeout is a gap between two chunks, so it must outlast a long prefill.
HTTP_TIMEOUT = httpx.Timeout(connect=10.0, read=600.0, write=60.0, pool=10.0)

#: SSE events the reader may hold before it stops reading (and the server's
#: TCP window fills): a consumer that stops pulling does not buffer a whole
#: completion in memory.
READ_AHEAD_EVENTS = 256

#: How often a caller's ``cancel_event`` is checked while waiting on the server.
CANCEL_POLL_INTERVAL_S = 0.1

#: How long close() waits for the reader thread after shutting its socket
#: down. It only runs longer while still connecting or resolving a name, which
#: the connect timeout bounds; it ends on its own then.
READER_JOIN_TIMEOUT_S = 0.5

#: How much of an HTTP error body (or of a non-SSE answer) an error names.
ERROR_EXCERPT_CHARS = 500

#: Keys of ``extra_body`` the loop owns; they have parameters of their own.
RESERVED_BODY_KEYS = frozenset({"model", "messages", "stream", "tools"})

#: Request keys that only make sense with ``tools``; the final, tool-less
#: request drops them (OpenAI rejects ``tool_choice`` without ``tools``).
TOOL_ONLY_BODY_KEYS = ("tool_choice", "parallel_tool_calls")

#: The reader thread's name, so a leak shows up in ``threading.enumerate()``.
READER_THREAD_NAME = "chat-completion-reader"

#: Tool kwargs the loop can offer an ``execute_tool``; each is passed only if
#: the callable declares it (or takes ``**kwargs``), and the optional ones only
#: when the caller gave a value, so a callable's own defaults stay in force.
TOOL_KEYWORDS = ("output_callback", "cancel_event", "timeout", "session_id", "pool", "session")

Event = dict
ExecuteTool = Callable[..., str]

_DONE_DATA = "[DONE]"
_CUT_OFF = "length"  # the finish_reason of a completion that max_tokens or a full context ended
_CONNECTED_TRACES = frozenset({
    "connection.connect_tcp.complete",
    "connection.connect_unix_socket.complete",
    "connection.start_tls.complete",
})


def chat_with_tools(
    base_url: str,
    messages: list,
    *,
    tools: Optional[list] = None,
    model: Optional[str] = None,
    pool: Any = None,
    execute_tool: Optional[ExecuteTool] = None,
    max_tool_iterations: int = 8,
    cancel_event: Optional[threading.Event] = None,
    http_client: Optional[httpx.Client] = None,
    heartbeat_interval_s: float = 10.0,
    session_id: Optional[str] = None,
    timeout: Optional[float] = None,
    extra_body: Optional[dict] = None,
    session: Any = None,
) -> Generator[Event, None, None]:
    """Chat with a model that may call tools, as a generator of events.

    ``base_url`` is what OpenAI clients take (``http://host:8080/v1``).
    ``tools`` defaults to the python and terminal tools, run by
    ``execpool.tools.execute_tool`` on ``pool`` in ``session_id``'s working
    directory with ``timeout`` seconds per call; a caller's ``execute_tool``
    replaces it (and gets those values too if it declares them).
    ``session`` (``execpool.tools.python_session(session_id)``, kept by the
    caller for the whole conversation and closed at its end) makes the
    python tool a stateful interpreter: what one call defines, the next
    call -- in this turn or a later one -- still has.
    ``max_tool_iterations`` bounds the rounds in which tools run; one more,
    tool-less completion then asks for the answer.

    Yields ``content`` / ``reasoning`` deltas, per tool call ``tool_start``,
    its ``tool_output`` / ``heartbeat`` events and ``tool_end``, heartbeats
    while the model is silent, ``error`` for anything the server or network
    did wrong, and always a last ``done`` event carrying the whole message
    list, the last ``finish_reason`` and ``stopped``: None when the model
    finished, else ``"error"``, ``"cancelled"``, ``"max_tool_iterations"`` or
    ``"length"``. Setting ``cancel_event`` or closing the generator stops the
    HTTP stream and the running tool; misuse raises here, before any request.

    A completion the server cut off (finish_reason ``"length"``) runs none of
    its tool calls, not even one whose arguments parse: the cut can fall
    anywhere in a program, and half a program that runs does more harm than
    none. A call that came whole before the cut waits too, since a turn's
    calls are one plan and the cut left the plan unfinished. Nor does the
    loop tell the model and ask again: the limit that cut it (the caller's
    max_tokens, or a full context, which the cut call would only fill
    further) would most likely cut the retry as well, at the cost of another
    whole completion. So the loop stops and says so, and the caller, who owns
    the limit and the history, decides what comes next.
    """
    url = _completions_url(base_url)
    history = _check_messages(messages)
    if tools is not None:
        _check_tools(tools)
    if model is not None and not isinstance(model, str):
        raise TypeError(f"model must be a str or None, not {type(model).__name__}")
    if execute_tool is not None and not callable(execute_tool):
        raise TypeError(f"execute_tool must be callable, not {type(execute_tool).__name__}")
    checks.integer("max_tool_iterations", max_tool_iterations, minimum=0)
    checks.cancel_event(cancel_event)
    if http_client is not None:
        if not isinstance(http_client, httpx.Client):
            raise TypeError(f"http_client must be an httpx.Client, not {type(http_client).__name__}")
        if http_client.is_closed:
            raise ValueError("http_client is closed")
    checks.seconds("heartbeat_interval_s", heartbeat_interval_s)
    if session_id is not None and not isinstance(session_id, str):
        raise TypeError(f"session_id must be a str or None, not {type(session_id).__name__}")
    if timeout is not None:
        checks.seconds("timeout", timeout)
    extra = _check_extra_body(extra_body)

    if tools is None or execute_tool is None:
        from . import tools as tool_layer  # the tool layer is only needed for its defaults

        if tools is None:
            tools = [tool_layer.PYTHON_TOOL, tool_layer.TERMINAL_TOOL]
        if execute_tool is None:
            execute_tool = tool_layer.execute_tool
    offered = {"timeout": timeout, "session_id": session_id, "pool": pool, "session": session}
    runner = _ToolRunner(execute_tool, {k: v for k, v in offered.items() if v is not None},
                         heartbeat_interval_s)
    return _chat(url, history, list(tools), model, extra, runner, max_tool_iterations, cancel_event,
                 http_client, heartbeat_interval_s)


# --------------------------------------------------------------------------- validation


def _completions_url(base_url: object) -> str:
    if not isinstance(base_url, str):
        raise TypeError(f"base_url must be a str, not {type(base_url).__name__}")
    try:
        parsed = httpx.URL(base_url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"base_url {base_url!r} is not a valid URL: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"base_url must be an http(s) URL such as http://127.0.0.1:8080/v1, got {base_url!r}")
    return str(parsed.copy_with(path=parsed.path.rstrip("/") + "/chat/completions"))


def _check_messages(messages: object) -> list:
    if not isinstance(messages, list):
        raise TypeError(f"messages must be a list of dicts, not {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TypeError(f"messages[{i}] must be a dict, not {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] has no str 'role'")
    _to_json(messages, "messages")
    return list(messages)


def _check_tools(tools: object) -> None:
    if not isinstance(tools, list):
        raise TypeError(f"tools must be a list of tool schemas (dicts), not {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise TypeError(f"tools[{i}] must be a dict, not {type(tool).__name__}")
    _to_json(tools, "tools")


def _check_extra_body(extra_body: object) -> dict:
    if extra_body is None:
        return {}
    if not isinstance(extra_body, dict):
        raise TypeError(f"extra_body must be a dict, not {type(extra_body).__name__}")
    owned = sorted(RESERVED_BODY_KEYS.intersection(extra_body))
    if owned:
        raise ValueError(f"extra_body must not set {', '.join(owned)}: pass them as parameters")
    _to_json(extra_body, "extra_body")
    return dict(extra_body)


def _to_json(value: Any, name: str) -> bytes:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{name} is not JSON-serializable: {exc}") from None


# --------------------------------------------------------------------------- the loop


def _chat(url: str, history: list, tools: list, model: Optional[str], extra: dict, runner: "_ToolRunner",
          max_tool_iterations: int, cancel_event: Optional[threading.Event],
          http_client: Optional[httpx.Client], heartbeat_interval_s: float) -> Generator[Event, None, None]:
    client = http_client if http_client is not None else httpx.Client(timeout=HTTP_TIMEOUT)
    # Tools always get an event, so close() can stop the running one even when
    # the caller gave none; only the caller's own event is worth polling.
    cancel = cancel_event if cancel_event is not None else threading.Event()
    ids = _CallIds(history)
    finished = False
    try:
        rounds = 0
        while True:
            with_tools = rounds < max_tool_iterations
            body = _request_body(model, history, tools if with_tools else None, extra)
            turn = yield from _complete(client, url, body, cancel if cancel_event is not None else None,
                                        heartbeat_interval_s)
            if turn.error is not None:
                finished = True
                yield {"type": "error", "message": turn.error}
                yield _done(history, turn.finish_reason, "error")
                return
            if turn.cancelled:
                finished = True
                yield _done(history, turn.finish_reason, "cancelled")
                return
            calls = turn.tool_calls(ids)
            cut_off = turn.finish_reason == _CUT_OFF
            if cut_off or not calls or not with_tools:
                if turn.text or not calls:
                    # Unrun calls are dropped, so the history stays valid to
                    # send again (every tool call needs a tool answer).
                    history.append(_assistant_message(turn.text, []))
                finished = True
                stopped = _CUT_OFF if cut_off else "max_tool_iterations" if calls else None
                yield _done(history, turn.finish_reason, stopped)
                return
            history.append(_assistant_message(turn.text, calls))
            for call in calls:
                if cancel.is_set():
                    result = CANCELLED_TEXT  # never started; answered so the history stays valid
                else:
                    result = yield from runner.run(call, cancel)
                history.append({"role": "tool", "name": call.name, "content": result, "tool_call_id": call.id})
            if cancel.is_set():
                finished = True
                yield _done(history, turn.finish_reason, "cancelled")
                return
            rounds += 1
    finally:
        if not finished:
            cancel.set()  # abandoned (close(), or an exception): as pool streams do, say so
        if http_client is None:
            client.close()


def _request_body(model: Optional[str], history: list, tools: Optional[list], extra: dict) -> bytes:
    body: dict[str, Any] = {}
    if model is not None:
        body["model"] = model
    body["messages"] = history
    body["stream"] = True
    if tools:
        body["tools"] = tools
        body.update(extra)
    else:
        body.update((k, v) for k, v in extra.items() if k not in TOOL_ONLY_BODY_KEYS)
    return json.dumps(body, ensure_ascii=False).encode("utf-8")


def _assistant_message(text: str, calls: list["_ToolCall"]) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return message


def _done(history: list, finish_reason: Optional[str], stopped: Optional[str]) -> Event:
    return {"type": "done", "messages": history, "finish_reason": finish_reason, "stopped": stopped}


# --------------------------------------------------------------------------- tool calls


@dataclass
class _ToolCall:
    id: str
    name: str = ""
    arguments: str = ""


class _CallIds:
    """``call_<n>`` for calls the server sent without an id, numbered past the
    calls already in the history so a continued conversation never reuses one."""

    def __init__(self, history: list) -> None:
        self.count = sum(len(m["tool_calls"]) for m in history
                         if m.get("role") == "assistant" and isinstance(m.get("tool_calls"), list))

    def next(self) -> str:
        self.count += 1
        return f"call_{self.count}"


class _ToolCallAssembler:
    """Joins ``delta.tool_calls`` fragments into calls.

    Fragments of one call share an ``index``; its id and name come first, the
    arguments in pieces. Some servers put every call at index 0: a fragment
    bringing a new id where the index already holds another call starts a new
    call.
    """

    def __init__(self) -> None:
        self.calls: list[_ToolCall] = []
        self._at_index: dict[Any, _ToolCall] = {}

    def add(self, fragment: dict) -> None:
        index = fragment.get("index")
        if index is not None and (isinstance(index, bool) or not isinstance(index, int)):
            raise _ProtocolError(f"tool call index is not an int: {_excerpt(json.dumps(fragment))}")
        call_id = fragment.get("id") or ""
        function = fragment.get("function") or {}
        if not isinstance(call_id, str) or not isinstance(function, dict):
            raise _ProtocolError(f"malformed tool call fragment: {_excerpt(json.dumps(fragment))}")
        current = self._at_index.get(index) if index is not None else (self.calls[-1] if self.calls else None)
        if current is None or (call_id and current.id and call_id != current.id):
            current = _ToolCall(id=call_id)
            self.calls.append(current)
            self._at_index[index] = current
        elif call_id and not current.id:
            current.id = call_id
        name = function.get("name")
        if isinstance(name, str) and name and not current.name:
            current.name = name
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            current.arguments += arguments
        elif isinstance(arguments, dict):  # a few servers send the object itself
            current.arguments += json.dumps(arguments, ensure_ascii=False)


class _ToolRunner:
    """Runs one call through ``execute_tool`` on a ``stream_tool_execution``
    thread, turning whatever the callable does into a model-facing string."""

    def __init__(self, execute_tool: ExecuteTool, values: dict, heartbeat_interval_s: float) -> None:
        self.execute_tool = execute_tool
        self.accepted = _accepted_keywords(execute_tool)
        self.values = values
        self.heartbeat_interval_s = heartbeat_interval_s

    def run(self, call: _ToolCall, cancel: threading.Event) -> Generator[Event, None, str]:
        yield {"type": "tool_start", "tool_name": call.name, "tool_call_id": call.id,
               "arguments": call.arguments}
        kwargs = {k: v for k, v in dict(self.values, cancel_event=cancel).items() if k in self.accepted}
        streams = "output_callback" in self.accepted

        def invoke(output_callback: Callable[[str], None]) -> str:
            live = {"output_callback": output_callback} if streams else {}
            try:
                result = self.execute_tool(call.name, call.arguments, **kwargs, **live)
            except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's to read
                return f"{ERROR_PREFIX}{type(exc).__name__}: {exc}"
            if not isinstance(result, str):
                return f"{ERROR_PREFIX}execute_tool returned {type(result).__name__}, not str"
            return result

        result = yield from stream_tool_execution(
            invoke, tool_name=call.name, tool_call_id=call.id, cancel_event=cancel,
            heartbeat_interval_s=self.heartbeat_interval_s, poll_interval_s=CANCEL_POLL_INTERVAL_S)
        yield {"type": "tool_end", "tool_name": call.name, "tool_call_id": call.id, "result": result}
        return result


def _accepted_keywords(func: Callable[..., Any]) -> frozenset:
    """Which of TOOL_KEYWORDS ``func`` takes: the rule of
    ``drain.accepts_output_callback`` (declared by name, or ``**kwargs``),
    applied to each; an uninspectable callable gets none of them."""
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return frozenset()
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return frozenset(TOOL_KEYWORDS)
    return frozenset(name for name in TOOL_KEYWORDS
                     if name in params and params[name].kind in (params[name].POSITIONAL_OR_KEYWORD,
                                                                 params[name].KEYWORD_ONLY))


# --------------------------------------------------------------------------- one completion


class _ProtocolError(Exception):
    """The server sent something a completion stream cannot contain."""


@dataclass
class _Turn:
    """What one completion produced."""

    text_parts: list[str] = field(default_factory=list)
    calls: _ToolCallAssembler = field(default_factory=_ToolCallAssembler)
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    cancelled: bool = False

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def tool_calls(self, ids: _CallIds) -> list[_ToolCall]:
        for call in self.calls.calls:
            if not call.id:
                call.id = ids.next()
        return self.calls.calls


def _complete(client: httpx.Client, url: str, body: bytes, cancel_event: Optional[threading.Event],
              heartbeat_interval_s: float) -> Generator[Event, None, _Turn]:
    """Stream one completion: yield its deltas and heartbeats, return the turn."""
    turn = _Turn()
    if cancel_event is not None and cancel_event.is_set():
        turn.cancelled = True
        return turn
    reader = _CompletionReader(client, url, body)
    next_beat = time.monotonic() + heartbeat_interval_s
    try:
        while True:
            wait = max(0.0, next_beat - time.monotonic())
            if cancel_event is not None:
                if cancel_event.is_set():
                    turn.cancelled = True
                    return turn
                wait = min(wait, CANCEL_POLL_INTERVAL_S)
            item = reader.get(wait)
            if item is None:
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + heartbeat_interval_s
                    yield {"type": "heartbeat"}
                continue
            kind, payload = item
            if kind == "error":
                turn.error = payload
                return turn
            if kind == "end":
                if turn.finish_reason is None:
                    turn.error = (f"the stream from {url} ended before the completion did "
                                  f"(no finish_reason and no [DONE])")
                return turn
            try:
                events = _apply_event(payload, turn)
            except _ProtocolError as exc:
                turn.error = f"{exc} (from {url})"
                return turn
            if events is None:
                return turn
            for event in events:
                yield event
                next_beat = time.monotonic() + heartbeat_interval_s
    finally:
        reader.stop()


def _apply_event(sse: ServerSentEvent, turn: _Turn) -> Optional[list[Event]]:
    """Fold one SSE event into ``turn``; the events to yield, or None at [DONE]."""
    data = sse.data.strip()
    if sse.event == "error":
        raise _ProtocolError(f"server error: {_excerpt(data)}")
    if data == _DONE_DATA:
        return None
    if not data:
        return []
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError as exc:
        raise _ProtocolError(f"malformed JSON chunk ({exc.msg}): {_excerpt(data)}") from None
    if not isinstance(chunk, dict):
        raise _ProtocolError(f"chunk is not a JSON object: {_excerpt(data)}")
    if "error" in chunk:  # llama-server reports mid-stream failures in-band
        raise _ProtocolError(f"server error: {_error_text(chunk['error'])}")
    choices = chunk.get("choices") or []  # the usage chunk has none
    if not isinstance(choices, list):
        raise _ProtocolError(f"'choices' is not a list: {_excerpt(data)}")
    events: list[Event] = []
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            continue  # n > 1 is not a tool loop's business: follow the first choice
        delta = choice.get("delta") or {}
        if not isinstance(delta, dict):
            raise _ProtocolError(f"'delta' is not an object: {_excerpt(data)}")
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            events.append({"type": "reasoning", "text": reasoning})
        content = delta.get("content")
        if isinstance(content, str) and content:
            turn.text_parts.append(content)
            events.append({"type": "content", "text": content})
        fragments = delta.get("tool_calls") or []
        if not isinstance(fragments, list):
            raise _ProtocolError(f"'tool_calls' is not a list: {_excerpt(data)}")
        for fragment in fragments:
            if not isinstance(fragment, dict):
                raise _ProtocolError(f"malformed tool call fragment: {_excerpt(data)}")
            turn.calls.add(fragment)
        if choice.get("finish_reason"):
            turn.finish_reason = str(choice["finish_reason"])
    return events


def _error_text(error: Any) -> str:
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        code = error.get("code")
        return f"{error['message']} (code {code})" if code is not None else error["message"]
    return _excerpt(error if isinstance(error, str) else json.dumps(error))


def _excerpt(text: str) -> str:
    """One line, short enough for an error event."""
    line = " ".join(text.split())
    if len(line) > ERROR_EXCERPT_CHARS:
        line = line[:ERROR_EXCERPT_CHARS] + "..."
    return line or "(empty)"


class _Stopped(Exception):
    """Raised inside httpx (from the trace hook) to abandon a request."""


class _CompletionReader:
    """One streaming request read on its own thread.

    Items on the queue: ``("sse", ServerSentEvent)``, then ``("end", None)``
    when the body ended, or ``("error", message)``. After ``[DONE]`` it stops
    reading rather than wait for the server to end the body.
    """

    def __init__(self, client: httpx.Client, url: str, body: bytes) -> None:
        self._client = client
        self._url = url
        self._body = body
        self._items: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=READ_AHEAD_EVENTS)
        self._lock = threading.Lock()
        self._stopped = False
        self._sock: Optional[socket.socket] = None
        self._thread = threading.Thread(target=self._read, name=READER_THREAD_NAME, daemon=True)
        self._thread.start()

    def get(self, timeout: float) -> Optional[tuple[str, Any]]:
        try:
            return self._items.get(timeout=timeout)
        except queue.Empty:
            return None

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            sock = self._sock
        _shutdown(sock)
        # Make room, so a reader blocked on a full queue wakes and sees the flag.
        while True:
            try:
                self._items.get_nowait()
            except queue.Empty:
                break
        self._thread.join(READER_JOIN_TIMEOUT_S)

    # -- the reader thread ---------------------------------------------------

    def _put(self, item: tuple[str, Any]) -> bool:
        if self._stopped:
            return False
        self._items.put(item)
        return not self._stopped

    def _attach(self, sock: Optional[socket.socket]) -> None:
        """Remember the request's socket so stop() can wake a blocked read."""
        with self._lock:
            if not self._stopped:
                self._sock = sock
                return
        _shutdown(sock)

    def _trace(self, name: str, info: dict) -> None:
        # Abandon at the next step forward, never inside httpcore's cleanup.
        if self._stopped and name.endswith(".started") and "close" not in name:
            raise _Stopped()
        if name in _CONNECTED_TRACES and info.get("return_value") is not None:
            self._attach(info["return_value"].get_extra_info("socket"))

    def _read(self) -> None:
        try:
            with connect_sse(self._client, "POST", self._url, content=self._body,
                             headers={"Content-Type": "application/json"},
                             extensions={"trace": self._trace}) as source:
                response = source.response
                # A reused keep-alive connection was never traced: take its
                # socket now. An HTTP/2 socket is shared with other requests,
                # so it is left alone (the read timeout bounds that reader).
                if response.http_version.startswith("HTTP/1"):
                    stream = response.extensions.get("network_stream")
                    if stream is not None:
                        self._attach(stream.get_extra_info("socket"))
                error = _response_error(response, self._url)
                if error is not None:
                    self._put(("error", error))
                    return
                for sse in source.iter_sse():
                    if not self._put(("sse", sse)) or sse.data.strip() == _DONE_DATA:
                        return
            self._put(("end", None))
        except Exception as exc:  # noqa: BLE001 - every failure becomes an error event
            if not self._stopped:
                self._put(("error", _transport_error(exc, self._url)))


def _shutdown(sock: Optional[socket.socket]) -> None:
    if sock is None:
        return
    try:
        # The base-class method: SSLSocket.shutdown would also drop its TLS
        # state under the reader's feet; the reader only needs its recv woken.
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by httpx: nothing left to wake


def _response_error(response: httpx.Response, url: str) -> Optional[str]:
    if response.status_code >= 400:
        status = f"{response.status_code} {response.reason_phrase}".strip()
        return f"HTTP {status} from {url}: {_excerpt(_read_head(response))}"
    content_type = response.headers.get("content-type", "")
    if "text/event-stream" not in content_type:
        return (f"{url} did not answer with an event stream (content-type {content_type!r}): "
                f"{_excerpt(_read_head(response))}")
    return None


def _read_head(response: httpx.Response) -> str:
    """The start of a body, without reading all of a large one."""
    data = bytearray()
    for chunk in response.iter_bytes():
        data += chunk
        if len(data) > 4 * ERROR_EXCERPT_CHARS:
            break
    return data.decode("utf-8", errors="replace")


def _transport_error(exc: Exception, url: str) -> str:
    if isinstance(exc, httpx.ConnectTimeout):
        return f"timed out connecting to {url}"
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out waiting for {url}: {type(exc).__name__}"
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect to {url}: {exc}"
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
        return f"connection to {url} lost mid-stream: {exc}"
    return f"request to {url} failed: {type(exc).__name__}: {exc}"
