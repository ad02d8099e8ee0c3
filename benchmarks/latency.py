"""Latency of execpool against the simplest thing that does the same job.

Run from the repository root::

    python benchmarks/latency.py            # or: python -m benchmarks.latency
    python benchmarks/latency.py --bash-iters 500 --python-iters 100 --cancel-rounds 40
    python benchmarks/latency.py --cancel-rounds 0      # exec round trips only

1. Exec round trip, on a warm pool, in interleaved pairs (pool, raw, pool,
   raw, ...) after a few warm-up pairs; reported: the median of each, the
   ratio of the medians, and the median per-pair overhead.

   - bash: ``pool.run(ShellJob("echo hi"))`` against
     ``subprocess.Popen([bash, "-c", "echo hi"], stdout=PIPE, stderr=STDOUT).communicate()``;
     and, as a diagnostic without a target, the same job with ``cwd`` given,
     so the pool makes and removes no private directory for it.
   - cold python: ``pool.run(PythonJob('print("hi")'))`` against the same
     Popen of ``[sys.executable, "-u", FILE]``.
   - warm python: ``pool.run(PythonJob('print("hi")', warm=True))`` (the
     worker forks itself and runs the code without a new interpreter) against
     the same raw cold start; reported as a speed-up, raw / pool. Left out,
     with a note, when this execpool's PythonJob has no ``warm``.

2. What the sandbox adds (``--sandbox-iters``, 0 to skip; execpool/shared/kernel/sandbox.py):
   the same bash, cold and warm jobs with ``sandbox="strict"`` and without,
   in pairs whose order alternates (plain first, then sandboxed first), so
   neither gains from coming second; reported: the median of each, the
   median per-pair difference ("added"), and what the sandbox added to the
   tool's own CPU time (its Result's ``cpu_s``, medians), a figure a busy
   machine disturbs far less than wall time. Left out, with a note, where
   the machine offers no sandbox.

3. Cancel to tree dead (``--cancel-rounds``, 0 to skip): ``gen.close()`` of
   a ``pool.stream`` against the reference design's 0.2 s polling watcher,
   on a 51-process tree, as in benchmarks/kill.py (which also times
   ``cancel_event.set()``; the code is shared).

Targets (printed, not asserted): bash ratio <= 1.15, cold python ratio
<= 1.10, warm python >= 6x faster than raw cold, the sandbox adding <= 0.3 ms
per job (median, each kind), cancel-to-reaped median <= 10 ms. The last
line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _common as C
from benchmarks import kill
from execpool import ExecPool, PythonJob, ShellJob

BASH = C.BASH

TARGET_BASH_RATIO = 1.15
TARGET_PYTHON_RATIO = 1.10
TARGET_WARM_SPEEDUP = 6.0
TARGET_CANCEL_MS = kill.TARGET_MS
TARGET_SANDBOX_ADDED_MS = 0.3


# --- exec round trip ------------------------------------------------------------


def _raw(argv: list[str]) -> bytes:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"raw {argv!r} exited {proc.returncode}: {out!r}")
    return out


def bench_exec(pool: ExecPool, job, argv: list[str], expected: str, iters: int, warmup: int) -> dict:
    pool_s: list[float] = []
    raw_s: list[float] = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        result = pool.run(job)
        t1 = time.perf_counter()
        out = _raw(argv)
        t2 = time.perf_counter()
        if result.exit_code != 0 or result.output != expected:
            raise RuntimeError(f"pool run of {job!r} gave {result!r}")
        if out.decode() != expected:
            raise RuntimeError(f"raw run of {argv!r} gave {out!r}")
        if i >= warmup:
            pool_s.append(t1 - t0)
            raw_s.append(t2 - t1)
    pool_med, raw_med = C.median(pool_s), C.median(raw_s)
    return {
        "n": iters,
        "pool_ms_median": C.ms(pool_med),
        "raw_ms_median": C.ms(raw_med),
        "pool_ms_p90": C.ms(C.quantile(pool_s, 0.9)),
        "raw_ms_p90": C.ms(C.quantile(raw_s, 0.9)),
        "overhead_ms_median": C.ms(C.median([p - r for p, r in zip(pool_s, raw_s)])),
        "ratio": round(pool_med / raw_med, 3),
        "speedup": round(raw_med / pool_med, 2),
    }


def _sandbox_missing() -> str | None:
    """Why this machine (or this execpool) has no sandbox; None if it has."""
    try:
        from execpool import sandbox_support
    except ImportError:
        return "this execpool has no sandbox"
    return sandbox_support().missing


def bench_sandbox(pool: ExecPool, make, iters: int, warmup: int) -> dict:
    """``make(sandbox)`` builds the job; pairs of it without and with the
    sandbox, the order alternating."""
    plain_s: list[float] = []
    boxed_s: list[float] = []
    plain_cpu: list[float] = []
    boxed_cpu: list[float] = []
    for i in range(warmup + iters):
        order = (None, "strict") if i % 2 == 0 else ("strict", None)
        for sandbox in order:
            t0 = time.perf_counter()
            result = pool.run(make(sandbox))
            elapsed = time.perf_counter() - t0
            if result.exit_code != 0 or result.output != "hi\n":
                raise RuntimeError(f"pool run with sandbox={sandbox!r} gave {result!r}")
            if i >= warmup:
                (boxed_s if sandbox else plain_s).append(elapsed)
                (boxed_cpu if sandbox else plain_cpu).append(result.cpu_s or 0.0)
    return {
        "n": iters,
        "plain_ms_median": C.ms(C.median(plain_s)),
        "sandboxed_ms_median": C.ms(C.median(boxed_s)),
        "added_ms_median": C.ms(C.median([b - p for p, b in zip(plain_s, boxed_s)])),
        "tool_cpu_added_ms_median": C.ms(C.median(boxed_cpu) - C.median(plain_cpu)),
    }


# --- main -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bash-iters", type=int, default=200, help="measured bash pairs (default 200)")
    parser.add_argument("--python-iters", type=int, default=60,
                        help="measured cold and warm python pairs, each (default 60)")
    parser.add_argument("--sandbox-iters", type=int, default=200,
                        help="measured sandboxed/plain pairs for bash, a third as many for cold and warm python "
                             "(default 200; 0 to skip)")
    parser.add_argument("--cancel-rounds", type=int, default=20,
                        help="measured cancel rounds, 0 to skip (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up pairs/rounds before measuring (default 5)")
    parser.add_argument("--workers", type=int, default=2, help="pool workers (default 2)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the cancel delays (default 1)")
    args = C.parse_args(parser, argv, smoke={"bash_iters": 3, "python_iters": 2, "sandbox_iters": 2,
                                             "cancel_rounds": 1, "warmup": 1})
    for name in ("bash_iters", "python_iters", "workers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or args.cancel_rounds < 0 or args.sandbox_iters < 0:
        parser.error("--warmup, --sandbox-iters and --cancel-rounds must not be negative")

    has_warm = C.python_job_accepts("warm")
    load_before = C.load()
    started = time.perf_counter()
    tmpdir = tempfile.mkdtemp(prefix="execpool-bench-")
    warm = cancel = None
    sandbox: dict = {}
    sandbox_missing = _sandbox_missing()
    try:
        script = os.path.join(tmpdir, "hi.py")
        with open(script, "w") as f:
            f.write('print("hi")\n')
        raw_python = [sys.executable, "-u", script]
        # Recycling a worker mid-run would put a worker start in some samples.
        try:
            pool = ExecPool(workers=args.workers, max_jobs_per_worker=1_000_000)
        except Exception as exc:  # noqa: BLE001 - reported as the run's result
            print(f"execpool latency: cannot start the pool: {type(exc).__name__}: {exc}")
            C.emit_json({"benchmark": "latency", "error": f"{type(exc).__name__}: {exc}"})
            return 2
        with pool:
            bash = bench_exec(pool, ShellJob("echo hi"), [BASH, "-c", "echo hi"], "hi\n",
                              args.bash_iters, args.warmup)
            # Diagnostic: the same with a given cwd, so no private directory
            # is made and removed per job -- what that costs.
            bash_cwd = bench_exec(pool, ShellJob("echo hi", cwd=tmpdir), [BASH, "-c", "echo hi"], "hi\n",
                                  (args.bash_iters + 1) // 2, args.warmup)
            python = bench_exec(pool, PythonJob('print("hi")'), raw_python, "hi\n",
                                args.python_iters, args.warmup)
            if has_warm:
                warm = bench_exec(pool, PythonJob('print("hi")', warm=True), raw_python, "hi\n",
                                  args.python_iters, args.warmup)
            if args.sandbox_iters and sandbox_missing is None:
                few = (args.sandbox_iters + 2) // 3
                sandbox["bash"] = bench_sandbox(pool, lambda box: ShellJob("echo hi", sandbox=box),
                                                args.sandbox_iters, args.warmup)
                sandbox["python_cold"] = bench_sandbox(pool, lambda box: PythonJob('print("hi")', sandbox=box),
                                                       few, args.warmup)
                if has_warm:
                    sandbox["python_warm"] = bench_sandbox(
                        pool, lambda box: PythonJob('print("hi")', warm=True, sandbox=box), few, args.warmup)
            if args.cancel_rounds:
                cancel = kill.bench_kill(pool, args.cancel_rounds, min(args.warmup, 2), args.seed,
                                         names=("pool_close", "reference_cancel_event"))
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    elapsed = time.perf_counter() - started

    targets = {
        "bash_ratio": C.target(bash["ratio"], TARGET_BASH_RATIO, "<="),
        "python_cold_ratio": C.target(python["ratio"], TARGET_PYTHON_RATIO, "<="),
        "python_warm_speedup": C.target(warm["speedup"] if warm else None, TARGET_WARM_SPEEDUP, ">="),
    }
    for kind, figures in sandbox.items():
        targets[f"sandbox_added_ms_{kind}"] = C.target(figures["added_ms_median"], TARGET_SANDBOX_ADDED_MS, "<=",
                                                       "ms")
    if cancel is not None:
        targets["close_to_reaped_ms"] = C.target(cancel["pool_close"]["reaped_ms_median"], TARGET_CANCEL_MS,
                                                 "<=", "ms")

    print(f"execpool latency: {args.workers} workers, python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs, load {load_before}, {elapsed:.1f} s")
    print()
    rows = [
        ["bash: echo hi", bash["n"], bash["pool_ms_median"], bash["raw_ms_median"], bash["pool_ms_p90"],
         bash["raw_ms_p90"], bash["overhead_ms_median"], f"{bash['ratio']}x", targets["bash_ratio"]["target"],
         C.met_cell(targets["bash_ratio"])],
        ["  (diagnostic) bash, cwd given", bash_cwd["n"], bash_cwd["pool_ms_median"], bash_cwd["raw_ms_median"],
         bash_cwd["pool_ms_p90"], bash_cwd["raw_ms_p90"], bash_cwd["overhead_ms_median"], f"{bash_cwd['ratio']}x",
         "", ""],
        ["python cold: print", python["n"], python["pool_ms_median"], python["raw_ms_median"],
         python["pool_ms_p90"], python["raw_ms_p90"], python["overhead_ms_median"], f"{python['ratio']}x",
         targets["python_cold_ratio"]["target"], C.met_cell(targets["python_cold_ratio"])],
    ]
    if warm is not None:
        rows.append(["python warm vs raw cold", warm["n"], warm["pool_ms_median"], warm["raw_ms_median"],
                     warm["pool_ms_p90"], warm["raw_ms_p90"], warm["overhead_ms_median"],
                     f"{warm['ratio']}x ({warm['speedup']}x faster)",
                     "speed-up " + targets["python_warm_speedup"]["target"],
                     C.met_cell(targets["python_warm_speedup"])])
    C.print_table("Exec round trip (ms, medians; interleaved pool/raw pairs)",
                  ["job", "n", "pool", "raw", "pool p90", "raw p90", "overhead", "pool/raw", "target", "met"],
                  rows)
    if warm is None:
        print("  note: this execpool's PythonJob has no `warm` field: the warm python row is skipped")
        print()
    if sandbox:
        C.print_table(
            "What the sandbox adds (ms, medians; pairs of plain and sandboxed, order alternating)",
            ["job", "n", "plain", "sandboxed", "added", "tool CPU added", "target", "met"],
            [[kind, f["n"], f["plain_ms_median"], f["sandboxed_ms_median"], f["added_ms_median"],
              f["tool_cpu_added_ms_median"], targets[f"sandbox_added_ms_{kind}"]["target"],
              C.met_cell(targets[f"sandbox_added_ms_{kind}"])] for kind, f in sandbox.items()],
        )
    elif args.sandbox_iters:
        print(f"  note: no sandbox rows: {sandbox_missing}")
        print()
    if cancel is not None:
        pool_cancel, base_cancel = cancel["pool_close"], cancel["reference_cancel_event"]
        C.print_table(
            f"Cancel to tree dead ({C.TREE_SIZE} processes; ms, medians over {args.cancel_rounds} interleaved rounds)",
            ["design", "dead", "reaped", "reaped p90", "reaped max", "unreaped", "target", "met"],
            [
                ["execpool stream close()", pool_cancel["dead_ms_median"], pool_cancel["reaped_ms_median"],
                 pool_cancel["reaped_ms_p90"], pool_cancel["reaped_ms_max"], pool_cancel["unreaped_rounds"],
                 targets["close_to_reaped_ms"]["target"], C.met_cell(targets["close_to_reaped_ms"])],
                [base_cancel["label"], base_cancel["dead_ms_median"], base_cancel["reaped_ms_median"],
                 base_cancel["reaped_ms_p90"], base_cancel["reaped_ms_max"], base_cancel["unreaped_rounds"],
                 "", ""],
            ],
        )
        print(f"  (execpool: gen.close() itself returned after {pool_cancel['close_ms_median']} ms median)")
        print()
    C.emit_json({
        "benchmark": "latency",
        "workers": args.workers,
        "elapsed_s": round(elapsed, 2),
        "machine": C.machine(),
        "load": {"before": load_before, "after": C.load()},
        "bash": bash,
        "bash_cwd_given": bash_cwd,
        "python": python,
        "python_warm": warm,
        "warm_available": has_warm,
        "sandbox": sandbox or None,
        "sandbox_missing": sandbox_missing,
        "cancel": cancel,
        "targets": targets,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
