"""What a pool has done so far, as numbers: ``ExecPool.stats()``.

Runs in the caller. Every job's end passes through ``StatsRecorder.job``
(on the dispatcher thread, or a dead worker's cleanup thread), every
replacement of a dead worker through ``worker_restarted``; ``snapshot`` copies
the counts under the recorder's lock. The service's ``/metrics``
(execpool/serve/app.py) exports the same figures; a program without HTTP reads
them here.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import Dict, Iterable, Tuple

from ..shared.result import Result

#: Upper bounds (seconds) of the job-duration histogram's buckets; the last
#: bucket is everything longer. Chosen for tools: a bash `echo` is ~2 ms, a
#: cold Python start ~25 ms, a test suite seconds to minutes.
DURATION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


@dataclass(frozen=True)
class Histogram:
    """Cumulative counts per bucket upper bound (the last is +inf), as
    Prometheus keeps them, plus the sum and the count."""

    buckets: Tuple[float, ...]
    counts: Tuple[int, ...]
    sum: float
    count: int


@dataclass(frozen=True)
class PoolStats:
    """A copy of a pool's counts at one moment.

    ``jobs`` counts ended jobs by ``(kind, status)`` -- kind ``"python"`` or
    ``"shell"``, status a ``Status`` value; ``durations`` is their run time
    by kind; ``in_flight`` the jobs running now; ``worker_restarts`` the
    workers that died and were replaced; ``output_bytes`` the bytes of output
    the jobs' tools wrote (counted whole, however much a Result kept).
    """

    jobs: Dict[Tuple[str, str], int] = field(default_factory=dict)
    durations: Dict[str, Histogram] = field(default_factory=dict)
    in_flight: int = 0
    worker_restarts: int = 0
    output_bytes: int = 0

    @property
    def jobs_total(self) -> int:
        return sum(self.jobs.values())


class StatsRecorder:
    """The live counts behind ``PoolStats``; cheap enough for every job."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: Dict[Tuple[str, str], int] = {}
        self._buckets: Dict[str, list] = {}
        self._sums: Dict[str, float] = {}
        self._restarts = 0
        self._output_bytes = 0

    def job(self, kind: str, result: Result) -> None:
        key = (kind, result.status.value)
        slot = bisect.bisect_left(DURATION_BUCKETS_S, result.duration_s)
        with self._lock:
            self._jobs[key] = self._jobs.get(key, 0) + 1
            self._buckets.setdefault(kind, [0] * (len(DURATION_BUCKETS_S) + 1))[slot] += 1
            self._sums[kind] = self._sums.get(kind, 0.0) + result.duration_s
            self._output_bytes += result.output_bytes

    def worker_restarted(self) -> None:
        with self._lock:
            self._restarts += 1

    def snapshot(self, in_flight: int) -> PoolStats:
        with self._lock:
            durations = {}
            for kind, counts in self._buckets.items():
                cumulative, running = [], 0
                for n in counts:
                    running += n
                    cumulative.append(running)
                durations[kind] = Histogram(DURATION_BUCKETS_S + (float("inf"),), tuple(cumulative),
                                            self._sums[kind], running)
            return PoolStats(dict(self._jobs), durations, in_flight, self._restarts, self._output_bytes)


def combined(parts: Iterable[PoolStats]) -> PoolStats:
    """The counts of several pools as one (``RayPool.stats()``: one pool per
    actor). Histograms share their buckets, so they add up bucket by bucket."""
    total = PoolStats()
    for part in parts:
        for key, n in part.jobs.items():
            total.jobs[key] = total.jobs.get(key, 0) + n
        for kind, h in part.durations.items():
            mine = total.durations.get(kind)
            total.durations[kind] = h if mine is None else Histogram(
                h.buckets, tuple(a + b for a, b in zip(mine.counts, h.counts, strict=True)), mine.sum + h.sum,
                mine.count + h.count)
        total = PoolStats(total.jobs, total.durations, total.in_flight + part.in_flight,
                          total.worker_restarts + part.worker_restarts, total.output_bytes + part.output_bytes)
    return total
