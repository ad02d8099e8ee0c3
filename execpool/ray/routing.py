"""Which replica of the service on Ray (execpool/ray/serve.py) takes a
request: Ray Serve's request router for its deployment.

Runs wherever a ``DeploymentHandle`` to the deployment routes requests: in
Ray Serve's HTTP proxies, in the replicas (they pass requests for each
other's sessions on), and in a caller's process on the cluster. In the
proxies it also answers for a replica lost mid-request (``_LossAnswered``).

A session lives in one replica's pool, and its id begins with that
replica's name (``NAME.<the pool's id>``). A request that carries such an
id as its ``multiplexed_model_id`` -- the ``serve_multiplexed_model_id``
header over HTTP, ``handle.options(multiplexed_model_id=...)`` in Python --
goes to that replica and no other, however busy it is: when it is full the
request waits for it, as any request waits for a replica. When no replica
of that name is left (its node went), it goes to any replica, which
answers 404 for the session: a session is never made anew elsewhere.

Requests with no such id: from the HTTP proxy, the power of two choices
over every replica (Ray Serve's own rule, minus its preference for the
proxy's node, which would leave every node but the one clients connect to
idle); from a handle in a caller's process, the caller's node first, then
the two-choices rule over all.

Why a router of ours and not Ray Serve's multiplexing as it is: its router
sends a request to a replica that "has the model" only while one of those
accepts it, and after a second of waiting sends it anywhere -- to a
replica that does not hold the session. Nor its two-choices router's
handing out of replicas (``SessionRouter._fulfill_next_pending_request``
says why). Replica names and nodes seen here are kept for ``replicas()``:
what ``GET /v1/cluster`` asks; and every name ever seen, for ``heard()``:
an ``Mcp-Session-Id`` that begins with none of them is one a client made
up, not one of a replica that went.
"""

from __future__ import annotations

import importlib
import json
import pickle
import random
import re
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ray.exceptions import RayActorError
from ray.serve._private.common import DeploymentHandleSource, RequestMetadata, RunningReplicaInfo
from ray.serve._private.replica_result import ReplicaResult
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve._private.request_router.replica_wrapper import RunningReplica

from ..formats.records import result_record
from ..shared.result import Result, Status

#: The replicas each deployment's routers in this process last heard of:
#: (name, node id), by ``app#deployment``.
_SEEN: Dict[str, List[Tuple[str, str]]] = {}

#: The name of every replica they ever heard of, gone ones too.
_HEARD: Dict[str, Set[str]] = {}


def owner(key: str) -> str:
    """The replica name a session id (or a bare ``NAME.``) begins with."""
    return key.split(".", 1)[0]


def left(name: str) -> str:
    """What a request for a session of replica ``name``, gone, is told."""
    return (f"no such session: its replica ({name}) is gone from the cluster -- its node left the cluster, or the "
            "service was redeployed")


def replicas(app: str, deployment: str) -> Optional[List[Tuple[str, str]]]:
    """(name, node id) of the deployment's replicas as this process's
    routers last heard; None before any router here has heard."""
    seen = _SEEN.get(f"{app}#{deployment}")
    return None if seen is None else list(seen)


def heard(app: str, deployment: str) -> Set[str]:
    """The names of the deployment's replicas this process's routers ever
    heard of, those gone included."""
    return set(_HEARD.get(f"{app}#{deployment}", ()))


class SessionRouter(PowerOfTwoChoicesRequestRouter):
    """The deployment's ``request_router_class`` (see the module docstring)."""

    def create_replica_wrapper(self, replica_info: RunningReplicaInfo) -> RunningReplica:
        if self._handle_source == DeploymentHandleSource.PROXY:
            return importlib.import_module(__name__)._LossAnswered(replica_info)
        return super().create_replica_wrapper(replica_info)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        # Through the module as this process imports it: Ray Serve sends
        # this class to each process by value, with globals of its own
        # (and a proxy has not imported the module at all).
        module = importlib.import_module(__name__)
        key = f"{self._deployment_id.app_name}#{self._deployment_id.name}"
        module._SEEN[key] = [(replica.replica_id.unique_id, replica.node_id) for replica in replicas]
        module._HEARD.setdefault(key, set()).update(replica.replica_id.unique_id for replica in replicas)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if pending_request is not None:
            # Each round tries the ranks below once, then waits a little:
            # without this the router would try again at once, for ever,
            # while a pinned replica is full.
            pending_request.routing_context.should_backoff = True
        key = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if key:
            name = owner(key)
            pinned = [replica for replica in candidate_replicas if replica.replica_id.unique_id == name]
            return [pinned] if pinned else [_two(candidate_replicas)]
        local = [replica for replica in candidate_replicas if replica.node_id == self._self_node_id]
        if self._handle_source == DeploymentHandleSource.PROXY or not local:
            return [_two(candidate_replicas)]
        return [_two(local), _two(candidate_replicas)]

    def _fulfill_next_pending_request(self, replica: RunningReplica,
                                      request_metadata: Optional[RequestMetadata] = None) -> None:
        """A replica chosen for a request goes to that request and no other.

        Ray Serve calls this once a replica accepts the request a routing
        task chose it for. Its two-choices router (FIFOMixin) gives the
        replica to a waiting request with the same ``multiplexed_model_id``,
        else to the oldest waiting request: a replica drawn for a request
        of no session went to an older one pinned to another replica, and
        a session's request reached a replica that does not hold it (one a
        replica passed on was answered 404, its session "gone").
        ``RequestRouter``'s own rule, the request with the same internal
        request id, is no better here: a replica's calls made while it
        serves one request (a pass-on, ``GET /v1/cluster``'s question to
        each replica) all carry that request's id. So the request is found
        by its metadata, the very object its routing task holds."""
        for index, pending in enumerate(self._pending_requests_to_fulfill):
            if pending.metadata is request_metadata:
                del self._pending_requests_to_fulfill[index]
                if not pending.future.done():
                    self._cancel_routing_task_for_pending_request(pending)
                    self._record_queue_wait_time(pending)
                    pending.future.set_result(replica)
                    self._remove_pending_request_from_indices(pending)
                # Drops what is done from the index of its
                # multiplexed_model_id, which only that lookup cleans.
                self._get_pending_request_matching_multiplexed_model_id(request_metadata)
                return


