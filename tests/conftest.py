import os
import sys
import threading

import psutil
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from execpool import ExecPool  # noqa: E402
from execpool.spawn import SPAWN_METHODS  # noqa: E402
from helpers import wait_for  # noqa: E402

#: How long a test module's last processes, threads and descriptors may
#: take to go once it is done (a pool's close is bounded well below this).
LEFTOVER_GRACE_S = 5.0


@pytest.fixture(params=SPAWN_METHODS)
def pool(request):
    """Every test that takes ``pool`` runs once per way a worker can start tools."""
    with ExecPool(workers=2, spawn_method=request.param) as p:
        yield p


@pytest.fixture
def doomed():
    """Processes a test started that must not outlive it, also when it fails:
    psutil handles (see helpers.remember), made while the pid was surely
    still theirs, killed at the end."""
    procs: list[psutil.Process] = []
    yield procs
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass


def _leftovers() -> tuple:
    """What this process holds that a test module may have left: its live
    descendants, its threads, its open descriptors."""
    me = psutil.Process()
    children = set()
    for child in me.children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                children.add((child.pid, child.create_time()))
        except psutil.Error:
            continue
    threads = {(t.ident, t.name) for t in threading.enumerate()}
    fds = set(os.listdir("/proc/self/fd"))
    return children, threads, fds


@pytest.fixture(scope="module", autouse=True)
def leaves_nothing_behind(request):
    """Fails the test module that leaves a child process, a thread or a file
    descriptor behind (its module-scoped pools are closed before this runs).
    Waits a bounded while first: what is being closed may take a moment."""
    before = _leftovers()
    yield
    def extra():
        now = _leftovers()
        return tuple(sorted(n - b) for n, b in zip(now, before))

    wait_for(lambda: not any(extra()), LEFTOVER_GRACE_S, interval=0.02)
    left = extra()
    children, threads, fds = left
    if any(left):
        described = [f"fd {fd} -> {_target(fd)}" for fd in fds]
        pytest.fail(f"{request.module.__name__} left behind: processes {_described(children)}, "
                    f"threads {threads}, descriptors {described}")


def _target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def _described(children: list) -> list:
    found = []
    for pid, _ in children:
        try:
            found.append((pid, " ".join(psutil.Process(pid).cmdline())[:80]))
        except psutil.Error:
            found.append((pid, "gone"))
    return found
