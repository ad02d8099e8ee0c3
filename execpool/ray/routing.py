"""Which replica of the service on Ray (execpool/ray/serve.py) takes a
request: Ray Serve's request router for its deployment.

Runs wherever a ``DeploymentHandle`` to the deployment routes requests: in
Ray Serve's HTTP proxies, in the replicas (they pass requests for each
other's sessions on), and in a caller's process on the cluster.

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
replica that does not hold the session. Replica names and nodes seen here
are kept for ``replicas()``: what ``GET /v1/cluster`` asks.
"""

from __future__ import annotations

import importlib
import random
from typing import Dict, List, Optional, Tuple

from ray.serve._private.common import DeploymentHandleSource
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve._private.request_router.replica_wrapper import RunningReplica

#: The replicas each deployment's routers in this process last heard of:
#: (name, node id), by ``app#deployment``.
_SEEN: Dict[str, List[Tuple[str, str]]] = {}


def owner(key: str) -> str:
    """The replica name a session id (or a bare ``NAME.``) begins with."""
    return key.split(".", 1)[0]


def replicas(app: str, deployment: str) -> Optional[List[Tuple[str, str]]]:
    """(name, node id) of the deployment's replicas as this process's
    routers last heard; None before any router here has heard."""
    seen = _SEEN.get(f"{app}#{deployment}")
    return None if seen is None else list(seen)


class SessionRouter(PowerOfTwoChoicesRequestRouter):
    """The deployment's ``request_router_class`` (see the module docstring)."""

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        # Through the module as this process imports it: Ray Serve sends
        # this class to each process by value, with globals of its own
        # (and a proxy has not imported the module at all).
        importlib.import_module(__name__)._SEEN[f"{self._deployment_id.app_name}#{self._deployment_id.name}"] = [
            (replica.replica_id.unique_id, replica.node_id) for replica in replicas]

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


def _two(replicas: List[RunningReplica]) -> List[RunningReplica]:
    """Two at random (the router takes the one with fewer requests)."""
    return random.sample(replicas, min(2, len(replicas)))
