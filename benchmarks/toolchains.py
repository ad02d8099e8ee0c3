"""The truth check's start-up cost: from a pool's start until every row of
``pool.languages()`` is known, and what jobs meanwhile waited for it.

Run from the repository root::

    python benchmarks/toolchains.py                 # or: python -m benchmarks.toolchains
    python benchmarks/toolchains.py --trials 5

Each trial is a fresh interpreter (``--trial``) with a cache directory of
its own and empty: the outcomes of the checks are kept for the life of a
process, and those that ran are recorded for the user's next processes
(execpool/pool/toolchains.py), so a second pool would list everything at
once. One more start, after the trials, reads the last trial's record: a
restart's cost. In each, a pool in the strict sandbox (as the
service runs jobs) starts; its first ``languages()`` call starts the checks
-- a hello-world of each language whose toolchain is here, compiled and
run in the sandbox, two at a time -- and is timed (it must not wait);
another thread then asks ``languages(wait=True)``, timed from the start of
the pool to every row known. Meanwhile, and then again once every row is
known, this thread runs small jobs one after another (a Python job, and a
C hello-world from the compile cache after the first): their latency
during the checks against after them is what the checks cost a request.

Targets: the first listing answers within 50 ms (it waits for no check);
the median job during the checks within 3x its median after.
The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _common as C
from execpool import CodeJob, ExecPool, PythonJob
from execpool.pool.toolchains import CACHE_DIR_ENV
from execpool.shared.languages import HELLO

FIRST_LISTING_TARGET_MS = 50.0
DURING_OVER_AFTER_TARGET = 3.0
#: Jobs run once every row is known, for the latency without checks.
AFTER_JOBS = 20
TRIAL_TIMEOUT_S = 600.0


def trial(workers: int) -> dict:
    """One pool's start, in this (fresh) process."""
    jobs = [PythonJob("print(1)", timeout=30), CodeJob("c", HELLO["c"][0], timeout=30)]
    started = time.perf_counter()
    with ExecPool(workers=workers, sandbox="strict") as pool:
        listing = time.perf_counter()
        first = pool.languages()
        first_s = time.perf_counter() - listing
        known = threading.Event()
        rows: list = []

        def wait_all() -> None:
            rows.extend(pool.languages(wait=True))
            known.set()

        waiter = threading.Thread(target=wait_all, name="bench-languages")
        waiter.start()
        during, after, wrong = [], [], 0
        while not known.is_set():
            for job in jobs:
                t0 = time.perf_counter()
                result = pool.run(job)
                during.append(time.perf_counter() - t0)
                wrong += result.output.strip() not in ("1", HELLO["c"][1])
        known_s = time.perf_counter() - started
        waiter.join()
        hello_worlds = pool.stats().jobs_total - len(during)  # each a compile or a run of one
        for _ in range(AFTER_JOBS // len(jobs)):
            for job in jobs:
                t0 = time.perf_counter()
                result = pool.run(job)
                after.append(time.perf_counter() - t0)
                wrong += result.output.strip() not in ("1", HELLO["c"][1])
    return {"first_listing_ms": C.ms(first_s), "checking_at_first": sum(row.checking for row in first),
            "all_known_s": round(known_s, 3), "check_jobs": hello_worlds, "jobs_during": len(during),
            "job_during_ms_median": C.ms(C.median(during)), "job_during_ms_max": C.ms(max(during, default=0.0)),
            "job_after_ms_median": C.ms(C.median(after)), "wrong": wrong,
            "runs": sorted(row.name for row in rows if row.runs),
            "why_not": {row.name: row.why_not for row in rows if not row.runs}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3, help="pool starts, each in a fresh interpreter")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--trial", metavar="CACHE_DIR", help=argparse.SUPPRESS)  # one trial, in this process
    args = C.parse_args(parser, argv, {"trials": 1})
    if args.trial:
        os.environ[CACHE_DIR_ENV] = args.trial
        C.emit_json(trial(args.workers))
        return 0
    load_before = C.load()
    with tempfile.TemporaryDirectory(prefix="execpool-bench-toolchains-") as caches:
        dirs = [os.path.join(caches, str(n)) for n in range(args.trials)]
        trials = [C.run_child("toolchains", ["--trial", cache, "--workers", str(args.workers)], TRIAL_TIMEOUT_S)
                  for cache in dirs]
        recorded = C.run_child("toolchains", ["--trial", dirs[-1], "--workers", str(args.workers)], TRIAL_TIMEOUT_S)
    first_ms = C.median([t["first_listing_ms"] for t in trials])
    known_s = C.median([t["all_known_s"] for t in trials])
    during = C.median([t["job_during_ms_median"] for t in trials])
    after = C.median([t["job_after_ms_median"] for t in trials])
    targets = {
        "first_listing_ms": C.target(first_ms, FIRST_LISTING_TARGET_MS, "<=", "ms"),
        "job_during_over_after": C.target(round(during / after, 2) if after else None, DURING_OVER_AFTER_TARGET,
                                          "<="),
        "no_wrong_answers": C.target(sum(t["wrong"] for t in trials), 0, "<="),
    }
    print(f"execpool toolchains: {args.trials} pool starts (strict sandbox, {args.workers} workers), "
          f"{os.cpu_count()} CPUs, load {load_before}")
    print()
    C.print_table("Per pool start", ["trial", "first listing ms", "rows checking then", "all known s",
                                     "check jobs", "jobs during", "job during ms (median)", "job after ms (median)"],
                  [[n, t["first_listing_ms"], t["checking_at_first"], t["all_known_s"], t["check_jobs"],
                    t["jobs_during"], t["job_during_ms_median"], t["job_after_ms_median"]]
                   for n, t in [*enumerate(trials, 1), ("after a recorded one", recorded)]])
    C.print_table("Languages", ["language", "runs", "why not"],
                  [[name, True, ""] for name in trials[-1]["runs"]]
                  + [[name, False, why] for name, why in trials[-1]["why_not"].items()])
    C.print_targets(targets)
    C.emit_json({
        "benchmark": "toolchains",
        "trials": trials,
        "workers": args.workers,
        "first_listing_ms_median": first_ms,
        "all_known_s_median": known_s,
        "recorded": recorded,
        "all_known_s_recorded": recorded["all_known_s"],
        "runs": trials[-1]["runs"],
        "machine": C.machine(),
        "load": {"before": load_before, "after": C.load()},
        "targets": targets,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
