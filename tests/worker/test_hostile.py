"""Hostile tools (tests/support/hostile.py) against the pool: each job ends the way the
SPEC and the docs say, and no process of it survives.

Every job here carries ``EXECPOOL_HOSTILE_RUN=<this run>`` in its
environment, so :func:`leftovers` finds what it left anywhere on the machine
without confusing it with the processes of another test run sharing the
machine; an autouse fixture kills such leftovers after each test, so a
failing test never leaves a storm behind for the next one (or for CI).

Safety on a shared machine: storms are bounded trees (a few hundred
processes); the unbounded fork bombs run only inside a cgroup whose
``pids.max`` this file created and verified first (from the outside and from
inside the process that starts the pool); the memory bomb refuses to
allocate unless it sees its own RLIMIT_AS; the disk fill refuses to write
unless it sees its own file-size limit, and writes only under ``tmp_path``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import psutil
import pytest

from execpool import ExecPool, Limits, PythonJob, ShellJob
from execpool.shared.output import STREAM_CAP_NOTICE
from tests.support import hostile
from tests.support.helpers import (
    OUTCOME,
    REPO,
    SPAWN_PARAMS,
    alive,
    all_dead,
    collect,
    joined_output,
    pids_in,
    processes_with_env,
    wait_for,
)

pytestmark = pytest.mark.hostile

RUN = uuid.uuid4().hex
RUN_VAR = "EXECPOOL_HOSTILE_RUN"
#: Carried instead by the bystander job of ``busy_pool``, which must survive.
BUSY_VAR = "EXECPOOL_HOSTILE_BYSTANDER"
MiB = 1 << 20


def env(**extra: str) -> dict:
    return {RUN_VAR: RUN, "PYTHON": sys.executable, **extra}


def leftovers(var: str = RUN_VAR) -> list[psutil.Process]:
    """Live processes of this test run's jobs, anywhere on the machine."""
    return processes_with_env(lambda environ: environ.get(var) == RUN)


def describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for proc in procs[:10]:
        try:
            out.append(f"{proc.pid} {proc.name()} ppid={proc.ppid()} pgid={os.getpgid(proc.pid)}")
        except (psutil.Error, OSError):
            out.append(f"{proc.pid} (gone)")
    return out


def assert_nothing_survives(pids=(), timeout: float = 2.0) -> None:
    pids = list(pids)
    assert all_dead(pids, timeout), [p for p in pids if alive(p)][:10]
    assert wait_for(lambda: not leftovers(), timeout), describe(leftovers())


@pytest.fixture(autouse=True)
def _kill_strays():
    """Whatever a failing test left behind dies before the next test starts.
    Stopped first, then killed: a stopped process cannot fork, so even a
    chain that grows while it is being killed runs out of new links."""
    yield
    for _ in range(50):
        procs = leftovers() + leftovers(BUSY_VAR)
        if not procs:
            return
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for proc in procs:
                try:
                    proc.send_signal(sig)
                except psutil.Error:
                    pass
        time.sleep(0.05)


@pytest.fixture
def default_pool():
    """For jobs whose start does not depend on the spawn method (warm jobs)."""
    with ExecPool(workers=2) as p:
        yield p


BUSY = "echo \"PIDS $$\"; exec sleep 300"
BUSY_ENV = {BUSY_VAR: RUN}


@pytest.fixture(params=SPAWN_PARAMS)
def busy_pool(request):
    """One worker that is never idle: a job of someone else's runs on it the
    whole time. An idle worker kills every child it has, whosever it is; a
    busy one must find what belongs to the job that ended -- and must leave
    the other job alone."""
    with ExecPool(workers=1, spawn_method=request.param) as p:
        other = p.stream(ShellJob(BUSY, timeout=120, env=BUSY_ENV))
        other_pid = pids_in(next(other)["text"])[0]
        yield p
        assert alive(other_pid), "a hostile job's cleanup killed another job's process"
        other.close()


def run_streaming(pool: ExecPool, job) -> tuple[str, object]:
    events, result = collect(pool.stream(job, heartbeat_interval_s=60))
    return joined_output(events), result


# --- storms --------------------------------------------------------------------------------


