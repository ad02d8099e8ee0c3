import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from execpool import ExecPool  # noqa: E402
from execpool.spawn import SPAWN_METHODS  # noqa: E402


@pytest.fixture(params=SPAWN_METHODS)
def pool(request):
    """Every test that takes ``pool`` runs once per way a worker can start tools."""
    with ExecPool(workers=2, spawn_method=request.param) as p:
        yield p
