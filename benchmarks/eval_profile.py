"""Where one ``execpool eval`` sample's time goes: each step of its way
measured on its own, one job at a time, on one pool (strict sandbox, the
judge preloaded, as ``execpool eval`` builds it).

Run from the repository root::

    python benchmarks/eval_profile.py            # or: python -m benchmarks.eval_profile
    python benchmarks/eval_profile.py --iters 20

Steps, each a median over ``--iters`` jobs (latency, caller to caller):

* ``warm pass, no sandbox``: a warm Python job that does nothing -- the
  pool's dispatch, a spare taking the job, the result path;
* ``warm pass, sandboxed``: the same in the strict sandbox (the view, the
  space, Landlock and seccomp entered);
* ``cold pass, sandboxed``: an interpreter started for the job;
* ``judge, 1 sample``: a HumanEval canonical solution through the judge,
  alone in its job (the judge's fork of its sample, the sample's start,
  the test, the verdict line);
* ``judge, N samples``: the same sample N times in one job (a batch),
  per sample;

and, inside the judge (its own ``cost`` of the sample, from the verdict
line): the sample's judge and process from its spec to its verdict, and
the test itself; and the command's writing of records (``ResultsFile``,
with its syncs), per record.

The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _common as C
from execpool import ExecPool, PythonJob
from execpool.cli.results_file import ResultsFile, encoded
from execpool.eval import EvalOptions, load_problems
from execpool.eval.harness import JUDGE_MODULE, JudgeTask, _verdict_line, judge_job


def _spec(problem, nonce: str) -> dict:
    return {"kind": "function", "setup": problem.prompt, "test": problem.test, "entry_point": problem.entry_point,
            "nonce": nonce, "all": False, "program": problem.prompt + CANONICAL, "timeout": 3.0}


CANONICAL = "    return a + b\n"
ADD = {"task_id": "add", "entry_point": "add", "prompt": "def add(a, b):\n    \"\"\"a + b\"\"\"\n",
       "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"}


def _latency(pool: ExecPool, job, iters: int) -> tuple[float, list]:
    times, results = [], []
    for _ in range(iters):
        started = time.perf_counter()
        results.append(pool.run(job))
        times.append(time.perf_counter() - started)
    return C.median(times), results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=40, help="jobs per step (default 40)")
    parser.add_argument("--batch", type=int, default=8, help="samples in the batched step (default 8)")
    args = C.parse_args(parser, argv, smoke={"iters": 3, "batch": 2})
    problem = load_problems([ADD])["add"]
    figures: dict[str, float] = {}
    inside: dict[str, list[float]] = {"judge_s": [], "test_s": [], "judge_cpu_s": []}
    with ExecPool(workers=1, sandbox="strict", preload=(JUDGE_MODULE,)) as pool:
        pool.run(PythonJob("pass", warm=True, timeout=30))  # the template ready
        figures["warm_pass_bare"], _ = _latency(pool, PythonJob("pass", warm=True, timeout=30, sandbox=False),
                                                args.iters)
        figures["warm_pass"], passes = _latency(pool, PythonJob("pass", warm=True, timeout=30), args.iters)
        figures["warm_pass_cpu"] = C.median([r.cpu_s or 0.0 for r in passes])
        figures["cold_pass"], _ = _latency(pool, PythonJob("pass", warm=False, timeout=30), args.iters)
        for size, name in ((1, "judge_1"), (args.batch, "judge_batch")):
            times, cpu = [], []
            for _ in range(args.iters):
                tasks = [JudgeTask(_spec(problem, os.urandom(16).hex())) for _ in range(size)]
                started = time.perf_counter()
                result = pool.run(judge_job(tasks, EvalOptions()))
                times.append((time.perf_counter() - started) / size)
                cpu.append((result.cpu_s or 0.0) / size)
                for task in tasks:
                    said = _verdict_line(result.output, task.spec["nonce"])
                    if said is None or said["tests"][0]["verdict"] != "Accepted":
                        raise RuntimeError(f"the judge did not accept the canonical sample: {result.output[-500:]}")
                    if size == 1:
                        inside["judge_s"].append(said["cost"]["time_s"])
                        inside["judge_cpu_s"].append(said["cost"]["cpu_s"])
                        inside["test_s"].append(said["tests"][0]["time_s"])
            figures[name] = C.median(times)
            figures[name + "_cpu"] = C.median(cpu)
    for key, values in inside.items():
        figures[key] = C.median(values)
    tmp = tempfile.mkdtemp(prefix="execpool-eval-profile-")
    try:
        record = encoded({"task_id": "HumanEval/0", "completion": CANONICAL, "line": 1, "passed": True,
                          "verdict": "Accepted", "tests": [{"verdict": "Accepted", "time_s": 0.001}]})
        out = ResultsFile(os.path.join(tmp, "out.jsonl"), fsync=True, what="execpool eval")
        out.prepare()
        started = time.perf_counter()
        for _ in range(1000):
            out.write(record)
        out.close()
        figures["record_write"] = (time.perf_counter() - started) / 1000
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [
        ["pool dispatch, spare, result path (warm pass, no sandbox)", C.ms(figures["warm_pass_bare"])],
        ["+ sandbox entry (warm pass, sandboxed)", C.ms(figures["warm_pass"] - figures["warm_pass_bare"])],
        ["interpreter start (cold pass - warm pass, sandboxed)", C.ms(figures["cold_pass"] - figures["warm_pass"])],
        ["warm pass, sandboxed: the job's CPU", C.ms(figures["warm_pass_cpu"])],
        ["judge, 1 sample a job: whole job", C.ms(figures["judge_1"])],
        ["  the job's CPU", C.ms(figures["judge_1_cpu"])],
        ["  of which the sample's judge and process, spec to verdict", C.ms(figures["judge_s"])],
        ["  of which the test itself", C.ms(figures["test_s"])],
        ["  the sample's judge and process: CPU", C.ms(figures["judge_cpu_s"])],
        [f"judge, {args.batch} samples a job: per sample", C.ms(figures["judge_batch"])],
        ["  the job's CPU, per sample", C.ms(figures["judge_batch_cpu"])],
        ["the command's record write (ResultsFile, synced), per record", C.ms(figures["record_write"])],
    ]
    C.print_table(f"One sample's way, milliseconds, CPU as the worker measured the job's processes (median of {args.iters} jobs, one at a time; load "
                  f"{C.load()[0]:.1f})", ["step", "ms"], rows)
    C.emit_json({"benchmark": "eval_profile", "iters": args.iters, "batch": args.batch, "load": C.load(),
                 "ms": {key: C.ms(value) for key, value in figures.items()},
                 "batch_vs_single": round(figures["judge_batch"] / figures["judge_1"], 3),
                 "batch_vs_single_cpu": round(figures["judge_batch_cpu"] / figures["judge_1_cpu"], 3)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
