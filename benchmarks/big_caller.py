"""Big caller: tool start latency when the calling process holds 2 GiB.

Run from the repository root::

    python benchmarks/big_caller.py          # or: python -m benchmarks.big_caller
    python benchmarks/big_caller.py --gib 4 --iters 60 --phases 3

A server process that holds gigabytes (model tokenizers, caches, request
state) pays for every ``fork`` of itself: the kernel copies its page tables,
35-45 ms per GiB on this VM, even when the child execs at once. Sandboxing servers
fork on every tool call because ``subprocess.Popen(..., preexec_fn=...)``
(to set rlimits, a new session, a seccomp filter) cannot use vfork.

This process measures, in interleaved triples after a warm-up:

- ``pool``: ``pool.run(ShellJob("true"))`` (the pool's workers are small and
  were started before the memory was taken; nothing forks the caller);
- ``Popen + preexec_fn``: ``subprocess.Popen([bash, "-c", "true"],
  preexec_fn=<no-op>, stdout=PIPE, stderr=STDOUT).communicate()`` from this
  process -- the full fork;
- ``Popen`` (for reference): the same without preexec_fn, which CPython
  starts with vfork.

It does so with a small caller (no extra memory) and with a big caller (a
``bytearray`` of ``--gib`` GiB with every page written, so it is resident,
and with transparent huge pages refused for it by ``madvise`` unless
``--thp``, as a heap of small objects would be), alternating small and big
phases (small, big, small, big, ...) so load drifts hit both.

Target: pool latency unchanged by caller size, i.e. the pool's big-caller
median within 10% (or 0.5 ms) of its small-caller median. The last line of
stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import mmap
import os
import subprocess
import sys
import time

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _common as C
from execpool import ExecPool, ShellJob

#: "Unchanged": the big-caller median at most this much above the small one.
TARGET_RATIO = 1.10
TARGET_SLACK_MS = 0.5
PAGE = mmap.PAGESIZE
MADV_NOHUGEPAGE = 15

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _noop() -> None:
    pass


def allocate(nbytes: int, thp: bool) -> bytearray:
    """A bytearray of ``nbytes`` with every page written (resident)."""
    buf = bytearray(nbytes)
    if not thp:
        address = ctypes.addressof((ctypes.c_char * nbytes).from_buffer(buf))
        start = (address + PAGE - 1) // PAGE * PAGE
        end = (address + nbytes) // PAGE * PAGE
        _libc.madvise(start, end - start, MADV_NOHUGEPAGE)  # best effort: refused where THP is absent
    buf[::PAGE] = b"\x01" * len(range(0, nbytes, PAGE))
    return buf


def pool_once(pool: ExecPool) -> float:
    t0 = time.perf_counter()
    result = pool.run(ShellJob("true"))
    elapsed = time.perf_counter() - t0
    if result.exit_code != 0:
        raise RuntimeError(f"pool run gave {result!r}")
    return elapsed


def popen_once(preexec: bool) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen([C.BASH, "-c", "true"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=_noop if preexec else None)
    proc.communicate()
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"raw run exited {proc.returncode}")
    return elapsed


def phase(pool: ExecPool, iters: int, warmup: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {"pool": [], "popen_preexec": [], "popen": []}
    for i in range(warmup + iters):
        p = pool_once(pool)
        f = popen_once(True)
        v = popen_once(False)
        if i >= warmup:
            samples["pool"].append(p)
            samples["popen_preexec"].append(f)
            samples["popen"].append(v)
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0, help="memory the big caller holds (default 2 GiB)")
    parser.add_argument("--iters", type=int, default=40, help="measured triples per phase (default 40)")
    parser.add_argument("--phases", type=int, default=2, help="small+big phase pairs (default 2)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up triples per phase (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="pool workers (default 2)")
    parser.add_argument("--thp", action="store_true", help="let the big buffer use transparent huge pages")
    args = C.parse_args(parser, argv, smoke={"gib": 1 / 64, "iters": 2, "phases": 1, "warmup": 1})
    if args.gib <= 0 or args.iters < 1 or args.phases < 1 or args.warmup < 0 or args.workers < 1:
        parser.error("--gib > 0, --iters >= 1, --phases >= 1, --warmup >= 0, --workers >= 1")
    nbytes = int(args.gib * (1 << 30))

    load_before = C.load()
    started = time.perf_counter()
    samples = {size: {"pool": [], "popen_preexec": [], "popen": []} for size in ("small", "big")}
    rss_mib = {"small": [], "big": []}
    alloc_s = []
    with ExecPool(workers=args.workers, max_jobs_per_worker=1_000_000) as pool:
        for _ in range(args.phases):
            for size in ("small", "big"):
                buf = None
                if size == "big":
                    t0 = time.perf_counter()
                    buf = allocate(nbytes, args.thp)
                    alloc_s.append(time.perf_counter() - t0)
                rss_mib[size].append(C.mib(C.rss()))
                for design, values in phase(pool, args.iters, args.warmup).items():
                    samples[size][design].extend(values)
                del buf
                gc.collect()
    elapsed = time.perf_counter() - started

    med = {size: {d: C.ms(C.median(v)) for d, v in by.items()} for size, by in samples.items()}
    p90 = {size: {d: C.ms(C.quantile(v, 0.9)) for d, v in by.items()} for size, by in samples.items()}
    growth = {d: round(med["big"][d] / med["small"][d], 3) for d in med["small"]}
    pool_small, pool_big = med["small"]["pool"], med["big"]["pool"]
    unchanged = pool_big <= max(pool_small * TARGET_RATIO, pool_small + TARGET_SLACK_MS)
    targets = {
        "pool_big_over_small": {"target": f"<= {TARGET_RATIO:g} x (or +{TARGET_SLACK_MS:g} ms)",
                                "value": growth["pool"], "met": unchanged},
        "pool_vs_popen_preexec_big": {"target": "pool faster", "value": round(pool_big / med["big"]["popen_preexec"], 3),
                                      "met": pool_big < med["big"]["popen_preexec"]},
    }

    print(f"execpool big caller: {args.gib:g} GiB resident in the big caller (THP {'allowed' if args.thp else 'refused'}), "
          f"{args.phases} x (small, big) phases of {args.iters} interleaved triples, {os.cpu_count()} CPUs, "
          f"load {load_before}, {elapsed:.1f} s")
    print(f"  caller RSS: small {rss_mib['small']} MiB, big {rss_mib['big']} MiB; "
          f"allocating took {C.median(alloc_s):.2f} s")
    print()
    labels = {"pool": "execpool pool.run(ShellJob('true'))", "popen_preexec": "Popen + preexec_fn (fork)",
              "popen": "Popen (vfork), for reference"}
    C.print_table("Start-to-exit latency of `bash -c true` (ms, medians; p90 in brackets)",
                  ["design", "small caller", f"{args.gib:g} GiB caller", "big/small"],
                  [[labels[d], f"{med['small'][d]} ({p90['small'][d]})", f"{med['big'][d]} ({p90['big'][d]})",
                    f"{growth[d]}x"] for d in med["small"]])
    C.print_targets(targets)
    C.emit_json({
        "benchmark": "big_caller",
        "gib": args.gib,
        "thp": args.thp,
        "iters_per_phase": args.iters,
        "phases": args.phases,
        "elapsed_s": round(elapsed, 2),
        "machine": C.machine(),
        "load": {"before": load_before, "after": C.load()},
        "caller_rss_mib": rss_mib,
        "alloc_s_median": round(C.median(alloc_s), 3),
        "median_ms": med,
        "p90_ms": p90,
        "big_over_small": growth,
        "targets": targets,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
