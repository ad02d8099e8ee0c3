"""What the benchmarks share: statistics, the table, the final JSON line,
and finding processes (descendants, environments)."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
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
    """The machine-readable result: exactly one JSON object, the last line of
    stdout (NaN and infinities, which JSON lacks, become null)."""
    sys.stdout.flush()
    sys.stdout.write(json.dumps(_finite(figures), sort_keys=True, allow_nan=False, default=str) + "\n")
    sys.stdout.flush()


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def descendants(pid: int | None = None) -> list[psutil.Process]:
    try:
        return psutil.Process(pid if pid is not None else os.getpid()).children(recursive=True)
    except psutil.Error:
        return []


def environ_of(proc: psutil.Process) -> dict | None:
    """A process's environment, or None when it is gone or unreadable."""
    try:
        return proc.environ()
    except (psutil.Error, OSError):
        return None
