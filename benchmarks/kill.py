"""Kill latency: from a cancel to every process of a tool's tree dead and reaped.

Run from the repository root::

    python benchmarks/kill.py                  # or: python -m benchmarks.kill
    python benchmarks/kill.py --rounds 40

The tool is a bash script that starts 50 background ``sleep 1000``, prints
``ready`` and waits (51 processes). Once ``ready`` has arrived, the tree's pids
are recorded; then the clock runs from the cancel until every recorded pid is
*dead* (a zombie or gone) and until every one is *reaped* (gone from /proc; a
pid whose start time changed counts as gone), polled in a loop that never
sleeps more than 0.1 ms. Each round first waits a random 0-0.2 s (the same
delay for every design of the round) so the cancel lands at a random point of
any poll period.

Designs, interleaved round by round:

- ``pool close()``: ``pool.stream`` consumed in this thread; the clock starts
  at ``gen.close()`` (an SSE client disconnect).
- ``pool cancel_event``: the stream consumed in another thread (as a server
  handler would); the clock starts at ``cancel_event.set()``, which the
  pool's cancel watcher sees within a few milliseconds.
- ``reference cancel_event`` / ``reference close()``: the thread-per-call
  reference design (benchmarks/reference.py), whose watcher polls the event
  every 0.2 s, then ``killpg(SIGKILL)``s the group and reaps it. This process
  makes itself a child subreaper for the run, so the reference reaps its
  orphans itself: it gets its best case and its only handicap is the poll.
- ``floor``: no design; this thread Popens the tree and, at the cancel,
  ``killpg``s and reaps it directly: what the kernel alone takes.

Target: <= 10 ms median from cancel to tree reaped, for close() and for
cancel_event. The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _common as C
from benchmarks.reference import WATCH_POLL_S, ThreadPerCall, consume, shell_argv
from execpool import ExecPool, ShellJob

TARGET_MS = 10.0
JOB_TIMEOUT_S = 60
#: A stream that has not ended this long after its cancel is a failure.
END_DEADLINE_S = 10.0


def _ready_text(gen) -> None:
    """Consume events until the tool printed "ready"."""
    text = ""
    while "ready" not in text:
        event = next(gen)
        if event.get("type") == "tool_output":
            text += event["text"]


class _Consumer(threading.Thread):
    """Iterates a stream to its end in its own thread (a server handler),
    saying when the tool is ready."""

    def __init__(self, gen) -> None:
        super().__init__(name="bench-consumer", daemon=True)
        self.gen = gen
        self.ready = threading.Event()
        self.result = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            _ready_text(self.gen)
            self.ready.set()
            self.result = consume(self.gen)[1]
        except BaseException as exc:  # noqa: BLE001 - reported by the round
            self.error = exc
            self.ready.set()


def _cancel_round(gen, tree_of: Callable[[], dict], phase: float, event: threading.Event) -> dict:
    consumer = _Consumer(gen)
    consumer.start()
    if not consumer.ready.wait(END_DEADLINE_S) or consumer.error is not None:
        raise RuntimeError(f"the tree never printed ready: {consumer.error!r}")
    tree = tree_of()
    time.sleep(phase)
    t0 = time.perf_counter()
    event.set()
    dead, reaped = C.wait_gone(tree, t0)
    consumer.join(END_DEADLINE_S)
    ended = consumer.result is not None and getattr(consumer.result, "cancelled", False)
    return {"tree": len(tree), "dead": dead, "reaped": reaped, "cancelled": ended}


def _close_round(gen, tree_of: Callable[[], dict], phase: float) -> dict:
    _ready_text(gen)
    tree = tree_of()
    time.sleep(phase)
    t0 = time.perf_counter()
    gen.close()
    close_s = time.perf_counter() - t0
    dead, reaped = C.wait_gone(tree, t0)
    return {"tree": len(tree), "dead": dead, "reaped": reaped, "close": close_s, "cancelled": True}


def pool_close_round(pool: ExecPool, phase: float) -> dict:
    gen = pool.stream(ShellJob(C.TREE_COMMAND, timeout=JOB_TIMEOUT_S), heartbeat_interval_s=30.0)
    return _close_round(gen, lambda: C.pool_tree(pool), phase)


def pool_cancel_round(pool: ExecPool, phase: float) -> dict:
    event = threading.Event()
    gen = pool.stream(ShellJob(C.TREE_COMMAND, timeout=JOB_TIMEOUT_S), cancel_event=event,
                      heartbeat_interval_s=30.0)
    return _cancel_round(gen, lambda: C.pool_tree(pool), phase, event)


class _Reference:
    """The reference design, remembering the leader of its latest call."""

    def __init__(self) -> None:
        self.leader = 0
        self.ref = ThreadPerCall(reap_orphans=True, on_start=self._started)

    def _started(self, call) -> None:
        self.leader = call.proc.pid

    def tree(self) -> dict:
        return C.subtree(self.leader)

    def cancel_round(self, phase: float) -> dict:
        event = threading.Event()
        gen = self.ref.stream(shell_argv(C.TREE_COMMAND), cancel_event=event, heartbeat_interval_s=30.0)
        return _cancel_round(gen, self.tree, phase, event)

    def close_round(self, phase: float) -> dict:
        gen = self.ref.stream(shell_argv(C.TREE_COMMAND), heartbeat_interval_s=30.0)
        return _close_round(gen, self.tree, phase)


def floor_round(phase: float) -> dict:
    """No design at all: this thread Popens the tree, and at the cancel
    killpg()s its group and reaps it at once -- the kernel's share of any
    design's figure (51 exits and reaps)."""
    proc = subprocess.Popen(shell_argv(C.TREE_COMMAND), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            start_new_session=True)
    try:
        while b"ready" not in proc.stdout.readline():
            pass
        tree = C.subtree(proc.pid)
        time.sleep(phase)
        t0 = time.perf_counter()
        os.killpg(proc.pid, signal.SIGKILL)
        while True:  # this process is a subreaper: the orphans come here
            try:
                os.waitpid(-proc.pid, 0)
            except ChildProcessError:
                break
        dead, reaped = C.wait_gone(tree, t0)
    finally:
        proc.stdout.close()
    return {"tree": len(tree), "dead": dead, "reaped": reaped, "cancelled": True}


