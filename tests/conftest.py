import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from execpool import ExecPool  # noqa: E402


@pytest.fixture
def pool():
    with ExecPool(workers=2) as p:
        yield p