@pytest.mark.slow
def test_bash_fork_storm_is_killed_whole_at_its_timeout(pool):
    result = pool.run(ShellJob(hostile.FORK_STORM_BASH, timeout=3, env=env()))
    pids = pids_in(result.output)
    assert result.timed_out and result.text == "Execution timed out after 3 seconds."
    assert len(pids) >= 200, f"the storm reached only {len(pids)} of {hostile.FORK_STORM_BASH_SIZE} processes"
    assert_nothing_survives(pids)
    assert pool.run(ShellJob("echo healthy")).text == "healthy\n"


@pytest.mark.slow
def test_python_fork_storm_that_leaves_its_group_is_killed_whole(pool):
    result = pool.run(PythonJob(hostile.FORK_STORM_PYTHON, timeout=3, env=env()))
    pids = pids_in(result.output)
    assert result.timed_out
    assert len(pids) >= 150, f"the storm reached only {len(pids)} of {hostile.FORK_STORM_PYTHON_SIZE} processes"
    assert_nothing_survives(pids)
    assert pool.run(PythonJob("print('healthy')")).text == "healthy\n"


@pytest.mark.slow
def test_warm_python_fork_storm_is_killed_whole(default_pool):
    result = default_pool.run(PythonJob(hostile.FORK_STORM_PYTHON, timeout=3, warm=True, env=env()))
    pids = pids_in(result.output)
    assert result.timed_out and len(pids) >= 150, len(pids)
    assert_nothing_survives(pids)
    assert default_pool.run(PythonJob("print('healthy')", warm=True)).text == "healthy\n"


def test_storm_still_forking_when_the_timeout_hits(pool):
    started = time.monotonic()
    result = pool.run(PythonJob(hostile.GROWING_STORM_PYTHON, timeout=0.4, env=env()))
    assert result.timed_out and time.monotonic() - started < 2.0
    assert pids_in(result.output), "the storm had started growing"
    # Had anything survived the kill it would still be forking: look twice.
    assert_nothing_survives(pids_in(result.output))
    time.sleep(0.3)
    assert not leftovers(), describe(leftovers())


# --- unbounded bombs, only inside a verified pids cap ---------------------------------------

CGROUP_PIDS_ROOT = "/sys/fs/cgroup/pids"
PIDS_CAP = 200

#: The start of a pool's owner that the test moves into the capped cgroup
#: (its pool's workers and tools inherit the group): it checks the cap from
#: inside before anything else.
CAPPED_OWNER = textwrap.dedent("""
    import json, os, sys, time
    cgroup, cap = sys.argv[1], sys.argv[2]
    sys.stdin.readline()  # the test moved us into the group and checked it
    ours = [line.rstrip("\\n").split(":", 2)[2] for line in open("/proc/self/cgroup")
            if line.split(":")[1] == "pids"]
    with open(os.path.join(cgroup, "pids.max")) as f:
        limit = f.read().strip()
    if ours != ["/" + os.path.basename(cgroup)] or limit != cap:
        print(json.dumps({"refused": f"not capped: cgroup {ours}, pids.max {limit}"}), flush=True)
        sys.exit(3)
    from execpool import ExecPool, PythonJob, Sandbox, ShellJob
""")

#: Runs two unbounded bombs, each followed by a job that must start.
BOMB_OWNER = CAPPED_OWNER + textwrap.dedent("""
    report = {}
    with ExecPool(workers=1) as pool:
        for name, job in (("bash", ShellJob(sys.argv[3], timeout=2)),
                          ("python", PythonJob(sys.argv[4], timeout=2))):
            started = time.monotonic()
            result = pool.run(job)
            report[name] = {"timed_out": result.timed_out, "text": result.text[:200],
                            "seconds": time.monotonic() - started}
            # The kill must free the group again, or the next job cannot start.
            report[name + "_next"] = pool.run(ShellJob("echo next", timeout=10)).text
    print(json.dumps(report), flush=True)
""")

#: Fills the group to its cap from the owner itself while the pool is idle,
#: so that every fork the pool's own processes try is refused: a job is
#: asked for meanwhile, then the fill is let go and the pool must serve
#: again. Before, the worker died of a helper's refused fork on the way
#: out of the job that could not start, and the dispatcher of a refused
#: thread for the cleanup: every later job waited for ever.
#: Takes every process slot of the group that comes free, from a thread
#: of the owner's: ``hogging.start()``, ``full.wait()``, then ``let_go()``.
HOG = textwrap.dedent("""
    import signal, threading
    fill, full, stop = [], threading.Event(), threading.Event()

    def hog():
        while not stop.is_set():
            try:
                pid = os.fork()
            except BlockingIOError:
                full.set()
                continue
            if pid == 0:
                signal.pause()
                os._exit(0)
            fill.append(pid)

    def let_go():
        stop.set()
        hogging.join()
        for pid in fill:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        return len(fill)

    hogging = threading.Thread(target=hog)
""")

