"""A checked call run on the pool for one client, and what the client owns.

Runs in the MCP server's process, on its event loop (asyncio, under the
SDK's anyio). Each call goes through the library's public face only, and
holds no thread while it runs: the tool layer's job (``tool_job`` and
``tool_text`` of ``execpool.tools``: its working directories, sandbox
rule, ``/mnt/data`` remap and model-facing strings) for bash and a
stateless python, a session of the pool (``pool.session``, via the tool
layer's ``python_session``) for a stateful python, and a ``CodeJob`` for
run_code -- each ``pool.submit``-ted and its future awaited.

Cancellation is the event loop's: the SDK cancels a call's task when the
client sends ``notifications/cancelled`` or goes away, and the awaited
future is cancelled with it, which is the pool's own cancel, at once: a
job's whole tree killed (escaped daemons included), or the running cell
interrupted as a notebook's Stop does and what it started killed, its
interpreter kept. What a connection started dies with it
(``Workspace.aclose``); what the server started dies with the pool,
which this process owns (its lifeline kills the rest if the process is
SIGKILLed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional, Tuple

import anyio
import anyio.to_thread

from ..agent.tools import (
    MAX_OUTPUT_CHARS,
    TOOL_SANDBOX_ENV,
    get_sandbox_workdir,
    missing_path_hint,
    python_session,
    tool_job,
    tool_text,
    tool_workspace,
    truncate,
)
from ..pool.future import JobOutput, OutputCapped
from ..pool.sessions import Session
from ..pool.workspaces import Workspace as PoolWorkspace
from ..shared.errors import ExecPoolError, SessionClosedError
from ..shared.jobs import CodeJob
from ..shared.kernel.dirs import remove_tree
from ..shared.output import STREAM_CAP_NOTICE
from ..shared.result import CANCELLED_TEXT, ERROR_PREFIX, Status
from ..supervisor import ExecPool
from .catalog import PYTHON, RESET, RUN_CODE, Call

#: How the tool layer's strings begin when the call did not succeed:
#: they make the call an MCP tool error.
FAILED_PREFIXES = ("Exit code ", "Execution timed out after ", CANCELLED_TEXT, ERROR_PREFIX)

RESET_TEXT = "Python was reset: the next python call runs in a fresh interpreter. Files were kept."

RESTARTED_NOTE = ("[note] The interpreter of earlier calls had ended (idle too long, or killed), so this code ran in "
                  "a fresh one: variables from earlier calls are gone; files remain.")

#: Where live output goes: called on the event loop, in the order printed.
OnOutput = Callable[[str], None]

#: A place for one more interpreter where a server bounds them (``execpool
#: serve``'s ``--max-sessions``): returns what gives it back, callable from
#: any thread; raises ``execpool.mcp.server.Busy`` when there is none.
Claim = Callable[[], Callable[[], None]]


#: The displayed types a client gets as images, the first a bundle has:
#: those a kernel sends base64 (an SVG is text, which the text carries).
IMAGE_TYPES = ("image/png", "image/jpeg")


def _image(bundle: dict) -> Optional[Tuple[str, str]]:
    """A display's image as (MIME type, base64), or None."""
    for mime in IMAGE_TYPES:
        if isinstance(bundle.get(mime), str):
            return mime, bundle[mime]
    return None


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a call gives the client: the model-facing text, the images the
    code displayed (MIME type, base64), and whether the call failed."""

    text: str
    images: Tuple[Tuple[str, str], ...] = ()
    is_error: bool = False


class Workspace:
    """What one client's connection owns: its files -- a workspace of the
    pool's (the tool layer's ``tool_workspace``: bounded, gone with the
    connection), or, without the sandbox, the tool layer's directory of a
    session id of its own -- shared by every tool, made at its first call;
    and, when python keeps state, its interpreter. ``aclose`` ends the
    interpreter with its whole tree and lets the files go. Each interpreter
    holds a place of ``claim``'s while it lives, and speaks IPython as
    ``ipython`` says (``pool.session``'s)."""

    def __init__(self, pool: ExecPool, idle_timeout: float, claim: Optional[Claim] = None,
                 ipython: Optional[bool] = None) -> None:
        self.pool = pool
        self.idle_timeout = idle_timeout
        self.ipython = ipython
        self._claim = claim
        self.session_id = "mcp-" + secrets.token_hex(8)
        self._space: Optional[PoolWorkspace] = None
        self._workdir: Optional[str] = None
        self._python: Optional[Session] = None
        #: Calls running now, and when the last one ended (``time.monotonic``).
        self.running = 0
        self.last_used = time.monotonic()

    def space(self) -> Optional[PoolWorkspace]:
        """The pool's workspace its calls run in (None without the sandbox:
        they run in ``workdir``); DiskBudgetError when it cannot be had now."""
        if self._space is None and self._workdir is None:
            self._space = tool_workspace(self.pool)
            if self._space is None:
                self._workdir = get_sandbox_workdir(self.session_id)
        return self._space

    @property
    def workdir(self) -> Optional[str]:
        """The directory its calls run in without the sandbox (None with it)."""
        self.space()
        return self._workdir

    def python(self) -> Tuple[Session, bool]:
        """The live interpreter, started now if there is none; and whether
        an earlier one had ended on its own (its state is gone)."""
        ended = self._python
        if ended is not None and ended.alive:
            return ended, False
        give_back = self._claim() if self._claim is not None else None
        try:
            session = python_session(self.session_id, self.pool, idle_timeout=self.idle_timeout,
                                     workspace=self.space(), ipython=self.ipython)
        except BaseException:
            if give_back is not None:
                give_back()
            raise
        if give_back is not None:
            session.add_done_callback(lambda _: give_back())
        self._python = session
        return session, ended is not None

    async def reset(self) -> None:
        session, self._python = self._python, None
        if session is not None:
            await anyio.to_thread.run_sync(session.close)

    async def aclose(self) -> None:
        """Shielded: a connection that ends under cancellation still takes
        its interpreter and files with it."""
        with anyio.CancelScope(shield=True):
            await self.reset()
            if self._space is not None:
                self._space.close()
            elif self._workdir is not None:
                await anyio.to_thread.run_sync(remove_tree, self._workdir)


class Runner:
    """Runs calls on ``pool``: python as cells of the workspace's
    interpreter when ``stateful``, else as the tool layer runs it."""

    def __init__(self, pool: ExecPool, *, stateful: bool) -> None:
        self.pool = pool
        self.stateful = stateful

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
        """bash, and python without state: the tool layer's job, submitted
        here and awaited on the loop (no thread held per call)."""
        try:
            place = space.space()
            job = tool_job("python" if call.tool == PYTHON else "terminal", call.source, self.pool,
                           timeout=call.timeout, session_id=space.session_id, in_workspace=place is not None)
            future = (place or self.pool).submit(job, on_event=_live(on_output))
        except (TypeError, ValueError, ExecPoolError) as exc:
            return Outcome(ERROR_PREFIX + " ".join(str(exc).splitlines()), is_error=True)
        result = await _settled(future)
        text = tool_text(result, job)
        return Outcome(text, is_error=text.startswith(FAILED_PREFIXES))

    async def _cell(self, call: Call, space: Workspace, on_output: Optional[OnOutput]) -> Outcome:
        on_event = _live(on_output)
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
        hint = missing_path_hint(result.text, session.cwd or PoolWorkspace.path)
        for note in (hint, RESTARTED_NOTE if restarted else ""):
            if note:
                text += ("\n" if text.endswith("\n") else "\n\n") + note
        images = tuple(image for bundle in result.shown if (image := _image(bundle)) is not None)
        return Outcome(text, images, result.status is not Status.OK)

    async def _program(self, call: Call, space: Workspace, on_output: Optional[OnOutput]) -> Outcome:
        try:
            place = space.space()
            job = CodeJob(call.language, call.source, timeout=call.timeout, cwd=space.workdir,
                          max_output_chars=MAX_OUTPUT_CHARS, sandbox=None if place is not None else self._sandbox())
            future = (place or self.pool).submit(job, on_event=_live(on_output))
        except (TypeError, ValueError, ExecPoolError) as exc:
            return Outcome(ERROR_PREFIX + " ".join(str(exc).splitlines()), is_error=True)
        result = await _settled(future)
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


def _live(on_output: Optional[OnOutput]) -> Optional[Callable[[object], None]]:
    """A pool ``on_event`` that hands a call's live output to ``on_output``
    on the loop, in the order printed (the pool calls it from its
    dispatcher), and the stream's notice once the live cap is hit."""
    if on_output is None:
        return None
    loop = asyncio.get_running_loop()

    def on_event(event: object) -> None:
        if isinstance(event, JobOutput):
            loop.call_soon_threadsafe(on_output, event.text)
        elif isinstance(event, OutputCapped):
            loop.call_soon_threadsafe(on_output, STREAM_CAP_NOTICE)
    return on_event
