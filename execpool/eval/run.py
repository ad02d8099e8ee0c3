"""``evaluate``: samples and problems in, one record per sample and a
summary with pass@k out -- the library function behind ``execpool eval``
and ``/v1/eval``.

Runs in the caller's process, on the thread that iterates it: like
``run_tagged`` (execpool/pool/mapping.py) it owns no thread and no process.
Each sample is judged by a generator (execpool/eval/harness.py) that
yields the jobs it needs, or a ``JudgeTask`` that is batched with other
samples' into one job; their futures, from the pool's public ``submit``
(an ExecPool's, a RayPool's, a service's), tag themselves onto one queue
when done, and so does each verdict line a batch prints live (which
frees that sample's seat). About ``max_in_flight`` jobs' worth of samples
are judged at once. Samples are
read from their iterable only when there is room. Stopping early (close(),
an exception, Ctrl-C) cancels every job still running.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
from concurrent import futures
from typing import Any, Callable, Dict, Generator, Hashable, Iterable, List, Mapping, Optional, Sequence, Tuple, TypeVar

from ..pool.future import JobOutput
from ..shared.jobs import Job
from ..shared.result import Result, Status
from .harness import JUDGE_MARKER, EvalOptions, JudgeTask, Judging, judge, judge_job
from .passk import DEFAULT_KS, overall, per_problem, reported_ks
from .problems import Problem, Sample, parse_sample, problem_of
from .verdicts import Verdict

Tag = TypeVar("Tag", bound=Hashable)
#: ``submit(job)``, and ``submit(job, on_event=...)`` where it is live.
Submit = Callable[..., "futures.Future[Result]"]

#: How long a stopped evaluation waits for its cancelled jobs to end.
CANCEL_WAIT_S = 1.0


@dataclasses.dataclass
class _Judged:
    tag: Any
    sample: Sample
    steps: Judging
    results: List[Optional[Result]] = dataclasses.field(default_factory=list)
    left: int = 0


@dataclasses.dataclass
class _Running:
    """A job in flight: whose results it carries (sample key, index in
    that sample's list) and the seats it holds -- a judging job one per
    sample whose verdict line has not come yet, any other job a batch's
    worth."""

    waiting: List[Tuple[int, int]]
    seats: int


class _Lines:
    """Counts the judge's verdict lines in a job's live output, so that a
    batch's seat is free once its sample is judged, not when the slowest
    sample of the batch is (the Result still carries every line)."""

    def __init__(self, done: "queue.SimpleQueue", ident: int) -> None:
        self.done = done
        self.ident = ident
        self.tail = ""

    def __call__(self, event: Any) -> None:
        if not isinstance(event, JobOutput):
            return
        text = self.tail + event.text
        count = text.count(JUDGE_MARKER)
        self.tail = text[-(len(JUDGE_MARKER) - 1):]
        if count:
            self.done.put((_SEEN, self.ident, count))


_SEEN, _ENDED = 0, 1


def judge_samples(submit: Submit, samples: Iterable[Tuple[Tag, Sample]], problems: Mapping[str, Problem],
                  options: EvalOptions = EvalOptions(), max_in_flight: int = 8, live: bool = True
                  ) -> Generator[Tuple[Tag, Dict[str, Any]], None, None]:
    """Yield ``(tag, verdict part of the record)`` for each ``(tag,
    sample)`` as its judging ends. ProblemsError for a sample whose
    problem is not in ``problems``. About ``max_in_flight`` jobs' worth
    of samples are judged at once: function- and assert-style samples
    ``options.batch`` to a job (a batch starts when it is full and a seat
    is free, so up to a batch's worth over), the rest a job each. ``live``: ``submit``
    takes ``on_event`` (an ExecPool's, a RayPool's), so a batch's seats
    are freed sample by sample."""
    if max_in_flight < 1:
        raise ValueError(f"max_in_flight must be at least 1, not {max_in_flight}")
    done: "queue.SimpleQueue[Tuple[int, int, Any]]" = queue.SimpleQueue()
    judging: Dict[int, _Judged] = {}
    running: Dict[int, _Running] = {}
    futures_of: Dict[int, futures.Future] = {}
    pending: List[Tuple[int, int, JudgeTask]] = []
    capacity = max_in_flight * options.batch
    items = iter(samples)
    exhausted = False
    counter = 0
    idents = 0
    # Seats held by running jobs. A batch starts once it is full (or the
    # samples ran out) and a seat is free: at most a batch's worth over.
    busy = 0

    def launch(job: Job, waiting: List[Tuple[int, int]], seats: int, judging_job: bool) -> None:
        nonlocal idents
        idents += 1
        future = submit(job, on_event=_Lines(done, idents)) if live and judging_job else submit(job)
        running[idents] = _Running(waiting, seats)
        futures_of[idents] = future
        future.add_done_callback(functools.partial(_tag, done, idents))

    def flush() -> None:
        nonlocal busy
        if pending:
            launch(judge_job([task for _, _, task in pending], options), [(key, index) for key, index, _ in pending],
                   len(pending), True)
            busy += len(pending)
            pending.clear()

    def start(key: int, jobs: List[Any]) -> None:
        nonlocal busy
        state = judging[key]
        state.results, state.left = [None] * len(jobs), len(jobs)
        for index, job in enumerate(jobs):
            if isinstance(job, JudgeTask) and not job.alone and options.batch > 1:
                pending.append((key, index, job))
                if len(pending) >= options.batch:
                    flush()
            elif isinstance(job, JudgeTask):
                launch(judge_job([job], options), [(key, index)], options.batch, True)
                busy += options.batch
            else:
                launch(job, [(key, index)], options.batch, False)
                busy += options.batch

    def advance(key: int, results: Optional[List[Result]]) -> Optional[Dict[str, Any]]:
        """The next jobs of a sample started, or its record when it is judged."""
        state = judging[key]
        try:
            jobs = next(state.steps) if results is None else state.steps.send(results)
        except StopIteration as stop:
            del judging[key]
            return stop.value
        start(key, jobs)
        return None

    try:
        while True:
            while not exhausted and busy < capacity:
                try:
                    tag, sample = next(items)
                except StopIteration:
                    exhausted = True
                    break
                problem = problem_of(problems, sample, f"sample {tag}")
                counter += 1
                judging[counter] = _Judged(tag, sample, judge(sample, problem, options))
                record = advance(counter, None)
                if record is not None:
                    yield tag, record
            if exhausted or busy == 0:
                flush()  # no sample will join it, or no seat will free for one: it goes as it is
            if not judging:
                return
            kind, ident, value = done.get()
            job = running.get(ident)
            if job is None:
                continue
            if kind == _SEEN:
                freed = min(value, job.seats - 1)  # the last seat goes with the job
                job.seats -= freed
                busy -= freed
                continue
            del running[ident], futures_of[ident]
            busy -= job.seats
            result = _result_of(value)
            for key, index in job.waiting:
                state = judging[key]
                state.results[index] = result
                state.left -= 1
                if state.left == 0:
                    tag = state.tag
                    record = advance(key, state.results)  # type: ignore[arg-type]
                    if record is not None:
                        yield tag, record
    finally:
        for future in futures_of.values():
            future.cancel()
        futures.wait(list(futures_of.values()), CANCEL_WAIT_S)


def _tag(done: "queue.SimpleQueue[Tuple[int, int, Any]]", ident: int, future: "futures.Future[Result]") -> None:
    done.put((_ENDED, ident, future))


def _result_of(future: "futures.Future[Result]") -> Result:
    try:
        return future.result()
    except Exception as exc:  # noqa: BLE001 - a future that failed is execpool's failure, never the sample's
        return Result(status=Status.INFRA, error=f"{type(exc).__name__}: {exc}")


def sample_record(sample: Sample, line: int, verdict: Mapping[str, Any]) -> Dict[str, Any]:
    """A sample's record: its own fields, its line, then the verdict part."""
    return {**sample.fields, "line": line, **verdict}


def summarize(records: Iterable[Mapping[str, Any]], ks: Sequence[int] = DEFAULT_KS) -> Dict[str, Any]:
    """pass@k (overall and per problem, for the k every problem has enough
    scored samples for) and the counts, from records. A sample whose
    verdict is Internal Error is counted apart and not scored."""
    counts: Dict[str, List[int]] = {}
    verdicts: Dict[str, int] = {}
    samples = 0
    for record in records:
        samples += 1
        verdicts[record["verdict"]] = verdicts.get(record["verdict"], 0) + 1
        task = record.get("task_id", record.get("id"))
        n_c = counts.setdefault(task if isinstance(task, str) else str(task), [0, 0])
        if Verdict(record["verdict"]).scored:
            n_c[0] += 1
            n_c[1] += bool(record["passed"])
    scored = {task: (n, c) for task, (n, c) in counts.items() if n}
    shown = reported_ks(scored, ks)
    return {**overall(scored, shown), "samples": samples, "problems": len(counts),
            "passed": sum(c for _, c in scored.values()),
            "internal_errors": verdicts.get(Verdict.INTERNAL_ERROR.value, 0),
            "verdicts": dict(sorted(verdicts.items())), "k": list(shown),
            "per_problem": {task: {"n": scored[task][0], "c": scored[task][1], **figures}
                            for task, figures in per_problem(scored, shown).items()}}


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """What :func:`evaluate` returns: one record per sample, in the
    samples' order, and the summary."""

    records: List[Dict[str, Any]]
    summary: Dict[str, Any]


def evaluate(pool: Any, samples: Iterable[Mapping[str, Any] | Sample], problems: Mapping[str, Problem], *,
             ks: Sequence[int] = DEFAULT_KS, options: EvalOptions = EvalOptions(),
             max_in_flight: Optional[int] = None) -> Evaluation:
    """Judge ``samples`` (dicts ``{task_id|id, completion|code, language?}``
    or Samples) against ``problems`` (``load_problems``) on ``pool`` (an
    ExecPool or a RayPool), at most ``max_in_flight`` jobs at once (default:
    the pool's ``default_max_in_flight``), retrying what execpool failed;
    the records and the summary with pass@k. A pool that preloads
    ``JUDGE_MODULE`` judges function-style samples about twice as fast."""
    parsed = [(n, s if isinstance(s, Sample) else parse_sample(s, f"samples[{n - 1}]"))
              for n, s in enumerate(samples, 1)]
    for n, sample in parsed:
        problem_of(problems, sample, f"samples[{n - 1}]")
    in_flight = max_in_flight or pool.default_max_in_flight
    by_line: Dict[int, Dict[str, Any]] = {}
    given = dict(parsed)
    for line, verdict in judge_samples(pool.submit, parsed, problems, options, in_flight):
        by_line[line] = sample_record(given[line], line, verdict)
    records = [by_line[n] for n, _ in parsed]
    return Evaluation(records, summarize(records, ks))
