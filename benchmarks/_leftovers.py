"""What a long run may leave behind, counted: used by benchmarks/soak.py.

This process's threads and descriptors, its descendants sorted into tool
processes (carrying a job's marker), the pool's own helpers, others and
zombies; every live process on the system that carries a job's marker (this
run's, told apart by ``RUN_VAR``, and others'); and this process's memory at
checkpoints -- RSS untrimmed and after ``malloc_trim(0)``, anonymous and
file-backed, and the Python heap ``tracemalloc`` traces -- with the drift
and slope helpers the soak's verdict is built from (its docstring says how).
"""

from __future__ import annotations

import ctypes
import gc
import os
import statistics
import threading
import time
import tracemalloc
from typing import Optional

import psutil

from benchmarks import _common as C
from execpool import ExecPool

#: Every job of a soak run carries these (the run's id, the job's kind) in
#: its environment; every tool process carries the job marker.
RUN_VAR = "EXECPOOL_SOAK_RUN"
KIND_VAR = "EXECPOOL_SOAK_KIND"
MARKER_VAR = "EXECPOOL_JOB"

try:
    _malloc_trim = ctypes.CDLL(None).malloc_trim  # glibc
except (OSError, AttributeError):
    _malloc_trim = None


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def native_thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def _has_job(env: Optional[dict]) -> bool:
    """Carries a job's marker: workers and their warm template and spares
    carry the variable too, blank (room a warm job stamps its marker into)."""
    return bool(env and env.get(MARKER_VAR, "").strip())


def marked_processes(run_id: str) -> dict:
    """Live processes anywhere carrying EXECPOOL_JOB: of this run / of others."""
    ours: list[dict] = []
    others = 0
    me = os.getpid()
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        env = C.environ_of(proc)
        if not _has_job(env):
            continue
        try:
            name = proc.name()
        except psutil.Error:
            continue
        if env.get(RUN_VAR) == run_id:
            ours.append({"pid": proc.pid, "name": name, "kind": env.get(KIND_VAR), "job": env.get(MARKER_VAR)})
        else:
            others += 1
    return {"ours": ours, "others": others}


def snapshot(pool: ExecPool, run_id: str) -> dict:
    workers = set(pool.worker_pids)
    zombies = tools = helpers = others = 0
    for proc in C.descendants():
        if proc.pid in workers:
            continue
        if C.is_dead(proc):
            zombies += 1
            continue
        env = C.environ_of(proc)
        if _has_job(env):
            tools += 1
        elif C.is_pool_helper(proc):
            helpers += 1
        else:
            others += 1
    marked = marked_processes(run_id)
    return {
        "threads": threading.active_count(),
        "native_threads": native_thread_count(),
        "fds": fd_count(),
        "rss_mb": round(psutil.Process().memory_info().rss / 2**20, 1),
        "workers": len(workers),
        "pool_helpers": helpers,
        "tool_processes": tools,
        "other_processes": others,
        "zombies": zombies,
        "marked_ours": len(marked["ours"]),
        "marked_others": marked["others"],
        "_marked_detail": marked["ours"][:10],
    }


def rss_checkpoint() -> dict:
    """This process's RSS (MiB) after gc, untrimmed and after malloc_trim(0),
    and the Python heap tracemalloc sees (bytes)."""
    gc.collect()
    raw = psutil.Process().memory_info().rss
    if _malloc_trim is not None:
        _malloc_trim(0)
    trimmed = psutil.Process().memory_info().rss
    point = {"raw_mib": round(raw / 2**20, 2), "trimmed_mib": round(trimmed / 2**20, 2), **_rss_parts()}
    point["traced_bytes"] = tracemalloc.get_traced_memory()[0]
    return point


def checkpoints_at(jobs: int, segments: int) -> list[dict]:
    """Where the checkpoints of a run fall (their ``jobs``), before it runs."""
    return [{"jobs": jobs * (seg + 1) // segments} for seg in range(segments)]


def rss_baseline(checkpoints: list[dict], warmup_jobs: float) -> int:
    """Index of the first checkpoint at or past the RSS warm-up (never the last)."""
    for i, point in enumerate(checkpoints[:-1]):
        if point["jobs"] >= warmup_jobs:
            return i
    return len(checkpoints) - 2


def window_drift(points: list[dict], key: str) -> float:
    """Median of the last few checkpoints minus median of the first few: a
    leak shows as the distance between them, while a single checkpoint that
    caught the allocator holding one more buffer (+-2 MiB here) does not."""
    n = max(1, min(3, len(points) // 3))
    first = statistics.median(p[key] for p in points[:n])
    last = statistics.median(p[key] for p in points[-n:])
    return round(last - first, 2)


def slope(points: list[dict], key: str) -> Optional[float]:
    """Least-squares slope of ``key`` per job over the checkpoints."""
    if len(points) < 2:
        return None
    xs = [p["jobs"] for p in points]
    ys = [p[key] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else None


def _rss_parts() -> dict:
    """Anonymous and file-backed resident memory (MiB), to tell heap growth
    from library pages touched for the first time."""
    parts = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssFile:")):
                    parts[line.split(":")[0][3:].lower() + "_mib"] = round(int(line.split()[1]) / 1024, 2)
    except OSError:
        pass
    return parts


def traced_growth(first: "tracemalloc.Snapshot", last: "tracemalloc.Snapshot", limit: int = 8) -> list[str]:
    return [str(stat) for stat in last.compare_to(first, "lineno")[:limit]]


STABLE_KEYS = ("threads", "native_threads", "fds", "workers", "tool_processes", "other_processes", "zombies",
               "marked_ours")


def settle(pool: ExecPool, run_id: str, seconds: float, target: Optional[dict] = None) -> dict:
    """gc, then sample until the counts match ``target`` (or, without one,
    stop changing for a few samples) or ``seconds`` pass."""
    gc.collect()
    deadline = time.monotonic() + seconds
    snap = snapshot(pool, run_id)
    stable = 0
    while time.monotonic() < deadline:
        if target is not None and all(snap[k] <= target[k] for k in STABLE_KEYS):
            break
        time.sleep(0.05)
        gc.collect()
        new = snapshot(pool, run_id)
        same = all(new[k] == snap[k] for k in STABLE_KEYS)
        snap = new
        stable = stable + 1 if same else 0
        if target is None and stable >= 5 and snap["marked_ours"] == 0 and snap["tool_processes"] == 0:
            break
    return snap


def kill_leftovers(run_id: str, pids: list[int]) -> int:
    """Leave nothing of this run behind, whatever the verdict."""
    killed = 0
    for pid in {entry["pid"] for entry in marked_processes(run_id)["ours"]} | set(pids):
        try:
            psutil.Process(pid).kill()
            killed += 1
        except psutil.Error:
            pass
    return killed
