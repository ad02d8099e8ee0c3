"""The service's Prometheus metrics (docs/service/index.md, metrics).

Runs in the service's process (execpool/serve/app.py). Each app gets a registry
of its own, so that two apps in one process do not collide; the figures the
pool keeps itself (``pool.stats()``) are read at scrape time rather than
copied, so the library and ``/metrics`` never disagree.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, SummaryMetricFamily

from ..pool.stats import DURATION_BUCKETS_S
from ..shared.result import Result
from ..supervisor import ExecPool
from .admission import Admission


class ServiceMetrics:
    """The metrics of one app: what it counts itself, and the pool's."""

    def __init__(self, pool: ExecPool, admission: Admission) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.jobs = Counter("execpool_jobs", "Jobs ended, by route, kind and status",
                            ["route", "kind", "status"], registry=r)
        self.duration = Histogram("execpool_job_duration_seconds", "Run time of jobs", ["kind"],
                                  buckets=DURATION_BUCKETS_S, registry=r)
        self.cpu = Counter("execpool_job_cpu_seconds", "CPU time of jobs' whole trees", ["kind"], registry=r)
        self.queue_wait = Histogram("execpool_queue_wait_seconds", "Time a request waited for a slot",
                                    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0), registry=r)
        Gauge("execpool_jobs_in_flight", "Jobs running now", registry=r).set_function(lambda: admission.in_flight)
        Gauge("execpool_queue_depth", "Requests waiting for a slot", registry=r).set_function(
            lambda: admission.queue_depth)
        self.rejected = Counter("execpool_rejected", "Requests refused, and answers dropped, by reason", ["reason"],
                                registry=r)
        self.sessions_open = Gauge("execpool_sessions_open", "Sessions open now", registry=r)
        self.session_cells = Counter("execpool_session_cells", "Cells of sessions ended, by status", ["status"],
                                     registry=r)
        r.register(_PoolCollector(pool))

    def job(self, route: str, kind: str, result: Result) -> None:
        self.jobs.labels(route, kind, result.status.value).inc()
        self.duration.labels(kind).observe(result.duration_s)
        if result.cpu_s is not None:
            self.cpu.labels(kind).inc(result.cpu_s)


class _PoolCollector:
    """Figures the pool keeps itself (``pool.stats()``), read at scrape time."""

    def __init__(self, pool: ExecPool) -> None:
        self.pool = pool

    def collect(self):
        stats = self.pool.stats()
        restarts = CounterMetricFamily("execpool_worker_restarts", "Workers that died and were replaced")
        restarts.add_metric([], stats.worker_restarts)
        output = CounterMetricFamily("execpool_output_bytes", "Bytes of output the jobs produced")
        output.add_metric([], stats.output_bytes)
        cache = self.pool.compile_cache
        lookups = CounterMetricFamily("execpool_compile_cache", "CodeJobs whose program was compiled (or compiling) "
                                      "already, and those that compiled it", labels=["result"])
        lookups.add_metric(["hit"], cache.hits)
        lookups.add_metric(["miss"], cache.misses)
        compiles = SummaryMetricFamily("execpool_compile_seconds", "Compiles and the seconds they took",
                                       count_value=cache.misses, sum_value=cache.compile_seconds)
        return [restarts, output, lookups, compiles]
