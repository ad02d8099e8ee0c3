"""execpool on a Ray cluster: ``RayPool``, ExecPool's public API over actors
that each own a local ExecPool.

::

    driver (your process)                          each node: _PoolActor (an async Ray actor)
    ---------------------                          -------------------------------------------
    RayPool.submit(job, on_event, cancel_event)    ExecPool of its own (workers, lifeline) -- every
      -> least-loaded live actor                     job is its pool.submit(job), nothing else
      -> one coroutine on the "execpool-ray"       run(call, job): the Result
         thread's event loop:                      stream(call, job): lists of up to
           await actor.run / iterate                 EVENTS_PER_ITEM events (the pool's
           actor.stream: events -> on_event,         JobOutput / OutputCapped), then the Result
           in order, then the future's Result      cancel(call): future.cancel() -- the tree
    future.cancel() / cancel_event /                 dies on that node
      a stream closed -> actor.cancel(call)
    run / stream / astream / map / imap_unordered
      are built on submit exactly as ExecPool's

Who runs this module: the driver (any process connected to the cluster)
runs ``RayPool``; one ``PoolActor`` per node (``per_node`` of them,
execpool/ray/actor.py) runs on each node's Ray worker process. The actor is a client of ExecPool's public
API and owns nothing else, so everything ExecPool promises on one machine
holds on each node -- and Ray adds none of its own process handling to it.

Why the actors need no help from Ray to leave nothing behind: Ray's
``ray.kill``, a driver's death (its actors go with it) and a node's raylet
dying all end with the actor process killed. Its ExecPool's lifeline sees
that (execpool/lifeline/process.py) and kills the workers; a worker's tools, and
whatever escaped from them with ``setsid`` and a double fork, are handed to
the lifeline -- the workers' parent and a child subreaper -- and killed. Ray
itself kills only an actor's direct children, and the ``setsid`` ones not
at all. ``ray.cancel`` does not interrupt a task on an actor, and dropping a
streaming generator does not stop it: every cancel is an ``actor.cancel``
call, which cancels the job in the actor's pool.

What Ray gives the tools, and what they get instead: a Ray worker runs at
niceness 15 with ``RAY_*`` variables in its environment. Tools start from
ExecPool's allow-listed environment, so they see no ``RAY_*`` variable, and
the actor's pool runs its workers at ``niceness`` (0 unless told) -- which
needs CAP_SYS_NICE below the Ray worker's 15; without it they stay at 15
and execpool logs a warning.

A lost actor (``ray.kill``, its node gone): its jobs in flight are run
again on another live actor, up to ``retries`` times, as long as none of
their output was delivered yet (a stream already consumed cannot be taken
back); otherwise their Result is ``INFRA``, naming the actor and why. Lost
actors are not replaced: a RayPool whose actors are all gone fails every
job as ``INFRA``.

Ray is imported only here, and only when a RayPool is made: ``pip install
'execpool[ray]'`` (Ray pinned to the minor release the tests ran on).
Every node needs execpool installed where its Ray workers import from.
"""


from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from concurrent.futures import Future, wait
from typing import Any, Iterable, Optional

from ..pool.config import PoolConfig
from ..pool.future import CancelWatcher, JobFuture, OnEvent
from ..pool.runner import JobRunner
from ..pool.stats import PoolStats, combined
from ..shared import checks
from ..shared.errors import PoolClosedError
from ..shared.jobs import CodeJob, Job, PythonJob, ShellJob
from ..shared.kernel import linux
from ..shared.result import Result, Status
from .actor import PoolActor

__all__ = ["RayPool"]

logger = logging.getLogger("execpool")

#: Calls one actor runs at once: every job waits in its own pool, not in
#: Ray's queue for the actor.
ACTOR_MAX_CONCURRENCY = 100_000

#: ``ray.init`` for ``address="local"``: a cluster of this machine, without
#: the dashboard (it costs a second and a few hundred MB here).
_LOCAL_INIT = {"include_dashboard": False}



class _Call:
    """One submitted job, as the driver follows it."""

    def __init__(self, number: int, job: Any, on_event: Optional[OnEvent]) -> None:
        self.number = number
        self.job = job
        self.on_event = on_event
        self.future = JobFuture(number)
        self.actor: Any = None
        self.delivered = False  # an event reached on_event: it cannot run again
        self.cancelled = False


