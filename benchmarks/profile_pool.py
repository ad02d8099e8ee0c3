"""Where a pool spends its time: run one scenario with every worker started
under cProfile (and the caller profiled too), then print the top functions.

Run from the repository root::

    python -m benchmarks.profile_pool concurrency --n 1024 --sleep 5
    python -m benchmarks.profile_pool flood --mb 200
    python -m benchmarks.profile_pool kill --rounds 20
    python -m benchmarks.profile_pool bash --iters 300
    python -m benchmarks.profile_pool warm --iters 300
    python -m benchmarks.profile_pool bash --iters 300 --sandbox strict

Nothing in execpool is changed: a worker's command line ``python -m
execpool.worker ...`` becomes ``python -m cProfile -o FILE -m
execpool.worker ...`` (``_common.workers_run_as``), and ``--tmpdir`` moves
the jobs' private directories. A worker writes its profile when it exits
normally (``pool.close()`` sends Shutdown), so the scenario always closes
its pool. The profiles are kept in ``--out`` (default: a fresh temporary
directory) for ``python -m pstats``.

Scenarios: ``concurrency`` (N concurrent ``sleep`` streams on asyncio),
``flood`` (one stream of MB megabytes), ``kill`` (close() of a 51-process
tree, repeated), ``bash`` (``echo hi`` round trips), ``warm`` (warm
``print('hi')`` round trips, through the workers' spares). The last line of
stdout is one JSON object: the scenario's figures and the profiles' paths.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import glob
import io
import os
import pstats
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _common as C
from execpool import ExecPool, PythonJob, ShellJob


def _drain(gen):
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


# Each scenario returns its figures, with "summary": one line saying them.


def scenario_concurrency(pool: ExecPool, args) -> dict:
    async def one():
        stream = pool.astream(ShellJob(f"sleep {args.sleep:g}", timeout=args.sleep + 120))
        async for _ in stream:
            pass
        return stream.result

    async def many():
        return await asyncio.gather(*(one() for _ in range(args.n)))

    t0 = time.perf_counter()
    results = asyncio.run(many())
    wall = time.perf_counter() - t0
    bad = sum(r.exit_code != 0 for r in results)
    return {"summary": f"{args.n} x sleep {args.sleep:g}: wall {wall:.3f} s, {bad} failed", "n": args.n,
            "wall_s": round(wall, 3), "failed": bad}


def scenario_flood(pool: ExecPool, args) -> dict:
    total = args.mb * 1_000_000
    t0 = time.perf_counter()
    result = _drain(pool.stream(ShellJob(f"yes {'x' * 99} | head -c {total}", timeout=600)))
    wall = time.perf_counter() - t0
    return {"summary": f"{args.mb} MB: {total / 1e6 / wall:.0f} MB/s, output_chars {result.output_chars}",
            "mb_per_s": round(total / 1e6 / wall, 1), "output_chars": result.output_chars}


def scenario_kill(pool: ExecPool, args) -> dict:
    times = []
    for _ in range(args.rounds):
        gen = pool.stream(ShellJob(C.TREE_COMMAND, timeout=60), heartbeat_interval_s=30.0)
        text = ""
        while "ready" not in text:
            event = next(gen)
            text += event.get("text", "")
        tree = C.pool_tree(pool)
        t0 = time.perf_counter()
        gen.close()
        times.append(C.wait_gone(tree, t0)[1] or float("nan"))
    reaped = C.ms(C.median(times))
    return {"summary": f"{args.rounds} close() of a {C.TREE_SIZE}-process tree: reaped median {reaped} ms",
            "rounds": args.rounds, "reaped_ms_median": reaped}


def scenario_bash(pool: ExecPool, args) -> dict:
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        pool.run(ShellJob("echo hi", sandbox=args.sandbox))
        times.append(time.perf_counter() - t0)
    median = C.ms(C.median(times))
    return {"summary": f"{args.iters} x echo hi: median {median} ms", "iters": args.iters, "ms_median": median}


def scenario_warm(pool: ExecPool, args) -> dict:
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        pool.run(PythonJob("print('hi')", warm=True, sandbox=args.sandbox))
        times.append(time.perf_counter() - t0)
    median = C.ms(C.median(times))
    return {"summary": f"{args.iters} x warm print('hi'): median {median} ms", "iters": args.iters,
            "ms_median": median}


SCENARIOS = {"concurrency": scenario_concurrency, "flood": scenario_flood, "kill": scenario_kill,
             "bash": scenario_bash, "warm": scenario_warm}


def _top(path_or_profile, limit: int, sort: str) -> str:
    buf = io.StringIO()
    stats = pstats.Stats(path_or_profile, stream=buf)
    stats.strip_dirs().sort_stats(sort).print_stats(limit)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--n", type=int, default=1024, help="concurrency: calls (default 1024)")
    parser.add_argument("--sleep", type=float, default=5.0, help="concurrency: seconds (default 5)")
    parser.add_argument("--mb", type=int, default=200, help="flood: megabytes (default 200)")
    parser.add_argument("--rounds", type=int, default=20, help="kill: rounds (default 20)")
    parser.add_argument("--iters", type=int, default=300, help="bash: round trips (default 300)")
    parser.add_argument("--workers", type=int, default=2, help="pool workers (default 2)")
    parser.add_argument("--top", type=int, default=25, help="functions shown per profile (default 25)")
    parser.add_argument("--sort", default="tottime", help="pstats sort key (default tottime)")
    parser.add_argument("--out", help="directory for the .prof files (default: a new temporary one)")
    parser.add_argument("--no-caller", action="store_true", help="do not profile the caller")
    parser.add_argument("--no-workers", action="store_true", help="do not profile the workers")
    parser.add_argument("--sandbox", choices=("strict",), default=None,
                        help="bash, warm: run the jobs in this sandbox (default none), to see what it costs")
    parser.add_argument("--tmpdir",
                        help="diagnostic: the temporary directory the pool makes the jobs' private directories "
                             "in (e.g. /dev/shm, to see what /tmp costs)")
    args = C.parse_args(parser, argv, smoke={"n": 4, "sleep": 0.1, "mb": 1, "rounds": 1, "iters": 3, "top": 5})
    out_dir = args.out or tempfile.mkdtemp(prefix="execpool-profile-")
    os.makedirs(out_dir, exist_ok=True)
    C.raise_nofile(2 * args.n + 256)

    if args.tmpdir is not None:
        tempfile.tempdir = args.tmpdir
    profiled = contextlib.nullcontext() if args.no_workers else C.workers_run_as(
        ["-m", "cProfile", "-o", os.path.join(out_dir, f"worker-{C.WORKER_NUMBER}.prof"), "-m", "execpool.worker"])
    caller = None if args.no_caller else cProfile.Profile()
    with profiled, ExecPool(workers=args.workers, max_jobs_per_worker=1_000_000) as pool:
        if caller is not None:
            caller.enable()
        figures = SCENARIOS[args.scenario](pool, args)
        if caller is not None:
            caller.disable()
    print(f"scenario: {figures['summary']}")
    print(f"profiles in {out_dir}")
    profiles = {}
    if caller is not None:
        profiles["caller"] = os.path.join(out_dir, "caller.prof")
        caller.dump_stats(profiles["caller"])
        print("\n=== caller (main thread only) ===")
        print(_top(caller, args.top, args.sort))
    for path in sorted(glob.glob(os.path.join(out_dir, "worker-*.prof"))):
        profiles[os.path.basename(path)[:-len(".prof")]] = path
        print(f"\n=== {os.path.basename(path)} ===")
        print(_top(path, args.top, args.sort))
    C.emit_json({"benchmark": "profile_pool", "scenario": args.scenario, "workers": args.workers,
                 "figures": figures, "profiles": profiles, "load": C.load(), "machine": C.machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
