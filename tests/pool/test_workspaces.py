"""Workspaces (execpool/pool/workspaces.py): a space that outlives jobs,
whose jobs, sessions and CodeJobs share its files within one bound, held
of the pool's disk budget until it is closed."""

from __future__ import annotations

import os
import signal

import pytest

from execpool import (
    CodeJob,
    DiskBudgetError,
    ExecPool,
    Limits,
    PythonJob,
    SessionForkError,
    ShellJob,
    Status,
    sandbox_support,
)
from execpool.shared.errors import PoolClosedError
from tests.support.helpers import wait_for

pytestmark = pytest.mark.skipif(not sandbox_support().available, reason="the kernel lacks the sandbox")

MiB = 1 << 20


@pytest.fixture(scope="module")
def pool():
    with ExecPool(workers=2) as p:  # no sandbox of its own: a workspace runs its jobs in the strict one
        yield p


def test_its_jobs_sessions_and_programs_share_its_files(pool):
    with pool.workspace(disk=16 * MiB) as ws:
        assert ws.run(ShellJob("pwd; echo shell > a.txt; echo tmp > /tmp/t")).output == f"{ws.path}\n"
        assert ws.run(PythonJob("print(open('a.txt').read().strip(), open('/tmp/t').read().strip())",
                                warm=True)).output == "shell tmp\n"
        program = '#include <stdio.h>\nint main(void){ char b[9]; fgets(b, 9, fopen("a.txt", "r")); printf("c %s", b); }'
        ran = ws.run(CodeJob("c", program, files={"extra.h": b""}))
        assert ran.output == "c shell\n", ran.text
        with ws.session("python") as session:
            assert session.run("import os\nsorted(os.listdir('.'))").value == "['a.txt']"  # the program's files went
            with pytest.raises(SessionForkError, match="workspace"):
                session.fork()


def test_its_bound_is_all_of_its_jobs_together_and_it_holds_its_budget(pool):
    taken = pool.disk_budget.taken
    with pool.workspace(disk=8 * MiB) as ws:
        assert pool.disk_budget.taken == taken + 8 * MiB
        assert ws.run(ShellJob("head -c 5M /dev/zero > a")).status is Status.OK
        full = ws.run(ShellJob("head -c 5M /dev/zero > /tmp/b"))  # its /tmp is the workspace's too
        assert full.status is Status.ERROR and "No space left" in full.output, full.text
        # Its jobs hold nothing of the budget beyond the workspace's.
        gate = ws.submit(ShellJob("sleep 30"))
        assert wait_for(lambda: pool.running_jobs == 1, 10.0) and pool.disk_budget.taken == taken + 8 * MiB
        gate.cancel()
    assert pool.disk_budget.taken == taken
    with pytest.raises(PoolClosedError):
        ws.run(ShellJob("true"))


def test_what_does_not_belong_in_a_workspace_is_refused(pool):
    with pool.workspace(disk=8 * MiB) as ws:
        with pytest.raises(ValueError, match="cwd"):
            ws.submit(ShellJob("true", cwd="/tmp"))
        with pytest.raises(ValueError, match="view"):
            ws.submit(ShellJob("true", sandbox=False))
    with pytest.raises(DiskBudgetError):
        pool.workspace(disk=pool.disk_budget.total + MiB)


def test_its_worker_s_death_ends_its_jobs_infra_and_the_pool_goes_on():
    with ExecPool(workers=1) as one:
        ws = one.workspace(disk=8 * MiB)
        assert ws.run(ShellJob("echo x > f")).status is Status.OK
        os.kill(ws.worker.pid, signal.SIGKILL)
        assert wait_for(lambda: one.worker_pids and one.worker_pids[0] != ws.worker.pid, 10.0)
        lost = ws.run(ShellJob("cat f"))
        assert lost.status is Status.INFRA, lost.text
        ws.close()
        assert one.disk_budget.taken == 0
        assert one.run(ShellJob("echo on", sandbox="strict")).output == "on\n"


def test_a_worker_retires_only_once_its_workspaces_are_closed():
    with ExecPool(workers=1, max_jobs_per_worker=2) as one:
        ws = one.workspace(disk=8 * MiB)
        first = ws.worker
        for n in range(4):
            assert ws.run(ShellJob(f"echo {n} >> log; wc -l < log")).output == f"{n + 1}\n"
        assert first.pid in one.worker_pids  # retiring, but holding the workspace
        ws.close()
        assert wait_for(lambda: first.pid not in one.worker_pids, 10.0)
        assert one.run(ShellJob("true")).status is Status.OK


def test_a_pools_default_bound_is_a_workspaces_default():
    with ExecPool(workers=1, limits=Limits(disk=4 * MiB)) as small:
        with small.workspace() as ws:
            assert ws.disk == 4 * MiB and small.disk_budget.taken == 4 * MiB
