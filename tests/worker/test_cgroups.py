"""The cgroup tier: process and memory caps that hold for root, a kill that
reaches the whole group, and groups that never outlive their job or worker."""

from __future__ import annotations

import glob
import os
import signal

import pytest

from execpool import ExecPool, Limits, PythonJob, ShellJob
from execpool.shared.kernel.cgroups import Cgroups
from tests.support.helpers import all_dead, pids_cgroup_tier, pids_in, wait_for, worker_records

pytestmark = pytest.mark.skipif(not pids_cgroup_tier(), reason="no pids cgroup controller execpool may use here")

OWN_PIDS_MAX = ("import os\npath = [l.split(':', 2)[2].strip() for l in open('/proc/self/cgroup') if ':pids:' in l "
                "or l.startswith('0::')][0]\nroots = ['/sys/fs/cgroup/pids', '/sys/fs/cgroup/unified', '/sys/fs/cgroup']\n"
                "print([open(r + path + '/pids.max').read().strip() for r in roots if os.path.exists(r + path + '/pids.max')][0])")


def execpool_groups() -> list:
    return glob.glob("/sys/fs/cgroup/*/execpool-*") + glob.glob("/sys/fs/cgroup/*/*/*/execpool-*")


def execpool_groups_of(pool) -> list:
    tokens = [w.token for w in worker_records(pool)]
    return [g for g in execpool_groups() for t in tokens if t in g and os.listdir(g) and
            any(entry.startswith("job-") for entry in os.listdir(g))]


@pytest.mark.slow
def test_a_fork_bomb_is_held_by_the_process_cap(pool):
    caps = Limits(processes=64)
    # The bomb runs only once its cap is seen in place from inside a job.
    assert pool.run(PythonJob(OWN_PIDS_MAX, limits=caps)).text == "64\n"
    result = pool.run(ShellJob("bomb() { bomb | bomb & }; bomb; sleep 1; echo survived", limits=caps, timeout=3))
    assert result.timed_out or "survived" in result.output
    assert pool.run(ShellJob("echo healthy")).text == "healthy\n"
    assert wait_for(lambda: not execpool_groups_of(pool), timeout=3)


@pytest.mark.slow
def test_the_cap_counts_every_process_of_the_job(pool):
    command = "for i in $(seq 40); do sleep 30 >/dev/null 2>&1 & echo \"PIDS $!\"; done 2>&1; echo end"
    result = pool.run(ShellJob(command, limits=Limits(processes=10), timeout=2))  # bash retries forks for long
    assert "Resource temporarily unavailable" in result.output or "retry" in result.output
    assert 0 < len(pids_in(result.output)) < 10
    assert all_dead(pids_in(result.output))


def test_memory_cap_ends_the_job_with_a_clear_error(pool):
    code = "x = bytearray(400 << 20)\nfor i in range(0, len(x), 4096):\n    x[i] = 1\nprint('survived')"
    result = pool.run(PythonJob(code, limits=Limits(memory=64 << 20, address_space=None)))
    assert result.text == "Execution error: the job went over its memory limit (67108864 bytes) and was killed"
    assert pool.run(PythonJob("print('next')", limits=Limits(memory=64 << 20))).text == "next\n"


def test_cgroup_kill_reaches_a_process_that_left_session_and_cleared_its_environment(pool):
    command = "setsid env -i /bin/sleep 100 >/dev/null 2>&1 & echo \"PIDS $!\"; sleep 100"
    stream = pool.stream(ShellJob(command, limits=Limits(processes=20), timeout=None))
    pids = pids_in(next(stream)["text"])
    stream.close()
    assert all_dead(pids, timeout=1.0)


@pytest.mark.slow
def test_groups_of_a_killed_worker_are_removed():
    with ExecPool(workers=1) as pool:
        token = worker_records(pool)[0].token
        stream = pool.stream(ShellJob("echo up; sleep 100", limits=Limits(processes=20), timeout=None))
        next(stream)
        assert [g for g in execpool_groups() if token in g]
        os.kill(pool.worker_pids[0], signal.SIGKILL)
        for _ in stream:
            pass
        assert wait_for(lambda: not [g for g in execpool_groups() if token in g], timeout=3)


def test_a_missing_controller_is_named():
    with pytest.raises(OSError, match="memory controller"):
        Cgroups({"pids": "/nonexistent"}, 1).create(1, None, 1 << 20)
