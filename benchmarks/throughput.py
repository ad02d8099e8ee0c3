"""Throughput: jobs per second through execpool against raw ``Popen`` threads.

Run from the repository root::

    python benchmarks/throughput.py                 # or: python -m benchmarks.throughput
    python benchmarks/throughput.py --jobs 400 --rounds 3 --concurrency 4 --workers 2

Three workloads of ``--jobs`` jobs each:

* bash: ``echo hi`` -- execpool ``ShellJob`` against ``Popen([bash, "-c", "echo hi"])``;
* cold python: ``print("hi")`` -- execpool ``PythonJob`` (a new interpreter
  per job) against ``Popen([sys.executable, "-u", FILE])``;
* warm python: the same program as ``PythonJob(..., warm=True)`` (a fork of
  the worker, no interpreter start), when this execpool has it; compared with
  raw *cold* python, since a raw ``Popen`` has no warm form.

execpool runs each workload through ``pool.imap_unordered(jobs,
max_in_flight=C)`` on a pool of ``--workers`` workers; the baseline is a
``ThreadPoolExecutor(C)`` whose threads each run
``subprocess.Popen(argv, stdout=PIPE, stderr=STDOUT).communicate()`` -- the
same concurrency C, in this same process, in the same run. Every output is
checked. Rounds alternate the order (raw first, then execpool first, ...) so
a neighbour's load hits both designs alike; each figure is the median
jobs/s over the rounds, and each ratio is the ratio of those medians.

Targets (printed, not asserted): cold python >= 0.95x raw, bash >= 0.9x raw,
warm python >= 4x raw cold python.

The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _common as C
from execpool import ExecPool, PythonJob, ShellJob

BASH = shutil.which("bash") or "/bin/bash"
PROGRAM = 'print("hi")'
EXPECTED = "hi\n"

TARGET_BASH = 0.9
TARGET_COLD = 0.95
TARGET_WARM_VS_RAW_COLD = 4.0


def _raw_one(argv: list[str]) -> None:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = proc.communicate()
    if proc.returncode != 0 or out != EXPECTED.encode():
        raise RuntimeError(f"raw {argv!r} exited {proc.returncode}: {out!r}")


def raw_rate(argv: list[str], n: int, concurrency: int) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as executor:
        for _ in executor.map(_raw_one, [argv] * n):
            pass
    return n / (time.perf_counter() - t0)


def pool_rate(pool: ExecPool, make_job, n: int, concurrency: int) -> float:
    jobs = (make_job() for _ in range(n))
    t0 = time.perf_counter()
    results = pool.imap_unordered(jobs, max_in_flight=concurrency)
    count = 0
    for _, result in results:
        if not result.ok or result.output != EXPECTED:
            raise RuntimeError(f"execpool job failed: {result!r}")
        count += 1
    elapsed = time.perf_counter() - t0
    assert count == n
    return n / elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=400, help="jobs per workload and round (default 400)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (default 3)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2,
                        help="execpool workers (default: the number of CPUs)")
    parser.add_argument("--concurrency", type=int, default=2 * (os.cpu_count() or 2),
                        help="jobs in flight, for both designs (default: two per CPU)")
    parser.add_argument("--warmup", type=int, default=40, help="unmeasured jobs per design first (default 40)")
    args = C.parse_args(parser, argv, smoke={"jobs": 4, "rounds": 1, "warmup": 1, "workers": 2, "concurrency": 2})
    for name in ("jobs", "rounds", "workers", "concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must not be negative")

    has_warm = "warm" in {f.name for f in dataclasses.fields(PythonJob)}
    started = time.perf_counter()
    load_before = os.getloadavg()
    tmpdir = tempfile.mkdtemp(prefix="execpool-bench-")
    try:
        script = os.path.join(tmpdir, "hi.py")
        with open(script, "w") as f:
            f.write(PROGRAM + "\n")
        workloads = {
            "bash": ([BASH, "-c", "echo hi"], lambda: ShellJob("echo hi")),
            "cold_python": ([sys.executable, "-u", script], lambda: PythonJob(PROGRAM)),
        }
        if has_warm:
            workloads["warm_python"] = (None, lambda: PythonJob(PROGRAM, warm=True))
        rates: dict[str, dict[str, list[float]]] = {k: {"raw": [], "pool": []} for k in workloads}
        # Recycling a worker mid-run would put worker starts in some rounds only.
        with ExecPool(workers=args.workers, max_jobs_per_worker=1_000_000) as pool:
            for name, (raw_argv, make_job) in workloads.items():
                if args.warmup:
                    pool_rate(pool, make_job, args.warmup, args.concurrency)
                    if raw_argv is not None:
                        raw_rate(raw_argv, args.warmup, args.concurrency)
            for round_no in range(args.rounds):
                for name, (raw_argv, make_job) in workloads.items():
                    order = ("raw", "pool") if round_no % 2 == 0 else ("pool", "raw")
                    for design in order:
                        if design == "raw":
                            if raw_argv is not None:
                                rates[name]["raw"].append(raw_rate(raw_argv, args.jobs, args.concurrency))
                        else:
                            rates[name]["pool"].append(pool_rate(pool, make_job, args.jobs, args.concurrency))
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    elapsed = time.perf_counter() - started

    figures: dict = {}
    for name, by_design in rates.items():
        entry = {"pool_jobs_per_s": round(C.median(by_design["pool"]), 1),
                 "pool_rounds": [round(r, 1) for r in by_design["pool"]]}
        if by_design["raw"]:
            entry["raw_jobs_per_s"] = round(C.median(by_design["raw"]), 1)
            entry["raw_rounds"] = [round(r, 1) for r in by_design["raw"]]
            entry["ratio"] = round(C.median(by_design["pool"]) / C.median(by_design["raw"]), 3)
        figures[name] = entry
    raw_cold = figures["cold_python"]["raw_jobs_per_s"]
    if has_warm:
        figures["warm_python"]["ratio_vs_raw_cold"] = round(figures["warm_python"]["pool_jobs_per_s"] / raw_cold, 3)

    def target(value, goal):
        return {"target": f">= {goal:g}", "value": value, "met": value is not None and value >= goal}

    targets = {
        "bash_ratio": target(figures["bash"]["ratio"], TARGET_BASH),
        "cold_python_ratio": target(figures["cold_python"]["ratio"], TARGET_COLD),
        "warm_vs_raw_cold_ratio": target(figures["warm_python"]["ratio_vs_raw_cold"] if has_warm else None,
                                         TARGET_WARM_VS_RAW_COLD),
    }

    print(f"execpool throughput: {args.jobs} jobs x {args.rounds} rounds per design, concurrency "
          f"{args.concurrency}, {args.workers} workers, {os.cpu_count()} CPUs, python "
          f"{sys.version.split()[0]}, load {os.getloadavg()[0]:.2f}, {elapsed:.1f} s")
    print()
    rows = []
    for name, key, goal in (("bash: echo hi", "bash_ratio", TARGET_BASH),
                            ("python cold: print", "cold_python_ratio", TARGET_COLD),
                            ("python warm: print (vs raw cold)", "warm_vs_raw_cold_ratio",
                             TARGET_WARM_VS_RAW_COLD)):
        fig = figures.get({"bash_ratio": "bash", "cold_python_ratio": "cold_python",
                           "warm_vs_raw_cold_ratio": "warm_python"}[key])
        if fig is None:
            rows.append([name, "-", "-", "-", f">= {goal}", "n/a (no warm Python here)"])
            continue
        raw = fig.get("raw_jobs_per_s", raw_cold)
        rows.append([name, fig["pool_jobs_per_s"], raw, targets[key]["value"], f">= {goal}",
                     "yes" if targets[key]["met"] else "NO"])
    C.print_table("Jobs per second (medians over rounds; same concurrency for both designs)",
                  ["workload", "execpool", "raw Popen", "ratio", "target", "met"], rows)
    C.emit_json({
        "benchmark": "throughput",
        "jobs": args.jobs,
        "rounds": args.rounds,
        "concurrency": args.concurrency,
        "workers": args.workers,
        "cpus": os.cpu_count(),
        "load": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]},
        "elapsed_s": round(elapsed, 2),
        "warm_available": has_warm,
        **figures,
        "targets": targets,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
