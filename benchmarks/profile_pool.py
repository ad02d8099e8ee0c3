"""Where a pool spends its time: run one scenario with every worker started
under cProfile (and the caller profiled too), then print the top functions.

Run from the repository root::

    python -m benchmarks.profile_pool concurrency --n 1024 --sleep 5
    python -m benchmarks.profile_pool flood --mb 200
    python -m benchmarks.profile_pool kill --rounds 20
    python -m benchmarks.profile_pool bash --iters 300
    python -m benchmarks.profile_pool warm --iters 300
    python -m benchmarks.profile_pool bash --iters 300 --sandbox strict

Nothing in execpool is changed: the ``subprocess.Popen`` that starts the
pool's lifeline (execpool/pool/lifeline.py) is wrapped, for this process
only, so that the lifeline wraps its own, and a worker's command line
``python -m execpool.worker ...`` becomes ``python -m cProfile -o FILE -m
execpool.worker ...`` (and ``--tmpdir`` moves the jobs' private directories).
A worker writes its profile when it exits normally
(``pool.close()`` sends Shutdown), so the scenario always closes its pool.
The profiles are kept in ``--out`` (default: a fresh temporary directory)
for ``python -m pstats``.

Scenarios: ``concurrency`` (N concurrent ``sleep`` streams on asyncio),
``flood`` (one stream of MB megabytes), ``kill`` (close() of a 51-process
tree, repeated), ``bash`` (``echo hi`` round trips), ``warm`` (warm
``print('hi')`` round trips, through the workers' spares).
"""

from __future__ import annotations

import argparse
import asyncio
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
import execpool.pool.lifeline as lifecycle


#: Run in the lifeline process, which starts the workers
#: (execpool/lifeline/process.py): its ``subprocess.Popen`` gives each
#: worker's command line to cProfile. ``{out}`` is the profiles' directory.
_LIFELINE = """
import os, subprocess, sys
import execpool.lifeline.process as process
real, n = subprocess.Popen, [0]
def popen(argv, *args, **kwargs):
    if list(argv[1:3]) == ["-m", "execpool.worker"]:
        n[0] += 1
        argv = [argv[0], "-m", "cProfile", "-o", os.path.join({out!r}, "worker-%d.prof" % n[0]), *argv[1:]]
    return real(argv, *args, **kwargs)
process.subprocess = type("Wrapped", (), {{"Popen": staticmethod(popen), "__getattr__": lambda self, name: getattr(subprocess, name)}})()
process.main(sys.argv[1:])
"""


class _ProfilingSubprocess:
    """Stands in for the ``subprocess`` module inside execpool/pool/lifeline.py:
    the lifeline it starts profiles the workers it starts."""

    def __init__(self, real, out_dir: str, profile: bool) -> None:
        self._real = real
        self._out_dir = out_dir
        self._profile = profile

    def __getattr__(self, name):
        return getattr(self._real, name)

    def Popen(self, argv, *args, **kwargs):  # noqa: N802 - the name it replaces
        argv = list(argv)
        if self._profile and argv[1:3] == ["-m", "execpool.lifeline"]:
            argv = [argv[0], "-c", _LIFELINE.format(out=self._out_dir), *argv[3:]]
        return self._real.Popen(argv, *args, **kwargs)


def _drain(gen):
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


def scenario_concurrency(pool: ExecPool, args) -> str:
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
    return f"{args.n} x sleep {args.sleep:g}: wall {wall:.3f} s, {bad} failed"


def scenario_flood(pool: ExecPool, args) -> str:
    total = args.mb * 1_000_000
    t0 = time.perf_counter()
    result = _drain(pool.stream(ShellJob(f"yes {'x' * 99} | head -c {total}", timeout=600)))
    wall = time.perf_counter() - t0
    return f"{args.mb} MB: {total / 1e6 / wall:.0f} MB/s, output_chars {result.output_chars}"


def scenario_kill(pool: ExecPool, args) -> str:
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
    return f"{args.rounds} close() of a {C.TREE_SIZE}-process tree: reaped median {C.ms(C.median(times))} ms"


def scenario_bash(pool: ExecPool, args) -> str:
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        pool.run(ShellJob("echo hi", sandbox=args.sandbox))
        times.append(time.perf_counter() - t0)
    return f"{args.iters} x echo hi: median {C.ms(C.median(times))} ms"


def scenario_warm(pool: ExecPool, args) -> str:
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        pool.run(PythonJob("print('hi')", warm=True, sandbox=args.sandbox))
        times.append(time.perf_counter() - t0)
    return f"{args.iters} x warm print('hi'): median {C.ms(C.median(times))} ms"


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
    args = parser.parse_args(argv)
    out_dir = args.out or tempfile.mkdtemp(prefix="execpool-profile-")
    os.makedirs(out_dir, exist_ok=True)
    C.raise_nofile(2 * args.n + 256)

    if args.tmpdir is not None:
        tempfile.tempdir = args.tmpdir
    lifecycle.subprocess = _ProfilingSubprocess(lifecycle.subprocess, out_dir, not args.no_workers)
    caller = None if args.no_caller else cProfile.Profile()
    try:
        with ExecPool(workers=args.workers, max_jobs_per_worker=1_000_000) as pool:
            if caller is not None:
                caller.enable()
            summary = SCENARIOS[args.scenario](pool, args)
            if caller is not None:
                caller.disable()
    finally:
        lifecycle.subprocess = lifecycle.subprocess._real
    print(f"scenario: {summary}")
    print(f"profiles in {out_dir}")
    if caller is not None:
        caller.dump_stats(os.path.join(out_dir, "caller.prof"))
        print("\n=== caller (main thread only) ===")
        print(_top(caller, args.top, args.sort))
    for path in sorted(glob.glob(os.path.join(out_dir, "worker-*.prof"))):
        print(f"\n=== {os.path.basename(path)} ===")
        print(_top(path, args.top, args.sort))
    return 0


if __name__ == "__main__":
    sys.exit(main())