FULL_OWNER = CAPPED_OWNER + OUTCOME + HOG + textwrap.dedent("""
    import tempfile
    report = {}
    gates = tempfile.mkdtemp()
    started, gate = os.path.join(gates, "started"), os.path.join(gates, "gate")

    with ExecPool(workers=1) as pool:  # its worker is ready: it has forked nothing yet
        held = pool.submit(PythonJob(
            f"import os, time\\nopen({started!r}, 'w').close()\\n"
            f"while not os.path.exists({gate!r}):\\n    time.sleep(0.005)\\nprint('held')", timeout=30))
        deadline = time.monotonic() + 30
        while not os.path.exists(started) and time.monotonic() < deadline:
            time.sleep(0.005)
        hogging.start()
        full.wait(30)
        open(gate, "w").close()  # the job ends while nothing else can fork
        report["held"] = outcome(held)
        report["during"] = outcome(pool.submit(PythonJob("print('during')", sandbox=Sandbox(), timeout=10)))
        report["filled"] = let_go()
        deadline = time.monotonic() + 30
        while True:
            report["after"] = outcome(pool.submit(ShellJob("echo after", timeout=10)))
            if report["after"] == "after\\n" or time.monotonic() > deadline:
                break
        report["sandboxed"] = outcome(pool.submit(PythonJob("print('sandboxed')", sandbox=Sandbox(), timeout=10)))
        report["restarts"] = pool.stats().worker_restarts
    print(json.dumps(report), flush=True)
""")


#: The service's question whether memory caps are cgroups, asked while a
#: tenant holds every process slot, then after.
MEMORY_PROBE_OWNER = CAPPED_OWNER + HOG + textwrap.dedent("""
    from execpool.serve.request_job import memory_cap_by_cgroup
    with ExecPool(workers=1) as pool:
        hogging.start()
        full.wait(30)
        during = memory_cap_by_cgroup(pool)
        let_go()
        after = memory_cap_by_cgroup(pool)
        print(json.dumps({"during": during, "after": after}), flush=True)
""")

def _cgroup_tasks(path: str) -> list[int]:
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(line) for line in f if line.strip()]
    except OSError:
        return []


@pytest.fixture
def pids_cgroup():
    """A v1 pids cgroup of our own with pids.max verified; whatever is left in
    it is killed and the group removed afterwards, also when the test fails."""
    if not os.access(os.path.join(CGROUP_PIDS_ROOT, "cgroup.procs"), os.W_OK):
        pytest.skip("no writable cgroup v1 pids hierarchy: the unbounded bombs need a verified pids cap")
    path = os.path.join(CGROUP_PIDS_ROOT, f"execpool-test-{RUN[:12]}")
    try:
        os.mkdir(path)
    except OSError as exc:
        pytest.skip(f"cannot create a pids cgroup: {exc}")
    try:
        with open(os.path.join(path, "pids.max"), "w") as f:
            f.write(str(PIDS_CAP))
        with open(os.path.join(path, "pids.max")) as f:
            assert f.read().strip() == str(PIDS_CAP)
        yield path
    finally:
        deadline = time.monotonic() + 10
        while (tasks := _cgroup_tasks(path)) and time.monotonic() < deadline:
            for pid in tasks:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.05)
        while True:
            try:
                os.rmdir(path)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def _run_capped(cgroup: str, script: str, *args: str) -> dict:
    """Run ``script`` (which starts with CAPPED_OWNER) moved into ``cgroup``
    before it goes on; its last line, a JSON report."""
    owner = subprocess.Popen([sys.executable, "-c", script, cgroup, str(PIDS_CAP), *args],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(owner.pid))
        assert _cgroup_tasks(cgroup) == [owner.pid]
        owner.stdin.write("go\n")
        owner.stdin.flush()
        out, _ = owner.communicate(timeout=90)
    finally:
        owner.kill()
        owner.wait()
    report = json.loads(out.strip().splitlines()[-1])
    assert "refused" not in report, report
    assert owner.returncode == 0, report
    return report


