"""The MCP server: execpool's code tools behind the official SDK's
low-level ``Server``, for any transport.

::

    MCP client --tools/call--> SDK dispatcher (a task per call)
                                 -> Catalog.parse   (execpool/mcp/catalog.py)
                                 -> Guard           (stdio: none; HTTP: admission, client gone)
                                 -> Runner.run      (execpool/mcp/calls.py) -> the pool
               <--notifications/progress--  live output, in order, while it runs
               <--CallToolResult----------  the model-facing text (+ images)

Runs in the MCP server's process (``execpool mcp`` over stdio, or
``execpool serve`` at ``/mcp``), on its event loop. The transport decides
who a call belongs to (``Workspaces``) and what must hold before it runs
(``Guard``); this module does the rest the same way for both.

Live output rides progress notifications, for a client that sent a
progress token: each carries the text printed since the last one as its
``message`` and the characters sent so far as ``progress`` (which must
grow). Not logging notifications: progress belongs to one request (on
Streamable HTTP it travels on that call's own response stream) and is what
clients show beside a running call, while log messages belong to the
connection, go to a log view if anywhere, and are deprecated in the
2026-07-28 protocol. The final result does not depend on what streamed.

No call raises into the SDK: a bad call, a busy server or a failure of
execpool's is a tool error (``isError``) whose text says what happened.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Awaitable, Callable, Optional, Tuple

import anyio
import mcp_types as types
from anyio.streams.memory import MemoryObjectSendStream
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel.server import Server

from ..shared.result import ERROR_PREFIX
from .calls import Outcome, Runner, Workspace
from .catalog import BadCall, Call, Catalog
from .settings import SERVER_NAME

logger = logging.getLogger("execpool")

Context = ServerRequestContext[Any, Any]

#: Who a call belongs to: its workspace, and whether it lasts this call only
#: (a client with no connection to keep state in).
Workspaces = Callable[[Context], Awaitable[Tuple[Workspace, bool]]]

#: Runs a call's work (which never raises) once the transport allows it, or
#: says why not: a ``Busy`` outcome.
Guard = Callable[[Context, Callable[[], Awaitable[Outcome]]], Awaitable[Outcome]]


class Busy(Exception):
    """The call cannot run now; the message says why (a tool error)."""


async def unguarded(ctx: Context, work: Callable[[], Awaitable[Outcome]]) -> Outcome:
    return await work()


def create_server(runner: Runner, catalog: Catalog, workspaces: Workspaces, guard: Guard = unguarded) -> Server:
    """The SDK's server with execpool's tools."""
    listed = [types.Tool(name=tool["name"], description=tool["description"], input_schema=tool["inputSchema"])
              for tool in catalog.tools()]

    async def list_tools(ctx: Context, params: Optional[types.PaginatedRequestParams]) -> types.ListToolsResult:
        return types.ListToolsResult(tools=listed)

    async def call_tool(ctx: Context, params: types.CallToolRequestParams) -> types.CallToolResult:
        try:
            call = catalog.parse(params.name, params.arguments)
        except BadCall as exc:
            outcome = Outcome(str(exc), is_error=True)
        else:
            outcome = await guard(ctx, lambda: _safely(call, _run(runner, workspaces, ctx, call)))
        content: list = [types.TextContent(text=outcome.text)]
        content.extend(types.ImageContent(data=image, mime_type=mime) for mime, image in outcome.images)
        return types.CallToolResult(content=content, is_error=outcome.is_error)

    return Server(SERVER_NAME, version=_version(), on_list_tools=list_tools, on_call_tool=call_tool)


async def _safely(call: Call, running: Awaitable[Outcome]) -> Outcome:
    """The call's outcome, a failure of execpool's included: the model reads
    every failure as text, and the server stays up."""
    try:
        return await running
    except Exception as exc:
        logger.exception("execpool mcp: a call to %r failed", call.tool)
        return Outcome(ERROR_PREFIX + (" ".join(str(exc).splitlines()) or type(exc).__name__), is_error=True)


async def _run(runner: Runner, workspaces: Workspaces, ctx: Context, call: Call) -> Outcome:
    space, temporary = await workspaces(ctx)
    try:
        token = (ctx.meta or {}).get("progress_token")
        if token is None:
            return await runner.run(call, space, None)
        send, receive = anyio.create_memory_object_stream[str](math.inf)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_progress, ctx, token, receive)
            with send:
                outcome = await runner.run(call, space, _sender(send))
        return outcome
    finally:
        if temporary:
            await space.aclose()


async def _progress(ctx: Context, token: Any, receive: Any) -> None:
    """Send what the call printed as progress notifications, in order, the
    texts queued meanwhile joined into one; done when the call is."""
    sent = 0
    related = None if ctx.request_id is None else str(ctx.request_id)
    listening = True
    async with receive:
        async for text in receive:
            while True:
                try:
                    text += receive.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
            sent += len(text)
            if listening:
                try:
                    await ctx.session.send_progress_notification(token, sent, message=text, related_request_id=related)
                except Exception:  # noqa: BLE001 - the client's end is gone: the call goes on, unwatched
                    listening = False


def _sender(send: MemoryObjectSendStream[str]) -> Callable[[str], None]:
    def forward(text: str) -> None:
        try:
            send.send_nowait(text)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # printed after its call ended (a cancelled call's last words): nobody to tell
    return forward


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("execpool")
    except PackageNotFoundError:
        return ""
