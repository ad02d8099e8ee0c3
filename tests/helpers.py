"""Process-level checks shared by the tests: what is still alive, and waiting
for a condition with a deadline instead of sleeping a fixed time."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from typing import Callable, Iterable

import psutil

from execpool.shared.kernel.proctree import JOB_MARKER_ENV

#: The unprivileged user tests run pools and tools as: nobody.
UNPRIVILEGED = 65534


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0, interval: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def worker_records(pool) -> list:
    """The pool's records of its worker processes (an internal view: pid,
    token, jobs_dir, jobs), for tests that look behind the public API."""
    with pool._workers.lock:
        return list(pool._workers.all)


def alive(pid: int) -> bool:
    """Running or sleeping, not a zombie waiting to be reaped."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def state(pid: int) -> str:
    """The one-letter state ``/proc/PID/stat`` gives (``T``: stopped), or
    "gone"."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0].decode()
    except OSError:
        return "gone"


def all_dead(pids: Iterable[int], timeout: float = 2.0) -> bool:
    pids = list(pids)
    return wait_for(lambda: not any(alive(p) for p in pids), timeout)


def remember(doomed: list, pids: Iterable[int]) -> None:
    """Put processes on a test's ``doomed`` list (tests/conftest.py)."""
    for pid in pids:
        try:
            doomed.append(psutil.Process(pid))
        except psutil.Error:
            pass


def pids_in(output: str) -> list[int]:
    """Pids that a hostile tool announced with ``PIDS ...``."""
    return [int(p) for line in re.findall(r"PIDS ([\d ]+)", output) for p in line.split()]


def processes_with_env(matches: Callable[[dict], bool]) -> list[psutil.Process]:
    """Live processes anywhere but this one whose environment ``matches``."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if matches(proc.environ()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def marked_processes(marker_prefix: str = "") -> list[psutil.Process]:
    """Live processes anywhere that carry an execpool job marker."""
    return processes_with_env(lambda env: JOB_MARKER_ENV in env and env[JOB_MARKER_ENV].startswith(marker_prefix))


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def collect(stream) -> tuple[list[dict], object]:
    """Consume a stream; return its events and its Result."""
    events = []
    while True:
        try:
            events.append(next(stream))
        except StopIteration as stop:
            return events, stop.value


def joined_output(events: list[dict]) -> str:
    return "".join(e["text"] for e in events if e["type"] == "tool_output")


def unprivileged_python() -> "str | None":
    """An interpreter of this Python version that ``nobody`` may run (the
    test's own often lives in root's home), or None."""
    for candidate in (f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}", sys.executable):
        if os.access(candidate, os.X_OK):
            probe = subprocess.run([candidate, "-c", "print(1)"], user=UNPRIVILEGED, group=UNPRIVILEGED,
                                   extra_groups=[], capture_output=True, text=True, cwd="/")
            if probe.stdout == "1\n":
                return candidate
    return None


def unprivileged_pythonpath(base: str) -> str:
    """A world-readable copy, under ``base``, of what an unprivileged
    interpreter needs to run execpool: the package (its built extension
    included) and its core dependencies. A copy, not links: this checkout
    and its venv may lie in a directory only root may enter (``/root``, any
    0700 folder), and a link does not make a path traversable."""
    import tqdm

    import execpool

    path = os.path.join(base, "site")
    os.mkdir(path, 0o755)
    for package in (execpool, psutil, tqdm):
        source = os.path.dirname(os.path.abspath(package.__file__))
        shutil.copytree(source, os.path.join(path, os.path.basename(source)),
                        ignore=shutil.ignore_patterns("__pycache__"))
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            target = os.path.join(root, name)
            os.chmod(target, os.stat(target).st_mode | 0o444 | (0o111 if name in dirs else 0))
    return path