class RayPool(JobRunner):
    """ExecPool's public API -- ``submit``, ``run``, ``stream``,
    ``astream``, ``map``, ``imap_unordered``, ``stats``, ``close`` -- over a
    Ray cluster: ``per_node`` actors on every live node, each owning an
    ExecPool made with ``pool_options`` (ExecPool's keyword arguments;
    ``workers`` is per actor). Jobs go to the actor with the fewest running.

    ``address`` is what ``ray.init`` takes: None (Ray's default: the
    cluster ``RAY_ADDRESS`` names, else a new local one), ``"auto"`` (a
    cluster running on this machine), ``"local"`` (a new one of this
    machine), or ``"HOST:PORT"``. When Ray is already initialised in this
    process, that connection is used and ``address`` must be None; a
    RayPool shuts down only a connection it opened. ``niceness`` is the
    tools' (0, not the Ray worker's 15). ``retries``: how many times a job
    whose actor was lost runs again elsewhere (see the module docstring).
    Results, Jobs and events are the same objects as ExecPool's.
    """

    def __init__(self, address: Optional[str] = None, *, per_node: int = 1, niceness: Optional[int] = 0,
                 retries: int = 2, startup_timeout: float = 60.0, **pool_options: Any) -> None:
        try:
            import ray
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        except ImportError:
            raise ImportError("RayPool needs Ray: pip install 'execpool[ray]'") from None
        checks.integer("per_node", per_node)
        checks.integer("retries", retries, minimum=0)
        checks.seconds("startup_timeout", startup_timeout)
        pool_options["niceness"] = niceness
        PoolConfig(**pool_options)  # every option checked here, not on each node
        self._ray = ray
        self._retries = retries
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=address, **(_LOCAL_INIT if address == "local" else {}), log_to_driver=False)
        elif address is not None:
            raise ValueError("Ray is already initialised in this process: pass address=None to use it")
        self._lock = threading.Lock()
        self._closed = False
        self._numbers = itertools.count(1)
        self._running: dict[Any, int] = {}  # live actor -> its calls in flight
        self._followed: set[Future] = set()  # one per call not yet ended, on the loop
        self._watcher = CancelWatcher()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="execpool-ray", daemon=True)
        self._thread.start()
        try:
            actor_class = ray.remote(num_cpus=0, max_concurrency=ACTOR_MAX_CONCURRENCY)(PoolActor)
            actors = [actor_class.options(
                          scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))
                      .remote(pool_options)
                      for node in ray.nodes() if node["Alive"] for _ in range(per_node)]
            ray.get([actor.node.remote() for actor in actors], timeout=startup_timeout)
            self._running = dict.fromkeys(actors, 0)
            self._cpus = int(ray.cluster_resources().get("CPU", 1))
        except BaseException:
            self._closed = True
            self._stop()
            raise

    # -- the entry point -----------------------------------------------------

    def submit(self, job: Job, *, on_event: Optional[OnEvent] = None,
               cancel_event: Optional[threading.Event] = None) -> JobFuture:
        """As ``ExecPool.submit``, on the least-loaded actor. A ``cwd`` is a
        directory on whichever node runs the job. ``on_event`` runs on the
        RayPool's one thread, in order, before the future is done. A
        ``CodeJob`` compiles in its actor's pool, whose compile cache is its
        own."""
        if not isinstance(job, (PythonJob, ShellJob, CodeJob)):
            raise TypeError(f"job must be an execpool.PythonJob, ShellJob or CodeJob, not {type(job).__name__}")
        if on_event is not None and not callable(on_event):
            raise TypeError(f"on_event must be callable, not {type(on_event).__name__}")
        checks.cancel_event(cancel_event)
        self._check_open()
        call = _Call(next(self._numbers), job, on_event)
        call.future._cancel = lambda: self._cancel(call)
        followed = asyncio.run_coroutine_threadsafe(self._follow(call), self._loop)
        with self._lock:
            self._followed.add(followed)
        followed.add_done_callback(self._unfollow)
        if cancel_event is not None:
            self._watcher.watch(call.future, cancel_event)
        return call.future

    def _unfollow(self, followed: Future) -> None:
        with self._lock:
            self._followed.discard(followed)

    async def _follow(self, call: _Call) -> None:
        """Run the call to its Result, on another actor when its actor is
        lost before any of its output was delivered."""
        ray = self._ray
        for attempt in itertools.count():
            call.actor = self._take_actor()
            if call.actor is None:
                call.future.set_result(Result(status=Status.INFRA, error="the RayPool has no live actor left "
                                              "to run this job"))
                return
            try:
                result = await self._run_on_actor(call)
            except ray.exceptions.RayActorError as exc:
                self._lost(call.actor, exc)
                if call.delivered or call.cancelled or attempt >= self._retries:
                    call.future.set_result(Result(status=Status.INFRA, error=f"the Ray actor running this job "
                                                  f"was lost: {_first_line(exc)}"))
                    return
                continue
            except BaseException as exc:  # noqa: BLE001 - the job's own misuse error (a missing cwd), raised by result()
                call.future.set_exception(exc)
                return
            finally:
                self._release(call.actor)
            call.future.set_result(result)
            return

    async def _run_on_actor(self, call: _Call) -> Result:
        if call.on_event is None:
            pending = call.actor.run.remote(call.number, call.job)
        else:
            pending = call.actor.stream.remote(call.number, call.job)
        if call.cancelled:  # before it had an actor: the actor cancels it as it starts
            call.actor.cancel.remote(call.number)
        if call.on_event is None:
            return await pending
        result = None
        async for ref in pending:
            item = await ref
            if isinstance(item, Result):
                result = item
                continue
            for event in item:
                call.delivered = True
                try:
                    call.on_event(event)
                except Exception:
                    logger.exception("execpool: an on_event callback raised")
        return result  # type: ignore[return-value]

    def _take_actor(self) -> Any:
        with self._lock:
            if not self._running:
                return None
            actor = min(self._running, key=self._running.__getitem__)
            self._running[actor] += 1
            return actor

    def _release(self, actor: Any) -> None:
        with self._lock:
            if actor in self._running:
                self._running[actor] -= 1

    def _lost(self, actor: Any, exc: BaseException) -> None:
        with self._lock:
            if self._running.pop(actor, None) is None:
                return
        logger.warning("execpool: a Ray actor of the RayPool was lost; its jobs run elsewhere: %s", _first_line(exc))
        self._ray.kill(actor, no_restart=True)

    def _cancel(self, call: _Call) -> None:
        call.cancelled = True
        if call.actor is not None:
            call.actor.cancel.remote(call.number)

    @property
    def default_max_in_flight(self) -> int:
        """Two jobs per CPU of the cluster."""
        return 2 * self._cpus

    def stats(self) -> PoolStats:
        """The live actors' ``pool.stats()`` added up (a lost actor's counts
        are lost with it)."""
        self._check_open()
        with self._lock:
            actors = list(self._running)
        return combined(self._ray.get([actor.stats.remote() for actor in actors]))

    @property
    def actors(self) -> int:
        """Live actors."""
        with self._lock:
            return len(self._running)

    @property
    def running_jobs(self) -> int:
        with self._lock:
            return sum(self._running.values())

    # -- the pool's life -----------------------------------------------------

    def close(self, timeout: float = 5.0) -> None:
        """Close every actor's pool (jobs still running end as ``INFRA``),
        end the actors, and shut Ray down if this RayPool started it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            actors = list(self._running)
        try:
            self._ray.get([actor.close.remote(timeout) for actor in actors], timeout=3 * timeout)
        except (self._ray.exceptions.RayError, TimeoutError) as exc:
            logger.warning("execpool: closing the RayPool's actors: %s", _first_line(exc))
        self._stop(actors, timeout)

    def _stop(self, actors: Iterable[Any] = (), timeout: float = 5.0) -> None:
        for actor in actors:
            self._ray.kill(actor, no_restart=True)
        # Calls still followed end once their actors are gone; then the loop.
        with self._lock:
            followed = list(self._followed)
        wait(followed, timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._watcher.close()
        if self._owns_ray:
            self._ray.shutdown()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError("this RayPool is closed")




def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def batch_pool(address: str, options: dict, workers_given: bool) -> RayPool:
    """The pool of ``execpool batch --ray ADDRESS`` ("" for Ray's default):
    ``--workers`` is per node, each node's CPUs when not given. The command
    is made non-dumpable (it holds OUT), the actors need not be."""
    linux.prctl(linux.PR_SET_DUMPABLE, 0)
    options = {k: v for k, v in options.items() if k != "non_dumpable" and (k != "workers" or workers_given)}
    return RayPool(address or None, **options)