@pytest.mark.slow
def test_unbounded_fork_bombs_inside_a_verified_pids_cap(pids_cgroup):
    report = _run_capped(pids_cgroup, BOMB_OWNER, hostile.FORK_BOMB_BASH, hostile.FORK_BOMB_PYTHON)
    for name in ("bash", "python"):
        assert report[name]["timed_out"], report
        assert report[name]["seconds"] < 5, report
        assert report[name + "_next"] == "next\n", report
    with open(os.path.join(pids_cgroup, "pids.events")) as f:
        refused_forks = int(f.read().split()[1])
    assert refused_forks > 0, "the bombs never reached the cap: they were not bombs"
    # The pool closed and its owner exited: nothing of either bomb is left.
    assert wait_for(lambda: not _cgroup_tasks(pids_cgroup), timeout=2.0), _cgroup_tasks(pids_cgroup)


@pytest.mark.slow
def test_a_pool_whose_processes_are_refused_every_fork_serves_again_once_they_are_not(pids_cgroup):
    report = _run_capped(pids_cgroup, FULL_OWNER)
    assert report["held"] == "held\n", report
    assert report["filled"] > 0, report
    # Nothing could start: the job fails, as the pool's (it may be retried).
    assert report["during"] == "during\n" or report["during"].startswith("infra"), report
    assert report["after"] == "after\n", report
    assert report["sandboxed"] == "sandboxed\n", report


@pytest.mark.slow
def test_whether_memory_caps_are_cgroups_is_not_concluded_while_a_tenant_holds_every_process(pids_cgroup):
    """Red team: the service took a probe that could not start for the
    answer "no memory cgroup here", and every later client's memory cap
    became an address-space limit, which memfd pages do not count."""
    report = _run_capped(pids_cgroup, MEMORY_PROBE_OWNER)
    assert report["during"] is None, report
    if not os.access("/sys/fs/cgroup/memory/cgroup.procs", os.W_OK):
        pytest.skip("no writable memory cgroup to say yes with")
    assert report["after"] is True, report


def _cap_or_skip(pool: ExecPool, caps: Limits) -> None:
    """Run the storms under a per-job cap only once a job sees the cap in place."""
    probe = pool.run(ShellJob("echo ok", limits=caps))
    if probe.error is not None and "cgroup" in probe.error:
        pytest.skip(f"no per-job cgroup tier here: {probe.error}")
    assert probe.text == "ok\n", probe.text


@pytest.mark.slow
def test_escaping_python_storm_is_held_by_the_per_job_process_cap(pool):
    caps = Limits(processes=32)
    _cap_or_skip(pool, caps)
    result = pool.run(PythonJob(hostile.FORK_STORM_PYTHON, timeout=2, limits=caps, env=env()))
    pids = pids_in(result.output)
    assert result.timed_out
    assert 0 < len(pids) < 32, len(pids)
    assert "Resource temporarily unavailable" in result.output  # the cap refused forks
    assert_nothing_survives(pids)
    assert pool.run(ShellJob("echo healthy")).text == "healthy\n"


@pytest.mark.slow
def test_warm_storm_and_its_daemons_are_held_and_killed_by_the_process_cap():
    """With a per-job cgroup, even processes the marker cannot attribute (a
    warm job's fork-without-exec daemons, see the next-but-one section) die
    with their job on a busy worker."""
    caps = Limits(processes=32)
    with ExecPool(workers=1) as pool:
        _cap_or_skip(pool, caps)
        other = pool.stream(ShellJob(BUSY, timeout=60, env=BUSY_ENV))
        other_pid = pids_in(next(other)["text"])[0]
        try:
            result = pool.run(PythonJob(hostile.FORK_STORM_PYTHON, timeout=2, limits=caps, warm=True, env=env()))
            pids = pids_in(result.output)
            assert result.timed_out and 0 < len(pids) < 32, result.text[:300]
            assert_nothing_survives(pids)
            result = pool.run(PythonJob(hostile.DAEMON_SWARM_PYTHON, limits=caps, warm=True, env=env()))
            assert result.exit_code == 0, result.text
            assert all_dead(pids_in(result.output), timeout=2.0)
            assert alive(other_pid)
        finally:
            other.close()


