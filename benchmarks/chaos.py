"""Chaos: jobs of every kind at high concurrency while workers are SIGKILLed,
jobs are cancelled and streams are closed early; then nothing may be lost
and nothing may be left.

Run from the repository root::

    python benchmarks/chaos.py                 # or: python -m benchmarks.chaos
    python benchmarks/chaos.py --minutes 5 --concurrency 64 --kill-every 1

For ``--minutes`` (default 0.5) ``--concurrency`` caller threads (default 32)
each submit job after job, of a random kind, to one pool of ``--workers``
workers (default 2), while a chaos thread SIGKILLs a random worker every
``--kill-every`` seconds (default 2, jittered by +-50 %).

=================  ===============================================================
kind               correct Result
=================  ===============================================================
shell              exact output, exit 0
python             exact output, exit 0
warm               the same through PythonJob(warm=True)
fail               ``Exit code 3:\\n...``
timeout            ``sleep`` past a 0.3 s timeout: ``Execution timed out after 0.3 seconds.``
cancel             cancel_event set after 0.1 s: ``Execution cancelled.``
close              stream closed after its first event: the job's one Result is
                   cancelled (or finished, if it beat the Cancel)
flood              5 MB through pool.stream: exact length, capped live output
daemon_python      setsid + double-fork daemon, then "ok"
warm_daemon        the same as a warm job
daemon_shell       ``setsid sleep`` from a subshell, then "ok"
daemon_holds_pipe  a setsid daemon keeps stdout open: times out at 0.3 s
background         20 background sleepers, then "bg"
zombie_leader      a daemon that ended its first thread (SYS_exit), then "ok"
dir_flood          5 000 directories in its own directory, then "ok"
symlink_racer      a daemon swapping a directory and a symlink to / under the
                   removal of its directory, then "ok"
marker_forger      5 sleepers marked as the job before it, then "ok"
=================  ===============================================================

Any kind may instead end with ``Execution error: worker process ...`` when
the chaos thread killed the worker under it; that is counted, not wrong.

Checked at the end:

- exactly one Result per submitted job: the pool's own submission is
  wrapped so every ``Finished`` message delivered to a job is counted,
  including those of streams closed early, whose Result no caller reads;
- every Result correct for its kind, or the clear worker-killed error;
- nothing leaked once the run settled (up to ``--settle`` s, default 3):
  this process's threads and fds back to their baseline (taken after a
  warm-up), the pool back to its worker count, nothing below this process
  but the workers, their warm templates and parked spares and the pool's
  lifeline, no zombie below this
  process, no live process carrying this run's marker anywhere;
- and after ``pool.close()``: no process below this one still running.

Prints a table per kind and one of counts, then one JSON line (last);
exits 1 on any lost, duplicated or wrong Result or any leak.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import logging
import os
import random
import signal
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Optional

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil

from benchmarks import _common as C
from execpool import TOOL_OUTPUT_STREAM_MAX_CHARS, ExecPool, PythonJob, Result, ShellJob
from execpool.shared.output import STREAM_CAP_NOTICE

RUN_VAR = "EXECPOOL_CHAOS_RUN"
KIND_VAR = "EXECPOOL_CHAOS_KIND"
JOB_TIMEOUT_S = 30  # bounds every job that is not meant to time out
SHORT_TIMEOUT_S = 0.3
CANCEL_AFTER_S = 0.1
FLOOD_CHARS = 5_000_000
#: What Result.error says when the worker under a job died.
WORKER_KILLED = "worker process "
#: A caller waiting longer than this for one job reports a hang.
HANG_S = 60.0


# --- exactly one Result per job ------------------------------------------------------------


class Ledger:
    """Counts the ends of each submitted job by wrapping the pool's public
    ``submit`` on this pool (every client -- run, stream, map -- goes
    through it) and listening to the ``execpool`` logger, where a job that
    ends a second time is reported (a future takes one result only)."""

    def __init__(self, pool: ExecPool) -> None:
        self.lock = threading.Lock()
        self.submitted: set[int] = set()
        self.finished: Counter = Counter()
        self.results: dict[int, Result] = {}
        self.kinds: dict[int, str] = {}
        original = pool.submit
        ledger = self

        def submit(job, **kwargs):
            future = original(job, **kwargs)
            with self.lock:
                self.submitted.add(future.job_id)
                self.kinds[future.job_id] = (job.env or {}).get(KIND_VAR, "")
            future.add_done_callback(self._ended)
            return future

        class Twice(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if "ended twice" in record.getMessage():
                    with ledger.lock:
                        ledger.finished[record.args[0]] += 1

        pool.submit = submit
        logging.getLogger("execpool").addHandler(Twice(logging.ERROR))

    def _ended(self, future) -> None:
        with self.lock:
            self.finished[future.job_id] += 1
            self.results[future.job_id] = future.result()

    def check(self) -> dict:
        with self.lock:
            lost = sorted(j for j in self.submitted if self.finished[j] == 0)
            duplicated = sorted(j for j in self.submitted if self.finished[j] > 1)
            unknown = sorted(j for j in self.finished if j not in self.submitted)
            # Nobody reads the Result of a stream closed early: judge it here.
            unclosed = sorted(j for j, r in self.results.items()
                              if self.kinds.get(j) == "close" and not (r.cancelled or _killed(r)))
            return {"submitted": len(self.submitted), "lost": lost, "duplicated": duplicated, "unknown": unknown,
                    "closed_not_cancelled": unclosed}


# --- job kinds -------------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str
    verdict: str  # "ok", "worker_killed" or "wrong"
    wall_s: float
    problem: Optional[str] = None


def _killed(result: Result) -> bool:
    return (result.error is not None and result.error.startswith(WORKER_KILLED)
            and result.text.startswith("Execution error: "))


def _expect(result: Result, text: str) -> Optional[str]:
    return None if result.text == text else f"text {result.text[:120]!r} (want {text[:120]!r})"


def _output(result: Result, want: str) -> Optional[str]:
    return None if result.output == want else f"output {result.output!r}"


class Chaos:
    def __init__(self, pool: ExecPool, run_id: str, rng: random.Random) -> None:
        self.pool = pool
        self.run_id = run_id
        self.rng = rng

    def env(self, kind: str) -> dict:
        return {RUN_VAR: self.run_id, KIND_VAR: kind}

    # Each returns the Result it judged (None for an early close) and a problem or None.

    def shell(self, i: int):
        r = self.pool.run(ShellJob(f"echo out-{i}; echo err-{i} >&2", timeout=JOB_TIMEOUT_S, env=self.env("shell")))
        return r, _expect(r, f"out-{i}\nerr-{i}\n")

    def python(self, i: int):
        r = self.pool.run(PythonJob(f"import sys\nprint('py', {i})\nprint('e', file=sys.stderr)",
                                    timeout=JOB_TIMEOUT_S, env=self.env("python")))
        return r, _expect(r, f"py {i}\ne\n")

    def fail(self, i: int):
        r = self.pool.run(ShellJob("echo failing; exit 3", timeout=JOB_TIMEOUT_S, env=self.env("fail")))
        return r, _expect(r, "Exit code 3:\nfailing\n")

    def timeout(self, i: int):
        r = self.pool.run(ShellJob("echo start; sleep 5", timeout=SHORT_TIMEOUT_S, env=self.env("timeout")))
        problem = _expect(r, f"Execution timed out after {SHORT_TIMEOUT_S} seconds.")
        return r, problem or _output(r, C.CUT_SHORT.expected(r, "start\n"))

    def cancel(self, i: int):
        event = threading.Event()
        timer = threading.Timer(CANCEL_AFTER_S * self.rng.uniform(0.5, 1.5), event.set)
        timer.start()
        try:
            r = self.pool.run(ShellJob("echo start; sleep 5", timeout=JOB_TIMEOUT_S, env=self.env("cancel")),
                              cancel_event=event)
        finally:
            timer.cancel()
        return r, _expect(r, "Execution cancelled.")

    def close(self, i: int):
        gen = self.pool.stream(ShellJob(f"echo first-{i}; sleep 5; echo late", timeout=JOB_TIMEOUT_S,
                                        env=self.env("close")), tool_name="chaos")
        try:
            first = next(gen)
        except StopIteration as stop:  # the worker died before the first line
            return stop.value, "ended before its first event"
        finally:
            started = time.monotonic()
            gen.close()
            took = time.monotonic() - started
        if took > 2.0:
            return None, f"close() took {took:.2f} s"
        if first.get("text") != f"first-{i}\n":
            return None, f"first event {first!r}"
        return None, None  # its one Result is judged from the ledger

    def flood(self, i: int):
        cmd = f"head -c {FLOOD_CHARS} /dev/zero | tr '\\0' x"
        events, r = C.drain(self.pool.stream(ShellJob(cmd, timeout=JOB_TIMEOUT_S, env=self.env("flood")),
                                             tool_name="chaos", heartbeat_interval_s=30.0))
        streamed = "".join(e["text"] for e in events if e["type"] == "tool_output")
        if _killed(r):
            return r, None
        if r.exit_code != 0 or r.output_chars != FLOOD_CHARS or r.output != "x" * self.pool.config.max_output_chars:
            return r, f"exit {r.exit_code}, output_chars {r.output_chars}, error {r.error!r}"
        if streamed != "x" * TOOL_OUTPUT_STREAM_MAX_CHARS + STREAM_CAP_NOTICE:
            return r, f"streamed {len(streamed)} chars ending {streamed[-40:]!r}"
        return r, None

    def warm(self, i: int):
        r = self.pool.run(PythonJob(f"import sys\nprint('warm', {i})\nprint('e', file=sys.stderr)",
                                    timeout=JOB_TIMEOUT_S, env=self.env("warm"), warm=True))
        return r, _expect(r, f"warm {i}\ne\n")

    def daemon_python(self, i: int, warm: bool = False):
        kind = "warm_daemon" if warm else "daemon_python"
        r = self.pool.run(PythonJob(C.DAEMON_PYTHON, timeout=JOB_TIMEOUT_S, env=self.env(kind), warm=warm))
        return r, _expect(r, "ok\n")

    def warm_daemon(self, i: int):
        return self.daemon_python(i, warm=True)

    def daemon_shell(self, i: int):
        r = self.pool.run(ShellJob("( setsid sleep 1000 >/dev/null 2>&1 & ); echo ok", timeout=JOB_TIMEOUT_S,
                                   env=self.env("daemon_shell")))
        return r, _expect(r, "ok\n")

    def daemon_holds_pipe(self, i: int):
        r = self.pool.run(ShellJob("( setsid sleep 1000 & ); echo ok", timeout=SHORT_TIMEOUT_S,
                                   env=self.env("daemon_holds_pipe")))
        problem = _expect(r, f"Execution timed out after {SHORT_TIMEOUT_S} seconds.")
        return r, problem or _output(r, C.CUT_SHORT.expected(r, "ok\n"))

    def hostile(self, kind: str):
        r = self.pool.run(PythonJob(C.HOSTILE[kind], timeout=JOB_TIMEOUT_S, env=self.env(kind)))
        return r, _expect(r, "ok\n")

    def zombie_leader(self, i: int):
        return self.hostile("zombie_leader")

    def dir_flood(self, i: int):
        return self.hostile("dir_flood")

    def symlink_racer(self, i: int):
        return self.hostile("symlink_racer")

    def marker_forger(self, i: int):
        return self.hostile("marker_forger")

    def filler(self, kind: str):
        r = self.pool.run(PythonJob(C.FILLERS[kind], timeout=JOB_TIMEOUT_S, env=self.env(kind), sandbox="strict",
                                    limits=C.FILLER_LIMITS))
        return r, _expect(r, "ok\n")

    def disk_filler(self, i: int):
        return self.filler("disk_filler")

    def tmpfs_filler(self, i: int):
        return self.filler("tmpfs_filler")

    def background(self, i: int):
        r = self.pool.run(ShellJob("for n in $(seq 20); do sleep 1000 >/dev/null 2>&1 & done; echo bg",
                                   timeout=JOB_TIMEOUT_S, env=self.env("background")))
        return r, _expect(r, "bg\n")


#: kind -> weight
KINDS: dict[str, int] = {
    "shell": 12, "python": 10, "warm": 6, "fail": 8, "timeout": 8, "cancel": 10, "close": 10, "flood": 4,
    "daemon_python": 6, "warm_daemon": 4, "daemon_shell": 8, "daemon_holds_pipe": 6, "background": 8,
    "zombie_leader": 2, "dir_flood": 1, "symlink_racer": 1, "marker_forger": 2, "disk_filler": 2, "tmpfs_filler": 2,
}


def run_one(chaos: Chaos, i: int, kind: str) -> Outcome:
    started = time.monotonic()
    try:
        result, problem = getattr(chaos, kind)(i)
    except Exception as exc:  # noqa: BLE001 - an exception out of the pool is a wrong result
        result, problem = None, f"raised {type(exc).__name__}: {exc}"
    wall = time.monotonic() - started
    if result is not None and _killed(result):
        return Outcome(kind, "worker_killed", wall)
    return Outcome(kind, "wrong" if problem else "ok", wall, problem)


# --- the chaos thread ---------------------------------------------------------------------------


def kill_workers(pool: ExecPool, every_s: float, stop: threading.Event, rng: random.Random,
                 kills: list) -> None:
    while not stop.wait(every_s * rng.uniform(0.5, 1.5)):
        pids = pool.worker_pids
        if not pids:
            continue
        victim = rng.choice(pids)
        try:
            os.kill(victim, signal.SIGKILL)
            kills.append(victim)
        except OSError:
            pass


# --- what is left --------------------------------------------------------------------------------


def marked(run_id: str) -> list[psutil.Process]:
    """Live processes anywhere carrying this run's marker."""
    found = []
    for proc in psutil.process_iter():
        env = C.environ_of(proc)
        if env and env.get(RUN_VAR) == run_id:
            found.append(proc)
    return found


