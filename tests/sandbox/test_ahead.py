"""Sandboxed jobs' own namespaces made ahead (execpool/worker/preparer.py).

A worker's preparer makes the next strict jobs' spaces, rulesets and
mount namespaces before they come; a job that finds one
enters it. These tests prove that a job does (the namespace its tool runs
in is one the worker held before and holds until the Result is out), that
what is made for one job is no other's, that jobs which do not fit get
their views made as before, and that the preparer dies with its pool,
leaves nothing behind, and that a dead preparer costs no job anything.
Run as root (the suite's user); the non-root view is the escape matrix's
(tests/sandbox/test_sandbox.py runs it as ``nobody``).
"""

from __future__ import annotations

import os
import platform
import signal

import psutil
import pytest

import execpool
from execpool import ExecPool, PythonJob, Sandbox, ShellJob, Status
from execpool.worker.preparer import STOCK
from tests.support.helpers import wait_for

pytestmark = pytest.mark.skipif(not execpool.sandbox_support().available,
                                reason=f"no sandbox here: {execpool.sandbox_support().missing}")

#: recvfrom and recvmsg: the preparer waits for a request, everything it made sent.
_RECEIVING = {"x86_64": ("45", "47"), "aarch64": ("207", "212")}.get(platform.machine(), ())
#: A job that shows which mount namespace it runs in and whether it found
#: what a job before it left in its /tmp, home and /dev/shm (a count of
#: everything would count what the view shows of the host there: a
#: checkout under /tmp, a warm job's script in its home).
_SHOW = ('echo "ns $(readlink /proc/self/ns/mnt)"; echo "tmp $(ls -A /tmp | grep -cx left) '
         'home $(ls -A ~ | grep -cx left) shm $(ls -A /dev/shm | grep -cx left)"; '
         'echo left > /tmp/left; echo left > ~/left; echo left > /dev/shm/left')


def _worker(pool: ExecPool) -> psutil.Process:
    return psutil.Process(pool.worker_pids[0])


def _preparer(pool: ExecPool):
    return next((child for child in _worker(pool).children() if child.name() == "execpool-prep"), None)


def _jobs_dir(pool: ExecPool) -> str:
    return pool._workers.all[0].jobs_dir


def _ready(pool: ExecPool) -> bool:
    """The stock is made and sent (no job running): the worker holds a
    namespace for each besides its template's, and the preparer waits for
    a request."""
    preparer = _preparer(pool)
    if preparer is None:
        return False
    made = len(_namespaces(_worker(pool).pid)) - 1
    try:
        with open(f"/proc/{preparer.pid}/syscall") as f:
            waiting = f.read().split()[0] in _RECEIVING
    except OSError:
        return False
    return made >= STOCK and waiting


def _namespaces(pid: int) -> set:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("mnt:"):
            found.add(target)
    return found


@pytest.fixture
def one_worker():
    with ExecPool(workers=1, warm_spares=1) as pool:
        yield pool


def _shown(gen) -> dict:
    """What a running job running _SHOW printed, once it has."""
    text = ""
    while "shm" not in text:
        text += next(gen).get("text", "")
    return dict(line.split(" ", 1) for line in text.splitlines())


@pytest.mark.skipif(not _RECEIVING, reason="the preparer's wait is read for x86_64 and aarch64 only")
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_job_enters_the_namespace_made_for_it_and_finds_nothing_of_another(one_worker, warm):
    pool = one_worker
    first = pool.run(ShellJob(_SHOW, sandbox="strict", timeout=30))
    assert first.status is Status.OK, first.output
    for _ in range(3):
        assert wait_for(lambda: _ready(pool), 10.0), "the preparer made nothing"
        if warm:
            code = ("import subprocess, sys, time\nprint(subprocess.run(['sh', '-c', " + repr(_SHOW) + "], "
                    "capture_output=True, text=True).stdout, end='', flush=True)\ntime.sleep(60)")
            gen = pool.stream(PythonJob(code, warm=True, sandbox="strict", timeout=60))
        else:
            gen = pool.stream(ShellJob(_SHOW + "; exec sleep 60", sandbox="strict", timeout=60))
        try:
            shown = _shown(gen)
            # Made ahead: the worker holds the job's namespace (a view made
            # in the tool's process is the tool's alone).
            assert shown["ns"] in _namespaces(pool.worker_pids[0]), "the job did not run in a namespace made ahead"
        finally:
            gen.close()
        # Nothing the job before it left, anywhere.
        assert shown["tmp"] == "0 home 0 shm 0", shown


