"""What each job of a long run cost, as its worker measured it, and which
jobs grew: used by benchmarks/soak.py.

A soak otherwise sees only the caller's side -- its own RSS, threads and
descriptors -- while what a tool call costs is measured in the worker
(``Result.cpu_user_s``, ``cpu_system_s``, ``max_rss_bytes``, ``processes``;
execpool/shared/result.py says which are exact and which bounds). Kept per job in
compact arrays (28 bytes a job, so a 10 000-job run does not grow the
caller's heap with its own records), per kind, this gives:

- each kind's typical cost (medians), and how it moved from the kind's first
  jobs to its last: a kind whose jobs cost more and more as the run goes on
  points at something that grows under them (a worker, a template);
- the single jobs that grew most over their kind's median: the outliers a
  soak tester goes looking for.
"""

from __future__ import annotations

import array
import statistics
import threading
from typing import Any, Optional

MiB = 1 << 20

#: The share of a kind's jobs, first and last, whose medians are compared.
EDGE = 0.2


class RecordingPool:
    """The pool as the soak's jobs see it: every Result that comes back is
    also kept for the thread that asked, so that a job's cost can be tallied
    without changing how each kind runs its job. One soak thread runs one job
    at a time; :meth:`take` hands over (and forgets) its thread's last Result."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._last = threading.local()

    def run(self, job: Any, **kwargs: Any) -> Any:
        result = self.pool.run(job, **kwargs)
        self._last.result = result
        return result

    def stream(self, job: Any, **kwargs: Any):
        result = yield from self.pool.stream(job, **kwargs)
        self._last.result = result
        return result

    def take(self) -> Optional[Any]:
        result = getattr(self._last, "result", None)
        self._last.result = None
        return result


def job_cost(result: Any) -> Optional[tuple[float, int, int]]:
    """(CPU seconds, max RSS bytes, processes) of a Result; None when the
    worker did not measure it (which a Result from a live worker never is)."""
    if result.cpu_s is None or result.max_rss_bytes is None or result.processes is None:
        return None
    return result.cpu_s, result.max_rss_bytes, result.processes


class CostTally:
    """Per kind, each job's index, CPU seconds, max RSS and processes."""

    def __init__(self) -> None:
        self.kinds: dict[str, tuple[array.array, array.array, array.array, array.array]] = {}

    def add(self, kind: str, index: int, cost: tuple[float, int, int]) -> None:
        columns = self.kinds.setdefault(kind, (array.array("i"), array.array("d"), array.array("d"),
                                               array.array("i")))
        for column, value in zip(columns, (index, *cost)):
            column.append(value)

    def by_kind(self) -> dict[str, dict]:
        """Each kind's medians -- CPU ms, max RSS MiB, processes (and their
        most) -- over all its jobs, and CPU and RSS over its first and last
        EDGE of them, with the growth from one to the other."""
        table = {}
        for kind, (indices, cpu, rss, procs) in sorted(self.kinds.items()):
            edge = max(1, int(len(indices) * EDGE))
            order = sorted(range(len(indices)), key=indices.__getitem__)
            early, late = order[:edge], order[-edge:]
            row = {"jobs": len(indices), "cpu_ms": _ms(statistics.median(cpu)),
                   "max_rss_mib": _mib(statistics.median(rss)), "processes": statistics.median(procs),
                   "processes_max": max(procs)}
            for name, column, unit in (("cpu_ms", cpu, _ms), ("max_rss_mib", rss, _mib)):
                first = statistics.median(column[n] for n in early)
                last = statistics.median(column[n] for n in late)
                row[f"{name}_early"], row[f"{name}_late"] = unit(first), unit(last)
                row[f"{name}_growth"] = round(last / first, 2) if first else None
            table[kind] = row
        return table

    def grew_most(self, top: int = 5) -> list[dict]:
        """The jobs whose max RSS, or CPU, was the most times their kind's
        median, largest first (a job of a kind of one is no outlier)."""
        found = []
        for kind, (indices, cpu, rss, procs) in self.kinds.items():
            if len(indices) < 2:
                continue
            typical = {"max_rss": statistics.median(rss), "cpu": statistics.median(cpu)}
            for n, index in enumerate(indices):
                for measure, value in (("max_rss", rss[n]), ("cpu", cpu[n])):
                    if typical[measure] > 0:
                        found.append((value / typical[measure], measure, kind, index, n))
        found.sort(reverse=True)
        rows, seen = [], set()
        for times, measure, kind, index, n in found:
            if index in seen:
                continue
            seen.add(index)
            _, cpu, rss, procs = self.kinds[kind]
            rows.append({"job": index, "kind": kind, "over": measure, "times_median": round(times, 1),
                         "cpu_ms": _ms(cpu[n]), "max_rss_mib": _mib(rss[n]), "processes": procs[n]})
            if len(rows) == top:
                break
        return rows


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def _mib(size: float) -> float:
    return round(size / MiB, 1)
