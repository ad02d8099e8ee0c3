"""Where one job's milliseconds go: a timestamped walk through the caller,
the worker and back, for a bash job, a warm Python job, or a close() kill.

Run from the repository root::

    python -m benchmarks.timeline bash --iters 300
    python -m benchmarks.timeline bash --cwd /tmp      # no private directory per job
    python -m benchmarks.timeline warm --iters 200
    python -m benchmarks.timeline warm --gap raw      # a raw cold start between jobs, as latency.py pairs them
    python -m benchmarks.timeline kill --iters 25

Nothing in execpool is changed. The pool's workers start as this file's
``_worker_main`` (``_common.workers_run_as``), which wraps a few worker
methods with ``time.monotonic()`` stamps (CLOCK_MONOTONIC: comparable
across processes) and then runs the real worker; in the caller, the pool's
public ``submit`` is wrapped and each future stamps its end. The worker
writes its stamps to a file at exit. Printed: the median time of each step
from one stamp to the next (bash, warm), or the median time of each stamp
after ``close()`` began (kill). The wrapped names are execpool internals: one
that no longer exists is named under ``unwrapped`` in the last line of
stdout, one JSON object with the medians.
"""

from __future__ import annotations

import argparse
import atexit
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BASH_STEPS = ["c_run_in", "c_submit_in", "c_start_sent", "w_start_recv", "w_spawn_in", "w_spawn_out",
              "w_spawned_sent", "w_finish_in", "w_finished_pre_send", "w_finished_sent", "c_finished_routed",
              "c_run_out"]


# --- in the worker ----------------------------------------------------------------

#: A worker's command line: its directory is /, so the repository is put on its path.
WORKER_BOOT = ("import sys\nsys.path.insert(0, sys.argv[1])\nfrom benchmarks.timeline import _worker_main\n"
               "_worker_main(sys.argv[2], sys.argv[3:])\n")


def _worker_main(out_path: str, worker_argv: list[str]) -> None:
    import execpool.shared.kernel.proctree as proctree
    import execpool.worker.launch as launch
    import execpool.worker.event_loop as worker
    import execpool.worker.warm.handover as handover
    from execpool.shared import worker_wire

    marks: dict[str, dict[str, float]] = {}
    unwrapped: list[str] = []
    current = {"job": None}

    def stamp(job_id, name: str) -> None:
        if job_id is not None:
            marks.setdefault(str(job_id), {}).setdefault(name, time.monotonic())

    def wrap(owner, attr: str, before=None, after=None) -> None:
        original = getattr(owner, attr, None)
        if original is None:
            unwrapped.append(f"{owner.__name__}.{attr}")
            return

        def wrapper(*args, **kwargs):
            if before:
                before(*args)
            result = original(*args, **kwargs)
            if after:
                after(*args)
            return result

        setattr(owner, attr, wrapper)

    W = worker.Worker
    wrap(W, "_start", before=lambda self, start: stamp(start.job_id, "w_start_recv"))
    # A cold tool is started, a warm job handed over to a spare: either is the start.
    for owner, attr in ((launch.Launcher, "start"), (handover.WarmJobs, "_hand_over")):
        wrap(owner, attr, before=lambda self, job, *_: stamp(job.start.job_id, "w_spawn_in"),
             after=lambda self, job, *_: stamp(job.start.job_id, "w_spawn_out"))
    wrap(W, "_finish", before=lambda self, job: stamp(job.start.job_id, "w_finish_in")
         if job.start.job_id in self.jobs else None)

    def end_before(self, job, ending):
        current["job"] = job.start.job_id
        stamp(job.start.job_id, "w_cancel_handled")

    wrap(W, "end", before=end_before, after=lambda self, job, ending: stamp(job.start.job_id, "w_end_out"))

    def send_before(self, msg):
        if isinstance(msg, worker_wire.Finished):
            stamp(msg.job_id, "w_finished_pre_send")

    def send_after(self, msg):
        if isinstance(msg, worker_wire.Finished):
            stamp(msg.job_id, "w_finished_sent")
            current["job"] = None
        elif isinstance(msg, worker_wire.Spawned):
            stamp(msg.job_id, "w_spawned_sent")

    wrap(W, "send", before=send_before, after=send_after)
    for attr, name in (("_subtree_pids", "w_walk"), ("_killpg", "w_killpg"), ("_marked", "w_sweep")):
        wrap(proctree, attr, before=lambda *a, name=name: stamp(current["job"], name + "_in"),
             after=lambda *a, name=name: stamp(current["job"], name + "_out"))

    def dump() -> None:
        with open(out_path, "w") as f:
            json.dump({"marks": marks, "unwrapped": unwrapped}, f)

    atexit.register(dump)
    worker.main(worker_argv)


# --- in the caller ------------------------------------------------------------------


def _caller_stamps(supervisor, marks: dict) -> None:
    """Stamps around the pool's public ``submit``; the future's done
    callback runs on the dispatcher thread as it routes the Finished."""
    pool_cls = supervisor.ExecPool
    submit = pool_cls.submit

    def stamped_submit(self, job, **kw):
        t = time.monotonic()
        future = submit(self, job, **kw)
        job_id = str(future.job_id)
        marks.setdefault(job_id, {}).update(c_submit_in=t, c_start_sent=time.monotonic())
        marks["_last"] = future.job_id
        future.add_done_callback(lambda _: marks[job_id].setdefault("c_finished_routed", time.monotonic()))
        return future

    pool_cls.submit = stamped_submit


