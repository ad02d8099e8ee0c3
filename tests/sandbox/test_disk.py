"""Every sandboxed tenant bounded (SPEC §10): a space of its own of
``Limits(disk=...)`` bytes holding its home, ``/tmp`` and ``/dev/shm``
together, held by the kernel for root and ``nobody``
(execpool/worker/space.py); the pool's disk budget over the tenants alive
at once (execpool/pool/budget.py); neighbours that never notice a full
space, a compile cache that never keeps the machine's failure; and nothing
of a sandboxed job outliving it, sessions open or not, with or without
cgroups (execpool/worker/userns.py)."""

from __future__ import annotations

import json
import os
import textwrap

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
from tests.support.helpers import Gates, alive, all_dead, pids_in, remember, run_as_nobody, wait_for

pytestmark = pytest.mark.skipif(not sandbox_support().available, reason="the kernel lacks the sandbox")

MiB = 1 << 20

#: Writes the same megabytes into /tmp, /dev/shm and the home in turn
#: until one write fails; what it wrote where, and how it failed.
FILL = textwrap.dedent("""\
    import errno, os
    written = {}
    failed = None
    for place in ("/tmp", "/dev/shm", os.path.expanduser("~")):
        try:
            with open(os.path.join(place, "fill"), "wb") as f:
                while True:
                    f.write(b"x" * (1 << 20))
                    f.flush()
                    written[place] = written.get(place, 0) + 1
        except OSError as exc:
            failed = errno.errorcode[exc.errno]
            break
    print(sum(written.values()), failed)
""")


@pytest.fixture(scope="module")
def pool():
    with ExecPool(workers=2, sandbox="strict") as p:
        yield p


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_home_tmp_and_shm_share_one_bound_that_the_kernel_keeps(pool, warm):
    result = pool.run(PythonJob(FILL, limits=Limits(disk=8 * MiB), warm=warm))
    assert result.status is Status.OK, result.text
    megabytes, failed = result.output.split()
    # Its inodes take an eighth of the bound: what is left holds about 7 MiB.
    assert failed == "ENOSPC" and 5 <= int(megabytes) <= 7, result.output
    # The next job has a space of its own, empty.
    after = pool.run(ShellJob("ls -A /tmp /dev/shm ~ | grep -c fill || true; df --output=used -B1 /tmp | tail -1",
                              limits=Limits(disk=8 * MiB)))
    assert after.output.split()[0] == "0", after.output


def test_files_are_bounded_as_bytes_are(pool):
    flood = pool.run(PythonJob("import os\nn = 0\ntry:\n    while True:\n        os.mkdir(f'd{n}')\n        n += 1\n"
                               "except OSError as exc:\n    print(n, exc.strerror)", limits=Limits(disk=4 * MiB)))
    made, reason = flood.output.split(" ", 1)
    assert flood.status is Status.OK and reason.strip() == "No space left on device", flood.text
    assert 400 <= int(made) <= 512, flood.output  # one file per 8 KiB of the bound


def test_a_filled_space_ends_its_job_as_its_program_makes_it_never_infra(pool):
    result = pool.run(ShellJob("head -c 64M /dev/zero > /tmp/big", limits=Limits(disk=4 * MiB)))
    assert result.status is Status.ERROR and result.exit_code == 1, result.text
    assert "No space left on device" in result.output


def test_a_session_that_fills_its_space_lives_and_its_neighbours_never_notice(pool):
    with pool.session("python", limits=Limits(disk=16 * MiB)) as session:
        filled = session.run(FILL)
        assert filled.status is Status.OK and filled.stdout.split()[1] == "ENOSPC", filled.text
        assert session.alive
        for job in (ShellJob("echo neighbour"), PythonJob("print('neighbour')"),
                    PythonJob("print('neighbour')", warm=True),
                    CodeJob("c", '#include <stdio.h>\nint main(void) { puts("neighbour"); }\n')):
            neighbour = pool.run(job)
            assert neighbour.status is Status.OK and neighbour.output == "neighbour\n", neighbour.text
        assert session.run("import os\nos.remove('/tmp/fill')\nopen('/tmp/again', 'w').write('x')").status \
            is Status.OK


