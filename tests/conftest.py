"""Fixtures every room shares: pools per test module and way of starting
tools, processes a test must not leave, and the check that a module left
nothing behind."""

import os
import shutil
import tempfile

import psutil
import pytest

from execpool import ExecPool
from execpool.pool.toolchains import CACHE_DIR_ENV
from tests.support.helpers import SPAWN_PARAMS, runs_here, wait_for
from tests.support.leftovers import LEFTOVER_GRACE_S, nothing_left_behind


@pytest.fixture(scope="session", autouse=True)
def _checks_recorded_for_this_run():
    """The record of the languages' checks (execpool/pool/toolchains.py) is
    this run's, in every pool and server it starts: the first server's
    checks serve the rest, and the user's own record is neither read nor
    written."""
    os.environ[CACHE_DIR_ENV] = cache = tempfile.mkdtemp(prefix="execpool-tests-cache-")
    yield
    shutil.rmtree(cache, ignore_errors=True)


@pytest.fixture(autouse=True)
def _toolchain(request):
    """A test marked ``toolchain(name)`` needs that language to run here
    (helpers.runs_here)."""
    for marker in request.node.iter_markers("toolchain"):
        runs_here(marker.args[0])


@pytest.fixture(scope="module", params=SPAWN_PARAMS)
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


@pytest.fixture(params=SPAWN_PARAMS)
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


@pytest.fixture(scope="module", autouse=True)
def leaves_nothing_behind(request):
    """Fails the test module that leaves a child process, a thread or a file
    descriptor behind (its module-scoped pools are closed before this runs).
    Waits a bounded while first: what is being closed may take a moment."""
    yield from nothing_left_behind(request)