@pytest.mark.slow
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_fork_chain_and_pid_hopper_are_killed_whole_by_the_process_cap(busy_pool, warm):
    """What the default kill path misses (see test_escaped_processes_die_with_
    their_job_on_a_busy_worker[fork-chain]; the PID hopper slips through it
    now and then for the same reason), the per-job cgroup catches."""
    caps = Limits(processes=400)
    _cap_or_skip(busy_pool, caps)
    for code, says in ((hostile.FORK_CHAIN, "growing\n"), (hostile.PID_HOPPER, "hopping\n")):
        result = busy_pool.run(PythonJob(code, limits=caps, warm=warm, env=env()))
        assert result.text == says
        assert_nothing_survives()
        time.sleep(0.2)
        assert not leftovers(), describe(leftovers())


# --- resources -----------------------------------------------------------------------------

BOMB_LIMIT = 512 * MiB


@pytest.mark.slow
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_memory_bomb_fails_with_memory_error_and_the_pool_is_fine(pool, warm):
    workers = pool.worker_pids
    limits = Limits(address_space=BOMB_LIMIT)
    result = pool.run(PythonJob(hostile.memory_bomb(BOMB_LIMIT), timeout=30, limits=limits, warm=warm, env=env()))
    assert result.output.startswith(f"RLIMIT_AS {BOMB_LIMIT}\n"), result.output[:300]
    assert result.exit_code == 1 and "MemoryError" in result.output, result.text[:500]
    assert pool.worker_pids == workers
    for pid in workers:
        assert psutil.Process(pid).memory_info().rss < 256 * MiB
    assert pool.run(PythonJob("print(sum(range(10)))", warm=warm)).text == "45\n"
    assert_nothing_survives()


@pytest.mark.slow
def test_memory_bomb_that_swallows_memory_error_ends_at_its_timeout(pool):
    limits = Limits(address_space=BOMB_LIMIT)
    started = time.monotonic()
    result = pool.run(PythonJob(hostile.memory_bomb(BOMB_LIMIT, stubborn=True), timeout=1, limits=limits,
                                env=env()))
    assert result.output.startswith(f"RLIMIT_AS {BOMB_LIMIT}\n")
    assert result.timed_out and time.monotonic() - started < 3
    assert_nothing_survives()
    assert pool.run(ShellJob("echo healthy")).text == "healthy\n"


def test_disk_fill_in_python_stops_at_the_file_size_limit(pool, tmp_path):
    limits = Limits(file_size=MiB)
    result = pool.run(PythonJob(hostile.disk_fill_python(MiB), cwd=str(tmp_path), limits=limits, env=env()))
    # Python ignores SIGXFSZ, so the write fails with EFBIG (27) exactly at the limit.
    assert result.text == f"RLIMIT_FSIZE {MiB}\nstopped 27 {MiB}\n"
    assert (tmp_path / "fill").stat().st_size == MiB
    assert pool.run(ShellJob("echo healthy")).text == "healthy\n"


def test_disk_fill_in_bash_is_stopped_by_sigxfsz(pool, tmp_path):
    limits = Limits(file_size=MiB)
    result = pool.run(ShellJob(hostile.DISK_FILL_BASH, cwd=str(tmp_path), limits=limits, env=env()))
    # ``yes`` dies of SIGXFSZ (25): bash says so, and $? is 128 + 25.
    assert "File size limit exceeded" in result.output and "rc=153" in result.output, result.output
    assert (tmp_path / "fill").stat().st_size <= MiB
    assert pool.run(ShellJob("echo healthy")).text == "healthy\n"


@pytest.mark.parametrize("kind", ["python", "shell"])
def test_fd_exhaustion_stops_at_the_open_files_limit(pool, kind):
    worker_fds = {pid: psutil.Process(pid).num_fds() for pid in pool.worker_pids}
    limits = Limits(open_files=64)
    if kind == "python":
        result = pool.run(PythonJob(hostile.FD_EXHAUSTION_PYTHON, limits=limits, env=env()))
        _, errno, opened = result.output.split()
        assert errno == "24"  # EMFILE
    else:
        result = pool.run(ShellJob(hostile.FD_EXHAUSTION_BASH, limits=limits, env=env()))
        opened = result.output.split()[-1]
    assert result.exit_code == 0 and 40 < int(opened) < 64, result.text
    # The worker sends the Result first and cleans up after (the job's
    # directory, the stray sweep), with descriptors of its own for a moment.
    now = lambda: {pid: psutil.Process(pid).num_fds() for pid in pool.worker_pids}  # noqa: E731
    assert wait_for(lambda: now() == worker_fds, 2.0), (now(), worker_fds)
    assert pool.run(ShellJob("echo healthy")).text == "healthy\n"


