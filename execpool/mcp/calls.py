"""A checked call run on the pool for one client, and what the client owns.

Runs in the MCP server's process, on its event loop (asyncio, under the
SDK's anyio). Each call goes through the library's public face only: the
tool layer (``execpool.tools``: its working directories, sandbox rule,
``/mnt/data`` remap and model-facing strings) for bash and a stateless
python, a session of the pool (``pool.session``, via the tool layer's
``python_session``) for a stateful python, and ``pool.submit`` of a
``CodeJob`` for run_code.

Cancellation is the event loop's: the SDK cancels a call's task when the
client sends ``notifications/cancelled`` or goes away, and each kind of
call turns that into the pool's own cancel at once -- the job's future
cancelled (its whole tree killed, escaped daemons included), the tool
layer's ``cancel_event`` set, or the running cell interrupted as a
notebook's Stop does, its interpreter kept. What a connection started
dies with it (``Workspace.aclose``); what the server started dies with
the pool, which this process owns (its lifeline kills the rest if the
process is SIGKILLed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import secrets
import shutil
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional, Tuple

import anyio
import anyio.to_thread

from ..agent.tools import (
    MAX_OUTPUT_CHARS,
    TOOL_SANDBOX_ENV,
    bash_exec,
    get_sandbox_workdir,
    missing_path_hint,
    python_exec,
    python_session,
    truncate,
)
from ..pool.future import JobOutput
from ..pool.sessions import Session
from ..pool.supervisor import ExecPool
from ..shared.errors import SessionClosedError
from ..shared.jobs import CodeJob
from ..shared.result import CANCELLED_TEXT, ERROR_PREFIX, Status
from .tools import BASH, PYTHON, RESET, RUN_CODE, Call

#: Calls run on threads at once (bash, and python without state, block in
#: the tool layer); more wait for one. A thread costs little while its call
#: waits on the pool.
TOOL_THREADS = 256

#: How the tool layer's strings begin when the call did not succeed (SPEC
#: §2): they make the call an MCP tool error.
FAILED_PREFIXES = ("Exit code ", "Execution timed out after ", CANCELLED_TEXT, ERROR_PREFIX)

RESET_TEXT = "Python was reset: the next python call runs in a fresh interpreter. Files were kept."

RESTARTED_NOTE = ("[note] The interpreter of earlier calls had ended (idle too long, or killed), so this code ran in "
                  "a fresh one: variables from earlier calls are gone; files remain.")

#: Where live output goes: called on the event loop, in the order printed.
OnOutput = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a call gives the client: the model-facing text, the PNG images
    (base64) the code displayed, and whether the call failed."""

    text: str
    images: Tuple[str, ...] = ()
    is_error: bool = False


class Workspace:
    """What one client's connection owns: a working directory -- the tool
    layer's, under a session id of its own, shared by every tool -- and,
    when python keeps state, its interpreter. ``aclose`` ends the
    interpreter with its whole tree and removes the directory."""

    def __init__(self, pool: ExecPool, idle_timeout: float) -> None:
        self.pool = pool
        self.idle_timeout = idle_timeout
        self.session_id = "mcp-" + secrets.token_hex(8)
        self.workdir = get_sandbox_workdir(self.session_id)
        self._python: Optional[Session] = None
        #: Calls running now, and when the last one ended (``time.monotonic``).
        self.running = 0
        self.last_used = time.monotonic()

    def python(self) -> Tuple[Session, bool]:
        """The live interpreter, started now if there is none; and whether
        an earlier one had ended on its own (its state is gone)."""
        ended = self._python
        if ended is not None and ended.alive:
            return ended, False
        self._python = python_session(self.session_id, self.pool, idle_timeout=self.idle_timeout)
        return self._python, ended is not None

    async def reset(self) -> None:
        session, self._python = self._python, None
        if session is not None:
            await anyio.to_thread.run_sync(session.close)

    async def aclose(self) -> None:
        """Shielded: a connection that ends under cancellation still takes
        its interpreter and files with it."""
        with anyio.CancelScope(shield=True):
            await self.reset()
            await anyio.to_thread.run_sync(functools.partial(shutil.rmtree, self.workdir, ignore_errors=True))


