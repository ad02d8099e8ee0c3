"""What starting a Python session costs in CPU, all processes counted:
IPython sessions (the default), plain Python ones (``ipython=False``) and,
with ``--baseline REPO``, the default session of another checkout, in
interleaved rounds of the same run.

Run from the repository root::

    python benchmarks/session_start.py                     # or: python -m benchmarks.session_start
    python benchmarks/session_start.py --baseline ../before --rounds 15

Latency on a shared machine says more about the load than about a start;
CPU is steadier. Each measurement is a child process that starts a pool
(strict sandbox, one worker), opens a session, runs ``x = 1`` in it and
closes it, N times one after another, then closes the pool; its CPU is
what it and every process below it spent, reaped down the chain (this
process is their subreaper, so an orphan is counted too). CPU per start is
(CPU with N = ``--sessions`` + 1, less CPU with N = 1) / ``--sessions``: the
pool's own start and end cancel out. A baseline runs from its own
checkout (its directory first on ``PYTHONPATH``, for the pool's workers
too) in this interpreter's environment.

The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _common as C

#: The child: ``python -c CHILD N KIND`` (KIND: ipython, plain, or default).
CHILD = """
import os, sys
import execpool
from execpool import ExecPool
count, kind = int(sys.argv[1]), sys.argv[2]
if not execpool.__file__.startswith(os.environ["EXECPOOL_BENCH_TREE"]):
    raise SystemExit(f"execpool came from {execpool.__file__}")
options = {} if kind == "default" else {"ipython": kind == "ipython"}
with ExecPool(workers=1, sandbox="strict") as pool:
    for _ in range(count):
        with pool.session("python", **options) as session:
            ran = session.run("x = 1")
            if ran.error is not None:
                raise SystemExit(f"the cell failed: {ran.error}")
"""


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_child(tree: str, count: int, kind: str) -> float:
    """CPU seconds of one child and everything below it."""
    env = dict(os.environ, EXECPOOL_BENCH_TREE=os.path.join(tree, "execpool"),
               PYTHONPATH=os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])))
    before = children_cpu()
    with C.subreaper():
        done = subprocess.run([sys.executable, "-c", CHILD, str(count), kind], cwd=tree, env=env,
                              capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} sessions from {tree} exited {done.returncode}: {done.stderr[-2000:]}")
    return children_cpu() - before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; figures are medians (default 5)")
    parser.add_argument("--sessions", type=int, default=100, help="starts measured per run (default 100)")
    parser.add_argument("--baseline", metavar="REPO", default=None,
                        help="also measure the default session of another checkout (e.g. a git worktree of an "
                             "earlier commit), as the kind 'baseline'")
    args = C.parse_args(parser, argv, smoke={"rounds": 1, "sessions": 2})
    if args.rounds < 1 or args.sessions < 1:
        parser.error("--rounds and --sessions must be at least 1")
    kinds = {"ipython": (C.REPO, "ipython"), "plain": (C.REPO, "plain")}
    if args.baseline:
        kinds["baseline"] = (os.path.abspath(args.baseline), "default")
    load = C.load()
    per_start: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(args.rounds):
        for kind, (tree, mode) in kinds.items():
            alone = run_child(tree, 1, mode)
            many = run_child(tree, args.sessions + 1, mode)
            per_start[kind].append((many - alone) / args.sessions)
    medians = {kind: C.median(values) for kind, values in per_start.items()}
    rows = [[kind, C.ms(medians[kind]), C.ms(min(values)), C.ms(max(values)),
             C.ms(medians[kind] - medians["baseline"]) if "baseline" in medians else ""]
            for kind, values in per_start.items()]
    C.print_table(f"CPU per session start, ms, all processes ({args.rounds} rounds of {args.sessions} starts; load "
                  f"{load[0]:.1f} before, {C.load()[0]:.1f} after)",
                  ["kind", "median", "lowest", "highest", "against baseline"], rows)
    targets = {}
    if "baseline" in medians:
        targets["ipython start <= baseline's"] = C.target(C.ms(medians["ipython"]), C.ms(medians["baseline"]), "<=",
                                                          "ms")
        C.print_targets(targets)
    C.emit_json({"benchmark": "session_start", "rounds": args.rounds, "sessions": args.sessions, "targets": targets,
                 "baseline": args.baseline, "cpu_ms_per_start": {kind: C.ms(value) for kind, value in medians.items()},
                 "cpu_ms_per_start_rounds": {kind: [C.ms(v) for v in values] for kind, values in per_start.items()},
                 "load_before": load, "load_after": C.load(), "machine": C.machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