# --- signals ---------------------------------------------------------------------------------


def test_tool_that_ignores_sigterm_dies_at_its_timeout(pool):
    started = time.monotonic()
    result = pool.run(ShellJob(hostile.IGNORES_SIGTERM, timeout=0.5, env=env()))
    assert result.timed_out and time.monotonic() - started < 1.5
    assert_nothing_survives(pids_in(result.output))


@pytest.mark.slow
def test_tool_that_ignores_every_catchable_signal_dies_at_its_timeout(pool):
    started = time.monotonic()
    result = pool.run(ShellJob(hostile.IGNORES_ALL_SIGNALS, timeout=1, env=env()))
    assert result.timed_out and time.monotonic() - started < 2.5
    pids = pids_in(result.output)
    assert len(pids) == 2, result.output
    assert_nothing_survives(pids)


def test_tool_that_ignores_every_signal_dies_when_its_stream_is_closed(pool):
    stream = pool.stream(ShellJob(hostile.IGNORES_ALL_SIGNALS, timeout=None, env=env()))
    seen = ""
    while len(pids_in(seen)) < 2:
        seen += next(stream).get("text", "")
    started = time.monotonic()
    stream.close()
    assert time.monotonic() - started < 1.0
    assert_nothing_survives(pids_in(seen))


def test_signal_ignoring_child_dies_when_its_leader_exits_cleanly(busy_pool):
    result = busy_pool.run(ShellJob(hostile.IGNORES_ALL_SIGNALS_CHILD, timeout=10, env=env()))
    assert result.exit_code == 0, result.text
    assert len(pids_in(result.output)) == 1
    assert_nothing_survives(pids_in(result.output))


def test_tool_that_kills_its_worker_gets_an_execution_error_and_the_pool_recovers(fresh_pool):
    pool = fresh_pool
    result = pool.run(ShellJob(hostile.KILLS_ITS_WORKER, timeout=5, env=env()))
    assert result.text.startswith("Execution error: worker process ") and "SIGKILL" in result.text
    assert_nothing_survives()
    assert wait_for(lambda: len(pool.worker_pids) == 2)
    assert pool.run(ShellJob("echo healthy")).text == "healthy\n"


@pytest.mark.slow
def test_tool_that_stops_its_worker_still_times_out():
    """A tool runs as the same user as its worker and can SIGSTOP it. The
    worker enforces the job's timeout, so a frozen worker enforces nothing:
    today this job (and every other job on that worker) hangs until someone
    sends SIGCONT. The safety net below continues the worker after 4 s so the
    test fails instead of hanging."""
    with ExecPool(workers=1) as pool:
        worker = pool.worker_pids[0]
        rescue = threading.Timer(4.0, lambda: os.kill(worker, signal.SIGCONT))
        rescue.start()
        try:
            started = time.monotonic()
            result = pool.run(ShellJob(hostile.STOPS_ITS_WORKER, timeout=1, env=env()))
            took = time.monotonic() - started
        finally:
            rescue.cancel()
            os.kill(worker, signal.SIGCONT)
        assert took < 3.0, f"a 1 s timeout took {took:.1f} s: the stopped worker enforced nothing"
        assert result.timed_out or result.error is not None, result.text
        assert_nothing_survives()


# --- closed output -----------------------------------------------------------------------------


def test_closed_stdout_with_a_timeout_is_killed_at_the_timeout(pool):
    started = time.monotonic()
    result = pool.run(PythonJob(hostile.closes_stdout(100), timeout=0.5, env=env()))
    assert result.timed_out and time.monotonic() - started < 1.5
    assert result.output.startswith("PIDS ")
    assert_nothing_survives(pids_in(result.output))


@pytest.mark.parametrize("kind", ["python", "shell"])
def test_closed_stdout_without_timeout_ends_when_the_leader_exits(pool, kind):
    """EOF arrives at once, but the worker waits for the leader's exit too
    (as ``communicate()`` does): the job ends with the leader's exit code."""
    if kind == "python":
        job = PythonJob(hostile.closes_stdout(0.5, exit_code=7), timeout=None, env=env())
    else:
        job = ShellJob("echo \"PIDS $$\"; exec >&- 2>&-; sleep 0.5; exit 7", timeout=None, env=env())
    started = time.monotonic()
    result = pool.run(job)
    assert time.monotonic() - started >= 0.5
    assert result.exit_code == 7 and result.text.startswith("Exit code 7:\nPIDS ")
    assert_nothing_survives(pids_in(result.output))