def test_a_compile_the_machine_failed_is_not_cached():
    """Red team: two compiles of a correct program that failed for want of
    space became a cached failure, served for ten minutes after the space
    was back."""
    program = '#include <stdio.h>\nstatic char big[32 << 20] = {1};\nint main(void) { return big[1]; }\n'
    with ExecPool(workers=1, sandbox="strict", limits=Limits(disk=8 * MiB)) as small:
        for attempt in range(3):
            result = small.run(CodeJob("c", program, limits=Limits(disk=64 * MiB)))
            assert result.compile_status is Status.ERROR, result.text
            assert "No space left on device" in (result.compile_output or ""), result.compile_output
            assert not result.compile_cached, f"attempt {attempt} was served the machine's failure from the cache"
        assert small.compile_cache.misses == 3


@pytest.mark.slow
def test_jobs_wait_for_room_in_the_disk_budget_and_sessions_do_not():
    with ExecPool(workers=1, sandbox="strict", disk_budget=12 * MiB, limits=Limits(disk=8 * MiB)) as small, \
            Gates() as gates:
        first = small.submit(ShellJob(gates.shell() + "; echo first"))
        assert wait_for(lambda: small.disk_budget.taken == 8 * MiB, 10.0)
        second = small.submit(ShellJob("echo second"))
        assert wait_for(lambda: small.disk_budget.waiting == 1, 10.0) and not second.done()
        with pytest.raises(DiskBudgetError, match="disk budget"):
            small.session("python")
        cancelled = small.submit(ShellJob("echo never"))
        assert wait_for(lambda: small.disk_budget.waiting == 2, 10.0)
        assert cancelled.cancel() and cancelled.result(10).status is Status.CANCELLED
        gates.open()
        assert first.result(30).output == "first\n" and second.result(30).output == "second\n"
        assert wait_for(lambda: small.disk_budget.taken == 0, 10.0)
        with small.session("python") as session:
            assert small.disk_budget.taken == 8 * MiB
            with pytest.raises(DiskBudgetError):
                session.fork()
            assert session.run("1").value == "1"
        assert wait_for(lambda: small.disk_budget.taken == 0, 10.0)
        with pytest.raises(ValueError, match="disk_budget"):
            small.submit(ShellJob("true", limits=Limits(disk=16 * MiB)))


def test_sessions_leave_what_is_kept_for_jobs_so_jobs_never_wait_on_idle_sessions():
    """Red team: one client's idle sessions held the service's whole disk
    budget, and every other client's job waited past its timeout."""
    with ExecPool(workers=1, sandbox="strict", disk_budget=24 * MiB, disk_kept_for_jobs=8 * MiB,
                  limits=Limits(disk=8 * MiB)) as small:
        with small.session("python") as first, small.workspace() as space:
            assert small.disk_budget.taken == 16 * MiB
            with pytest.raises(DiskBudgetError, match="leave the last 8388608 to jobs"):
                small.session("python")
            with pytest.raises(DiskBudgetError):
                first.fork()
            assert small.run(ShellJob("echo job", timeout=30)).output == "job\n"
            assert space.run(ShellJob("echo in the workspace", timeout=30)).output == "in the workspace\n"
    with pytest.raises(ValueError, match="disk_kept_for_jobs"):
        ExecPool(disk_budget=8 * MiB, disk_kept_for_jobs=9 * MiB)