def _steps(rows: list[dict], order: list[str]) -> list[tuple[str, float, int]]:
    deltas: dict[str, list[float]] = {}
    for m in rows:
        seq = [(k, m[k]) for k in order if k in m]
        for (a, ta), (b, tb) in zip(seq, seq[1:]):
            deltas.setdefault(f"{a} -> {b}", []).append(tb - ta)
        if "c_run_in" in m and "c_run_out" in m:
            deltas.setdefault("TOTAL", []).append(m["c_run_out"] - m["c_run_in"])
    return [(k, statistics.median(v) * 1e3, len(v)) for k, v in deltas.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=["bash", "warm", "kill"])
    parser.add_argument("--iters", type=int, default=200, help="jobs (kill: rounds) measured (default 200)")
    parser.add_argument("--cwd", help="bash/warm: run the jobs in this directory (no private directory per job)")
    parser.add_argument("--gap", choices=["none", "raw"], default="none",
                        help="bash/warm: between jobs, nothing (default) or the raw Popen of the same tool "
                             "(cold python for warm), as the interleaved pairs of latency.py do")

    import execpool.supervisor as supervisor
    from benchmarks import _common as C
    from execpool import ExecPool, PythonJob, ShellJob

    args = C.parse_args(parser, argv, smoke={"iters": 3})
    out_dir = tempfile.mkdtemp(prefix="execpool-timeline-")
    caller: dict = {}
    _caller_stamps(supervisor, caller)
    measured = []
    with C.workers_run_as(["-c", WORKER_BOOT, C.REPO, os.path.join(out_dir, f"worker-{C.WORKER_NUMBER}.json")]), \
            ExecPool(workers=1, max_jobs_per_worker=1_000_000) as pool:
        if args.scenario in ("bash", "warm"):
            if args.scenario == "warm" and not C.python_job_accepts("warm"):
                print("this execpool's PythonJob has no `warm`")
                return 2
            job = (ShellJob("echo hi", cwd=args.cwd) if args.scenario == "bash"
                   else PythonJob('print("hi")', warm=True, cwd=args.cwd))
            script = os.path.join(out_dir, "raw.py")
            with open(script, "w") as f:
                f.write('print("hi")\n')
            raw = [C.BASH, "-c", "echo hi"] if args.scenario == "bash" else [sys.executable, "-u", script]
            for i in range(5 + args.iters):
                t0 = time.monotonic()
                pool.run(job)
                t1 = time.monotonic()
                if args.gap == "raw":
                    subprocess.run(raw, stdout=subprocess.DEVNULL, check=True)
                if i >= 5:
                    entry = caller[str(caller["_last"])]
                    entry.update(c_run_in=t0, c_run_out=t1)
                    measured.append(str(caller["_last"]))
        else:
            for _ in range(args.iters):
                gen = pool.stream(ShellJob(C.TREE_COMMAND, timeout=60), heartbeat_interval_s=30.0)
                text = ""
                while "ready" not in text:
                    text += next(gen).get("text", "")
                tree = C.pool_tree(pool)
                job_id = str(caller["_last"])
                time.sleep(0.05)
                t0, p0 = time.monotonic(), time.perf_counter()
                gen.close()
                close_out = time.monotonic()
                dead, reaped = C.wait_gone(tree, p0)
                caller[job_id].update(c_close_in=t0, c_close_out=close_out,
                                      c_tree_dead=t0 + (dead or float("nan")),
                                      c_tree_reaped=t0 + (reaped or float("nan")))
                measured.append(job_id)
    worker_marks: dict = {}
    unwrapped: set[str] = set()
    for path in glob.glob(os.path.join(out_dir, "worker-*.json")):
        with open(path) as f:
            dumped = json.load(f)
        worker_marks.update(dumped["marks"])
        unwrapped.update(dumped["unwrapped"])
    shutil.rmtree(out_dir, ignore_errors=True)
    rows = [{**caller[j], **worker_marks.get(j, {})} for j in measured]

    print(f"execpool timeline: {args.scenario}, {len(rows)} measured, load {C.load()}")
    if args.scenario == "kill":
        after: dict[str, list[float]] = {}
        for m in rows:
            for k, t in m.items():
                if k != "c_close_in":
                    after.setdefault(k, []).append((t - m["c_close_in"]) * 1e3)
        table = sorted(((k, statistics.median(v), len(v)) for k, v in after.items()
                        if not k.startswith(("c_submit", "c_start", "w_start", "w_spawn"))), key=lambda r: r[1])
        C.print_table("Median ms after gen.close() began", ["stamp", "ms", "n"], table)
    else:
        table = _steps(rows, BASH_STEPS)
        C.print_table("Median ms per step (one job, stamp to next stamp)", ["step", "ms", "n"], table)
    if unwrapped:
        print(f"  note: no stamps from {', '.join(sorted(unwrapped))}: execpool has no such method now")
        print()
    C.emit_json({"benchmark": "timeline", "scenario": args.scenario, "measured": len(rows),
                 "median_ms": {name: round(ms, 3) for name, ms, _ in table}, "unwrapped": sorted(unwrapped),
                 "load": C.load(), "machine": C.machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
