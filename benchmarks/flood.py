"""Flood: a tool writing 200 MB (1 GB with --gb) through a stream.

Run from the repository root::

    python benchmarks/flood.py              # or: python -m benchmarks.flood
    python benchmarks/flood.py --gb --reps 1
    python benchmarks/flood.py --mb 50 --line-bytes 4096

The tool is ``yes LINE | head -c BYTES`` under bash (100-byte lines by
default: 99 ``x`` and a newline), so the producer costs almost nothing and the
figure is the design's. Every event is consumed.

- execpool: ``pool.stream(ShellJob(...))`` on a one-worker pool. The worker
  forwards live output only up to the stream's cap and keeps only the
  Result's bounded head; the caller receives the cap, the notice and a
  Result with ``output_chars`` = BYTES.
- reference: the thread-per-call design (benchmarks/reference.py) keeping
  every line, with the same live cap applied where events are yielded.

Each trial runs in a fresh child process (``--trial``), so its memory figures
start from a clean heap and never inherit another trial's freed arenas; the
trials alternate between the designs (pool, reference, reference, pool, ...).
Per trial: throughput in MB/s (10^6 bytes, from the first ``next()`` to the
Result), caller peak RSS growth and worker peak RSS growth over the RSS after
a warm-up job, sampled with psutil every 5 ms in a thread (and, as a check,
the kernel's VmHWM after resetting it through /proc/PID/clear_refs).

Targets: execpool >= 3x the reference's MB/s (medians); caller RSS growth
<= 5 MiB and worker RSS growth <= 16 MiB (the largest over the trials, of
the sampled peak and the kernel's VmHWM).
The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _common as C
from benchmarks.reference import ThreadPerCall, shell_argv

TARGET_SPEEDUP = 3.0
TARGET_CALLER_MIB = 5.0
TARGET_WORKER_MIB = 16.0
DESIGNS = ("pool", "reference")


def flood_command(total: int, line_bytes: int) -> str:
    line = "x" * (line_bytes - 1)
    return f"yes {line} | head -c {total}"


def _consume(gen) -> tuple[int, int, object]:
    """(events, streamed chars, result) of a stream drained to its end."""
    events = chars = 0
    while True:
        try:
            event = next(gen)
        except StopIteration as stop:
            return events, chars, stop.value
        events += 1
        if event["type"] == "tool_output":
            chars += len(event["text"])


def _measure(stream_factory, pids: dict[str, int], sample_s: float) -> dict:
    gc.collect()
    hwm_ok = all(C.reset_peak_rss(pid) for pid in pids.values())
    hwm_base = {name: C.rss(pid) for name, pid in pids.items()}
    sampler = C.Sampler(pids, sample_s).start()
    t0 = time.perf_counter()
    events, chars, result = _consume(stream_factory())
    seconds = time.perf_counter() - t0
    sampler.stop()
    figures = {"seconds": seconds, "events": events, "streamed_chars": chars, "samples": sampler.samples,
               "output_chars": result.output_chars, "exit_code": result.exit_code}
    for name, pid in pids.items():
        figures[f"{name}_rss_base_mib"] = C.mib(sampler.base[name])
        figures[f"{name}_growth_mib"] = C.mib(sampler.growth(name))
        hwm = C.peak_rss(pid) if hwm_ok else None
        figures[f"{name}_hwm_growth_mib"] = C.mib(hwm - hwm_base[name]) if hwm is not None else None
    return figures


def trial(design: str, total: int, line_bytes: int, sample_s: float) -> dict:
    command = flood_command(total, line_bytes)
    if design == "pool":
        from execpool import ExecPool, ShellJob

        with ExecPool(workers=1, max_jobs_per_worker=1_000_000) as pool:
            _consume(pool.stream(ShellJob("echo warm")))
            pids = {"caller": os.getpid(), "worker": pool.worker_pids[0]}
            figures = _measure(lambda: pool.stream(ShellJob(command, timeout=600), heartbeat_interval_s=30.0),
                               pids, sample_s)
    else:
        ref = ThreadPerCall()
        _consume(ref.stream(shell_argv("echo warm")))
        figures = _measure(lambda: ref.stream(shell_argv(command), heartbeat_interval_s=30.0),
                           {"caller": os.getpid()}, sample_s)
    figures["design"] = design
    figures["bytes"] = total
    figures["mb_per_s"] = round(total / 1e6 / figures["seconds"], 1)
    figures["ok"] = figures["exit_code"] == 0 and figures["output_chars"] == total
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=200, help="megabytes (10^6 bytes) the tool writes (default 200)")
    parser.add_argument("--gb", action="store_true", help="write 1 GB (1000 MB) instead")
    parser.add_argument("--line-bytes", type=int, default=100, help="bytes per line, newline included (default 100)")
    parser.add_argument("--reps", type=int, default=5, help="trials per design (default 5)")
    parser.add_argument("--sample-ms", type=float, default=5.0, help="RSS sampling period (default 5 ms)")
    parser.add_argument("--designs", default=",".join(DESIGNS), help="comma-separated: pool,reference")
    parser.add_argument("--trial", choices=DESIGNS, help=argparse.SUPPRESS)  # one trial, in this process
    args = C.parse_args(parser, argv, smoke={"mb": 1, "reps": 1})
    total = (1000 if args.gb else args.mb) * 1_000_000
    designs = [d for d in args.designs.split(",") if d]
    if args.line_bytes < 2 or args.reps < 1 or total < 1 or not designs or set(designs) - set(DESIGNS):
        parser.error("--line-bytes >= 2, --reps >= 1, --mb >= 1, --designs from pool,reference")
    if args.trial:
        C.emit_json(trial(args.trial, total, args.line_bytes, args.sample_ms / 1000.0))
        return 0

    load_before = C.load()
    started = time.perf_counter()
    trials: dict[str, list[dict]] = {d: [] for d in designs}
    child_args = ["--mb", str(total // 1_000_000), "--line-bytes", str(args.line_bytes),
                  "--sample-ms", str(args.sample_ms)]
    for rep in range(args.reps):
        # ABBA order, so a drift in the machine's load does not favour one design.
        for design in (designs if rep % 2 == 0 else designs[::-1]):
            trials[design].append(C.run_child("flood", [*child_args, "--trial", design],
                                              timeout=120 + total / 1e6))
    elapsed = time.perf_counter() - started

    summary = {}
    for design, runs in trials.items():
        summary[design] = {
            "mb_per_s_median": round(C.median([r["mb_per_s"] for r in runs]), 1),
            "seconds_median": round(C.median([r["seconds"] for r in runs]), 3),
            "caller_growth_mib_median": C.median([r["caller_growth_mib"] for r in runs]),
            "caller_growth_mib_max": max(r["caller_growth_mib"] for r in runs),
            "caller_hwm_growth_mib_max": _max_or_none([r["caller_hwm_growth_mib"] for r in runs]),
            "worker_growth_mib_median": _median_or_none([r.get("worker_growth_mib") for r in runs]),
            "worker_growth_mib_max": _max_or_none([r.get("worker_growth_mib") for r in runs]),
            "worker_hwm_growth_mib_max": _max_or_none([r.get("worker_hwm_growth_mib") for r in runs]),
            "all_ok": all(r["ok"] for r in runs),
        }
    targets = {}
    if "pool" in summary:
        pool = summary["pool"]
        if "reference" in summary:
            speedup = round(pool["mb_per_s_median"] / summary["reference"]["mb_per_s_median"], 2)
            pool["speedup"] = speedup
            targets["throughput_vs_reference"] = C.target(speedup, TARGET_SPEEDUP, ">=", "x")
        # Judged on the larger of the sampled peak and the kernel's exact one.
        targets["caller_rss_growth_mib"] = C.target(
            _max_or_none([pool["caller_growth_mib_max"], pool["caller_hwm_growth_mib_max"]]),
            TARGET_CALLER_MIB, "<=", "MiB")
        targets["worker_rss_growth_mib"] = C.target(
            _max_or_none([pool["worker_growth_mib_max"], pool["worker_hwm_growth_mib_max"]]),
            TARGET_WORKER_MIB, "<=", "MiB")
        targets["correct"] = {"target": "output_chars == bytes, exit 0", "value": pool["all_ok"],
                              "met": pool["all_ok"]}

    print(f"execpool flood: {total / 1e6:.0f} MB in {args.line_bytes}-byte lines, {args.reps} trial(s) per "
          f"design (each in a fresh process), {os.cpu_count()} CPUs, load {load_before}, {elapsed:.1f} s")
    print()
    labels = {"pool": "execpool pool.stream", "reference": "reference (thread per call, keeps every line)"}
    rows = []
    for design, s in summary.items():
        rows.append([labels[design], s["mb_per_s_median"], s["seconds_median"], s["caller_growth_mib_median"],
                     s["caller_growth_mib_max"], s["caller_hwm_growth_mib_max"], s["worker_growth_mib_max"],
                     s["worker_hwm_growth_mib_max"], "yes" if s["all_ok"] else "NO"])
    C.print_table("Throughput and peak RSS growth (MB/s and s: medians; MiB: median / max over trials)",
                  ["design", "MB/s", "s", "caller", "caller max", "caller HWM", "worker max", "worker HWM",
                   "correct"], rows)
    if targets:
        C.print_targets(targets)
    C.emit_json({
        "benchmark": "flood",
        "bytes": total,
        "line_bytes": args.line_bytes,
        "reps": args.reps,
        "elapsed_s": round(elapsed, 2),
        "machine": C.machine(),
        "load": {"before": load_before, "after": C.load()},
        "designs": summary,
        "trials": trials,
        "targets": targets,
    })
    return 0


def _median_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return C.median(values) if values else None


def _max_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


if __name__ == "__main__":
    sys.exit(main())