def test_jobs_in_flight_fill_what_is_kept_for_them_before_the_sessions_room():
    """A job in flight took its share out of the sessions' room, not out
    of the reserve kept for jobs: a new server's checks of its languages
    left room for one MCP client of the four its budget had room for."""
    with ExecPool(workers=1, sandbox="strict", disk_budget=24 * MiB, disk_kept_for_jobs=8 * MiB,
                  limits=Limits(disk=8 * MiB)) as small, Gates() as gates:
        held = small.submit(ShellJob(gates.shell() + "; echo held"))
        assert wait_for(lambda: small.disk_budget.taken == 8 * MiB, 10.0)
        with small.session("python") as session, small.workspace() as space:
            assert small.disk_budget.taken == 24 * MiB
            with pytest.raises(DiskBudgetError, match="16777216 of them by sessions and workspaces"):
                small.workspace()
            assert session.run("1").value == "1"
            assert space.run(ShellJob("echo in the workspace", timeout=30)).output == "in the workspace\n"
            gates.open()
            assert held.result(30).output == "held\n"
        assert wait_for(lambda: small.disk_budget.taken == 0, 10.0)


def test_a_job_that_keeps_its_daemons_keeps_its_share_until_the_pool_closes(doomed):
    """Red team: a job with keep_background gave its share of the budget
    back at its end while its daemon kept its space, memory, alive."""
    with ExecPool(workers=1, sandbox="strict", disk_budget=16 * MiB, limits=Limits(disk=8 * MiB)) as small:
        result = small.run(ShellJob("sleep 600 >/dev/null 2>&1 & echo \"PIDS $!\"", keep_background=True, timeout=30))
        remember(doomed, pids_in(result.output))
        assert result.ok and small.disk_budget.taken == 8 * MiB
        assert small.run(ShellJob("echo after", timeout=30)).output == "after\n"
        assert small.disk_budget.taken == 8 * MiB


def test_jobs_waiting_for_room_end_infra_when_the_pool_closes():
    small = ExecPool(workers=1, sandbox="strict", disk_budget=8 * MiB, limits=Limits(disk=8 * MiB))
    with Gates() as gates:
        try:
            held = small.submit(ShellJob(gates.shell()))
            waiting = small.submit(ShellJob("echo never"))
            assert wait_for(lambda: small.disk_budget.waiting == 1, 10.0)
        finally:
            small.close()
    assert waiting.result(10).status is Status.INFRA and "closed" in waiting.result().text
    assert held.result(10).status is Status.INFRA


#: Starts a daemon that leaves its session and clears its environment --
#: its job's marker -- and says its pid.
DAEMON = "setsid bash -c 'env -i /bin/sleep 600 >/dev/null 2>&1 & echo \"PIDS $!\"'"


@pytest.mark.slow
def test_a_sandboxed_jobs_unmarked_daemon_dies_with_it_while_a_session_is_open(doomed):
    """Red team: a stray was swept only when its worker ran no job, and an
    open session (anyone's) is a job for its whole life."""
    with ExecPool(workers=1, sandbox="strict", cgroups=False) as one:
        with one.session("python") as session:
            assert session.run("1").value == "1"
            stray = pids_in(one.run(ShellJob(DAEMON)).output)
            assert stray, "the daemon said no pid"
            assert all_dead(stray, 10.0), "the daemon outlived its job on a busy worker"
            # A closed session's daemon dies with it, the other still open.
            with one.session("bash") as other:
                said = other.run(DAEMON)
                daemon = pids_in(said.stdout)
                assert daemon and all(alive(pid) for pid in daemon)
            assert all_dead(daemon, 10.0), "the closed session's daemon outlived it"
            assert session.run("2").value == "2"


def test_a_keep_background_jobs_unmarked_daemon_is_kept():
    with ExecPool(workers=1, sandbox="strict", cgroups=False) as one:
        kept = pids_in(one.run(ShellJob(DAEMON, keep_background=True)).output)
        assert kept and one.run(ShellJob("true")).status is Status.OK
        assert all(alive(pid) for pid in kept), "a kept background daemon was swept"
    assert all_dead(kept, 10.0)


