"""A request's slot, held until its answer is sent.

Runs in the service's process, on its event loop. A route takes a slot
(execpool/serve/admission.py) before its job runs; the slot is given back
only once the answer has gone out -- however that ends -- so a client that
does not read its answer holds its slot, not a pile of answers in the
server's memory. A big answer is sent in pieces, each waiting for the
client to take the one before.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.responses import Response, StreamingResponse

from .admission import Admission

#: Bodies (and answers) larger than this are parsed (built, sent in pieces)
#: on a thread: the loop serves everyone.
OFF_LOOP_BYTES = 64 << 10


async def off_loop(size: int, function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``, on a thread when ``size`` bytes are enough that
    doing it on the loop would hold everyone else up."""
    if size > OFF_LOOP_BYTES:
        return await asyncio.to_thread(function, *args)
    return function(*args)


class Held:
    """A slot a route took: the job that runs on it ``take``s it over (and
    releases it when done); if the answer never runs (the client left
    before it started), the response releases it."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.held = True

    def take(self) -> None:
        self.held = False

    def release(self) -> None:
        if self.held:
            self.held = False
            self.admission.release()


class _ReleasesSlot:
    """An answer that returns its route's slot once sent, however that ends."""

    held: Held

    async def __call__(self, scope: Any, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)  # type: ignore[misc]
        finally:
            self.held.release()


class SlotStream(_ReleasesSlot, StreamingResponse):
    """A streamed answer (SSE, NDJSON, a big JSON in pieces) on a slot."""

    def __init__(self, held: Held, content: AsyncIterator[Any], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.held = held


class SlotAnswer(_ReleasesSlot, Response):
    """A JSON answer on a slot."""

    def __init__(self, held: Held, content: bytes, status_code: int) -> None:
        super().__init__(content, status_code=status_code, media_type="application/json")
        self.held = held


def json_answer(held: Held, content: bytes, status: int) -> Response:
    """``content`` as the answer on ``held``'s slot: whole, or in pieces
    when big -- in one piece it would sit in the connection's buffer with
    the slot already released."""
    if len(content) <= OFF_LOOP_BYTES:
        return SlotAnswer(held, content, status)
    return SlotStream(held, _pieces(content), status_code=status, media_type="application/json",
                      headers={"Content-Length": str(len(content))})


async def _pieces(content: bytes) -> AsyncIterator[memoryview]:
    view = memoryview(content)
    for start in range(0, len(view), OFF_LOOP_BYTES):
        yield view[start:start + OFF_LOOP_BYTES]


async def server_sent(items: AsyncIterator[Any], record: Callable[[Any], Awaitable[dict]]) -> AsyncIterator[str]:
    """A stream's SSE body: each event dict as a ``data:`` line, heartbeats
    as ``: keep-alive`` comments, and the last item -- the outcome, not a
    dict -- as ``event: result`` with ``record(outcome)``."""
    async for item in items:
        if not isinstance(item, dict):
            yield f"event: result\ndata: {json.dumps(await record(item))}\n\n"
        elif item["type"] == "heartbeat":
            yield ": keep-alive\n\n"
        else:
            yield f"data: {json.dumps(item)}\n\n"
