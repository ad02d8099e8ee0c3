"""The parent-side stream: from a job's messages to the events a server sends.

Runs in the caller's thread (or asyncio task) that consumes the stream; no
thread of its own for pool jobs. A client of ``ExecPool.submit`` like any
other: it submits its job with an ``on_event`` that fills an inbox, yields
``tool_output`` and ``heartbeat`` events from it, turns the live-output cap
into its notice, turns ``close()`` (an SSE client disconnect) into
``future.cancel()``, and returns the job's ``Result`` -- the same Result a
non-streamed run gives, because the worker builds it before and apart from
any live output.

``stream_tool_execution`` gives any blocking callable (a web search, an MCP
call) the same events, on one worker thread per call named
``tool-exec-<tool_name>`` so a leak shows up in ``threading.enumerate()``.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import queue
import threading
import time
from concurrent import futures
from typing import Any, Callable, Generator, Optional, Tuple

from .pool.future import JobOutput, OutputCapped
from .shared import checks
from .shared.output import STREAM_CAP_NOTICE, LiveBudget
from .shared.result import Result

#: How long close() waits for the worker to confirm the tree is dead.
CLOSE_ACK_TIMEOUT_S = 0.5

Event = dict
EventStream = Generator[Event, None, Any]
Submit = Callable[..., Any]


def accepts_output_callback(func: Callable[..., Any]) -> bool:
    """Whether ``func`` declares ``output_callback`` or takes ``**kwargs``."""
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.kind is p.VAR_KEYWORD
        or (p.name == "output_callback" and p.kind is not p.POSITIONAL_ONLY)
        for p in params
    )


def drain_queue(q: "queue.Queue[Any] | queue.SimpleQueue[Any]", sentinel: object,
                max_chars: Optional[int]) -> Tuple[str, bool]:
    """Join every chunk queued right now, in order, without blocking.

    Past ``max_chars`` it keeps exactly one more character (so the caller can
    tell the budget was exceeded) and discards the rest, but keeps reading so
    the queue is emptied and the sentinel still reported.
    """
    parts: list[str] = []
    kept = 0
    hit = False
    while True:
        try:
            item = q.get_nowait()
        except queue.Empty:
            break
        if item is sentinel:
            hit = True
            break
        if max_chars is None:
            parts.append(item)
            continue
        room = max(max_chars, 0) + 1 - kept
        if room > 0:
            piece = item[:room]
            parts.append(piece)
            kept += len(piece)
    return "".join(parts), hit


def _output_event(tool_name: str, tool_call_id: str, text: str) -> Event:
    return {"type": "tool_output", "tool_name": tool_name, "tool_call_id": tool_call_id, "text": text}


class _LiveView:
    """Event shaping shared by every stream: the cap, its notice, and the
    heartbeat pacing (reset by streamed output, not by output past the cap)."""

    def __init__(self, tool_name: str, tool_call_id: str, heartbeat_interval_s: float) -> None:
        self.tool_name = tool_name
        self.tool_call_id = tool_call_id
        self.interval = heartbeat_interval_s
        self.live = LiveBudget()
        self.next_beat = time.monotonic() + heartbeat_interval_s

    def output(self, text: str) -> list[Event]:
        if self.live.capped or not text:
            return []
        piece = self.live.take(text)
        events = [_output_event(self.tool_name, self.tool_call_id, piece)] if piece else []
        if self.live.capped:
            events.append(_output_event(self.tool_name, self.tool_call_id, STREAM_CAP_NOTICE))
        self.next_beat = time.monotonic() + self.interval
        return events

    def cap(self) -> list[Event]:
        """The producer said the cap was hit: the notice, once."""
        if self.live.capped:
            return []
        self.live.capped = True
        self.next_beat = time.monotonic() + self.interval
        return [_output_event(self.tool_name, self.tool_call_id, STREAM_CAP_NOTICE)]

    def until_beat(self) -> float:
        return max(0.0, self.next_beat - time.monotonic())

    def beat(self) -> list[Event]:
        now = time.monotonic()
        if now < self.next_beat:
            return []
        self.next_beat = now + self.interval
        return [{"type": "heartbeat"}]


def _check_stream_args(cancel_event: Optional[threading.Event], heartbeat_interval_s: float,
                       poll_interval_s: Optional[float] = None) -> None:
    """``poll_interval_s`` only for wrapped callables: a pool job's
    cancel_event is watched by the pool."""
    checks.seconds("heartbeat_interval_s", heartbeat_interval_s)
    if poll_interval_s is not None:
        checks.seconds("poll_interval_s", poll_interval_s)
    checks.cancel_event(cancel_event)


#: Put on a stream's inbox when its job's future is done.
_DONE = object()


class _JobConsumer:
    """The state of one pool job's stream, apart from how its inbox is
    waited on, so the thread and asyncio drivers share every rule. The job
    is submitted through the pool's public ``submit``: its events and the
    end of its future go to ``put``, from the dispatcher thread, in order."""

    def __init__(self, submit: Submit, job: Any, tool_name: str, tool_call_id: str,
                 cancel_event: Optional[threading.Event], heartbeat_interval_s: float,
                 put: Callable[[object], None]) -> None:
        self.view = _LiveView(tool_name, tool_call_id, heartbeat_interval_s)
        self.cancel_event = cancel_event
        self.result: Optional[Result] = None
        self.future = submit(job, on_event=put, cancel_event=cancel_event)
        self.future.add_done_callback(lambda _: put(_DONE))

    def wait_timeout(self) -> Optional[float]:
        """How long the driver may block on the inbox (None: until a message)."""
        timeout = self.view.until_beat()
        return None if math.isinf(timeout) else timeout

    def step(self, msg: Optional[object]) -> list[Event]:
        """Handle one inbox item (None: the wait timed out)."""
        if msg is _DONE:
            self.result = self.future.result()
            return []
        if isinstance(msg, JobOutput):
            return self.view.output(msg.text)
        if isinstance(msg, OutputCapped):
            return self.view.cap()
        return self.view.beat()

    def abandon(self) -> None:
        """The consumer went away before the end: cancel the job and tell the
        other tool calls of this turn through the shared cancel_event."""
        if self.cancel_event is not None:
            self.cancel_event.set()
        self.future.cancel()


def _stream_job(submit: Submit, job: Any, tool_name: str, tool_call_id: str,
                cancel_event: Optional[threading.Event], heartbeat_interval_s: float) -> EventStream:
    q: queue.SimpleQueue[object] = queue.SimpleQueue()
    consumer = _JobConsumer(submit, job, tool_name, tool_call_id, cancel_event, heartbeat_interval_s, q.put)
    try:
        while consumer.result is None:
            try:
                msg = q.get(timeout=consumer.wait_timeout())
            except queue.Empty:
                msg = None
            yield from consumer.step(msg)
        return consumer.result
    finally:
        if consumer.result is None:
            consumer.abandon()
            # Bounded: close() returns promptly even if the worker is slow to
            # confirm the tree is dead.
            futures.wait([consumer.future], CLOSE_ACK_TIMEOUT_S)


def stream_job(submit: Submit, job: Any, *, tool_name: str = "", tool_call_id: str = "",
               cancel_event: Optional[threading.Event] = None,
               heartbeat_interval_s: float = 10.0) -> EventStream:
    """Validate now, in the caller's frame; submit on the first ``next()``."""
    _check_stream_args(cancel_event, heartbeat_interval_s)
    return _stream_job(submit, job, str(tool_name), str(tool_call_id), cancel_event, heartbeat_interval_s)


