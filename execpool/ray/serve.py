"""``execpool serve`` as a Ray Serve application: one service across a Ray
cluster (docs/service-on-ray.md).

::

    clients --HTTP--> Ray Serve's proxy (each node)      callers on the cluster
                          |  routed by execpool/ray/routing.py     | DeploymentHandle
                          v                                        v
    replica (a Ray actor, one per node unless told)  <--forward-->  replica ...
      the app of ``execpool serve`` (execpool/serve/app.py) over an ExecPool of
      its node's CPUs; the guard, then ``_Pinned``, then the routes

Who runs what: ``Service`` runs in each replica's Ray worker process, on
the event loop Ray Serve runs its user code on; ``app`` and ``handle`` in
whatever process builds or calls the application.

A replica is the same app as ``execpool serve``'s, made by the same code
(``execpool.serve.command.service``) from the same options, so every flag
means what it means there, per replica: admission (503/504), limits,
auth, sessions. What it adds is a name -- Ray Serve's for the replica --
which fills SandboxFusion's ``executor_pod_name`` and begins every session
id it gives (``/v1/sessions``' and, in the ``Mcp-Session-Id`` header,
``/mcp``'s), and ``_Pinned`` before its routes: a request for a session of
another replica is passed on to that one (``forward``, through a handle
pinned by the router) and its answer streamed back; one for a session
whose replica is gone is a 404 saying its node left the cluster.

Why passing on through a handle and not asking clients to send
``serve_multiplexed_model_id``: SandboxFusion's and every other client send
a session's id in the path, which Ray Serve's proxy does not read; a client
that does send the header (the session's id) saves the extra hop.

Why ``await`` and never ``.result()`` on a handle's answer here: the
replica's event loop is the one the answer arrives on; a call that blocks
it waits for itself.

Nothing of a replica outlives it: at the application's deletion Ray Serve
lets its requests end, then ``__del__`` closes its pool; a replica killed
outright (its node's raylet gone) takes its pool's lifeline's owner with
it, and the lifeline kills every worker and tool (execpool/lifeline).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, List, Mapping, Optional, Set, Tuple

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.datastructures import Headers
from starlette.middleware import Middleware

from ..cli.main import serve_options
from ..mcp.settings import SESSION_HEADER
from ..serve.app import Place
from ..serve.command import checked, service
from ..serve.settings import default_max_in_flight
from . import routing

__all__ = ["APP_NAME", "DEPLOYMENT", "ServiceError", "app", "handle"]

#: The application's name on the cluster, and its one deployment's.
APP_NAME = "execpool"
DEPLOYMENT = "ExecPoolService"

#: What a replica takes at once beyond what its admission lets run and
#: wait (those past it are answered 503 by the app): its cheap routes
#: (health, the page, /v1/cluster) and requests it passes on.
SPARE_REQUESTS = 64

#: Seconds a replica's answer to ``GET /v1/cluster`` may take before it is
#: listed as not ready.
DESCRIBE_TIMEOUT_S = 5.0

#: The key a replica puts in the ASGI scope of a request it was passed: its
#: session's replica is gone when the request reaches another.
_PASSED = "execpool.passed_on"

#: The MCP session's header as ASGI names it.
_SESSION_KEY = SESSION_HEADER.encode()

#: What an ASGI scope carries between replicas (the rest is the server's).
_SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "root_path",
               "query_string", "headers", "client", "server")


class ServiceError(Exception):
    """A handle call the service refused or could not run: ``status`` is
    the HTTP status the same request would have had, ``detail`` its
    ``detail`` (or its body)."""

    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(f"{status}: {detail}")
        self.status = status
        self.detail = detail

    def __reduce__(self) -> Any:
        # Made again from what it was made of: Ray pickles a replica's
        # exception to its caller, and by default would call
        # ``ServiceError(message)``, which fails (the caller got Ray's
        # UnserializableException instead).
        return ServiceError, (self.status, self.detail)


@serve.ingress()
class Service:
    """One replica: the app of ``execpool serve`` over an ExecPool of its
    own (see the module docstring). Its methods are the handle API."""

    def __init__(self, options: argparse.Namespace, token: Optional[str] = None) -> None:
        context = serve.get_replica_context()
        self.name: str = context.replica_id.unique_id
        self._app_name = context.app_name
        self._deployment = context.deployment
        self._token = token if token is not None else checked(options)
        self._handle: Optional[DeploymentHandle] = None
        self._stack = contextlib.ExitStack()
        place = Place(self.name, [Middleware(_Pinned, service=self, max_body_bytes=options.max_body_mb << 20,
                                             read_timeout=options.read_timeout)])
        # Jobs at niceness 0, as RayPool's: a Ray worker, and so this
        # replica, runs at 15 (execpool/ray/pool.py says what that needs).
        self._asgi = self._stack.enter_context(service(options, self._token, place, niceness=0))
        runtime = ray.get_runtime_context()
        self.node_id = runtime.get_node_id()
        self.address = ray.util.get_node_ip_address()

    def __serve_build_asgi_app__(self) -> Any:
        return self._asgi

    async def __del__(self) -> None:
        """Ray Serve let the requests end: sessions and the pool go."""
        self._asgi.state.jobs.stop_jobs()
        await self._asgi.state.sessions.close_all()
        await asyncio.to_thread(self._stack.close)

    @property
    def own(self) -> DeploymentHandle:
        """A handle to this deployment, for passing requests on."""
        if self._handle is None:
            self._handle = serve.get_deployment_handle(self._deployment, self._app_name)
        return self._handle

    # -- between replicas -----------------------------------------------------------------

    async def forward(self, scope: Dict[str, Any], body: bytes) -> AsyncIterator[List[Dict[str, Any]]]:
        """A request another replica was given, run here: its answer's ASGI
        messages, a list at a time. Cancelled (its client left), it ends
        the request as a client gone."""
        async for messages in _asgi_call(self._asgi, {**scope, _PASSED: True}, body):
            yield messages

    def describe(self) -> Dict[str, Any]:
        """This replica as ``GET /v1/cluster`` lists it."""
        jobs = self._asgi.state.jobs
        return {"replica": self.name, "node_id": self.node_id, "address": self.address,
                "jobs_in_flight": jobs.admission.in_flight, "jobs_waiting": jobs.admission.queue_depth,
                "sessions_open": len(self._asgi.state.sessions), "jobs_served": jobs.pool.stats().jobs_total,
                "ready": True}

    async def known(self) -> List[Tuple[str, str]]:
        """(name, node id) of every replica, as the routers here know them."""
        seen = routing.replicas(self._app_name, self._deployment)
        if seen is None:
            await self.own.options(multiplexed_model_id=f"{self.name}.").describe.remote()
            seen = routing.replicas(self._app_name, self._deployment) or []
        return seen

    async def heard(self) -> Set[str]:
        """The name of every replica the routers here heard of, gone ones too."""
        await self.known()
        return routing.heard(self._app_name, self._deployment)

    async def cluster(self) -> Dict[str, Any]:
        """Every replica, as the routers here know them, each asked apart."""
        seen = await self.known()

        async def asked(name: str, node: str) -> Dict[str, Any]:
            try:
                found = await asyncio.wait_for(
                    self.own.options(multiplexed_model_id=f"{name}.").describe.remote(), DESCRIBE_TIMEOUT_S)
                if found["replica"] == name:
                    return found
            except (asyncio.TimeoutError, ray.exceptions.RayError):
                pass
            return {"replica": name, "node_id": node, "address": None, "jobs_in_flight": None,
                    "jobs_waiting": None, "sessions_open": None, "jobs_served": None, "ready": False}
        return {"replicas": list(await asyncio.gather(*(asked(name, node) for name, node in seen)))}

    # -- the handle API: the routes' answers, without HTTP -------------------------------

    async def run_code(self, request: Mapping[str, Any]) -> Dict[str, Any]:
        """SandboxFusion's ``/run_code``: its ``RunCodeResponse``."""
        return await self._call("POST", "/run_code", request)

    async def run(self, job: Mapping[str, Any]) -> Dict[str, Any]:
        """``/v1/run``: the job's record."""
        return await self._call("POST", "/v1/run", job)

    async def open_session(self, request: Mapping[str, Any]) -> Dict[str, Any]:
        """``POST /v1/sessions``: the session, on this replica."""
        return await self._call("POST", "/v1/sessions", request)

    async def run_cell(self, session_id: str, cell: Mapping[str, Any]) -> Dict[str, Any]:
        """``POST /v1/sessions/{id}/run``: the cell's record."""
        return await self._call("POST", f"/v1/sessions/{session_id}/run", cell)

    async def fork_session(self, session_id: str) -> Dict[str, Any]:
        """``POST /v1/sessions/{id}/fork``: the copy, beside its parent."""
        return await self._call("POST", f"/v1/sessions/{session_id}/fork", {})

    async def close_session(self, session_id: str) -> None:
        """``DELETE /v1/sessions/{id}``."""
        await self._call("DELETE", f"/v1/sessions/{session_id}", None)

    async def _call(self, method: str, path: str, obj: Any) -> Any:
        headers = [(b"host", b"localhost"), (b"content-type", b"application/json")]
        if self._token is not None:
            headers.append((b"authorization", f"Bearer {self._token}".encode()))
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
                 "headers": headers, "client": None, "server": None}
        status, body = 500, []
        async for messages in _asgi_call(self._asgi, scope, b"" if obj is None else json.dumps(obj).encode()):
            for message in messages:
                if message["type"] == "http.response.start":
                    status = message["status"]
                elif message["type"] == "http.response.body":
                    body.append(message.get("body", b""))
        text = b"".join(body)
        answer = json.loads(text) if text else None
        if status >= 300:
            raise ServiceError(status, answer.get("detail", answer) if isinstance(answer, dict) else answer)
        return answer


