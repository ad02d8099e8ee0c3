"""Concurrency: N concurrent ``sleep 5`` tools, each consumed as a stream.

Run from the repository root::

    python benchmarks/concurrency.py                     # or: python -m benchmarks.concurrency
    python benchmarks/concurrency.py --sleep 2 --n 256   # shorter
    python benchmarks/concurrency.py --reps 3 --designs pool-async,pool-threads,reference

Designs (``--designs``; all but pool-threads by default):

- ``pool-async``: one ExecPool (2 workers); every call is an asyncio task
  iterating ``pool.astream(ShellJob("sleep 5"))`` on one event loop.
- ``pool-threads``: the same pool, each call's ``pool.stream`` iterated by its
  own thread (a synchronous server's handler threads).
- ``reference``: the thread-per-call design (benchmarks/reference.py): per
  call a consumer thread iterating the stream, a reader thread and a 0.2 s
  polling watcher thread, and a Popen from this process.
- ``floor``: no design, no streaming: one thread Popens all N tools and reads
  their pipes with one selector -- how soon N ``bash -c "sleep 5"`` can start
  and end on this machine at all (a lower bound for the wall time).

Every trial runs in a fresh child process (so memory figures start from a
clean heap), after a warm-up of 8 calls made the same way; trials alternate
between the designs. Per trial: wall time from the first submission to the
last Result; the caller's peak native thread count (from /proc, sampled every
10 ms; it includes the sampler itself and, for the pool, its dispatcher);
the caller's peak RSS growth over the RSS after the warm-up, per call; and
the caller's CPU time (user + system, ``os.times()`` delta; the workers'
CPU is reported beside it for the pool). Every Result must be exit 0.

The reference needs two fds per call in this process, and the pool's
workers one per tool: each trial raises its soft RLIMIT_NOFILE to the hard
limit when N would not fit (the JSON says whether it did).

Targets: wall <= 1.1x the sleep; caller threads independent of N (the same
peak at every N); <= 32 KiB caller RSS per call; less caller CPU than the
reference. The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import selectors
import subprocess
import sys
import threading
import time

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil

from benchmarks import _common as C
from benchmarks.reference import ThreadPerCall, consume, shell_argv

TARGET_WALL_RATIO = 1.1
TARGET_KIB_PER_CALL = 32.0
DESIGNS = ("pool-async", "pool-threads", "reference", "floor")
DEFAULT_DESIGNS = ("pool-async", "reference", "floor")
WARMUP_CALLS = 8
SAMPLE_S = 0.01


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _worker_cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


class _Runner:
    """Runs ``n`` concurrent calls of a command one way; returns the Results."""

    def __init__(self, design: str, workers: int) -> None:
        self.design = design
        self.pool = None
        self.loop = None
        if design.startswith("pool"):
            from execpool import ExecPool

            self.pool = ExecPool(workers=workers, max_jobs_per_worker=1_000_000)
            if design == "pool-async":
                self.loop = asyncio.new_event_loop()
        else:
            self.ref = ThreadPerCall()

    def run(self, n: int, command: str, timeout: float, cwd: str | None = None) -> list:
        if self.design == "pool-async":
            return self.loop.run_until_complete(self._async(n, command, timeout, cwd))
        if self.design == "pool-threads":
            from execpool import ShellJob

            return _threads(n, lambda: self.pool.stream(ShellJob(command, timeout=timeout, cwd=cwd)))
        if self.design == "floor":
            return _floor(n, command, cwd)
        return _threads(n, lambda: self.ref.stream(shell_argv(command), timeout=timeout, cwd=cwd))

    async def _async(self, n: int, command: str, timeout: float, cwd: str | None) -> list:
        from execpool import ShellJob

        async def one():
            stream = self.pool.astream(ShellJob(command, timeout=timeout, cwd=cwd))
            async for _ in stream:
                pass
            return stream.result

        return await asyncio.gather(*(one() for _ in range(n)))

    @property
    def worker_pids(self) -> list[int]:
        return self.pool.worker_pids if self.pool is not None else []

    def close(self) -> None:
        if self.loop is not None:
            self.loop.close()
        if self.pool is not None:
            self.pool.close()


class _Exit:
    __slots__ = ("exit_code",)

    def __init__(self, exit_code: int) -> None:
        self.exit_code = exit_code


def _floor(n: int, command: str, cwd: str | None) -> list:
    """No design: one thread starts every tool (vfork) and reads all their
    pipes with one selector -- how soon N tools can start and end here."""
    procs = [subprocess.Popen(shell_argv(command), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd) for _ in range(n)]
    with selectors.DefaultSelector() as sel:
        for proc in procs:
            sel.register(proc.stdout, selectors.EVENT_READ)
        open_pipes = n
        while open_pipes:
            for key, _ in sel.select():
                if not os.read(key.fd, 65536):
                    sel.unregister(key.fileobj)
                    key.fileobj.close()
                    open_pipes -= 1
    return [_Exit(proc.wait()) for proc in procs]


def _threads(n: int, make_stream) -> list:
    results: list = [None] * n

    def call(i: int) -> None:
        results[i] = consume(make_stream())[1]

    threads = [threading.Thread(target=call, args=(i,), name=f"bench-call-{i}", daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def trial(design: str, n: int, sleep_s: float, workers: int, cwd: str | None = None) -> dict:
    nofile = C.raise_nofile(2 * n + 256)
    runner = _Runner(design, workers)
    worker_pids = runner.worker_pids
    try:
        timeout = sleep_s + 120
        runner.run(WARMUP_CALLS, "true", timeout, cwd)
        time.sleep(0.3)  # the warm-up's watcher threads (reference) notice their end and exit
        gc.collect()
        sampler = C.Sampler({"caller": os.getpid()}, SAMPLE_S).start()
        cpu0, wcpu0 = _cpu(), _worker_cpu(worker_pids)
        t0 = time.perf_counter()
        results = runner.run(n, f"sleep {sleep_s:g}", timeout, cwd)
        wall = time.perf_counter() - t0
        cpu, wcpu = _cpu() - cpu0, _worker_cpu(worker_pids) - wcpu0
        sampler.stop()
    finally:
        runner.close()
    bad = [r for r in results if r is None or r.exit_code != 0]
    growth = sampler.growth("caller")
    return {
        "design": design,
        "n": n,
        "sleep_s": sleep_s,
        "wall_s": round(wall, 3),
        "wall_ratio": round(wall / sleep_s, 3),
        "threads_base": sampler.base_threads,
        "threads_peak": sampler.peak_threads,
        "rss_base_mib": C.mib(sampler.base["caller"]),
        "rss_growth_mib": C.mib(growth),
        "rss_kib_per_call": round(growth / n / C.KiB, 2),
        "caller_cpu_s": round(cpu, 3),
        "worker_cpu_s": round(wcpu, 3) if worker_pids else None,
        "failed": len(bad),
        "nofile": nofile,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", default="256,1024", help="comma-separated concurrencies (default 256,1024)")
    parser.add_argument("--sleep", type=float, default=5.0, help="seconds each tool sleeps (default 5)")
    parser.add_argument("--reps", type=int, default=1, help="trials per design and N (default 1)")
    parser.add_argument("--workers", type=int, default=2, help="pool workers (default 2)")
    parser.add_argument("--designs", default=",".join(DEFAULT_DESIGNS),
                        help=f"comma-separated, from {','.join(DESIGNS)} (default {','.join(DEFAULT_DESIGNS)})")
    parser.add_argument("--job-cwd", help="run every tool in this existing directory (for execpool: no private "
                                          "temporary directory per job, to measure what those cost)")
    parser.add_argument("--trial", choices=DESIGNS, help=argparse.SUPPRESS)  # one trial, in this process
    args = C.parse_args(parser, argv, smoke={"n": "4", "sleep": 0.2})
    try:
        ns = [int(x) for x in args.n.split(",") if x]
    except ValueError:
        parser.error("--n takes comma-separated integers")
    designs = [d for d in args.designs.split(",") if d]
    if not ns or min(ns) < 1 or args.sleep <= 0 or args.reps < 1 or args.workers < 1:
        parser.error("--n >= 1, --sleep > 0, --reps >= 1, --workers >= 1")
    if not designs or set(designs) - set(DESIGNS):
        parser.error(f"--designs from {','.join(DESIGNS)}")
    if args.trial:
        C.emit_json(trial(args.trial, ns[0], args.sleep, args.workers, args.job_cwd))
        return 0

    load_before = C.load()
    started = time.perf_counter()
    trials: dict[str, dict[int, list[dict]]] = {d: {n: [] for n in ns} for d in designs}
    for rep in range(args.reps):
        for n in ns:
            for design in (designs if rep % 2 == 0 else designs[::-1]):
                trials[design][n].append(C.run_child(
                    "concurrency", ["--trial", design, "--n", str(n), "--sleep", f"{args.sleep:g}",
                                    "--workers", str(args.workers),
                                    *(["--job-cwd", os.path.abspath(args.job_cwd)] if args.job_cwd else [])],
                    timeout=args.sleep + 300))
    elapsed = time.perf_counter() - started

    summary: dict[str, dict[str, dict]] = {}
    for design, by_n in trials.items():
        summary[design] = {}
        for n, runs in by_n.items():
            summary[design][str(n)] = {
                "wall_s_median": round(C.median([r["wall_s"] for r in runs]), 3),
                "wall_ratio_median": round(C.median([r["wall_ratio"] for r in runs]), 3),
                "threads_peak_max": max(r["threads_peak"] for r in runs),
                "threads_base": runs[0]["threads_base"],
                "rss_kib_per_call_median": round(C.median([r["rss_kib_per_call"] for r in runs]), 2),
                "rss_kib_per_call_max": max(r["rss_kib_per_call"] for r in runs),
                "caller_cpu_s_median": round(C.median([r["caller_cpu_s"] for r in runs]), 3),
                "worker_cpu_s_median": (round(C.median([r["worker_cpu_s"] for r in runs]), 3)
                                        if runs[0]["worker_cpu_s"] is not None else None),
                "failed": sum(r["failed"] for r in runs),
                "nofile_raised": any(r["nofile"]["raised"] for r in runs),
            }

    targets = {}
    pool_design = "pool-async" if "pool-async" in summary else None
    if pool_design:
        pool = summary[pool_design]
        worst_wall = max(s["wall_ratio_median"] for s in pool.values())
        targets["wall_ratio"] = C.target(worst_wall, TARGET_WALL_RATIO, "<=", "x sleep")
        peaks = sorted({s["threads_peak_max"] for s in pool.values()})
        targets["caller_threads_independent_of_n"] = {
            "target": "same peak at every N", "value": peaks[-1] if len(peaks) == 1 else peaks,
            "met": len(peaks) == 1}
        targets["caller_rss_kib_per_call"] = C.target(max(s["rss_kib_per_call_max"] for s in pool.values()),
                                                      TARGET_KIB_PER_CALL, "<=", "KiB")
        if "reference" in summary:
            ratios = [pool[n]["caller_cpu_s_median"] / summary["reference"][n]["caller_cpu_s_median"]
                      for n in pool if summary["reference"][n]["caller_cpu_s_median"] > 0]
            worst = round(max(ratios), 3) if ratios else None
            targets["caller_cpu_vs_reference"] = {"target": "< 1 x", "value": worst,
                                                  "met": worst is not None and worst < 1.0}
        failed = sum(s["failed"] for s in pool.values())
        targets["all_exit_0"] = {"target": "every Result exit 0", "value": failed == 0, "met": failed == 0}

    print(f"execpool concurrency: N in {ns}, `sleep {args.sleep:g}`, {args.reps} trial(s) each (each in a fresh "
          f"process), {args.workers} workers, {os.cpu_count()} CPUs, load {load_before}, {elapsed:.1f} s"
          + (f", every tool in {args.job_cwd}" if args.job_cwd else ""))
    print()
    rows = []
    for design, by_n in summary.items():
        for n, s in by_n.items():
            rows.append([design, n, s["wall_s_median"], s["wall_ratio_median"], s["threads_peak_max"],
                         round((s["threads_peak_max"] - s["threads_base"]) / int(n), 2),
                         s["rss_kib_per_call_median"], s["caller_cpu_s_median"], s["worker_cpu_s_median"],
                         s["failed"]])
    C.print_table("Per design and N (medians; threads: peak native threads of the caller)",
                  ["design", "N", "wall s", "wall/sleep", "threads", "threads/call", "KiB/call", "caller CPU s",
                   "worker CPU s", "failed"], rows)
    if any(s["nofile_raised"] for by_n in summary.values() for s in by_n.values()):
        print("  note: the trials raised their soft RLIMIT_NOFILE to the hard limit to fit N")
        print()
    if targets:
        C.print_targets(targets, "Targets (execpool pool-async)")
    C.emit_json({
        "benchmark": "concurrency",
        "n": ns,
        "sleep_s": args.sleep,
        "reps": args.reps,
        "workers": args.workers,
        "job_cwd": args.job_cwd,
        "elapsed_s": round(elapsed, 2),
        "machine": C.machine(),
        "load": {"before": load_before, "after": C.load()},
        "designs": summary,
        "trials": {d: {str(n): runs for n, runs in by_n.items()} for d, by_n in trials.items()},
        "targets": targets,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
