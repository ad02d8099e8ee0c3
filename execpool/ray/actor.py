"""One node's ExecPool behind Ray: the actor a ``RayPool`` starts on every
node.

Who runs this module: a Ray worker process on each node, the actor's
process (Ray imports it there by name). The actor is a client of ExecPool's
public API and owns nothing else -- every job is its pool's ``submit`` --
so everything ExecPool promises on one machine holds on each node, and Ray
adds none of its own process handling to it. The driver's side is
execpool/ray/pool.py.

    run(call, job): the Result
    stream(call, job): lists of up to EVENTS_PER_ITEM events (the pool's
      JobOutput / OutputCapped), then the Result
    cancel(call): future.cancel() -- the tree dies on this node
"""

from __future__ import annotations

import asyncio
import collections
import os
from typing import Any, Optional

from ..pool.future import JobFuture, OnEvent
from ..pool.stats import PoolStats
from ..shared.result import Result
from ..supervisor import ExecPool

#: Events per streamed item: one Ray item costs ~0.5-1 ms here, so a flood
#: is carried ~50 events at a time (tens of thousands of events/s). An item
#: goes out with fewer once EVENT_BATCH_S has passed since its first event,
#: so a lone line waits at most that long.
EVENTS_PER_ITEM = 50
EVENT_BATCH_S = 0.002

#: Cancels of calls the actor has not seen start yet (the cancel and the
#: call travel separately): remembered so the call is cancelled as it
#: starts. Bounded: a cancel that crossed its call's end is never used.
EARLY_CANCELS_KEPT = 10_000

_DONE = object()


class PoolActor:
    """One node's ExecPool, behind Ray (made a Ray actor class by
    ``RayPool``). Its methods are coroutines on the actor's event loop:
    many calls run at once, each waiting on its job's future."""

    def __init__(self, pool_options: dict) -> None:
        self._pool = ExecPool(**pool_options)
        self._futures: dict[int, JobFuture] = {}
        self._early_cancels: collections.OrderedDict = collections.OrderedDict()

    def node(self) -> tuple:
        """Where it runs: (node id, pid) -- and the pool is ready."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def _submit(self, call: int, job: Any, on_event: Optional[OnEvent] = None) -> JobFuture:
        future = self._pool.submit(job, on_event=on_event)
        self._futures[call] = future
        future.add_done_callback(lambda _: self._futures.pop(call, None))
        if self._early_cancels.pop(call, None) is not None:
            future.cancel()
        return future

    async def run(self, call: int, job: Any) -> Result:
        return await asyncio.wrap_future(self._submit(call, job))

    async def stream(self, call: int, job: Any):
        """The job's events in lists, then its Result. Closed early (Ray
        cancels the generator), it cancels the job."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        future = self._submit(call, job, on_event=lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(events.put_nowait, _DONE))
        try:
            done = False
            while not done:
                batch = [await events.get()]
                deadline = loop.time() + EVENT_BATCH_S
                while batch[-1] is not _DONE and len(batch) < EVENTS_PER_ITEM:
                    try:
                        batch.append(await asyncio.wait_for(events.get(), max(0.0, deadline - loop.time())))
                    except asyncio.TimeoutError:
                        break
                done = batch[-1] is _DONE
                if done:
                    batch.pop()
                if batch:
                    yield batch
            yield future.result()
        finally:
            future.cancel()  # a no-op once it ended

    def cancel(self, call: int) -> None:
        future = self._futures.get(call)
        if future is not None:
            future.cancel()
            return
        self._early_cancels[call] = True
        while len(self._early_cancels) > EARLY_CANCELS_KEPT:
            self._early_cancels.popitem(last=False)

    def stats(self) -> PoolStats:
        return self._pool.stats()

    def close(self, timeout: float) -> None:
        self._pool.close(timeout)