class _Pinned:
    """Between the guard and the routes of each replica's app: a request
    for another replica's session (of ``/v1/sessions`` or ``/mcp``) is
    passed on to it; ``GET /v1/cluster`` and ``GET /v1/sessions`` are
    answered for the whole cluster."""

    def __init__(self, app: Callable, service: Service, max_body_bytes: int, read_timeout: float) -> None:
        self.app = app
        self.service = service
        self.max_body_bytes = max_body_bytes
        self.read_timeout = read_timeout

    async def __call__(self, scope: Dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        if path == "/v1/cluster" and method == "GET":
            await send_json(send, 200, await self.service.cluster())
            return
        if path == "/v1/sessions" and method == "GET" and not scope.get(_PASSED):
            await send_json(send, 200, await self._all_sessions(scope))
            return
        if path == "/mcp":
            await self._mcp(scope, receive, send)
            return
        match = routing.SESSION_PATH.match(path)
        if match is None or "." not in match.group(1) or match.group(1).startswith(f"{self.service.name}."):
            await self.app(scope, receive, send)
            return
        await self._elsewhere(match.group(1), scope, receive, send, _no_session)

    async def _mcp(self, scope: Dict[str, Any], receive: Callable, send: Callable) -> None:
        """``/mcp``, whose sessions the MCP SDK names in a header: each id
        it gives out leaves as ``NAME.<the SDK's id>`` and comes back in
        without ``NAME.``, so the SDK (and the endpoint's workspaces) see
        their own ids, and a session's requests find its replica as those
        of ``/v1/sessions`` do. An id that names no replica ever heard of
        (one a client of the sessionless protocol made up) goes to the SDK
        as it is."""
        ident = Headers(scope=scope).get(SESSION_HEADER)
        mine = f"{self.service.name}."
        if ident is not None and ident.startswith(mine):
            scope = {**scope, "headers": [(key, value[len(mine):] if key == _SESSION_KEY else value)
                                          for key, value in scope["headers"]]}
        elif ident is not None and "." in ident and routing.owner(ident) in await self.service.heard():
            await self._elsewhere(ident, scope, receive, send, _no_mcp_session)
            return

        async def named(message: Dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [
                    (key, mine.encode() + value if key.lower() == _SESSION_KEY else value)
                    for key, value in message.get("headers", ())]}
            await send(message)
        await self.app(scope, receive, named)

    async def _elsewhere(self, ident: str, scope: Dict[str, Any], receive: Callable, send: Callable,
                         refuse: Callable[[Callable, str], Awaitable[None]]) -> None:
        """A request for session ``ident`` of another replica, passed on to
        it; ``refuse(send, detail)`` answers it when that replica is gone."""
        name = routing.owner(ident)
        seen = routing.replicas(self.service._app_name, self.service._deployment)
        if scope.get(_PASSED) or (seen is not None and name not in {known for known, _ in seen}):
            await refuse(send, routing.left(name))
            return
        body = await self._body(receive, send, scope)
        if body is not None:
            await self._pass_on(ident, scope, body, send, refuse)

    async def _body(self, receive: Callable, send: Callable, scope: Dict[str, Any]) -> Optional[bytes]:
        """The request's body under the app's own limits (413, 408)."""
        chunks: List[bytes] = []
        size = 0

        async def read() -> bool:
            nonlocal size
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return False
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise OverflowError
                chunks.append(chunk)
                if not message.get("more_body"):
                    return True
        try:
            if not await asyncio.wait_for(read(), self.read_timeout):
                return None
        except OverflowError:
            await send_json(send, 413, {"detail": f"the body is over {self.max_body_bytes >> 20} MiB"})
            return None
        except asyncio.TimeoutError:
            await send_json(send, 408, {"detail": f"the body did not arrive within {self.read_timeout:g} s"})
            return None
        return b"".join(chunks)

    async def _pass_on(self, ident: str, scope: Dict[str, Any], body: bytes, send: Callable,
                       refuse: Callable[[Callable, str], Awaitable[None]]) -> None:
        """The request on the session's replica, its answer sent as it comes."""
        call = self.service.own.options(multiplexed_model_id=ident, stream=True)
        answer = call.forward.remote(_portable(scope), body)
        started = False
        try:
            async for messages in answer:
                for message in messages:
                    started = started or message["type"] == "http.response.start"
                    await send(message)
        except ray.exceptions.RayError:
            if started:
                raise
            await refuse(send, routing.left(routing.owner(ident)))
        finally:
            answer.cancel()

    async def _all_sessions(self, scope: Dict[str, Any]) -> List[Dict[str, Any]]:
        """Every replica's ``GET /v1/sessions``, one list. Each replica is
        asked for as long as it takes, not as ``GET /v1/cluster`` asks: a
        replica slow to answer under load is still there, and its sessions
        were left out of the list; only one that is gone lists none."""
        names = [name for name, _ in await self.service.known()]

        async def of(name: str) -> List[Dict[str, Any]]:
            call = self.service.own.options(multiplexed_model_id=f"{name}.", stream=True)
            status, found = 500, []
            try:
                async for messages in call.forward.remote(_portable(scope), b""):
                    for message in messages:
                        status = message.get("status", status)
                        found.append(message.get("body", b""))
            except ray.exceptions.RayError:
                return []
            return json.loads(b"".join(found)) if status == 200 else []
        return [session for sessions in await asyncio.gather(*map(of, names)) for session in sessions]


async def _asgi_call(asgi: Callable, scope: Dict[str, Any], body: bytes) -> AsyncIterator[List[Dict[str, Any]]]:
    """``asgi`` run on one request whose body is ``body``: the messages it
    sends, as many at a time as have come. The client never leaves on its
    own; closing the iterator is its leaving."""
    queue: asyncio.Queue = asyncio.Queue()
    given = asyncio.Event()
    left = asyncio.Event()

    async def receive() -> Dict[str, Any]:
        if not given.is_set():
            given.set()
            return {"type": "http.request", "body": body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: Dict[str, Any]) -> None:
        queue.put_nowait(message)

    task = asyncio.ensure_future(asgi(scope, receive, send))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        while True:
            messages = [await queue.get()]
            while not queue.empty():
                messages.append(queue.get_nowait())
            ended = messages[-1] is None
            if ended:
                messages.pop()
            if messages:
                yield messages
            if ended:
                break
        task.result()
    finally:
        if not task.done():
            left.set()  # the app sees its client go: its job is cancelled
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), 5.0)
            task.cancel()


