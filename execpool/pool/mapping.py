"""Many jobs through one pool, with bounded in-flight work.

::

    caller's thread (iterating the results)          dispatcher thread (the pool's one)
    ---------------------------------------          ----------------------------------
    pull the next job from the iterable, lazily
      -> pool.submit(job) -> JobFuture  ---------->  the job's end -> future done
    q.get() <- (tag, future)  <----------------------  done callback -> ONE SimpleQueue
    yield the result, refill up to max_in_flight       (shared by every in-flight job)

Who runs this: the thread that iterates ``map_jobs`` / ``imap_unordered_jobs``
(``ExecPool.map`` / ``ExecPool.imap_unordered``) or ``execpool batch``. It owns
no thread and no process: each in-flight job is one future whose done
callback tags it onto one queue, so a million-job map costs the caller the
same threads as one job. ``submit`` is the pool's public ``submit`` (or
anything with its signature that returns a ``concurrent.futures.Future`` of
a ``Result``).

Jobs are pulled from the iterable only when there is room, so a generator of
a million jobs is never materialised. When the consumer stops early
(``close()`` of the generator, an exception, Ctrl-C), every in-flight job is
cancelled -- its process tree killed by its worker -- and their ends are
awaited briefly, so nothing keeps running for a caller who left.
"""

from __future__ import annotations

import queue
from concurrent import futures
from typing import Any, Callable, Dict, Generator, Hashable, Iterable, Iterator, Optional, Tuple, TypeVar

from ..shared import checks
from ..shared.result import Result

#: How long a stopped map waits for its cancelled jobs to end (the workers
#: kill the trees in parallel, typically in a few milliseconds).
CANCEL_DRAIN_TIMEOUT_S = 1.0

#: ``map_jobs`` yields in input order, so results that finish early wait for
#: the slower ones before them. It holds at most this many times
#: ``max_in_flight`` jobs between "submitted" and "yielded" (running or
#: waiting for their turn): one slow job at the head lets others keep running
#: for a while, and memory stays bounded whatever the stall.
MAP_REORDER_WINDOW = 4

Submit = Callable[..., "futures.Future[Result]"]
Tag = TypeVar("Tag", bound=Hashable)


def check_max_in_flight(max_in_flight: object) -> int:
    return checks.integer("max_in_flight", max_in_flight)


class InFlight:
    """The jobs one consumer has submitted and not yet collected.

    Every job's future tags itself onto one shared queue when done;
    ``next_done`` returns finished jobs in the order they end.
    """

    def __init__(self, submit: Submit) -> None:
        self._submit = submit
        self._queue: "queue.SimpleQueue[Tuple[Hashable, futures.Future]]" = queue.SimpleQueue()
        self._futures: Dict[Hashable, futures.Future] = {}

    def __len__(self) -> int:
        return len(self._futures)

    def start(self, tag: Hashable, job: Any) -> None:
        if tag in self._futures:
            raise ValueError(f"tag {tag!r} is already in flight")
        future = self._submit(job)
        self._futures[tag] = future
        put = self._queue.put
        future.add_done_callback(lambda done: put((tag, done)))

    def next_done(self, on_idle: Optional[Callable[[], None]] = None) -> Tuple[Hashable, Result]:
        """Block until a job finishes; ``on_idle`` runs first whenever no
        result is waiting (the CLI syncs its output file there)."""
        if on_idle is not None and self._queue.empty():
            on_idle()
        tag, future = self._queue.get()
        del self._futures[tag]
        return tag, future.result()

    def cancel_all(self, timeout: float = CANCEL_DRAIN_TIMEOUT_S) -> None:
        """Cancel every job still running and wait (bounded) for their ends."""
        pending = list(self._futures.values())
        self._futures.clear()
        for future in pending:
            future.cancel()
        futures.wait(pending, timeout)


def run_tagged(submit: Submit, items: Iterable[Tuple[Tag, Any]], max_in_flight: int, *,
               on_idle: Optional[Callable[[], None]] = None) -> Generator[Tuple[Tag, Result], None, None]:
    """Run ``(tag, job)`` pairs, at most ``max_in_flight`` at once, and yield
    ``(tag, Result)`` as each job ends. Tags must be unique among in-flight
    jobs. The building block of ``imap_unordered_jobs`` and ``execpool batch``.

    An exception raised by the iterable or by ``submit`` (a job of the wrong
    type, a missing cwd, a closed pool) stops the intake; the jobs already
    running are finished and yielded, then the exception is raised.
    """
    check_max_in_flight(max_in_flight)
    return _run_tagged(submit, iter(items), max_in_flight, on_idle)


def _run_tagged(submit: Submit, items: Iterator[Tuple[Tag, Any]], max_in_flight: int,
                on_idle: Optional[Callable[[], None]]) -> Generator[Tuple[Tag, Result], None, None]:
    flight = InFlight(submit)
    error: Optional[Exception] = None
    exhausted = False
    try:
        while True:
            while not exhausted and error is None and len(flight) < max_in_flight:
                try:
                    tag, job = next(items)
                    flight.start(tag, job)
                except StopIteration:
                    exhausted = True
                except Exception as exc:  # noqa: BLE001 - re-raised once the running jobs are in
                    error = exc
            if not flight:
                break
            yield flight.next_done(on_idle)  # type: ignore[misc]
        if error is not None:
            raise error
    finally:
        if flight:
            flight.cancel_all()


def imap_unordered_jobs(submit: Submit, jobs: Iterable[Any], max_in_flight: int) -> Iterator[Tuple[int, Result]]:
    """Yield ``(input index, Result)`` for each job as it ends, with at most
    ``max_in_flight`` jobs submitted at once; ``jobs`` is consumed lazily."""
    return run_tagged(submit, enumerate(jobs), max_in_flight)


def map_jobs(submit: Submit, jobs: Iterable[Any], max_in_flight: int) -> Iterator[Result]:
    """Yield each job's Result in input order, with at most ``max_in_flight``
    jobs submitted at once; ``jobs`` is consumed lazily.

    A result that ends before an earlier one is held until its turn; at most
    ``MAP_REORDER_WINDOW * max_in_flight`` jobs are between submission and
    being yielded, so a stalled head job bounds memory (use
    ``imap_unordered_jobs`` when order does not matter). An exception from
    ``jobs`` or from submitting job *k* is raised after results 0..k-1.
    """
    check_max_in_flight(max_in_flight)
    return _map(submit, iter(jobs), max_in_flight)


def _map(submit: Submit, jobs: Iterator[Any], max_in_flight: int) -> Generator[Result, None, None]:
    flight = InFlight(submit)
    waiting: Dict[int, Result] = {}
    window = MAP_REORDER_WINDOW * max_in_flight
    next_in = next_out = 0
    error: Optional[Exception] = None
    exhausted = False
    try:
        while True:
            while (not exhausted and error is None and len(flight) < max_in_flight
                   and next_in - next_out < window):
                try:
                    flight.start(next_in, next(jobs))
                    next_in += 1
                except StopIteration:
                    exhausted = True
                except Exception as exc:  # noqa: BLE001 - raised in its place in the order
                    error = exc
            if next_out in waiting:
                result = waiting.pop(next_out)
                next_out += 1
                yield result
                continue
            if not flight:
                break
            index, result = flight.next_done()
            waiting[index] = result  # type: ignore[index]
        if error is not None:
            raise error
    finally:
        if flight:
            flight.cancel_all()