class Runner:
    """Runs calls on ``pool``: python as cells of the workspace's
    interpreter when ``stateful``, else as the tool layer runs it."""

    def __init__(self, pool: ExecPool, *, stateful: bool) -> None:
        self.pool = pool
        self.stateful = stateful
        self._threads = anyio.CapacityLimiter(TOOL_THREADS)

    async def run(self, call: Call, space: Workspace, on_output: Optional[OnOutput]) -> Outcome:
        space.running += 1
        try:
            return await self._run(call, space, on_output)
        finally:
            space.running -= 1
            space.last_used = time.monotonic()

    async def _run(self, call: Call, space: Workspace, on_output: Optional[OnOutput]) -> Outcome:
        if call.tool == RESET:
            await space.reset()
            return Outcome(RESET_TEXT)
        if call.tool == PYTHON and self.stateful:
            return await self._cell(call, space, on_output)
        if call.tool == RUN_CODE:
            return await self._program(call, space, on_output)
        return await self._tool_layer(call, space, on_output)

    async def _tool_layer(self, call: Call, space: Workspace, on_output: Optional[OnOutput]) -> Outcome:
        run = python_exec if call.tool == PYTHON else bash_exec
        assert call.tool in (PYTHON, BASH)
        cancel = threading.Event()
        invoke = functools.partial(run, call.source, cancel_event=cancel, timeout=call.timeout,
                                   output_callback=_from_threads(on_output), session_id=space.session_id,
                                   pool=self.pool)
        try:
            text = await anyio.to_thread.run_sync(invoke, abandon_on_cancel=True, limiter=self._threads)
        except anyio.get_cancelled_exc_class():
            cancel.set()  # the tool layer kills the tree and returns; nobody waits for its string
            raise
        return Outcome(text, is_error=text.startswith(FAILED_PREFIXES))

    async def _cell(self, call: Call, space: Workspace, on_output: Optional[OnOutput]) -> Outcome:
        forward = _from_threads(on_output)

        def on_event(event: object) -> None:
            if isinstance(event, JobOutput) and forward is not None:
                forward(event.text)

        for last in (False, True):
            session, restarted = space.python()
            try:
                result = await _settled(session.submit(call.source, timeout=call.timeout, on_event=on_event))
                break
            except SessionClosedError:
                # The interpreter ended before this cell ran -- between the
                # look and the cell, or while the cell waited behind one that
                # was killed for ignoring its interrupt: once more, in a new one.
                if last:
                    raise
        text = truncate(result.text, MAX_OUTPUT_CHARS)
        hint = missing_path_hint(result.text, session.cwd)
        for note in (hint, RESTARTED_NOTE if restarted else ""):
            if note:
                text += ("\n" if text.endswith("\n") else "\n\n") + note
        shown = (*result.display, result.data or {})
        images = tuple(item["image/png"] for item in shown if isinstance(item.get("image/png"), str))
        return Outcome(text, images, result.status is not Status.OK)

    async def _program(self, call: Call, space: Workspace, on_output: Optional[OnOutput]) -> Outcome:
        forward = _from_threads(on_output)
        job = CodeJob(call.language, call.source, timeout=call.timeout, cwd=space.workdir,
                      max_output_chars=MAX_OUTPUT_CHARS, sandbox=self._sandbox())
        on_event = None if forward is None else (
            lambda event: forward(event.text) if isinstance(event, JobOutput) else None)
        result = await _settled(self.pool.submit(job, on_event=on_event))
        return Outcome(result.text, is_error=result.status is not Status.OK)

    def _sandbox(self) -> Optional[str]:
        """A program's sandbox, by the tool layer's rule for its own tools:
        the pool's if it has one, none if its switch says off, else strict."""
        if self.pool.config.sandbox is not None or os.environ.get(TOOL_SANDBOX_ENV, "").strip().lower() == "off":
            return None
        return "strict"


async def _settled(future: "Future[Any]") -> Any:
    """The pool future's result, awaited on the loop; a cancelled wait
    cancels the future (asyncio passes the cancel on), which is the pool's
    own cancel: a job's tree killed, a cell interrupted."""
    return await asyncio.wrap_future(future)


def _from_threads(on_output: Optional[OnOutput]) -> Optional[OnOutput]:
    """``on_output`` callable from any thread (the pool's dispatcher, a
    tool thread), run on the loop in the order called."""
    if on_output is None:
        return None
    loop = asyncio.get_running_loop()

    def forward(text: str) -> None:
        loop.call_soon_threadsafe(on_output, text)
    return forward
