import os
import sys

import psutil
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from execpool import ExecPool  # noqa: E402
from execpool.spawn import SPAWN_METHODS  # noqa: E402


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