def test_the_namespace_is_the_workers_until_the_result_is_out(one_worker):
    pool = one_worker
    assert pool.run(ShellJob("true", sandbox="strict")).status is Status.OK
    assert wait_for(lambda: _ready(pool), 10.0)
    gen = pool.stream(ShellJob('echo "$$ $(readlink /proc/self/ns/mnt)"; exec sleep 60', sandbox="strict",
                               timeout=60))
    text = ""
    while "mnt:" not in text:
        text += next(gen).get("text", "")
    pid, ns = text.split()
    # Held here too, so that its number is not given to the worker's next
    # namespace once the job's is gone (the kernel reuses them).
    held = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY)
    try:
        # Running: held by the worker (its teardown is not on the tool's way out).
        assert ns in _namespaces(pool.worker_pids[0])
        gen.close()
        assert wait_for(lambda: ns not in _namespaces(pool.worker_pids[0]), 10.0), "the job's namespace is held still"
    finally:
        os.close(held)


_SHOW_LONG = _SHOW + "; exec sleep 60"


@pytest.mark.parametrize("job", [
    lambda cwd: ShellJob(_SHOW_LONG, sandbox="strict", cwd=cwd, timeout=60),
    lambda cwd: ShellJob(_SHOW_LONG, sandbox=Sandbox(read=(cwd,)), timeout=60),
    lambda cwd: ShellJob(_SHOW_LONG, sandbox=Sandbox(connect=(443,)), timeout=60),
], ids=["cwd", "read", "ports"])
def test_jobs_that_do_not_fit_get_their_view_made_as_before(one_worker, job):
    pool = one_worker
    cwd = pool.scratch_dir()
    assert pool.run(ShellJob("true", sandbox="strict")).status is Status.OK
    assert wait_for(lambda: _ready(pool), 10.0)
    gen = pool.stream(job(cwd))
    try:
        ns = _shown(gen)["ns"]
        assert ns not in _namespaces(pool.worker_pids[0])
    finally:
        gen.close()
    # What was made waits for a job that fits.
    gen = pool.stream(ShellJob(_SHOW + "; exec sleep 60", sandbox="strict", timeout=60))
    try:
        assert _shown(gen)["ns"] in _namespaces(pool.worker_pids[0])
    finally:
        gen.close()


def test_a_dead_preparer_costs_no_job_anything(one_worker):
    pool = one_worker
    assert pool.run(ShellJob("true", sandbox="strict")).status is Status.OK
    assert wait_for(lambda: _preparer(pool) is not None, 10.0)
    preparer = _preparer(pool)
    preparer.send_signal(signal.SIGKILL)
    preparer.wait(10)
    for _ in range(5):
        result = pool.run(ShellJob(_SHOW, sandbox="strict", timeout=30))
        assert result.status is Status.OK, result.output
        assert "tmp 0 home 0 shm 0" in result.output
    # Said once and not tried again: no preparer comes back.
    assert _preparer(pool) is None


def test_nothing_is_left_of_it_when_the_pool_closes():
    pool = ExecPool(workers=1)
    try:
        assert pool.run(ShellJob("true", sandbox="strict")).status is Status.OK
        assert wait_for(lambda: _ready(pool), 10.0)
        preparer, jobs_dir = _preparer(pool), _jobs_dir(pool)
    finally:
        pool.close()
    assert wait_for(lambda: not preparer.is_running(), 5.0)
    assert not os.path.exists(jobs_dir)


def test_what_is_made_ahead_does_not_pile_up(one_worker):
    """Twenty jobs later the worker holds its stock and no more, and none
    of it on the disk: a made job's home is its space's."""
    pool = one_worker
    for _ in range(20):
        assert pool.run(ShellJob("echo x > ~/x", sandbox="strict")).status is Status.OK
    assert wait_for(lambda: _ready(pool), 10.0)
    assert len(_namespaces(pool.worker_pids[0])) == STOCK + 1
    assert [name for name in os.listdir(_jobs_dir(pool)) if not name.startswith(".")] == []
    assert os.listdir(os.path.join(_jobs_dir(pool), ".trash")) == []