def counts(pool: ExecPool, run_id: str) -> dict:
    workers = set(pool.worker_pids)
    zombies = others = helpers = 0
    for proc in C.descendants():
        if proc.pid in workers:
            continue
        if C.is_dead(proc):
            zombies += 1
        elif C.is_pool_helper(proc):
            helpers += 1  # a worker's warm template, parked spares and helpers, the lifeline
        else:
            others += 1
    return {
        "threads": threading.active_count(),
        "native_threads": C.thread_count(),
        "fds": len(os.listdir("/proc/self/fd")),
        "workers": len(workers),
        "processes_below_workers": others,
        "pool_helpers": helpers,
        "zombies": zombies,
        "marked": len(marked(run_id)),
    }


SETTLE_KEYS = ("threads", "native_threads", "fds", "processes_below_workers", "zombies", "marked")
#: Counts that must be zero once settled, whatever the baseline.
ZERO = {"processes_below_workers": 0, "zombies": 0, "marked": 0}


def settle(pool: ExecPool, run_id: str, baseline: dict, workers: int, seconds: float) -> dict:
    """gc and poll until the counts are at most ``baseline`` (or time is up)."""
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        now = counts(pool, run_id)
        back = all(now[k] <= baseline[k] for k in SETTLE_KEYS) and now["workers"] == workers
        if back or time.monotonic() >= deadline:
            return now
        time.sleep(0.05)


