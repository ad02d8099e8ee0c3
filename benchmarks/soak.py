"""Soak: many mixed jobs through one pool, then look for anything left behind.

Run from the repository root::

    python benchmarks/soak.py                       # or: python -m benchmarks.soak
    python benchmarks/soak.py --jobs 2000 --concurrency 16 --max-jobs-per-worker 200
    python benchmarks/soak.py --long        # 10 000 jobs at concurrency 32 (~1.5 min here)

The default is 2000 jobs at concurrency 16 on 2 workers recycled every 200
jobs (15-25 s on a 2-core machine; 6000 jobs took 45 s); ``--jobs`` scales it,
``--long`` is 10 000 jobs at concurrency 32.

Every job's Result is checked against what that kind of job must give:

====================  ==========================================================
shell_output          exact output, exit 0
python_output         exact output, exit 0
warm_python           the same through PythonJob(warm=True)
stream_output         pool.stream: the events concatenate to the exact output
fail                  exit_code 3, text "Exit code 3:\\n..."
timeout               ``sleep`` past a 0.2 s timeout: timed_out, output kept
                      (a prefix of it when the loaded machine had not let
                      the tool print by the deadline; counted and reported)
cancel                cancel_event set by a timer after 0.1 s: cancelled
stream_close          pool.stream closed after its first event (a client
                      disconnect): the first event, close() returns promptly
cancel_chatty         a job printing as fast as it can, cancelled after 0.1 s:
                      cancelled, and its output only whole "tick" lines (the
                      last one may be cut by the kill)
stream_close_chatty   the same job's stream closed after its first event
flood_shell/python    5 MB through pool.stream: the live events stop at the cap
                      with the notice, output_chars == 5,000,000, the kept head
                      is exact
daemon_shell          ``( setsid sleep 1000 >/dev/null 2>&1 & )``: a double-fork
                      daemon that left the group; "ok", exit 0
daemon_python         the same with os.fork + os.setsid + os.fork
warm_daemon           the same as a warm job (a fork of a fork of the worker)
daemon_holds_pipe     the daemon keeps stdout open, so no EOF: must time out
                      (0.3 s) with the output kept
background            background grandchildren (one in the group, one in a
                      subshell); "bg", exit 0
zombie_leader,        the red team's jobs (benchmarks/_common.py HOSTILE): a
dir_flood,            daemon that ended its first thread, 5 000 directories,
symlink_racer,        a daemon swapping a directory and a symlink under the
marker_forger         removal, sleepers marked as another job's; "ok", and
                      every other job's Result stays right
====================  ==========================================================

Before the run (after a warm-up of ~50 jobs) and after it (after
``gc.collect()`` and a settle of up to ``--settle`` seconds, polling until the
counts stabilise) it records this process's thread count, open fds, RSS, the
pool's worker count, and its descendants other than the workers, sorted into
tool processes (carrying a job's ``EXECPOOL_JOB``), the pool's own helpers
(the workers' warm templates and parked spares), other processes, and
zombies; and every live process on the system carrying ``EXECPOOL_JOB``
(those of this run are told apart by an extra variable every job of this run
gets; others, e.g. a concurrent test run, are reported but not blamed on this
run). Every process below this one just before ``pool.close()`` must be dead
(or a zombie) within ``--settle`` seconds after it. (The counting, and the
memory checkpoints below, are in benchmarks/_leftovers.py.)

What each job cost, as its worker measured it (CPU time, largest resident
set, processes: ``Result.cpu_user_s`` and the rest), is kept for every job of
the measured run and reported per kind -- the medians, and how they moved
from the kind's first fifth of jobs to its last (a growth there means
something grows under the jobs: a worker, a template) -- along with the
jobs that grew most over their kind's median (benchmarks/_jobcost.py). A
Result without these figures is a wrong result.

A job that fails because the worker under it crashed is counted as wrong
(its Result has ``error``); the table says how many such errors there were,
and the worker's traceback is on stderr. ``--skip KIND,...`` leaves kinds out.

Memory: the measured run is cut into ``--checkpoints`` equal segments
(default 10); after each, with ``gc.collect()`` and ``malloc_trim(0)`` (which
hands the allocator's free pages back), this process's RSS and its Python
heap (``tracemalloc``, which traces every Python allocation exactly, one
frame deep) are recorded. The first ``--rss-warmup`` of the run (default
half) is the warm-up: caches fill and the allocator's arenas reach the
high-water mark of the jobs' peak overlap there (a few floods at once hold
several MB each). Over the second half the verdict fits a least-squares
slope to each:

* the Python heap, in bytes per job: a leak of Python objects, however
  small, grows it steadily, while the allocator's noise does not touch it.
  Over ``--heap-slope-max`` (default 256 bytes a job; the soak's own
  bookkeeping is 36) is a leak.
* the RSS, in KiB per 1000 jobs: what the heap cannot see (native memory).
  RSS moves by a few MiB with the allocator's moods, so it is a leak only
  when both the slope is over ``--rss-slope-max`` (default 4096 KiB per
  1000 jobs, i.e. 4 KiB a job) and the drift -- the last checkpoints'
  median minus the first ones' -- is over 2 MiB.

``--leak-per-job BYTES`` is the negative control: each job then keeps that
many bytes in this process for good, and the verdict must say FAIL (1024
bytes a job is caught by the heap slope at the default sizes).

Exits 1 on any wrong Result or any leak: threads, fds, tool or other
processes, zombies, workers, a surviving process of this run, a process
still running after ``pool.close()``, or memory growing as above.
``--smoke`` runs one block of the schedule (every kind at least once) and
reports the memory slopes without judging them: a hundred jobs are too
few for a slope.
The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import array
import os
import random
import sys
import threading
import time
import tracemalloc
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _common as C
from benchmarks import _plot as P
from benchmarks import _jobcost
from benchmarks._leftovers import (KIND_VAR, RUN_VAR, checkpoints_at, kill_leftovers, marked_processes,
                                   rss_baseline, rss_checkpoint, settle, slope, traced_growth, window_drift)
from execpool import TOOL_OUTPUT_STREAM_MAX_CHARS, ExecPool, PythonJob, Result, ShellJob
from execpool.shared.output import STREAM_CAP_NOTICE

FLOOD_CHARS = 5_000_000
DEFAULT_MAX_OUTPUT_CHARS = 1_000_000  # the pool's default Result head
JOB_TIMEOUT_S = 30  # bounds every job that is not meant to time out
TIMEOUT_S = 0.2
HOLDS_PIPE_TIMEOUT_S = 0.3
CANCEL_AFTER_S = 0.1
#: A job that ends by timeout/cancel/close must not take longer than this.
END_SLACK_S = 5.0
#: In Result.error when the worker under a job died.
WORKER_DIED = "died unexpectedly"
#: A whole job of any kind; past it the soak reports a hang.
HANG_S = 60.0
#: Growth over the second half above which the soak calls it a leak: the
#: Python heap's slope, and the RSS slope when the RSS drift is also over
#: its noise (see the module docstring).
HEAP_SLOPE_MAX_BYTES_PER_JOB = 256.0
RSS_SLOPE_MAX_KIB_PER_1000 = 4096.0
RSS_NOISE_MIB = 2.0
LONG_JOBS, LONG_CONCURRENCY = 10_000, 32

@dataclass
class Outcome:
    index: int
    kind: str
    wall_s: float
    problem: Optional[str] = None
    cost: Optional[tuple[float, int, int]] = None  # CPU s, max RSS bytes, processes


@dataclass
class Soak:
    pool: _jobcost.RecordingPool  # the ExecPool, keeping each thread's last Result
    run_id: str

    def env(self, kind: str) -> dict:
        return {RUN_VAR: self.run_id, KIND_VAR: kind}


# --- the job kinds ------------------------------------------------------------------
# Each returns None when the job did what it must, else a description.

def _expect(result: Result, *, output: Optional[str] = None, exit_code: Optional[int] = 0,
            timed_out: bool = False, cancelled: bool = False) -> Optional[str]:
    problems = []
    if result.error is not None:
        problems.append(f"error={result.error!r}")
    if result.exit_code != exit_code:
        problems.append(f"exit_code={result.exit_code!r} (want {exit_code!r})")
    if result.timed_out != timed_out:
        problems.append(f"timed_out={result.timed_out} (want {timed_out})")
    if result.cancelled != cancelled:
        problems.append(f"cancelled={result.cancelled} (want {cancelled})")
    if output is not None and result.output != output:
        problems.append(f"output={result.output[:60]!r} (want {output[:60]!r})")
    return "; ".join(problems) or None


def _text(events: list[dict]) -> str:
    return "".join(e["text"] for e in events if e.get("type") == "tool_output")


def shell_output(s: Soak, i: int) -> Optional[str]:
    r = s.pool.run(ShellJob(f"echo out-{i}; printf 'line 2\\n' >&2", timeout=JOB_TIMEOUT_S, env=s.env("shell_output")))
    return _expect(r, output=f"out-{i}\nline 2\n")


def python_output(s: Soak, i: int) -> Optional[str]:
    code = f"import sys\nprint('py-{i}')\nprint('err', file=sys.stderr)\n"
    r = s.pool.run(PythonJob(code, timeout=JOB_TIMEOUT_S, env=s.env("python_output")))
    return _expect(r, output=f"py-{i}\nerr\n")


def warm_python(s: Soak, i: int) -> Optional[str]:
    code = f"import sys\nprint('warm-{i}')\nprint('err', file=sys.stderr)\n"
    r = s.pool.run(PythonJob(code, timeout=JOB_TIMEOUT_S, env=s.env("warm_python"), warm=True))
    return _expect(r, output=f"warm-{i}\nerr\n")


def stream_output(s: Soak, i: int) -> Optional[str]:
    job = ShellJob(f"for n in 1 2 3; do echo s{i}-$n; done", timeout=JOB_TIMEOUT_S, env=s.env("stream_output"))
    events, r = C.drain(s.pool.stream(job, tool_name="soak"))
    want = "".join(f"s{i}-{n}\n" for n in (1, 2, 3))
    problem = _expect(r, output=want)
    if problem is None and _text(events) != want:
        problem = f"streamed {_text(events)!r} (want {want!r})"
    return problem


def fail(s: Soak, i: int) -> Optional[str]:
    r = s.pool.run(ShellJob("echo failing >&2; exit 3", timeout=JOB_TIMEOUT_S, env=s.env("fail")))
    problem = _expect(r, output="failing\n", exit_code=3)
    if problem is None and r.text != "Exit code 3:\nfailing\n":
        problem = f"text={r.text!r}"
    return problem


def timeout(s: Soak, i: int) -> Optional[str]:
    t0 = time.monotonic()
    r = s.pool.run(ShellJob("echo start; sleep 5; echo late", timeout=TIMEOUT_S, env=s.env("timeout")))
    wall = time.monotonic() - t0
    problem = _expect(r, output=C.CUT_SHORT.expected(r, "start\n"), exit_code=None, timed_out=True)
    if problem is None and not (TIMEOUT_S <= wall < TIMEOUT_S + END_SLACK_S):
        problem = f"took {wall:.3f} s for a {TIMEOUT_S} s timeout"
    if problem is None and r.text != f"Execution timed out after {TIMEOUT_S} seconds.":
        problem = f"text={r.text!r}"
    return problem


def _run_cancelled(s: Soak, cmd: str, kind: str) -> tuple[Result, float]:
    """Run ``cmd`` with its cancel_event set by a timer after CANCEL_AFTER_S:
    (its Result, the wall time of pool.run)."""
    event = threading.Event()
    timer = threading.Timer(CANCEL_AFTER_S, event.set)
    timer.daemon = True
    timer.start()
    t0 = time.monotonic()
    r = s.pool.run(ShellJob(cmd, timeout=JOB_TIMEOUT_S, env=s.env(kind)), cancel_event=event)
    wall = time.monotonic() - t0
    timer.join()
    return r, wall


def cancel(s: Soak, i: int) -> Optional[str]:
    r, wall = _run_cancelled(s, "echo start; sleep 5; echo late", "cancel")
    problem = _expect(r, exit_code=None, cancelled=True)
    if problem is None and wall > CANCEL_AFTER_S + END_SLACK_S:
        problem = f"took {wall:.3f} s to cancel"
    if problem is None and r.text != "Execution cancelled.":
        problem = f"text={r.text!r}"
    return problem


def stream_close(s: Soak, i: int) -> Optional[str]:
    gen = s.pool.stream(ShellJob(f"echo first-{i}; sleep 5; echo late", timeout=JOB_TIMEOUT_S,
                                 env=s.env("stream_close")), tool_name="soak")
    first = next(gen)
    t0 = time.monotonic()
    gen.close()
    took = time.monotonic() - t0
    if first.get("type") != "tool_output" or first.get("text") != f"first-{i}\n":
        return f"first event {first!r}"
    if took > END_SLACK_S:
        return f"close() took {took:.3f} s"
    return None


CHATTY = "while :; do echo tick; done"


def _only_ticks(output: str) -> bool:
    """Whole "tick\\n" lines, the last possibly cut by the kill."""
    whole = len(output) // 5
    return output[: whole * 5] == "tick\n" * whole and "tick\n".startswith(output[whole * 5 :])


def cancel_chatty(s: Soak, i: int) -> Optional[str]:
    r, wall = _run_cancelled(s, CHATTY, "cancel_chatty")
    problem = _expect(r, exit_code=None, cancelled=True)
    if problem is None and not _only_ticks(r.output):
        problem = f"output {r.output[:40]!r}...{r.output[-40:]!r} is not ticks"
    if problem is None and wall > CANCEL_AFTER_S + END_SLACK_S:
        problem = f"took {wall:.3f} s to cancel"
    return problem


def stream_close_chatty(s: Soak, i: int) -> Optional[str]:
    gen = s.pool.stream(ShellJob(CHATTY, timeout=JOB_TIMEOUT_S, env=s.env("stream_close_chatty")),
                        tool_name="soak")
    first = next(gen)
    t0 = time.monotonic()
    gen.close()
    took = time.monotonic() - t0
    if first.get("type") != "tool_output" or not first.get("text") or not _only_ticks(first["text"]):
        return f"first event {str(first)[:200]}"
    if took > END_SLACK_S:
        return f"close() took {took:.3f} s"
    return None


def _flood(s: Soak, job) -> Optional[str]:
    events, r = C.drain(s.pool.stream(job, tool_name="soak", heartbeat_interval_s=30.0))
    problem = _expect(r, output="x" * DEFAULT_MAX_OUTPUT_CHARS)
    if problem is None and r.output_chars != FLOOD_CHARS:
        problem = f"output_chars={r.output_chars} (want {FLOOD_CHARS})"
    streamed = _text(events)
    if problem is None and streamed != "x" * TOOL_OUTPUT_STREAM_MAX_CHARS + STREAM_CAP_NOTICE:
        problem = f"streamed {len(streamed)} chars ending {streamed[-60:]!r}"
    return problem


def flood_shell(s: Soak, i: int) -> Optional[str]:
    cmd = f"head -c {FLOOD_CHARS} /dev/zero | tr '\\0' x"
    return _flood(s, ShellJob(cmd, timeout=JOB_TIMEOUT_S, env=s.env("flood_shell")))


def flood_python(s: Soak, i: int) -> Optional[str]:
    code = f"import sys\nfor _ in range({FLOOD_CHARS // 100_000}):\n    sys.stdout.write('x' * 100_000)\n"
    return _flood(s, PythonJob(code, timeout=JOB_TIMEOUT_S, env=s.env("flood_python")))


def daemon_shell(s: Soak, i: int) -> Optional[str]:
    cmd = "( setsid sleep 1000 >/dev/null 2>&1 & ) ; echo ok"
    return _expect(s.pool.run(ShellJob(cmd, timeout=JOB_TIMEOUT_S, env=s.env("daemon_shell"))), output="ok\n")


def daemon_python(s: Soak, i: int) -> Optional[str]:
    return _expect(s.pool.run(PythonJob(C.DAEMON_PYTHON, timeout=JOB_TIMEOUT_S, env=s.env("daemon_python"))),
                   output="ok\n")


def warm_daemon(s: Soak, i: int) -> Optional[str]:
    return _expect(s.pool.run(PythonJob(C.DAEMON_PYTHON, timeout=JOB_TIMEOUT_S, env=s.env("warm_daemon"), warm=True)),
                   output="ok\n")


def daemon_holds_pipe(s: Soak, i: int) -> Optional[str]:
    # The daemon inherits stdout, so the output never ends: like communicate(),
    # the job runs to its timeout, and then the escaped daemon must die too.
    r = s.pool.run(ShellJob("( setsid sleep 1000 & ) ; echo ok", timeout=HOLDS_PIPE_TIMEOUT_S,
                            env=s.env("daemon_holds_pipe")))
    return _expect(r, output=C.CUT_SHORT.expected(r, "ok\n"), exit_code=None, timed_out=True)


def background(s: Soak, i: int) -> Optional[str]:
    cmd = "sleep 1000 >/dev/null 2>&1 & (sleep 1000 >/dev/null 2>&1 &) ; echo bg"
    return _expect(s.pool.run(ShellJob(cmd, timeout=JOB_TIMEOUT_S, env=s.env("background"))), output="bg\n")


def _hostile(kind: str) -> Callable[[Soak, int], Optional[str]]:
    """A red team's job (benchmarks/_common.py): its own Result is "ok"; what
    it does to its neighbours shows in theirs and in what is left."""
    def run(s: Soak, i: int) -> Optional[str]:
        return _expect(s.pool.run(PythonJob(C.HOSTILE[kind], timeout=JOB_TIMEOUT_S, env=s.env(kind))), output="ok\n")
    return run


def _filler(kind: str) -> Callable[[Soak, int], Optional[str]]:
    """A sandboxed job that fills its space to the bound (benchmarks/_common.py)."""
    def run(s: Soak, i: int) -> Optional[str]:
        return _expect(s.pool.run(PythonJob(C.FILLERS[kind], timeout=JOB_TIMEOUT_S, env=s.env(kind), sandbox="strict",
                                            limits=C.FILLER_LIMITS)), output="ok\n")
    return run


#: kind -> (function, weight per 100 jobs)
KINDS: dict[str, tuple[Callable[[Soak, int], Optional[str]], int]] = {
    "shell_output": (shell_output, 10),
    "python_output": (python_output, 8),
    "warm_python": (warm_python, 4),
    "stream_output": (stream_output, 6),
    "fail": (fail, 10),
    "timeout": (timeout, 8),
    "cancel": (cancel, 8),
    "stream_close": (stream_close, 8),
    "cancel_chatty": (cancel_chatty, 3),
    "stream_close_chatty": (stream_close_chatty, 3),
    "flood_shell": (flood_shell, 3),
    "flood_python": (flood_python, 2),
    "daemon_shell": (daemon_shell, 8),
    "daemon_python": (daemon_python, 5),
    "warm_daemon": (warm_daemon, 3),
    "daemon_holds_pipe": (daemon_holds_pipe, 4),
    "background": (background, 7),
    **{kind: (_hostile(kind), 1) for kind in C.HOSTILE},
    **{kind: (_filler(kind), 1) for kind in C.FILLERS},
}


def schedule(n: int, seed: int, skip: frozenset = frozenset()) -> list[str]:
    """n kinds in the KINDS proportions, each block of 100 shuffled."""
    block = [kind for kind, (_, weight) in KINDS.items() if kind not in skip for _ in range(weight)]
    rng = random.Random(seed)
    kinds: list[str] = []
    while len(kinds) < n:
        rng.shuffle(block)
        kinds.extend(block)
    return kinds[:n]


#: The negative control (--leak-per-job): bytes each job keeps, and where.
_leak = {"bytes": 0}
_leaked: list[bytes] = []


def run_one(s: Soak, i: int, kind: str) -> Outcome:
    t0 = time.monotonic()
    s.pool.take()
    try:
        problem = KINDS[kind][0](s, i)
    except Exception as exc:  # noqa: BLE001 - a raised exception is a wrong result
        problem = f"raised {type(exc).__name__}: {exc}"
    result = s.pool.take()  # None for the kinds that close their stream before it ends
    cost = None if result is None else _jobcost.job_cost(result)
    if result is not None and cost is None and problem is None:
        problem = "its Result has no cost figures (cpu_user_s, max_rss_bytes, processes)"
    if _leak["bytes"]:
        _leaked.append(os.urandom(_leak["bytes"]))
    return Outcome(i, kind, time.monotonic() - t0, problem, cost)


def run_batch(s: Soak, kinds: list[str], concurrency: int, first_index: int) -> list[Outcome]:
    # A fresh executor per batch, shut down before any count is taken.
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="soak") as ex:
        futures = [ex.submit(run_one, s, first_index + n, kind) for n, kind in enumerate(kinds)]
        outcomes = []
        for n, fut in enumerate(futures):
            try:
                outcomes.append(fut.result(timeout=HANG_S))
            except Exception as exc:  # noqa: BLE001 - a hang
                outcomes.append(Outcome(first_index + n, kinds[n], HANG_S, f"no result: {exc!r}"))
    return outcomes


class Tally:
    """Per kind, the wall times (8 bytes a job), what each job cost (28) and
    the wrong outcomes only: a 10 000-job soak must not grow this process's
    RSS with its own records."""

    def __init__(self) -> None:
        self.walls: dict[str, array.array] = {}
        self.cost = _jobcost.CostTally()
        self.wrong: list[Outcome] = []

    def add(self, outcomes: list[Outcome]) -> None:
        for o in outcomes:
            self.walls.setdefault(o.kind, array.array("d")).append(o.wall_s)
            if o.cost is not None:
                self.cost.add(o.kind, o.index, o.cost)
            if o.problem is not None:
                self.wrong.append(o)

    def wrong_of(self, kind: str) -> int:
        return sum(o.kind == kind for o in self.wrong)


# --- main ---------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, help="jobs in the measured run (default 2000; --long: 10000)")
    parser.add_argument("--concurrency", type=int, help="caller threads (default 16; --long: 32)")
    parser.add_argument("--long", action="store_true",
                        help=f"the long soak: {LONG_JOBS} jobs at concurrency {LONG_CONCURRENCY}")
    parser.add_argument("--checkpoints", type=int, default=10,
                        help="RSS checkpoints over the measured run (default 10)")
    parser.add_argument("--rss-warmup", type=float, default=0.5,
                        help="fraction of the measured run before the memory baseline (default 0.5)")
    parser.add_argument("--heap-slope-max", type=float, default=HEAP_SLOPE_MAX_BYTES_PER_JOB,
                        help="a leak: the Python heap growing faster, in bytes per job, over the measured part "
                             f"(default {HEAP_SLOPE_MAX_BYTES_PER_JOB:g}; negative: report only)")
    parser.add_argument("--rss-slope-max", type=float, default=RSS_SLOPE_MAX_KIB_PER_1000,
                        help="a leak: RSS growing faster, in KiB per 1000 jobs, while drifting over "
                             f"{RSS_NOISE_MIB:g} MiB (default {RSS_SLOPE_MAX_KIB_PER_1000:g}; negative: report only)")
    parser.add_argument("--leak-per-job", type=int, default=0, metavar="BYTES",
                        help="negative control: keep this many bytes per job for good (the verdict must fail)")
    parser.add_argument("--workers", type=int, default=2, help="pool workers (default 2)")
    parser.add_argument("--max-jobs-per-worker", type=int, default=200,
                        help="recycle workers after this many jobs (default 200)")
    parser.add_argument("--warmup", type=int, default=50, help="warm-up jobs before the first count (default 50)")
    parser.add_argument("--settle", type=float, default=2.0, help="max seconds to let counts settle (default 2)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the job order (default 1)")
    parser.add_argument("--skip", default="", help="comma-separated kinds to leave out, e.g. cancel_chatty")
    P.add_option(parser)
    args = C.parse_args(parser, argv, smoke={"jobs": sum(weight for _, weight in KINDS.values()), "warmup": 5,
                                             "checkpoints": 2, "heap_slope_max": -1, "rss_slope_max": -1})
    if args.jobs is None:
        args.jobs = LONG_JOBS if args.long else 2000
    if args.concurrency is None:
        args.concurrency = LONG_CONCURRENCY if args.long else 16
    if args.checkpoints < 2:
        parser.error("--checkpoints must be at least 2")
    if not 0 <= args.rss_warmup < 1:
        parser.error("--rss-warmup is a fraction in [0, 1)")
    skip = {k for k in args.skip.split(",") if k}
    if skip - set(KINDS):
        parser.error(f"unknown kinds {sorted(skip - set(KINDS))}; kinds are {', '.join(KINDS)}")
    if skip >= set(KINDS):
        parser.error("--skip leaves no kind to run")
    for name in ("jobs", "concurrency", "workers", "max_jobs_per_worker"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or args.settle < 0:
        parser.error("--warmup and --settle must not be negative")

    run_id = uuid.uuid4().hex
    _leak["bytes"] = args.leak_per_job
    tracemalloc.start(1)
    load_before = C.load()
    started = time.perf_counter()
    try:
        pool = ExecPool(workers=args.workers, max_jobs_per_worker=args.max_jobs_per_worker)
    except Exception as exc:  # noqa: BLE001 - reported as the run's result
        print(f"execpool soak: cannot start the pool: {type(exc).__name__}: {exc}")
        C.emit_json({"benchmark": "soak", "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        return 2
    try:
        soak = Soak(_jobcost.RecordingPool(pool), run_id)
        warm = Tally()
        if args.warmup:
            warm.add(run_batch(soak, schedule(args.warmup, args.seed + 1, frozenset(skip)), args.concurrency, 0))
        before = settle(pool, run_id, args.settle)
        t0 = time.perf_counter()
        kinds = schedule(args.jobs, args.seed, frozenset(skip))
        tally = Tally()
        checkpoints = []
        snapshots = []
        segments = min(args.checkpoints, args.jobs)
        for seg in range(segments):
            lo, hi = args.jobs * seg // segments, args.jobs * (seg + 1) // segments
            tally.add(run_batch(soak, kinds[lo:hi], args.concurrency, args.warmup + lo))
            checkpoints.append({"jobs": hi, "s": round(time.perf_counter() - t0, 2), **rss_checkpoint()})
            if seg in (rss_baseline(checkpoints_at(args.jobs, segments), args.jobs * args.rss_warmup),
                       segments - 1):
                snapshots.append(tracemalloc.take_snapshot())
        run_s = time.perf_counter() - t0
        after = settle(pool, run_id, args.settle, target=before)
        settle_s = time.perf_counter() - t0 - run_s
    finally:
        below = C.processes_below()
        pool.close()
    survivors = C.still_running(below, args.settle)
    after_close = marked_processes(run_id)
    killed = kill_leftovers(run_id, survivors)
    elapsed = time.perf_counter() - started

    # Problems of their own first: a crashed worker fails every job it ran.
    wrong = sorted(warm.wrong + tally.wrong, key=lambda o: (WORKER_DIED in (o.problem or ""), o.index))
    crash_errors = sum(WORKER_DIED in (o.problem or "") for o in wrong)
    by_kind = tally.walls
    leaks = []
    for key in ("threads", "native_threads", "fds", "tool_processes", "other_processes"):
        if after[key] > before[key]:
            leaks.append(f"{key}: {before[key]} -> {after[key]}")
    if after["workers"] != args.workers:
        leaks.append(f"workers: {after['workers']} (want {args.workers})")
    if after["zombies"]:
        leaks.append(f"zombies among descendants: {after['zombies']}")
    if after["marked_ours"]:
        leaks.append(f"processes of this run still alive: {after['marked_ours']} "
                     f"e.g. {after['_marked_detail'][:3]}")
    if survivors:
        leaks.append(f"processes below this process still running after pool.close(): {survivors[:10]}")
    if after_close["ours"]:
        leaks.append(f"processes of this run alive after pool.close(): {len(after_close['ours'])}")
    base = rss_baseline(checkpoints, args.jobs * args.rss_warmup)
    measured = checkpoints[base:]
    leaks.extend(C.CUT_SHORT.problems())
    rss_drift = window_drift(measured, "trimmed_mib")
    rss_drift_raw = window_drift(measured, "raw_mib")
    rss_slope = round((slope(measured, "trimmed_mib") or 0.0) * 1024 * 1000, 1)
    heap_slope = round(slope(measured, "traced_bytes") or 0.0, 1)
    heap_growth_kib = round((measured[-1]["traced_bytes"] - measured[0]["traced_bytes"]) / 1024, 1)
    span = f"from job {measured[0]['jobs']} to job {measured[-1]['jobs']}"
    if 0 <= args.heap_slope_max < heap_slope:
        leaks.append(f"the Python heap grew {heap_slope:g} bytes per job {span} ({heap_growth_kib:g} KiB; "
                     f"limit {args.heap_slope_max:g} bytes per job)")
    if 0 <= args.rss_slope_max < rss_slope and rss_drift > RSS_NOISE_MIB:
        leaks.append(f"RSS grew {rss_slope:g} KiB per 1000 jobs {span} (drift {rss_drift} MiB; limit "
                     f"{args.rss_slope_max:g} KiB per 1000 jobs with a drift over {RSS_NOISE_MIB:g} MiB)")

    print(f"execpool soak: {args.jobs} jobs (+{args.warmup} warm-up), concurrency {args.concurrency}, "
          f"{args.workers} workers recycled every {args.max_jobs_per_worker} jobs, {os.cpu_count()} CPUs")
    print(f"  run {run_s:.1f} s ({args.jobs / run_s:.0f} jobs/s), settle {settle_s:.2f} s, total {elapsed:.1f} s")
    print()
    C.print_table(
        "Jobs by kind (wall ms per job, from the caller's thread)",
        ["kind", "jobs", "wrong", "median", "p90", "max"],
        [[k, len(v), tally.wrong_of(k), C.ms(C.median(v)), C.ms(C.quantile(v, 0.9)), C.ms(max(v))]
         for k, v in sorted(by_kind.items())],
    )
    cost_by_kind, grew_most = tally.cost.by_kind(), tally.cost.grew_most()
    C.print_table(
        "What the jobs cost, as their workers measured it (medians per kind; early/late: the kind's first "
        "and last fifth of jobs)",
        ["kind", "jobs", "CPU ms", "max RSS MiB", "processes", "max", "CPU early->late", "RSS early->late"],
        [[k, c["jobs"], c["cpu_ms"], c["max_rss_mib"], c["processes"], c["processes_max"],
          f"{c['cpu_ms_early']} -> {c['cpu_ms_late']}", f"{c['max_rss_mib_early']} -> {c['max_rss_mib_late']}"]
         for k, c in cost_by_kind.items()],
    )
    C.print_table("The jobs that grew most over their kind's median",
                  ["job", "kind", "over", "x median", "CPU ms", "max RSS MiB", "processes"],
                  [[g["job"], g["kind"], g["over"], g["times_median"], g["cpu_ms"], g["max_rss_mib"], g["processes"]]
                   for g in grew_most])
    rows = []
    for key in ("threads", "native_threads", "fds", "rss_mb", "workers", "pool_helpers", "tool_processes",
                "other_processes", "zombies", "marked_ours", "marked_others"):
        delta = after[key] - before[key]
        rows.append([key, before[key], after[key], round(delta, 1) if isinstance(delta, float) else delta])
    rows.append(["running after pool.close()", len(below), len(survivors), ""])
    C.print_table("Before (after warm-up) / after (after settle)", ["count", "before", "after", "delta"], rows)
    C.print_table(f"Memory of this process at checkpoints (MiB, after gc; trimmed: after malloc_trim(0); heap: "
                  f"tracemalloc) -- {span}: heap {heap_slope:g} bytes/job (limit {args.heap_slope_max:g}), "
                  f"RSS {rss_slope:g} KiB/1000 jobs (limit {args.rss_slope_max:g} with a drift over "
                  f"{RSS_NOISE_MIB:g} MiB), RSS drift {rss_drift} MiB (untrimmed {rss_drift_raw})",
                  ["after job", "raw", "trimmed", "anon", "file", "heap"],
                  [[c["jobs"], c["raw_mib"], c["trimmed_mib"], c.get("anon_mib"), c.get("file_mib"),
                    round(c["traced_bytes"] / 2**20, 2)] for c in checkpoints])
    growth_lines = traced_growth(snapshots[0], snapshots[-1]) if len(snapshots) == 2 else []
    for line in growth_lines:
        print(f"  traced growth: {line}")
    if growth_lines:
        print()
    if after["marked_others"]:
        print(f"  note: {after['marked_others']} EXECPOOL_JOB process(es) of another run are alive (not counted)")
    if crash_errors:
        print(f"  {crash_errors} wrong result(s) are jobs failed by a crashed worker (see stderr)")
    C.CUT_SHORT.note()
    for o in wrong[:10]:
        print(f"  WRONG job {o.index} ({o.kind}): {o.problem}")
    if len(wrong) > 10:
        print(f"  ... and {len(wrong) - 10} more wrong results")
    for leak in leaks:
        print(f"  LEAK {leak}")
    if killed:
        print(f"  killed {killed} leftover process(es) of this run")
    ok = not wrong and not leaks
    print(f"  verdict: {'OK' if ok else 'FAIL'}")
    print()

    figures = {
        "benchmark": "soak",
        "ok": ok,
        "jobs": args.jobs,
        "warmup_jobs": args.warmup,
        "concurrency": args.concurrency,
        "workers": args.workers,
        "max_jobs_per_worker": args.max_jobs_per_worker,
        "cpus": os.cpu_count(),
        "run_s": round(run_s, 2),
        "jobs_per_s": round(args.jobs / run_s, 1),
        "settle_s": round(settle_s, 2),
        "elapsed_s": round(elapsed, 2),
        "wrong": len(wrong),
        "wrong_from_worker_crash": crash_errors,
        "skipped_kinds": sorted(skip),
        "wrong_examples": [f"{o.index} {o.kind}: {o.problem}" for o in wrong[:5]],
        "kinds": {k: {"jobs": len(v), "wrong": tally.wrong_of(k), "median_ms": C.ms(C.median(v))}
                  for k, v in sorted(by_kind.items())},
        "job_cost": {"by_kind": cost_by_kind, "grew_most": grew_most},
        "before": {k: v for k, v in before.items() if not k.startswith("_")},
        "after": {k: v for k, v in after.items() if not k.startswith("_")},
        "processes_below_at_close": len(below),
        "running_after_close": len(survivors),
        "leaks": leaks,
        "leftovers_killed": killed,
        "timed_out_before_output": C.CUT_SHORT.figures(),
        "rss_checkpoints": checkpoints,
        "traced_growth": growth_lines,
        "rss_drift_mib": rss_drift,
        "rss_drift_untrimmed_mib": rss_drift_raw,
        "rss_drift_from_job": measured[0]["jobs"],
        "rss_slope_kib_per_1000_jobs": rss_slope,
        "heap_slope_bytes_per_job": heap_slope,
        "heap_growth_kib": heap_growth_kib,
        "leak_per_job_injected": args.leak_per_job,
        "machine": C.machine(),
        "load": {"before": load_before, "after": C.load()},
        "targets": {
            "no_leak_no_wrong_result": {"target": "0 wrong, 0 leaked", "value": len(wrong) + len(leaks),
                                        "met": ok},
            "heap_slope_bytes_per_job": C.target(heap_slope, HEAP_SLOPE_MAX_BYTES_PER_JOB, "<=", "bytes/job"),
            "rss_slope_kib_per_1000_jobs": C.target(rss_slope, RSS_SLOPE_MAX_KIB_PER_1000, "<=",
                                                     "KiB/1000 jobs (leak only with drift > 2 MiB)"),
        },
    }
    C.emit_json(figures)
    plot(args.plot, figures)
    return 0 if ok else 1


def plot(path: Optional[str], figures: dict) -> None:
    """This process's memory at each checkpoint against the time into the
    measured run: RSS as it was and after ``malloc_trim(0)``, and the
    Python heap tracemalloc sees; a leak is a line that climbs."""
    if path is None:  # no --plot
        return
    points = figures["rss_checkpoints"]
    seconds = [c["s"] for c in points]
    title = (f"Soak: the caller's memory over {figures['jobs']} mixed jobs at concurrency {figures['concurrency']} "
             f"({figures['jobs_per_s']} jobs/s)")
    with P.figure(path, title, figures, panels=2) as axes:
        axes[0].plot(seconds, [c["raw_mib"] for c in points], "o-", label="RSS")
        axes[0].plot(seconds, [c["trimmed_mib"] for c in points], "o-", label="RSS after malloc_trim(0)")
        axes[0].set_ylabel("MiB")
        axes[0].set_title("resident set")
        axes[1].plot(seconds, [c["traced_bytes"] / 2**20 for c in points], "o-", color="tab:purple")
        axes[1].set_ylabel("MiB")
        axes[1].set_title("Python heap (tracemalloc)")
        for ax in axes:
            ax.set_xlabel("seconds into the measured run")
            ax.set_xlim(left=0)
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            jobs = ax.secondary_xaxis("top", functions=(_along(points, "s", "jobs"), _along(points, "jobs", "s")))
            jobs.set_xlabel("jobs done", fontsize=8)
        axes[0].legend(fontsize=7)


def _along(points: list, given: str, wanted: str) -> Callable:
    """``given`` (seconds, or jobs done) to ``wanted`` between checkpoints,
    as a line from the run's start: the two scales of the plot's x axis."""
    import numpy
    xs, ys = [0] + [c[given] for c in points], [0] + [c[wanted] for c in points]
    return lambda value: numpy.interp(value, xs, ys)


if __name__ == "__main__":
    sys.exit(main())