@pytest.mark.slow
def test_closed_stdout_without_timeout_runs_until_cancelled(pool):
    """Documented behaviour: with ``timeout=None`` a leader that closed its
    output and keeps running keeps its job running (only heartbeats), until
    the job is cancelled."""
    stream = pool.stream(PythonJob(hostile.closes_stdout(100), timeout=None, env=env()),
                         heartbeat_interval_s=0.05)
    # Under load a heartbeat (every 50 ms) can come before the tool has started.
    first = next(event for event in stream if event["type"] == "tool_output")
    pids = pids_in(first["text"])
    events = []
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        events.append(next(stream))  # a StopIteration here would mean the job ended
    assert events and all(e["type"] == "heartbeat" for e in events)
    assert all(alive(p) for p in pids)
    stream.close()
    assert_nothing_survives(pids)


# --- escapes -----------------------------------------------------------------------------------

ESCAPES = {
    "setsid-swarm-bash": ShellJob(hostile.DAEMON_SWARM_BASH, env=env()),
    "double-fork-swarm-python": PythonJob(hostile.DAEMON_SWARM_PYTHON, env=env()),
    "mutual-respawn": PythonJob(hostile.MUTUAL_RESPAWN, env=env()),
    "fork-chain": PythonJob(hostile.FORK_CHAIN, env=env()),
    "job-control-groups": ShellJob(hostile.JOB_CONTROL_BACKGROUND, env=env()),
    "new-pgid-orphans": PythonJob(hostile.NEW_PGID_ORPHANS, env=env()),
    "200-background-sleepers": ShellJob(hostile.MANY_SLEEPERS, env=env()),
    "popen-new-sessions": PythonJob(hostile.POPEN_NEW_SESSIONS, env=env()),
}


#: The escapes the fast tier tries (the whole suite tries each): a new
#: session, a double fork, a new process group.
FAST_ESCAPES = {"setsid-swarm-bash", "double-fork-swarm-python", "new-pgid-orphans"}


def _escapes(names) -> list:
    return [pytest.param(name, marks=[] if name in FAST_ESCAPES else [pytest.mark.slow]) for name in names]


@pytest.mark.parametrize("name", _escapes(ESCAPES))
def test_escaped_processes_die_with_their_job_on_a_busy_worker(busy_pool, name):
    result = busy_pool.run(ESCAPES[name])
    assert result.exit_code == 0 and result.error is None, result.text[:300]
    assert_nothing_survives(pids_in(result.output))
    # Respawners and hoppers would be back by now if one had slipped through.
    time.sleep(0.2)
    assert not leftovers(), describe(leftovers())


@pytest.mark.parametrize("name", _escapes(["200-background-sleepers", "new-pgid-orphans", "setsid-swarm-bash"]))
def test_escaped_processes_die_at_the_timeout(pool, name):
    job = ESCAPES[name]
    job = type(job)(job.source + ("\nsleep 100\n" if job.kind == "shell" else "\nimport time; time.sleep(100)\n"),
                    timeout=0.5, env=env())
    result = pool.run(job)
    assert result.timed_out
    assert_nothing_survives(pids_in(result.output))


def test_warm_double_fork_daemons_die_with_their_job_on_a_busy_worker():
    """A warm job is a fork of the worker: a daemon it forks without exec
    keeps the worker's exec-time environment in /proc/PID/environ, which has
    no job marker, so the worker cannot attribute it while another job keeps
    it from being idle."""
    with ExecPool(workers=1) as pool:
        other = pool.stream(ShellJob(BUSY, timeout=60, env=BUSY_ENV))
        other_pid = pids_in(next(other)["text"])[0]
        try:
            result = pool.run(PythonJob(hostile.DAEMON_SWARM_PYTHON, warm=True, env=env()))
            pids = pids_in(result.output)
            assert result.exit_code == 0 and len(pids) == 10, result.text
            assert all_dead(pids, timeout=2.0), f"{sum(map(alive, pids))} of 10 warm daemons outlived their job"
            assert alive(other_pid)
        finally:
            other.close()


# --- output ------------------------------------------------------------------------------------