class AsyncJobStream:
    """``async for event in pool.astream(job)``; then ``.result``.

    Cancelling the consuming task (or ``aclose()``) cancels the job. The
    dispatcher thread hands events to the event loop with
    ``call_soon_threadsafe``, so no thread is spent per job here either.
    """

    def __init__(self, submit: Submit, job: Any, *, tool_name: str, tool_call_id: str,
                 cancel_event: Optional[threading.Event], heartbeat_interval_s: float) -> None:
        _check_stream_args(cancel_event, heartbeat_interval_s)
        self.result: Optional[Result] = None
        self._gen = self._events(submit, job, str(tool_name), str(tool_call_id), cancel_event,
                                 heartbeat_interval_s)

    def __aiter__(self) -> "AsyncJobStream":
        return self

    async def __anext__(self) -> Event:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        await self._gen.aclose()

    async def run(self) -> Result:
        """Consume every event and return the Result."""
        async for _ in self:
            pass
        assert self.result is not None
        return self.result

    async def _events(self, submit: Submit, job: Any, tool_name: str, tool_call_id: str,
                      cancel_event: Optional[threading.Event], heartbeat_interval_s: float):
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[object] = asyncio.Queue()

        def put(item: object) -> None:
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, item)
            except RuntimeError:
                pass  # the loop is closed; nobody is waiting for this job any more

        consumer = _JobConsumer(submit, job, tool_name, tool_call_id, cancel_event, heartbeat_interval_s, put)
        try:
            while consumer.result is None:
                try:
                    msg = await asyncio.wait_for(inbox.get(), consumer.wait_timeout())
                except asyncio.TimeoutError:
                    msg = None
                for event in consumer.step(msg):
                    yield event
            self.result = consumer.result
        finally:
            if consumer.result is None:
                consumer.abandon()


