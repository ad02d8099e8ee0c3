"""What a test module may leave behind -- a child process, a thread, a file
descriptor -- and the check that it left none (tests/conftest.py runs it
for every module)."""

import os
import threading

import psutil
import pytest

from tests.support.helpers import wait_for

#: How long a test module's last processes, threads and descriptors may
#: take to go once it is done (a pool's close is bounded well below this).
LEFTOVER_GRACE_S = 5.0


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


def nothing_left_behind(request, descriptors: bool = True):
    """The body of ``leaves_nothing_behind``, for a module that overrides it
    (tests/ray/test_ray.py starts the session's Ray cluster first, and leaves
    the descriptors out: Ray's driver opens connections to the actors'
    processes as it goes and keeps them until the session's ``ray.shutdown``)."""
    before = _leftovers()
    yield
    def extra():
        now = _leftovers()
        found = tuple(sorted(n - b) for n, b in zip(now, before))
        return found if descriptors else (*found[:2], [])

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