def _reference(code: str, tmp_path) -> str:
    """What SPEC §2 says a job's output is: communicate() with text=True,
    encoding utf-8, errors=replace, stdout and stderr merged."""
    script = tmp_path / "reference.py"
    script.write_text(code)
    return subprocess.run([sys.executable, "-u", str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, encoding="utf-8", errors="replace").stdout


def test_binary_garbage_decodes_like_communicate(pool, tmp_path):
    code = hostile.random_bytes(300_000, seed=6)
    expected = _reference(code, tmp_path)
    assert "\ufffd" in expected and "\r" not in expected
    streamed, result = run_streaming(pool, PythonJob(code, env=env()))
    assert result.exit_code == 0
    assert result.output == expected
    assert streamed == expected  # under the live cap, so the stream is all of it
    assert result.output_chars == len(expected)


def test_binary_garbage_from_a_warm_job(default_pool, tmp_path):
    code = hostile.random_bytes(200_000, seed=7)
    assert default_pool.run(PythonJob(code, warm=True, env=env())).output == _reference(code, tmp_path)


def test_single_50mb_line_keeps_a_bounded_result_with_the_exact_length(pool):
    caller, workers = psutil.Process(), [psutil.Process(p) for p in pool.worker_pids]
    base = [caller.memory_info().rss] + [w.memory_info().rss for w in workers]
    command = hostile.FLOOD_ONE_LINE_CMD.format(n=50_000_000)
    streamed, result = run_streaming(pool, ShellJob(command, timeout=60, env=env()))
    after = [caller.memory_info().rss] + [w.memory_info().rss for w in workers]
    assert result.exit_code == 0 and result.output_chars == 50_000_000
    assert result.output == "x" * pool.config.max_output_chars
    assert streamed == "x" * 400_000 + STREAM_CAP_NOTICE
    assert all(a - b < 64 * MiB for a, b in zip(after, base)), (base, after)


def test_single_line_of_multibyte_characters_is_counted_exactly(pool):
    # 25 million 'é' (50 MB of UTF-8) in one write: every read of the pipe
    # splits a character somewhere, and not one may be lost or doubled.
    code = "import sys\nsys.stdout.write('\\u00e9' * 25_000_000)\n"
    result = pool.run(PythonJob(code, timeout=60, max_output_chars=1000, env=env()))
    assert result.exit_code == 0 and result.output_chars == 25_000_000
    assert result.output == "\u00e9" * 1000
    assert result.text.endswith("[output truncated: 25000000 chars total, the first 1000 kept]")


# --- stdin ---------------------------------------------------------------------------------------


def test_shell_stdin_readers_all_end_on_devnull(pool):
    result = pool.run(ShellJob(hostile.STDIN_READERS_SHELL, timeout=10, env=env()))
    assert result.text == "/dev/null\nend\n"


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_python_stdin_readers_all_end_on_devnull(pool, warm):
    result = pool.run(PythonJob(hostile.STDIN_READERS_PYTHON, timeout=10, warm=warm, env=env()))
    assert result.text == "/dev/null\n'' b'' []\nEOFError\n"


def test_reading_stdin_forever_ends_at_the_timeout(pool):
    result = pool.run(ShellJob(hostile.STDIN_FOREVER, timeout=0.5, env=env()))
    assert result.timed_out
    assert_nothing_survives()


# --- crashes -------------------------------------------------------------------------------------


def test_shell_killed_by_sigsegv(pool):
    result = pool.run(ShellJob(hostile.SEGFAULT_SHELL, env=env()))
    assert result.exit_code == -11 and result.signal_name == "SIGSEGV"
    assert result.text == "Exit code -11:\nbefore\n"


def test_abort_names_sigabrt(pool):
    result = pool.run(PythonJob(hostile.ABORT, env=env()))
    assert result.exit_code == -6 and result.signal_name == "SIGABRT"
    assert result.text.startswith("Exit code -6:\nbefore\n")


def test_warm_segfault_names_sigsegv(default_pool):
    result = default_pool.run(PythonJob(hostile.SEGFAULT, warm=True, env=env()))
    assert result.exit_code == -11 and result.signal_name == "SIGSEGV"
    assert result.output.startswith("before\n")
    assert default_pool.run(PythonJob("print('healthy')", warm=True)).text == "healthy\n"


def test_a_crashing_grandchild_does_not_change_the_leaders_exit(pool):
    result = pool.run(ShellJob(hostile.SEGFAULT_GRANDCHILD, env=env()))
    assert result.exit_code == 0 and result.signal_name is None
    assert result.output.endswith("child status 139\n")