def stream_tool_execution(invoke: Callable[[Callable[[str], None]], Any], *, tool_name: str,
                          tool_call_id: str = "", cancel_event: Optional[threading.Event] = None,
                          heartbeat_interval_s: float = 10.0, poll_interval_s: float = 0.25) -> EventStream:
    """Stream any blocking ``invoke(output_callback) -> result`` the way pool
    jobs stream: same events, cap, heartbeats and close semantics.

    The cap is enforced where output is produced: once a call has queued more
    than the cap, its callback drops further chunks, so a flood holds at most
    the cap plus one chunk in the queue.
    """
    _check_stream_args(cancel_event, heartbeat_interval_s, poll_interval_s)
    return _stream_callable(invoke, str(tool_name), str(tool_call_id), cancel_event,
                            heartbeat_interval_s, poll_interval_s)


def _stream_callable(invoke: Callable[[Callable[[str], None]], Any], tool_name: str, tool_call_id: str,
                     cancel_event: Optional[threading.Event], heartbeat_interval_s: float,
                     poll_interval_s: float) -> EventStream:
    q: queue.SimpleQueue[object] = queue.SimpleQueue()
    done = object()
    outcome: dict[str, Any] = {}
    # One character past the cap is queued, so the consumer can tell.
    produced = LiveBudget(slack=1)

    def output_callback(text: str) -> None:
        if isinstance(text, str) and text and not produced.capped:
            piece = produced.take(text)
            if piece:
                q.put(piece)

    def call() -> None:
        try:
            outcome["result"] = invoke(output_callback)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            outcome["error"] = exc
        finally:
            q.put(done)

    view = _LiveView(tool_name, tool_call_id, heartbeat_interval_s)
    finished = False
    threading.Thread(target=call, name=f"tool-exec-{tool_name}", daemon=True).start()
    try:
        while not finished:
            timeout = view.until_beat()
            if cancel_event is not None:
                timeout = min(timeout, poll_interval_s)
            try:
                first = q.get(timeout=timeout)
            except queue.Empty:
                yield from view.beat()
                continue
            if not isinstance(first, str):  # done: nothing else is queued but text
                finished = True
                break
            rest, finished = drain_queue(q, done, view.live.room - len(first))
            yield from view.output(first + rest)
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("result")
    finally:
        if not finished and cancel_event is not None:
            cancel_event.set()
