"""Job markers: what ties a process to its job when its session, group
and leader no longer do.

Shared, and kept free of psutil: the warm template imports it, and a pool
may run its jobs -- the template included -- with an interpreter of their
own that has none of execpool's dependencies (execpool comes from the
worker's ``PYTHONPATH``). The sweeps that read markers are in
execpool/shared/kernel/proctree.py.
"""

from __future__ import annotations

from typing import Optional

#: Environment variable naming the job a process belongs to (inherited by the
#: whole tree unless a process clears its environment).
JOB_MARKER_ENV = "EXECPOOL_JOB"


def marker_matches(value: Optional[str], marker: str) -> bool:
    """A job marker is ``TOKEN/JOB/SECRET``; matching ``TOKEN`` finds a whole worker's
    jobs. Blanks are padding (see execpool/tool/spare.py)."""
    if value is None:
        return False
    value = value.strip()
    return value == marker or value.startswith(marker + "/")