NOBODY = textwrap.dedent("""\
    import json, os, time
    from execpool import ExecPool, Limits, PythonJob, ShellJob
    FILL = FILL_SOURCE
    DAEMON = DAEMON_SOURCE
    def alive(pid):
        try:
            os.kill(pid, 0)
            return open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] != "Z"
        except OSError:
            return False
    seen = {}
    with ExecPool(workers=1, sandbox="strict") as pool:
        seen["fill"] = pool.run(PythonJob(FILL, limits=Limits(disk=8 << 20))).output.split()
        with pool.session("python") as session:
            session.run("1")
            out = pool.run(ShellJob(DAEMON)).output
            pid = int(out.split()[-1])
            deadline = time.monotonic() + 10
            while alive(pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            seen["daemon_dead"] = not alive(pid)
    print(json.dumps(seen))
""")


@pytest.mark.slow
@pytest.mark.nobody
def test_as_nobody_the_bound_and_the_end_of_strays_hold_too():
    """An unprivileged server: no cgroups, its spaces made in its view's
    user namespace."""
    done = run_as_nobody(NOBODY.replace("FILL_SOURCE", repr(FILL)).replace("DAEMON_SOURCE", repr(DAEMON)))
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["fill"][1] == "ENOSPC" and 5 <= int(seen["fill"][0]) <= 7, seen
    assert seen["daemon_dead"], seen


def test_a_sandboxed_fork_that_does_not_fit_says_so():
    with ExecPool(workers=1, sandbox="strict", disk_budget=10 * MiB, limits=Limits(disk=8 * MiB)) as small:
        with small.session("python") as session:
            with pytest.raises(DiskBudgetError):
                session.fork()
            assert not isinstance(DiskBudgetError("x"), SessionForkError)


WITHOUT_EXTENSION = textwrap.dedent("""\
    import json, sys
    import execpool.tool.become as become
    assert become._spawn is None, "the extension was found"
    from execpool import ExecPool, Limits, PythonJob, ShellJob
    FILL = FILL_SOURCE
    seen = {}
    with ExecPool(workers=1, sandbox="strict") as pool:
        seen["fill"] = pool.run(PythonJob(FILL, limits=Limits(disk=8 << 20))).output.split()
        seen["user_ns"] = pool.run(ShellJob("cat /proc/self/uid_map")).output.split()
        with pool.session("python") as session:
            session.run("open('f', 'w').write('parent')")
            child = session.fork()
            grandchild = child.fork()
            seen["copies"] = [child.run("open('f').read()").value, grandchild.run("open('f').read()").value]
    print(json.dumps(seen))
""")


@pytest.mark.slow
@pytest.mark.parametrize("user", ["root", pytest.param("nobody", marks=pytest.mark.nobody)])
def test_without_the_c_extension_spaces_namespaces_and_forks_are_the_same(user):
    """Where the extension is not built, the same system calls go through
    ctypes and forks of the worker (a copy's mounts once failed there: the
    helper closed the namespaces it needed)."""
    import shutil
    import subprocess
    import sys
    import tempfile

    from tests.support.helpers import UNPRIVILEGED, unprivileged_python, unprivileged_pythonpath

    if user == "nobody" and (os.getuid() != 0 or unprivileged_python() is None):
        pytest.skip("needs root, to run as nobody")
    base = tempfile.mkdtemp(prefix="execpool-test-")  # tmp_path's parents are root's alone
    os.chmod(base, 0o755)
    site = unprivileged_pythonpath(base)
    for built in os.listdir(os.path.join(site, "execpool", "tool")):
        if built.startswith("_spawn") and built.endswith(".so"):
            os.unlink(os.path.join(site, "execpool", "tool", built))
    script = WITHOUT_EXTENSION.replace("FILL_SOURCE", repr(FILL))
    credentials = {} if user == "root" else {"user": UNPRIVILEGED, "group": UNPRIVILEGED, "extra_groups": []}
    python = sys.executable if user == "root" else unprivileged_python()
    try:
        done = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=240, cwd="/",
                              env={"PYTHONPATH": site, "PATH": "/usr/bin:/bin"}, **credentials)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["fill"][1] == "ENOSPC" and 5 <= int(seen["fill"][0]) <= 7, seen
    uid = str(0 if user == "root" else UNPRIVILEGED)
    assert seen["user_ns"] == [uid, uid, "1"], seen
    assert seen["copies"] == ["'parent'", "'parent'"], seen
