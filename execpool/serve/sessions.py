"""The service's sessions (docs/service/sessions.md): ``/v1/sessions`` and
SandboxFusion's ``/run_jupyter``.

Runs in the service's process, on its event loop. A session is the pool's
(``pool.session``, execpool/pool/sessions.py), kept here by its id -- the
pool's unguessable one, which is all a client has to name it --, its
request's files given to it as a job's are (its worker writes them into
its directory). A cell takes a slot as a job does, so sessions share
``--max-in-flight`` with everything else; the number of sessions open is
bounded apart (``--max-sessions``, and the pool's disk budget: each
sandboxed session holds its disk bound for its life), and the interpreters
``/mcp`` keeps for its clients count against the same bound (``lend``):
else each door would let a client open as many again. A session that ends
on its own (idle, killed) leaves the registry as it ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import json
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable, Dict, List, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..formats import records, sandbox_fusion
from ..formats.request import CELL, RUN_JUPYTER, SESSION, BadField, Defaults, read
from ..pool.future import JobOutput
from ..pool.sessions import Session
from ..shared.cells import CellResult
from ..shared.errors import DiskBudgetError, ExecPoolError, SessionClosedError, SessionForkError
from ..shared.result import Status
from .admission import ClientGone, Reason, Rejected
from .request_job import ServiceJobs, disconnected, until_done_or_gone
from .slots import Held, SlotStream, off_loop, server_sent

logger = logging.getLogger("execpool")


class NoSuchSession(Exception):
    """An id that names no open session (404)."""


class CannotFork(Exception):
    """A session that cannot be forked (409), with why: a bash session, a
    sandboxed family out of forks, a copy that could not start."""


@dataclasses.dataclass
class _Open:
    session: Session


class ServiceSessions:
    """The sessions of one app."""

    def __init__(self, jobs: ServiceJobs, max_sessions: int, idle_timeout: float, prefix: str = "") -> None:
        self.jobs = jobs
        #: Before the pool's id in every id this app gives (``Place.name`` and a dot).
        self.prefix = prefix
        self.max_sessions = max_sessions
        self.idle_timeout = idle_timeout
        self._open: Dict[str, _Open] = {}
        self._opening = 0  # sessions being made: they count against the cap already
        self._lent = 0  # places held by /mcp's interpreters
        self._lock = threading.Lock()  # ends come on the pool's thread
        metrics = jobs.metrics
        self.cells = metrics.session_cells
        metrics.sessions_open.set_function(lambda: len(self._open) + self._lent)

    @property
    def defaults(self) -> Defaults:
        return dataclasses.replace(self.jobs.settings.defaults, max_idle=max(self.idle_timeout, 0.001))

    # -- a session's life ---------------------------------------------------------------------

    async def open(self, values: Dict[str, Any], language: str) -> Session:
        """A new session with its files; Rejected past ``--max-sessions``."""
        self._reserve()
        try:
            return await self._open_one(values, language)
        finally:
            with self._lock:
                self._opening -= 1

    async def fork(self, ident: str, request: Request) -> Session:
        """A copy of session ``ident`` in a directory of its own (a copy of
        its parent's), counted as any session; CannotFork with why."""
        parent = self.get(ident)
        self._reserve()
        try:
            forking = asyncio.ensure_future(asyncio.to_thread(parent.session.fork))
            gone = asyncio.ensure_future(disconnected(request))
            try:
                await asyncio.wait({forking, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not forking.done():
                    raise ClientGone()
                child = forking.result()
            except BaseException as exc:
                # A copy nobody will name (its client went mid-fork) is closed once made.
                forking.add_done_callback(lambda done: asyncio.ensure_future(asyncio.to_thread(_discard_copy, done)))
                if isinstance(exc, SessionClosedError):
                    raise NoSuchSession(ident) from None
                if isinstance(exc, DiskBudgetError):
                    raise Rejected(Reason.DISK_BUDGET, 5) from None
                if isinstance(exc, SessionForkError):
                    raise CannotFork(str(exc)) from None
                raise
            finally:
                gone.cancel()
            self._register(child)
            return child
        finally:
            with self._lock:
                self._opening -= 1

    def _reserve(self) -> None:
        """A place among ``--max-sessions``, taken before any await: else
        concurrent requests would all find one free."""
        with self._lock:
            self._check_room()
            self._opening += 1

    def lend(self) -> Callable[[], None]:
        """A place among ``--max-sessions`` for a session kept elsewhere
        (an ``/mcp`` client's interpreter); returns what gives it back,
        from any thread, once. Rejected when there is none."""
        with self._lock:
            self._check_room()
            self._lent += 1
        held = True

        def give_back() -> None:
            nonlocal held
            with self._lock:
                if held:
                    held = False
                    self._lent -= 1
        return give_back

    def _check_room(self) -> None:
        if len(self._open) + self._opening + self._lent >= self.max_sessions:
            raise Rejected(Reason.SESSIONS_FULL, 5)

    def _register(self, session: Session) -> None:
        with self._lock:
            self._open[self.prefix + session.id] = _Open(session)
        loop = asyncio.get_running_loop()
        session.add_done_callback(lambda ended: _on_loop(loop, self._ended, ended))

    async def _open_one(self, values: Dict[str, Any], language: str) -> Session:
        if values.get("ipython") and language != "python":
            raise BadField('"ipython": true is for a Python session; a bash session speaks bash')
        try:
            session = await asyncio.to_thread(
                self.jobs.pool.session, language, limits=values.get("memory_limit_MB") or self.defaults.limits,
                idle_timeout=values.get("idle_timeout", self.idle_timeout), network=self.defaults.network,
                files=values.get("files", {}), fetch=[glob.escape(path) for path in values.get("fetch_files", ())],
                ipython=values.get("ipython"))
        except DiskBudgetError as exc:
            logger.warning("execpool serve: cannot open a session: %s", exc)
            raise Rejected(Reason.DISK_BUDGET, 5) from None
        except ExecPoolError as exc:
            logger.warning("execpool serve: cannot open a session: %s", exc)
            raise Rejected(Reason.NO_WORKERS, 1) from None
        except ImportError as exc:
            raise BadField(f'"ipython": {exc}') from None
        except (TypeError, ValueError) as exc:
            raise BadField(f'"files": {exc}') from None
        self._register(session)
        return session

    def _ended(self, session: Session) -> None:
        with self._lock:
            self._open.pop(self.prefix + session.id, None)

    def get(self, ident: str) -> _Open:
        with self._lock:
            entry = self._open.get(ident)
        if entry is None or not entry.session.alive:
            raise NoSuchSession(ident)
        return entry

    async def close(self, ident: str) -> None:
        entry = self.get(ident)
        await asyncio.to_thread(entry.session.close)

    async def close_all(self) -> None:
        """At shutdown: every session goes, with its tree."""
        with self._lock:
            entries = list(self._open.values())
        await asyncio.gather(*(asyncio.to_thread(entry.session.close) for entry in entries))

    def listed(self) -> List[Dict[str, Any]]:
        with self._lock:
            entries = list(self._open.values())
        return [self.described(entry.session) for entry in entries]

    def described(self, session: Session) -> Dict[str, Any]:
        """What a client is told of a session: its id here first."""
        return {"id": self.prefix + session.id, "language": session.language, "ipython": session.ipython,
                "created": round(session.created, 3), "last_used": round(session.last_used, 3),
                "alive": session.alive}

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    # -- cells --------------------------------------------------------------------------------

    def cell(self, body: bytes) -> Dict[str, Any]:
        values = read(_json(body), CELL, self.defaults)
        values.setdefault("timeout", self.defaults.timeout)
        return values

    async def run(self, session: Session, code: str, timeout: Optional[float],
                  request: Optional[Request]) -> CellResult:
        """One cell, on a slot the caller holds; a client that goes away
        interrupts it (the session lives on)."""
        try:
            future = session.submit(code, timeout=timeout)
        except SessionClosedError as exc:
            raise NoSuchSession(str(exc)) from None
        with self.jobs.running(future):
            result = await until_done_or_gone(future, request)
        self.cells.labels(result.status.value).inc()
        return result

    async def stream(self, session: Session, code: str, timeout: Optional[float]) -> AsyncIterator[Any]:
        """The cell's output as events, then its CellResult last. Closing
        the generator (the client left) interrupts the cell."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def on_event(event: object) -> None:
            if isinstance(event, JobOutput):
                loop.call_soon_threadsafe(queue.put_nowait, {"type": "tool_output", "stream": event.stream,
                                                             "text": event.text})

        try:
            future = session.submit(code, timeout=timeout, on_event=on_event)
        except SessionClosedError as exc:
            raise NoSuchSession(str(exc)) from None
        done = asyncio.wrap_future(future)
        try:
            self.jobs.running_add(future)
            while True:
                getter = asyncio.ensure_future(queue.get())
                finished, _ = await asyncio.wait({getter, done}, timeout=self.jobs.settings.heartbeat_s,
                                                 return_when=asyncio.FIRST_COMPLETED)
                if getter in finished:
                    yield getter.result()
                    continue
                getter.cancel()
                if done in finished:
                    break
                yield {"type": "heartbeat"}
            while not queue.empty():
                yield queue.get_nowait()
            result = done.result()
            self.cells.labels(result.status.value).inc()
            yield result
        finally:
            self.jobs.running_discard(future)
            if not future.done():
                future.cancel()


def _on_loop(loop: asyncio.AbstractEventLoop, callback: Any, *args: Any) -> None:
    """``callback(*args)`` on the service's loop -- unless it is closed: a
    session that ends as the service stops has nobody to tell."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass


def _discard_copy(forking: "asyncio.Future[Session]") -> None:
    if not forking.cancelled() and forking.exception() is None:
        forking.result().close()


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise BadField(f"the body is not JSON: {exc}") from None


class SessionRoutes:
    """The route handlers of ``/v1/sessions`` and ``/run_jupyter``."""

    def __init__(self, sessions: ServiceSessions, read_body) -> None:
        self.sessions = sessions
        self.jobs = sessions.jobs
        self.body = read_body

    async def create(self, request: Request) -> Response:
        body = await self.body(request)
        values = await off_loop(len(body), lambda: read(_json(body), SESSION, self.sessions.defaults))
        session = await self.sessions.open(values, values.get("session_language", "python"))
        return JSONResponse(self.sessions.described(session), status_code=201)

    async def fork(self, request: Request) -> Response:
        child = await self.sessions.fork(request.path_params["ident"], request)
        return JSONResponse(self.sessions.described(child), status_code=201)

    async def listed(self, request: Request) -> Response:
        return JSONResponse(self.sessions.listed())

    async def delete(self, request: Request) -> Response:
        await self.sessions.close(request.path_params["ident"])
        return Response(status_code=204)

    async def run(self, request: Request) -> Response:
        entry = self.sessions.get(request.path_params["ident"])
        values = self.sessions.cell(await self.body(request))
        await self.jobs.slot(request)
        try:
            result = await self.sessions.run(entry.session, values["code"], values["timeout"], request)
        finally:
            self.jobs.admission.release()
        return JSONResponse(records.cell_record(result))

    async def stream(self, request: Request) -> Response:
        entry = self.sessions.get(request.path_params["ident"])
        values = self.sessions.cell(await self.body(request))
        await self.jobs.slot(request)
        held = Held(self.jobs.admission)
        return SlotStream(held, self._events(entry.session, values, held), media_type="text/event-stream",
                          headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    async def _events(self, session: Session, values: Dict[str, Any], held: Held) -> AsyncIterator[str]:
        async def record(result: CellResult) -> Dict[str, Any]:
            return records.cell_record(result)

        held.take()
        try:
            async for line in server_sent(self.sessions.stream(session, values["code"], values["timeout"]), record):
                yield line
        finally:
            self.jobs.admission.release()

    async def run_jupyter(self, request: Request) -> Response:
        """SandboxFusion's ``/run_jupyter``: the request's cells in one
        session of their own, closed at the end. A cell past its own
        ``cell_timeout`` is interrupted (a KeyboardInterrupt among its
        errors) and the next runs; past ``total_timeout`` the driver's
        status is ``TimeLimitExceeded``."""
        try:
            body = await self.body(request)
            obj = await off_loop(len(body), _json, body)
            defaults = self.sessions.defaults
            if isinstance(obj, dict) and isinstance(obj.get("memory_limit_MB"), int) and obj["memory_limit_MB"] > 0:
                defaults = dataclasses.replace(defaults, memory_by_cgroup=await asyncio.to_thread(
                    self.jobs.memory_by_cgroup))
            values = await off_loop(len(body), read, obj, RUN_JUPYTER, defaults)
        except BadField as exc:
            return JSONResponse(sandbox_fusion.jupyter_error(str(exc)))
        total = values.get("total_timeout", 45.0) or self.jobs.settings.defaults.max_timeout or 45.0
        cell_timeout = values.get("cell_timeout")
        try:
            session = await self.sessions.open(values, "python")
        except Rejected as exc:
            return JSONResponse({"detail": f"execpool is busy ({exc.reason}); retry"}, status_code=504)
        except BadField as exc:
            return JSONResponse(sandbox_fusion.jupyter_error(str(exc)))
        started = time.monotonic()
        results: List[CellResult] = []
        status = "Finished"
        try:
            for code in values["cells"]:
                left = total - (time.monotonic() - started)
                if left <= 0:
                    status = "TimeLimitExceeded"
                    break
                timeout = left if cell_timeout is None else min(cell_timeout, left)
                await self.jobs.slot(request)
                try:
                    result = await self.sessions.run(session, code, timeout, request)
                finally:
                    self.jobs.admission.release()
                if result.status is Status.TIMEOUT and timeout == left:
                    status = "TimeLimitExceeded"
                    break
                results.append(result)
                if result.status is Status.CANCELLED:
                    return Response(status_code=499)
                if not result.alive:
                    status = "Error"
                    break
        except (ClientGone, NoSuchSession):
            return Response(status_code=499)
        finally:
            await asyncio.shield(asyncio.to_thread(session.close))
        # What the session's fetch found as it ended (its worker read it).
        files = self.jobs.settings.answered(values.get("fetch_files", ()), session.files) if status == "Finished" \
            else {}
        return JSONResponse(sandbox_fusion.jupyter_answer(status, time.monotonic() - started, results, files))