def _two(replicas: List[RunningReplica]) -> List[RunningReplica]:
    """Two at random (the router takes the one with fewer requests)."""
    return random.sample(replicas, min(2, len(replicas)))


#: ``/v1/sessions/{id}`` and what follows it.
SESSION_PATH = re.compile(r"^/v1/sessions/([^/]+)(?:/(?:run|stream|fork))?$")

#: Why a request got no answer of its replica's.
LOST = "the replica running it was lost (its node left the cluster)"


class _LossAnswered(RunningReplica):
    """A replica as Ray Serve's HTTP proxy sends it requests, whose loss
    mid-request execpool answers.

    Why here: when the replica's actor dies before its answer has begun
    (its node's raylet killed), the proxy sends no message for the error
    (it answers only a timeout, 429 or 503 itself) and ends the ASGI call;
    uvicorn, finding no answer begun, sends a bare 500 -- which no proxy
    middleware sees, and which verl's client does not retry. The proxy's
    router is the only execpool code on that path."""

    def try_send_request(self, pr: PendingRequest, with_rejection: bool) -> ReplicaResult:
        result = super().try_send_request(pr, with_rejection)
        return _Answered(result, pr.args) if pr.metadata.is_streaming else result


class _Answered(ReplicaResult):
    """A streamed answer of a replica (pickled lists of ASGI messages, as
    the proxy reads them) that, if the replica is lost before its first
    message, ends with execpool's answer for the lost request instead of
    the error (``lost_answer``); after that first message, the error goes
    on to the proxy (the answer has begun: the connection is cut)."""

    def __init__(self, result: ReplicaResult, args: List[Any]) -> None:
        self._result = result
        self._args = args
        self._begun = False
        self._ended = False

    async def __anext__(self) -> Any:
        if self._ended:
            raise StopAsyncIteration
        try:
            messages = await self._result.__anext__()
        except RayActorError:
            answer = None if self._begun else lost_answer(self._args)
            if answer is None:
                raise
            self._ended = True
            return answer
        self._begun = True
        return messages

    async def get_rejection_response(self) -> Any:
        return await self._result.get_rejection_response()

    def get(self, timeout_s: Optional[float]) -> Any:
        return self._result.get(timeout_s)

    async def get_async(self) -> Any:
        return await self._result.get_async()

    def __next__(self) -> Any:
        return self._result.__next__()

    def add_done_callback(self, callback: Callable) -> None:
        self._result.add_done_callback(callback)

    def cancel(self) -> None:
        self._result.cancel()

    def to_object_ref(self) -> Any:
        return self._result.to_object_ref()

    async def to_object_ref_async(self) -> Any:
        return await self._result.to_object_ref_async()

    def to_object_ref_gen(self) -> Any:
        return self._result.to_object_ref_gen()


def lost_answer(args: List[Any]) -> Optional[bytes]:
    """The answer, as the proxy reads a replica's, to an HTTP request whose
    replica was lost before answering: what SandboxFusion's and execpool's
    clients take for a failure worth retrying -- 504 on ``/run_code`` (as
    the service answers when it cannot run the code in time), a record of
    status ``infra`` on ``/v1/run`` (id null: the body stayed with the
    replica), 404 for a session (it was on the lost node), else 504. None
    for what is not an HTTP request."""
    scope = getattr(pickle.loads(args[0]), "asgi_scope", None) if args and isinstance(args[0], bytes) else None
    if scope is None or scope.get("type") != "http":
        return None
    path = scope.get("path", "")
    session = SESSION_PATH.match(path)
    if session is not None and "." in session.group(1):
        status, body = 404, {"detail": left(owner(session.group(1)))}
    elif path == "/v1/run":
        status, body = 200, result_record(None, 1, Result(status=Status.INFRA, error=LOST))
    else:
        status, body = 504, {"detail": f"execpool could not answer: {LOST}; retry"}
    content = json.dumps(body).encode()
    return pickle.dumps([{"type": "http.response.start", "status": status,
                          "headers": [(b"content-type", b"application/json"),
                                      (b"content-length", str(len(content)).encode())]},
                         {"type": "http.response.body", "body": content}])