# --- main ---------------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=0.5, help="length of the run (default 0.5)")
    parser.add_argument("--concurrency", type=int, default=32, help="caller threads (default 32)")
    parser.add_argument("--workers", type=int, default=2, help="pool workers (default 2)")
    parser.add_argument("--kill-every", type=float, default=2.0,
                        help="seconds between worker SIGKILLs, jittered +-50%% (default 2; 0: none)")
    parser.add_argument("--settle", type=float, default=3.0, help="max seconds to let counts settle (default 3)")
    parser.add_argument("--seed", type=int, default=1, help="seed of kinds, cancel delays and victims (default 1)")
    args = C.parse_args(parser, argv, smoke={"minutes": 0.03, "concurrency": 4, "kill_every": 0.5})
    if args.minutes <= 0 or args.concurrency < 1 or args.workers < 1 or args.kill_every < 0 or args.settle < 0:
        parser.error("--minutes must be positive, --concurrency and --workers at least 1, "
                     "--kill-every and --settle not negative")

    run_id = uuid.uuid4().hex
    rng = random.Random(args.seed)
    load_before = C.load()
    started = time.perf_counter()
    pool = ExecPool(workers=args.workers)
    ledger = Ledger(pool)
    chaos = Chaos(pool, run_id, random.Random(args.seed + 1))
    outcomes: list[Outcome] = []
    outcomes_lock = threading.Lock()
    kills: list[int] = []
    index = itertools.count()
    index_lock = threading.Lock()
    kinds = [kind for kind, weight in KINDS.items() for _ in range(weight)]
    try:
        # Warm-up without chaos, so the baseline counts include what a busy pool keeps.
        for n, kind in enumerate(KINDS):
            run_one(chaos, n, kind)
        # Settled: what the warm-up started is gone, so the baseline holds
        # only what an idle pool keeps (threads, fds) and no process.
        baseline = settle(pool, run_id, counts(pool, run_id) | ZERO, args.workers, args.settle)

        deadline = time.monotonic() + args.minutes * 60
        stop = threading.Event()

        def caller(seed: int) -> None:
            local = random.Random(seed)
            while time.monotonic() < deadline:
                with index_lock:
                    i = next(index)
                outcome = run_one(chaos, i, local.choice(kinds))
                with outcomes_lock:
                    outcomes.append(outcome)

        killer = None
        if args.kill_every > 0:
            killer = threading.Thread(target=kill_workers, args=(pool, args.kill_every, stop, rng, kills),
                                      name="chaos-killer", daemon=True)
            killer.start()
        callers = [threading.Thread(target=caller, args=(args.seed * 1000 + n,), name=f"chaos-caller-{n}")
                   for n in range(args.concurrency)]
        for t in callers:
            t.start()
        hung = 0
        for t in callers:
            t.join(max(0.0, deadline - time.monotonic()) + HANG_S)
            hung += t.is_alive()
        stop.set()
        if killer is not None:
            killer.join()
        run_s = time.perf_counter() - started
        after = settle(pool, run_id, baseline | ZERO, args.workers, args.settle)
        ledger_report = ledger.check()
    finally:
        below = C.processes_below()
        pool.close()
    survivors = C.still_running(below, args.settle)
    leftovers = marked(run_id)
    for proc in leftovers:
        try:
            proc.kill()
        except psutil.Error:
            pass
    elapsed = time.perf_counter() - started

    by_kind: dict[str, Counter] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, Counter())[o.verdict] += 1
    wrong = [o for o in outcomes if o.verdict == "wrong"]
    leaks = []
    for key in SETTLE_KEYS:
        allowed = ZERO.get(key, baseline[key])
        if after[key] > allowed:
            leaks.append(f"{key}: {after[key]} (allowed {allowed})")
    if after["workers"] != args.workers:
        leaks.append(f"workers: {after['workers']} (want {args.workers})")
    if survivors:
        leaks.append(f"running after pool.close(): {survivors[:10]}")
    if leftovers:
        leaks.append(f"processes of this run alive after pool.close(): {len(leftovers)}")
    problems = []
    if ledger_report["lost"]:
        problems.append(f"jobs without a Result: {len(ledger_report['lost'])}")
    if ledger_report["duplicated"]:
        problems.append(f"jobs with more than one Result: {len(ledger_report['duplicated'])}")
    if ledger_report["unknown"]:
        problems.append(f"Results for jobs never submitted: {len(ledger_report['unknown'])}")
    if ledger_report["closed_not_cancelled"]:
        problems.append(f"streams closed early whose Result is not cancelled: "
                        f"{len(ledger_report['closed_not_cancelled'])}")
    if hung:
        problems.append(f"caller threads hung: {hung}")
    problems.extend(C.CUT_SHORT.problems())
    ok = not wrong and not leaks and not problems

    total = len(outcomes)
    print(f"execpool chaos: {args.minutes:g} min at concurrency {args.concurrency}, {args.workers} workers, "
          f"a worker SIGKILLed every ~{args.kill_every:g} s, {os.cpu_count()} CPUs")
    print(f"  {total} jobs ({total / max(run_s, 1e-9):.0f}/s), {len(kills)} workers killed, "
          f"{ledger_report['submitted']} submissions, elapsed {elapsed:.1f} s")
    print()
    C.print_table("Jobs by kind", ["kind", "jobs", "ok", "worker killed", "wrong"],
                  [[k, sum(c.values()), c["ok"], c["worker_killed"], c["wrong"]] for k, c in sorted(by_kind.items())])
    C.print_table("Baseline (after warm-up) / after (settled)", ["count", "baseline", "after"],
                  [[k, baseline[k], after[k]] for k in (*SETTLE_KEYS, "workers")]
                  + [["running after pool.close()", len(below), len(survivors)]])
    C.CUT_SHORT.note()
    for o in wrong[:10]:
        print(f"  WRONG {o.kind}: {o.problem}")
    for line in problems + [f"LEAK {leak}" for leak in leaks]:
        print(f"  {line}")
    print(f"  verdict: {'OK' if ok else 'FAIL'}")
    print()

    C.emit_json({
        "benchmark": "chaos",
        "ok": ok,
        "minutes": args.minutes,
        "concurrency": args.concurrency,
        "workers": args.workers,
        "kill_every_s": args.kill_every,
        "seed": args.seed,
        "jobs": total,
        "jobs_per_s": round(total / max(run_s, 1e-9), 1),
        "workers_killed": len(kills),
        "worker_killed_results": sum(o.verdict == "worker_killed" for o in outcomes),
        "wrong": len(wrong),
        "wrong_examples": [f"{o.kind}: {o.problem}" for o in wrong[:5]],
        "timed_out_before_output": C.CUT_SHORT.figures(),
        "submitted": ledger_report["submitted"],
        "lost": len(ledger_report["lost"]),
        "duplicated": len(ledger_report["duplicated"]),
        "problems": problems,
        "leaks": leaks,
        "kinds": {k: dict(c) for k, c in sorted(by_kind.items())},
        "baseline": baseline,
        "after": after,
        "running_after_close": len(survivors),
        "elapsed_s": round(elapsed, 2),
        "machine": C.machine(),
        "load": {"before": load_before, "after": C.load()},
        "targets": {
            "nothing_lost_wrong_or_leaked": {"target": "0", "value": len(wrong) + len(leaks) + len(problems),
                                             "met": ok},
        },
    })
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
