"""What the benchmarks share: statistics, the final JSON line, and counting
this process's threads, fds, memory and descendants."""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
from typing import Iterable, Sequence

import psutil


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def print_table(title: str, header: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    rows = [[_cell(c) for c in row] for row in rows]
    header = list(header)
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(header)]
    print(title)
    print("  " + "  ".join(str(h).ljust(w) for h, w in zip(header, widths)))
    print("  " + "  ".join("-" * w for w in widths))
    for row in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)))
    print()


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def emit_json(figures: dict) -> None:
    """The machine-readable result: exactly one JSON object, the last line of stdout."""
    sys.stdout.flush()
    sys.stdout.write(json.dumps(figures, sort_keys=True, allow_nan=False, default=str) + "\n")
    sys.stdout.flush()


def thread_count() -> int:
    """Python threads; see native_thread_count for the kernel's view."""
    return threading.active_count()


def native_thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def descendants(pid: int | None = None) -> list[psutil.Process]:
    try:
        return psutil.Process(pid if pid is not None else os.getpid()).children(recursive=True)
    except psutil.Error:
        return []


def is_zombie(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def environ_of(proc: psutil.Process) -> dict | None:
    """A process's environment, or None when it is gone or unreadable."""
    try:
        return proc.environ()
    except (psutil.Error, OSError):
        return None