async def _no_session(send: Callable, detail: str) -> None:
    await send_json(send, 404, {"detail": detail})


async def _no_mcp_session(send: Callable, detail: str) -> None:
    """404, as the MCP SDK answers an id it does not know (the client then
    opens a new session): a JSON-RPC error, "Invalid Request"."""
    await send_json(send, 404, {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": detail}})


def _portable(scope: Dict[str, Any]) -> Dict[str, Any]:
    return {key: scope[key] for key in _SCOPE_KEYS if key in scope}


async def send_json(send: Callable, status: int, obj: Any) -> None:
    """A whole JSON answer on an ASGI ``send``."""
    body = json.dumps(obj).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def app(options: Optional[Mapping[str, Any]] = None, /, **more: Any) -> Any:
    """The service as a Ray Serve application, for ``serve.run(app(...),
    name="execpool", route_prefix="/")`` or a config file's
    ``import_path: execpool.ray.serve:app`` (its ``args`` are ``options``).
    Options are ``execpool serve``'s flags by name (``workers=2``,
    ``sandbox="off"``, ``max_in_flight=8``; ``True`` for a bare flag),
    each replica's, and ``replicas``, ``min_replicas``, ``max_replicas``:
    one replica per node with CPUs unless told. The token comes from
    ``token_file`` or ``EXECPOOL_TOKEN`` on each replica's node."""
    given = {**(options or {}), **more}
    argv: List[str] = []
    for key, value in given.items():
        if value is False or value is None:
            continue
        argv.append("--" + key.replace("_", "-"))
        if value is not True:
            argv.append(str(value))
    return application(serve_options(argv), None)


def application(options: argparse.Namespace, token: Optional[str]) -> Any:
    """The application for ``execpool serve --ray``'s parsed options (and
    its token: None to have each replica read its own)."""
    check_scale(options)
    admits = (options.max_in_flight or default_max_in_flight()) + options.max_queue
    scale: Dict[str, Any]
    if options.min_replicas is not None or options.max_replicas is not None:
        low = options.min_replicas if options.min_replicas is not None else 1
        high = options.max_replicas if options.max_replicas is not None else max(low, _nodes_with_cpus())
        scale = {"autoscaling_config": {"min_replicas": low, "max_replicas": high, "initial_replicas": max(low, 1),
                                        "target_ongoing_requests": options.max_in_flight or default_max_in_flight()}}
    elif options.replicas is not None:
        scale = {"num_replicas": options.replicas}
    else:
        scale = {"num_replicas": _nodes_with_cpus(), "max_replicas_per_node": 1}
    deployment = serve.deployment(
        Service, name=DEPLOYMENT, max_ongoing_requests=admits + SPARE_REQUESTS,
        # A token CPU: a replica goes only where there are CPUs, and takes
        # none from the cluster's other work (its pool's are the node's).
        ray_actor_options={"num_cpus": 0.01},
        request_router_config=RequestRouterConfig(request_router_class=routing.SessionRouter),
        graceful_shutdown_timeout_s=options.grace + 5.0, health_check_period_s=2.0, health_check_timeout_s=10.0,
        **scale)
    return deployment.bind(options, token)


def check_scale(options: argparse.Namespace) -> None:
    """ValueError for replica counts that contradict each other."""
    if options.replicas is not None and (options.min_replicas is not None or options.max_replicas is not None):
        raise ValueError("--replicas is a fixed count: give it or --min-replicas/--max-replicas, not both")
    if options.min_replicas is not None and options.max_replicas is not None \
            and options.min_replicas > options.max_replicas:
        raise ValueError(f"--min-replicas {options.min_replicas} is over --max-replicas {options.max_replicas}")


def _nodes_with_cpus() -> int:
    return max(1, sum(1 for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU", 0) > 0))


def handle(app_name: str = APP_NAME) -> DeploymentHandle:
    """The service's handle for a caller on the cluster, its requests going
    to a replica on the caller's own node first. Every method is awaited
    (``await h.run_code.remote({...})``) or ``.result()`` outside an event
    loop; a session's calls go straight to its replica with
    ``h.options(multiplexed_model_id=session_id)``."""
    return serve.get_deployment_handle(DEPLOYMENT, app_name)
