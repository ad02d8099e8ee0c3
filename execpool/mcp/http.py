"""The MCP server over Streamable HTTP: an ASGI app that ``execpool serve``
mounts at ``/mcp``, behind the service's own guard (token, Origin, Host)
and admission (a call takes a slot as a job does).

Runs in the service's process, on its event loop. The SDK's session
manager keeps one MCP session per client (its ``Mcp-Session-Id``); this
module keeps that session's workspace -- directory and Python interpreter
-- by the same id, and ends it when the client deletes its session, when
it has had no call for ``idle_timeout`` seconds (the SDK forgets an idle
session after as long), or when the endpoint closes. A client that speaks
without a session (the 2026-07-28 protocol) gets a workspace per call.

A call belongs to the HTTP exchange that carries it: when that exchange
ends before the call does -- the client dropped the stream -- the call is
cancelled and its tree dies, as ``/v1/stream``'s job does. (The protocol
lets a client resume a dropped stream; this server gives none a reason
to, since a call it cannot deliver is one nobody is waiting for.)
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import (
    Any,
    AsyncContextManager,
    AsyncIterator,
    Callable,
    Dict,
    Mapping,
    MutableMapping,
    Optional,
    Set,
    Tuple,
)

import anyio
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from starlette.responses import JSONResponse

from ..agent.tools import SANDBOX_ROOT_ENV
from ..shared.result import CANCELLED_TEXT
from ..supervisor import ExecPool
from .calls import Claim, Outcome, Runner, Workspace
from .catalog import Catalog
from .server import Busy, Context, create_server
from .settings import (
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    SESSION_HEADER,
)

#: The ASGI scope key of an exchange's end (an ``anyio.Event``), for the call it carries.
ENDED = "execpool.mcp.ended"

#: A slot for one call, given the time its request arrived (``time.monotonic``,
#: or None); raises ``execpool.mcp.server.Busy`` when there is none to give.
Gate = Callable[[Optional[float]], AsyncContextManager[None]]


def no_gate(arrived: Optional[float]) -> AsyncContextManager[None]:
    return contextlib.nullcontext()


class Endpoint:
    """The ASGI app of ``/mcp`` on ``pool``. ``running()`` must be entered
    around serving it (the SDK's session manager lives there); ``close``
    ends it gracefully. ``max_sessions`` bounds the MCP sessions open at
    once: past it, 503; ``claim`` bounds their interpreters, with other
    sessions of the server's own. A body over ``max_body_bytes`` is
    answered 413."""

    def __init__(self, pool: ExecPool, *, stateful: bool = True, timeout: float = DEFAULT_TIMEOUT_S,
                 max_timeout: float = DEFAULT_MAX_TIMEOUT_S, idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
                 max_sessions: Optional[int] = None, gate: Gate = no_gate, claim: Optional[Claim] = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, ipython: Optional[bool] = None) -> None:
        self.pool = pool
        self.idle_timeout = idle_timeout
        self.ipython = ipython
        self.gate = gate
        self.claim = claim
        # The clients' directories live under the pool's own, which goes with
        # the pool even when the process is SIGKILLed, and which the pool's
        # user can write wherever its home is (unless the caller chose a root).
        os.environ.setdefault(SANDBOX_ROOT_ENV, pool.scratch_dir())
        server = create_server(Runner(pool, stateful=stateful), Catalog(stateful, timeout, max_timeout),
                               self._workspace, self._guard)
        # The service's guard checks Origin and Host before this app is reached.
        self.manager = StreamableHTTPSessionManager(app=server, session_idle_timeout=idle_timeout,
                                                    max_sessions=max_sessions, max_request_body_size=max_body_bytes)
        self._spaces: Dict[str, Workspace] = {}
        # The session ids the SDK gave out (at each handshake), and when: a
        # request may name only one of these for a workspace that lasts --
        # a client on the sessionless protocol can put any id in the header.
        self._given: Dict[str, float] = {}
        self._exchanges: Set[anyio.Event] = set()
        self._calls = 0
        self._quiet = anyio.Event()
        self._quiet.set()
        self._closing = False

    async def __call__(self, scope: Dict[str, Any], receive: Callable, send: Callable) -> None:
        if self._closing:
            await JSONResponse({"detail": "execpool is stopping"}, status_code=503)(scope, receive, send)
            return
        ended, leave = anyio.Event(), anyio.Event()
        scope[ENDED] = ended
        self._exchanges.add(leave)

        async def sent(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start" and message["status"] < 300:
                given = _header(message, SESSION_HEADER)
                if given is not None:
                    self._given.setdefault(given, time.monotonic())
                if scope.get("method") == "DELETE":
                    # Answered once its workspace is gone: a client that
                    # opens the next at once finds the room this one held.
                    await self._end(_header(scope, SESSION_HEADER))
            await send(message)

        try:
            await self.manager.handle_request(scope, _until(receive, leave), sent)
        finally:
            ended.set()
            self._exchanges.discard(leave)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """The SDK's session manager, and the sweep that ends idle
        workspaces; on the way out, every workspace ends."""
        async with self.manager.run(), anyio.create_task_group() as tasks:
            tasks.start_soon(self._sweep)
            try:
                yield
            finally:
                tasks.cancel_scope.cancel()
                for ident in list(self._spaces):
                    await self._end(ident)

    async def close(self, timeout: float) -> None:
        """Take no new request; give the calls running ``timeout`` seconds,
        then end every exchange still open, which cancels its call."""
        self._closing = True
        with anyio.move_on_after(timeout):
            await self._quiet.wait()
        for leave in self._exchanges:
            leave.set()

    async def _workspace(self, ctx: Context) -> Tuple[Workspace, bool]:
        ident = _header(ctx.request.scope, SESSION_HEADER) if ctx.request is not None else None
        if ident is None or ident not in self._given:
            return Workspace(self.pool, self.idle_timeout, self.claim, self.ipython), True
        space = self._spaces.get(ident)
        if space is None:
            space = self._spaces[ident] = Workspace(self.pool, self.idle_timeout, self.claim, self.ipython)
        return space, False

    async def _guard(self, ctx: Context, work: Callable[[], Any]) -> Outcome:
        """``work`` in a slot of the gate's, cancelled if its exchange ends first."""
        scope = ctx.request.scope if ctx.request is not None else {}
        ended: Optional[anyio.Event] = scope.get(ENDED)
        outcome: Optional[Outcome] = None
        self._calls += 1
        if self._calls == 1:
            self._quiet = anyio.Event()
        try:
            async with anyio.create_task_group() as tasks:
                if ended is not None:
                    tasks.start_soon(_cancel_on, ended, tasks.cancel_scope)
                try:
                    async with self.gate(scope.get("state", {}).get("arrived")):
                        outcome = await work()
                except Busy as exc:
                    outcome = Outcome(str(exc), is_error=True)
                tasks.cancel_scope.cancel()
        finally:
            self._calls -= 1
            if not self._calls:
                self._quiet.set()
        return outcome if outcome is not None else Outcome(CANCELLED_TEXT, is_error=True)  # nobody reads it

    async def _sweep(self) -> None:
        """End the workspaces that have had no call for ``idle_timeout``."""
        while True:
            await anyio.sleep(min(60.0, self.idle_timeout / 4))
            now = time.monotonic()
            for ident, space in list(self._spaces.items()):
                if not space.running and now - space.last_used > self.idle_timeout:
                    await self._end(ident)
            for ident, since in list(self._given.items()):
                if ident not in self._spaces and now - since > self.idle_timeout:
                    del self._given[ident]  # a session that never called a tool, gone by now

    async def _end(self, ident: Optional[str]) -> None:
        if ident is not None:
            self._given.pop(ident, None)
        space = self._spaces.pop(ident, None) if ident is not None else None
        if space is not None:
            await space.aclose()


async def _cancel_on(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


def _until(receive: Callable, leave: anyio.Event) -> Callable:
    """``receive``, but the client seems gone once ``leave`` is set: how a
    closing endpoint ends the streams it holds open."""
    async def wrapped() -> Dict[str, Any]:
        message: Dict[str, Any] = {"type": "http.disconnect"}
        if leave.is_set():
            return message
        async with anyio.create_task_group() as tasks:
            async def take() -> None:
                nonlocal message
                message = await receive()
                tasks.cancel_scope.cancel()

            tasks.start_soon(take)
            tasks.start_soon(_cancel_on, leave, tasks.cancel_scope)
        return message
    return wrapped


def _header(scope: Mapping[str, Any], name: str) -> Optional[str]:
    wanted = name.encode("latin-1")
    return next((value.decode("latin-1") for key, value in scope.get("headers", ()) if key.lower() == wanted), None)
