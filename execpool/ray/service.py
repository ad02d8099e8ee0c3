"""``execpool serve --ray [ADDRESS]``: the service deployed onto a running
Ray cluster (execpool/ray/serve.py), until told to stop.

Runs in the command's process, a Ray driver: it starts Ray Serve's HTTP
proxy at ``--host``/``--port`` (where Serve is not running yet), deploys the
application, says ``execpool serve: ready at URL`` once every replica
answers through the cluster, and at SIGINT or SIGTERM deletes the
application -- each replica gets ``--grace`` for its requests, then closes
its pool -- and shuts Serve down when no other application is left on it.
The replicas' processes are Ray's; what they leave is nothing, as their
pools' lifelines see to it even when a replica is killed outright.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

import ray
from ray import serve

from ..serve.command import UsageError, checked
from .serve import APP_NAME, DEPLOYMENT, application, check_scale

#: Seconds the replicas have to come up and answer.
STARTUP_TIMEOUT_S = 300.0


def main(args: argparse.Namespace) -> int:
    """Exits 0 after the application is deleted, 2 for bad usage."""
    try:
        token = checked(args)
        check_scale(args)
    except (UsageError, ValueError) as exc:
        print(f"execpool serve: {exc}", file=sys.stderr)
        return 2
    address = args.ray or os.environ.get("RAY_ADDRESS") or "auto"
    stop = threading.Event()
    ray.init(address=address, log_to_driver=False)
    # After ray.init, which puts handlers of its own in their place.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(application(args, token), name=APP_NAME, route_prefix="/", blocking=False)
        if not _all_answer(stop):
            return 0 if stop.is_set() else 1
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"execpool serve: ready at http://{host}:{args.port}", flush=True)
        stop.wait()
    finally:
        _delete()
        ray.shutdown()
    return 0


def _all_answer(stop: threading.Event) -> bool:
    """Wait until the deployment runs its target of replicas and each
    answers ``GET /v1/cluster``'s question; False if stopped first or too
    late (said on stderr)."""
    handle = serve.get_deployment_handle(DEPLOYMENT, APP_NAME)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not stop.is_set() and time.monotonic() < deadline:
        status = serve.status().applications.get(APP_NAME)
        deployment = None if status is None else status.deployments.get(DEPLOYMENT)
        if deployment is not None and deployment.status == "HEALTHY":
            target = deployment.replica_states.get("RUNNING", 0)
            replicas = handle.cluster.remote().result(timeout_s=30)["replicas"]
            if replicas and len(replicas) >= target and all(replica["ready"] for replica in replicas):
                return True
        elif deployment is not None and deployment.status in ("UNHEALTHY", "DEPLOY_FAILED"):
            print(f"execpool serve: the replicas did not start: {deployment.message}", file=sys.stderr)
            return False
        stop.wait(0.2)
    if not stop.is_set():
        print(f"execpool serve: the replicas did not all answer within {STARTUP_TIMEOUT_S:g} s", file=sys.stderr)
    return False


def _delete() -> None:
    """The application goes (its replicas close their pools); Serve too,
    when nothing else runs on it."""
    serve.delete(APP_NAME)
    if not serve.status().applications:
        serve.shutdown()