def variants(pool: ExecPool, names: tuple[str, ...] | None = None) -> dict:
    """name -> (label, round function of the phase)."""
    ref = _Reference()
    table = {
        "pool_close": ("execpool stream close()", lambda phase: pool_close_round(pool, phase)),
        "pool_cancel_event": ("execpool cancel_event.set()", lambda phase: pool_cancel_round(pool, phase)),
        "reference_cancel_event": (f"reference cancel_event.set() ({WATCH_POLL_S:g} s watcher)",
                                   ref.cancel_round),
        "reference_close": (f"reference close() ({WATCH_POLL_S:g} s watcher)", ref.close_round),
        "floor": ("floor: killpg + waitpid from the caller, no poll", floor_round),
    }
    if names is not None:
        table = {k: v for k, v in table.items() if k in names}
    return table


def bench_kill(pool: ExecPool, rounds: int, warmup: int, seed: int,
               names: tuple[str, ...] | None = None) -> dict:
    """Interleaved rounds of every variant; name -> summary (ms)."""
    table = variants(pool, names)
    rng = random.Random(seed)
    samples: dict[str, list[dict]] = {name: [] for name in table}
    with C.subreaper():
        for i in range(warmup + rounds):
            # The cancel lands at a random point of any poll period, as a
            # user's click would; the same delay for every design.
            phase = rng.uniform(0.0, WATCH_POLL_S)
            for name, (_label, round_fn) in table.items():
                sample = round_fn(phase)
                if i >= warmup:
                    samples[name].append(sample)
    out = {}
    for name, rounds_of in samples.items():
        summary = C.summarise_kills(rounds_of)
        summary["label"] = table[name][0]
        summary["not_cancelled"] = sum(not r["cancelled"] for r in rounds_of)
        out[name] = summary
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20, help="measured rounds (default 20)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up rounds (default 2)")
    parser.add_argument("--workers", type=int, default=2, help="pool workers (default 2)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the cancel delays (default 1)")
    args = C.parse_args(parser, argv, smoke={"rounds": 1, "warmup": 0})
    if args.rounds < 1 or args.workers < 1 or args.warmup < 0:
        parser.error("--rounds and --workers must be at least 1, --warmup not negative")

    load_before = C.load()
    started = time.perf_counter()
    with ExecPool(workers=args.workers, max_jobs_per_worker=1_000_000) as pool:
        results = bench_kill(pool, args.rounds, args.warmup, args.seed)
    elapsed = time.perf_counter() - started

    targets = {
        "close_to_reaped_ms": C.target(results["pool_close"]["reaped_ms_median"], TARGET_MS, "<=", "ms"),
        "cancel_event_to_reaped_ms": C.target(results["pool_cancel_event"]["reaped_ms_median"], TARGET_MS,
                                              "<=", "ms"),
    }
    judged = {"pool_close": targets["close_to_reaped_ms"], "pool_cancel_event": targets["cancel_event_to_reaped_ms"]}

    print(f"execpool kill: {C.TREE_SIZE}-process tree, {args.rounds} interleaved rounds, {args.workers} workers, "
          f"{os.cpu_count()} CPUs, load {load_before}, {elapsed:.1f} s")
    print()
    rows = []
    for name, s in results.items():
        entry = judged.get(name)
        rows.append([s["label"], s["dead_ms_median"], s["reaped_ms_median"], s["reaped_ms_p90"],
                     s["reaped_ms_max"], s["unreaped_rounds"] + s["not_cancelled"],
                     entry["target"] if entry else "", C.met_cell(entry) if entry else ""])
    C.print_table("Cancel to tree dead / reaped (ms; medians, p90 and max of the reaped time)",
                  ["design", "dead", "reaped", "p90", "max", "failed", "target", "met"], rows)
    print(f"  (execpool gen.close() itself returned after {results['pool_close']['close_ms_median']} ms median)")
    print()
    C.emit_json({
        "benchmark": "kill",
        "rounds": args.rounds,
        "workers": args.workers,
        "tree_size": C.TREE_SIZE,
        "elapsed_s": round(elapsed, 2),
        "machine": C.machine(),
        "load": {"before": load_before, "after": C.load()},
        "designs": results,
        "targets": targets,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
