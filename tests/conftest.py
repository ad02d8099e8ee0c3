import os
import sys
import threading

import psutil
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from execpool import ExecPool  # noqa: E402
from execpool.worker.spawn import SPAWN_METHODS  # noqa: E402
from helpers import runs_here, wait_for  # noqa: E402

#: How long a test module's last processes, threads and descriptors may
#: take to go once it is done (a pool's close is bounded well below this).
LEFTOVER_GRACE_S = 5.0


@pytest.fixture(autouse=True)
def _toolchain(request):
    """A test marked ``toolchain(name)`` needs that language to run here
    (helpers.runs_here)."""
    for marker in request.node.iter_markers("toolchain"):
        runs_here(marker.args[0])


@pytest.fixture(scope="module", params=SPAWN_METHODS)
def module_pool(request):
    """One pool per test module and way a worker can start tools."""
    with ExecPool(workers=2, spawn_method=request.param) as p:
        yield p


@pytest.fixture
def pool(module_pool):
    """Every test that takes ``pool`` runs once per way a worker can start
    tools, on its module's pool: a pool per test was a fifth of the suite's
    time. A test that counts, closes or breaks its pool takes ``fresh_pool``.
    After each test nothing of it may still run in the pool the next one
    gets."""
    yield module_pool
    assert wait_for(lambda: module_pool.running_jobs == 0, LEFTOVER_GRACE_S), "the test left jobs running"


@pytest.fixture(params=SPAWN_METHODS)
def fresh_pool(request):
    """A pool of the test's own, for a test whose subject is the pool itself."""
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
    yield from nothing_left_behind(request)


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory):
    """The one local Ray cluster of the test session (two CPUs, no
    dashboard, its files under the session's temporary directory), this
    process its driver; its GCS address, for drivers in other processes.
    Only tests/test_ray.py uses it, and it ends with that module: its
    processes are this process's children, and a later module that checks
    it left none (tests/test_faults.py) found Ray's GCS among them."""
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"  # else the first init writes ~/.ray/auth_token
    context = ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                       _temp_dir=str(tmp_path_factory.mktemp("ray")))
    yield context.address_info["gcs_address"]
    ray.shutdown()


def nothing_left_behind(request, descriptors: bool = True):
    """The body of ``leaves_nothing_behind``, for a module that overrides it
    (tests/test_ray.py starts the session's Ray cluster first, and leaves
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
