"""Nothing a job started outlives its worker, ``pool.close()`` or the
process that owns the pool -- also a daemon that left its session with
``setsid``, cleared its environment with ``env -i`` (so no job marker finds
it) and was re-parented to init when its worker died, and also a worker
that its own tool keeps stopped.

Where a cgroup v2 hierarchy is writable (root here) each worker runs in a
group of its own, and ``cgroup.kill`` reaches whatever a job did to its
session, group or environment; when the owner dies, the pool's lifeline
(execpool/lifeline/process.py) continues and kills the workers, kills those groups
and removes the workers' directories. Without a writable hierarchy (a
non-root user on most machines) the lifeline still continues and kills the
workers and removes their directories; a daemon that cleared its
environment is then beyond reach -- the tests that need the groups say so
and skip.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil
import pytest

from execpool import ExecPool, ShellJob
from execpool.shared.kernel import cgroups
from tests.support.helpers import (
    REPO,
    UNPRIVILEGED,
    alive,
    all_dead,
    pids_in,
    remember,
    state,
    unprivileged_python,
    unprivileged_pythonpath,
    wait_for,
    worker_records,
)

#: A daemon in a session of its own with an empty environment, orphaned at
#: once (its parent ``sh`` exits), announcing its pid.
ESCAPE = "setsid sh -c 'env -i /bin/sleep 300 </dev/null >/dev/null 2>&1 & echo \"PIDS $!\"'; "
#: ...then the tool SIGKILLs its worker.
ESCAPE_THEN_KILL_WORKER = ESCAPE + "sleep 0.5; kill -KILL $PPID; sleep 100"
#: A tool that keeps its worker stopped: stops it again 50 ms after anyone continues it.
STOPPER = "while :; do kill -STOP $PPID; sleep 0.05; done"
ESCAPE_THEN_STOP_WORKER = ESCAPE + "sleep 0.3; " + STOPPER


def _own_v2_group() -> str:
    """Where this process sits in the cgroup v2 hierarchy ("" where there is none)."""
    with open("/proc/self/mounts") as f:
        mounts = [line.split()[1] for line in f if line.split()[2] == "cgroup2"]
    with open("/proc/self/cgroup") as f:
        paths = [line.rstrip("\n").split(":", 2)[2] for line in f if line.startswith("0::")]
    return mounts[0] + paths[0].rstrip("/") if mounts and paths else ""


def _worker_groups_possible() -> bool:
    """Whether a group below ours can be made, and killed whole."""
    own = _own_v2_group()
    if not own:
        return False
    probe = os.path.join(own, f"execpool-probe-{os.getpid()}")
    try:
        os.mkdir(probe)
    except OSError:
        return False
    try:
        return os.path.exists(os.path.join(probe, "cgroup.kill"))
    finally:
        os.rmdir(probe)


needs_worker_groups = pytest.mark.skipif(
    not _worker_groups_possible(), reason="no writable cgroup v2 hierarchy: an env -i daemon is beyond reach here")


def groups_of(token: str) -> list:
    """The cgroup directories of the worker with this token, anywhere."""
    found = []
    for directory, subdirs, _files in os.walk("/sys/fs/cgroup"):
        found += [os.path.join(directory, d) for d in subdirs if d.startswith(f"execpool-{token}")]
    return found


def destroy_group(path: str, timeout: float = 2.0) -> None:
    """Kill everything in a v2 group a failed test left and remove it."""
    cgroups.WorkerGroup(path).destroy(timeout)


def _read_until_pids(stream, timeout: float = 10.0) -> list:
    deadline = time.monotonic() + timeout
    text = ""
    while "PIDS" not in text:
        assert time.monotonic() < deadline, f"the tool announced no pids: {text!r}"
        text += next(stream).get("text", "")
    return pids_in(text)


def _environ(pid: int) -> dict:
    try:
        return psutil.Process(pid).environ()
    except psutil.Error:
        return {"gone": "yes"}


def _assert_escaped(daemon: int, leader: int) -> None:
    """The daemon really is what the test says: an empty environment (once
    ``env -i`` ran) and a session that is not its job's."""
    assert wait_for(lambda: _environ(daemon) == {}, 5.0), _environ(daemon)
    assert os.getsid(daemon) not in (os.getsid(leader), os.getsid(0))


@needs_worker_groups
def test_the_worker_sits_in_a_group_of_its_own():
    with ExecPool(workers=1) as pool:
        worker = worker_records(pool)[0]
        with open(f"/proc/{worker.proc.pid}/cgroup") as f:
            v2 = [line.split(":", 2)[2].strip() for line in f if line.startswith("0::")]
        assert v2 and f"/execpool-{worker.token}/" in v2[0] + "/", v2
    assert wait_for(lambda: not groups_of(worker.token), 3.0), groups_of(worker.token)


def test_a_worker_in_its_group_gets_its_jobs_groups_beside_it(tmp_path, monkeypatch):
    """Where v2 hands out controllers, a worker sits in the leaf of its own
    group, which may hold no controllers itself (a v2 group with processes
    cannot hand them on): the per-job tier goes beside the leaf, in the
    worker's group, with the controllers that group is offered. This machine
    keeps its controllers on v1, so the hierarchy here is a stand-in."""
    group = tmp_path / "execpool-0123abcd"
    (group / cgroups.WORKER_LEAF).mkdir(parents=True)
    (group / "cgroup.controllers").write_text("cpu io memory pids\n")
    (group / "cgroup.subtree_control").write_text("")
    monkeypatch.setattr(cgroups, "_mounts", lambda: {"": str(tmp_path)})
    monkeypatch.setattr(cgroups, "_own_groups", lambda: {"": f"/execpool-0123abcd/{cgroups.WORKER_LEAF}"})
    tier = cgroups.Cgroups.detect("0123abcd")
    assert tier is not None and tier.version == 2
    assert tier.bases == {"pids": str(group), "memory": str(group)}
    assert (group / "cgroup.subtree_control").read_text() == "+memory +pids"
    # Offered nothing, it has no v2 tier (and, with no v1 hierarchy either, none).
    (group / "cgroup.controllers").write_text("cpu io\n")
    assert cgroups.Cgroups.detect("0123abcd") is None


@pytest.mark.slow
@needs_worker_groups
def test_an_escaped_daemon_dies_with_the_worker_it_killed(doomed):
    with ExecPool(workers=1) as pool:
        worker = worker_records(pool)[0]
        stream = pool.stream(ShellJob(ESCAPE_THEN_KILL_WORKER, timeout=None), heartbeat_interval_s=0.1)
        daemon = _read_until_pids(stream)[0]
        remember(doomed, [daemon])
        _assert_escaped(daemon, worker.proc.pid)
        with pytest.raises(StopIteration) as stop:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                next(stream)
        assert "SIGKILL" in stop.value.value.text, stop.value.value
        assert all_dead([daemon], timeout=2.0), "the daemon outlived the worker it killed"
        assert wait_for(lambda: not groups_of(worker.token), 3.0), groups_of(worker.token)
        assert wait_for(lambda: not os.path.exists(worker.jobs_dir), 10.0)
        assert pool.run(ShellJob("echo healthy")).text == "healthy\n"


@needs_worker_groups
def test_nothing_a_job_started_outlives_close(doomed):
    pool = ExecPool(workers=1)
    try:
        worker = worker_records(pool)[0]
        stream = pool.stream(ShellJob('echo "PIDS $$"; ' + ESCAPE_THEN_STOP_WORKER, timeout=None),
                             heartbeat_interval_s=0.1)
        pids = _read_until_pids(stream)
        while len(pids) < 2:
            pids += _read_until_pids(stream)
        remember(doomed, pids)
        _assert_escaped(pids[1], pids[0])
        assert wait_for(lambda: state(worker.proc.pid) == "T", 5.0), "the tool never stopped its worker"
        started = time.monotonic()
        pool.close(timeout=1.0)
        assert time.monotonic() - started < 5.0
        assert all_dead(pids + [worker.proc.pid], timeout=2.0), [p for p in pids if alive(p)]
        assert not groups_of(worker.token), groups_of(worker.token)
        assert not os.path.exists(worker.jobs_dir)
    finally:
        pool.close()


#: The pool's owner: starts two jobs -- the first keeps its worker stopped,
#: the second leaves a daemon -- says what it started, and waits to be killed.
OWNER = textwrap.dedent("""
    import json, sys, time
    from execpool import ExecPool, ShellJob
    pool = ExecPool(workers=2, cgroups=sys.argv[1] == "cgroups")
    pids, streams = [], []  # a stream dropped is a job cancelled: keep them
    for command in sys.argv[2:]:
        stream = pool.stream(ShellJob(command, timeout=None), heartbeat_interval_s=0.1)
        streams.append(stream)
        text, deadline = "", time.monotonic() + 20
        while text.count("PIDS") < command.count("PIDS") and time.monotonic() < deadline:
            text += next(stream).get("text", "")
        pids += [int(p) for p in text.split() if p.isdigit()]
    workers = [(w.proc.pid, w.token, w.jobs_dir) for w in pool._workers.all]
    print(json.dumps({"workers": workers, "tools": pids}), flush=True)
    sys.stdin.read()
""")

#: Without cgroups only what carries its job's marker can be found once the
#: worker is gone: this daemon left its session but kept its environment.
MARKED_DAEMON = "setsid sleep 300 </dev/null >/dev/null 2>&1 & echo \"PIDS $!\"; sleep 100"


@pytest.mark.slow
@pytest.mark.parametrize("cgroups", [
    pytest.param(True, marks=needs_worker_groups, id="worker-groups"),
    pytest.param(False, id="no-cgroups"),
])
def test_sigkill_of_the_owner_leaves_no_worker_tool_daemon_or_directory(cgroups, tmp_path, doomed):
    """The owner dies while one worker is kept stopped by its tool (it would
    never see its control pipe close) and a daemon has escaped from the
    other worker's job: with the worker groups an ``env -i`` one, without
    them one that kept its marker."""
    tmpdir = tmp_path / "owner-tmp"
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    daemon_job = ESCAPE + "sleep 100" if cgroups else MARKED_DAEMON
    with open(tmp_path / "owner.err", "wb") as err:
        owner = subprocess.Popen(
            [sys.executable, "-c", OWNER, "cgroups" if cgroups else "no-cgroups",
             'echo "PIDS $$"; sleep 0.3; ' + STOPPER, daemon_job],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, cwd=REPO, env=env, text=True)
    tokens: list = []
    try:
        line = owner.stdout.readline()
        assert line, (tmp_path / "owner.err").read_text()[-2000:]
        report = json.loads(line)
        workers = [pid for pid, _, _ in report["workers"]]
        tokens = [token for _, token, _ in report["workers"]]
        helpers = [p.pid for p in psutil.Process(owner.pid).children()]  # the workers, and the lifeline
        remember(doomed, workers + report["tools"] + helpers)
        stopped, daemon = workers[0], report["tools"][1]
        assert wait_for(lambda: state(stopped) == "T", 5.0), "the tool never stopped its worker"
        if cgroups:
            _assert_escaped(daemon, workers[1])
        assert sorted(os.listdir(tmpdir)) == sorted(os.path.basename(d) for _, _, d in report["workers"])

        _kill_and_expect_nothing_left(owner, workers + report["tools"] + helpers, tmpdir)
        assert wait_for(lambda: not [g for t in tokens for g in groups_of(t)], 5.0)
    finally:
        _let_go(owner, doomed)
        for token in tokens:
            for path in groups_of(token):
                destroy_group(path)


#: Kills the pool's lifeline (the worker's parent).
KILLS_THE_LIFELINE = 'kill -KILL "$(ps -o ppid= -p $PPID | tr -d " ")"; echo "PIDS $$"; sleep 100'


def _lifelines(owner: int) -> list:
    found = []
    for child in psutil.Process(owner).children():
        try:
            if "execpool.lifeline" in child.cmdline():
                found.append(child.pid)
        except psutil.Error:
            continue
    return found


@pytest.mark.slow
def test_a_lifeline_a_tool_killed_is_replaced_before_the_owner_dies(tmp_path, doomed):
    """A tool can kill the lifeline (it runs as the tool's user, and it is
    its worker's parent), then keep its worker stopped: the owner's death
    would then leave both behind. The watchdog replaces a dead lifeline
    while jobs run, and the new one knows the workers of the old."""
    tmpdir = tmp_path / "owner-tmp"
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    with open(tmp_path / "owner.err", "wb") as err:
        owner = subprocess.Popen(
            [sys.executable, "-c", OWNER, "no-cgroups", KILLS_THE_LIFELINE, 'echo "PIDS $$"; sleep 0.3; ' + STOPPER],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, cwd=REPO, env=env, text=True)
    try:
        line = owner.stdout.readline()
        assert line, (tmp_path / "owner.err").read_text()[-2000:]
        report = json.loads(line)
        workers = [pid for pid, _, _ in report["workers"]]
        remember(doomed, workers + report["tools"] + [p.pid for p in psutil.Process(owner.pid).children()])
        assert wait_for(lambda: "T" in {state(w) for w in workers}, 5.0), "the tool never stopped its worker"
        # The first lifeline died before the report; one lives now.
        assert wait_for(lambda: len(_lifelines(owner.pid)) == 1, 5.0), "no lifeline came back"
        remember(doomed, _lifelines(owner.pid))
        _kill_and_expect_nothing_left(owner, [proc.pid for proc in doomed], tmpdir)
    finally:
        _let_go(owner, doomed)


def _kill_and_expect_nothing_left(owner: subprocess.Popen, pids: list, tmpdir) -> None:
    """SIGKILL the owner; then none of ``pids`` may live on, nor anything in
    its temporary directory."""
    owner.kill()
    owner.wait()
    survivors = lambda: [pid for pid in pids if alive(pid)]  # noqa: E731
    assert wait_for(lambda: not survivors(), 5.0), survivors()
    assert wait_for(lambda: not os.listdir(tmpdir), 5.0), os.listdir(tmpdir)


def _let_go(owner: subprocess.Popen, doomed: list) -> None:
    """Whatever a test ends with: the owner dead, and nothing it started
    left stopped (the doomed fixture kills it all)."""
    owner.kill()
    owner.wait()
    for proc in doomed:
        try:
            proc.send_signal(signal.SIGCONT)
        except psutil.Error:
            pass


#: An owner that starts a pool and one job per worker, says what runs, and
#: waits to be killed.
QUICK_OWNER = textwrap.dedent("""
    import json, sys, time
    from execpool import ExecPool, ShellJob
    pool = ExecPool(workers=2, warm_spares=0)
    texts = [[], []]
    futures = [pool.submit(ShellJob('echo "PIDS $$"; sleep 100 & echo "PIDS $!"; wait', timeout=None),
                           on_event=lambda e, t=t: t.append(e.text)) for t in texts]
    while sum("".join(t).count("PIDS") for t in texts) < 4:
        time.sleep(0.001)
    tools = [int(p) for t in texts for p in "".join(t).split() if p.isdigit()]
    print(json.dumps({"workers": pool.worker_pids, "tools": tools}), flush=True)
    sys.stdin.read()
""")

#: CPU-bound neighbours for the test below, bounded in time whatever happens.
BUSY = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end:\n    pass\n"


@pytest.mark.slow
# Fifty owners, each started and killed in turn: 52 s on a quiet machine,
# past the suite's 120 s with two suites sharing the CPUs. Each round is
# bounded on its own (1 s for the workers, 10 s for the lifeline).
@pytest.mark.timeout(600)
def test_fifty_owner_sigkills_under_load_leave_no_worker_or_tool_alive_after_a_second(doomed):
    """The owner is SIGKILLed at once after its jobs started, 50 times in a
    row, with two CPU-bound processes beside it: each time, its workers and
    their tools are gone within a second (and the lifeline soon after)."""
    busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(2)]
    remember(doomed, [p.pid for p in busy])
    late = []
    try:
        for attempt in range(50):
            owner = subprocess.Popen([sys.executable, "-c", QUICK_OWNER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, cwd=REPO, text=True)
            try:
                line = owner.stdout.readline()
                assert line, f"attempt {attempt}: the owner said nothing"
                report = json.loads(line)
                bound = report["workers"] + report["tools"]
                lifelines = [p.pid for p in psutil.Process(owner.pid).children() if p.pid not in bound]
                remember(doomed, bound + lifelines)
                owner.kill()
                owner.wait()
                killed = time.monotonic()
                if not wait_for(lambda: not [p for p in bound if alive(p)], 1.0):
                    late.append((attempt, [(p, state(p), _name(p)) for p in bound if alive(p)],
                                 round(time.monotonic() - killed, 3)))
                # The lifeline itself may take longer: it sweeps the host
                # for markers and removes the workers' directories.
                assert wait_for(lambda: not [p for p in lifelines if alive(p)], 10.0), "the lifeline never ended"
            finally:
                _let_go(owner, doomed)
                owner.stdin.close()
                owner.stdout.close()
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    assert not late, f"alive more than 1 s after the owner's SIGKILL: {late}"


def _name(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:60]
    except psutil.Error:
        return "gone"


#: An owner with a scratch directory holding a file (and a tree) of a job's.
SCRATCH_OWNER = textwrap.dedent("""
    import sys
    from execpool import ExecPool, ShellJob
    pool = ExecPool(workers=1)
    scratch = pool.scratch_dir()
    assert pool.run(ShellJob("mkdir -p a/b/c && echo x > a/b/c/f", timeout=30, cwd=scratch)).exit_code == 0
    print(scratch, flush=True)
    sys.stdin.read()
""")


@pytest.mark.slow
def test_a_scratch_directory_goes_with_close_and_with_a_sigkilled_owner(tmp_path, doomed):
    """The service keeps the files of its requests' jobs in scratch
    directories: a SIGKILLed server left them in /tmp (red team)."""
    tmpdir = tmp_path / "owner-tmp"
    tmpdir.mkdir()
    with ExecPool(workers=1) as pool:
        scratch = pool.scratch_dir()
        assert os.stat(scratch).st_mode & 0o777 == 0o700
        assert pool.run(ShellJob("echo x > f", timeout=30, cwd=scratch)).exit_code == 0
    assert not os.path.exists(scratch)
    with pytest.raises(RuntimeError):
        pool.scratch_dir()
    with open(tmp_path / "owner.err", "wb") as err:
        owner = subprocess.Popen([sys.executable, "-c", SCRATCH_OWNER], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=err, cwd=REPO,
                                 env={**os.environ, "TMPDIR": str(tmpdir)}, text=True)
    try:
        scratch = owner.stdout.readline().strip()
        assert scratch, (tmp_path / "owner.err").read_text()[-2000:]
        assert os.path.exists(os.path.join(scratch, "a/b/c/f"))
        remember(doomed, [p.pid for p in psutil.Process(owner.pid).children()])
        _kill_and_expect_nothing_left(owner, [proc.pid for proc in doomed], tmpdir)
    finally:
        _let_go(owner, doomed)


#: An owner whose only job leaves a daemon that escaped its session, double
#: forked and cleared its environment; it says which pids run and waits.
ESCAPING_OWNER = textwrap.dedent("""
    import json, sys, threading
    from execpool import ExecPool, ShellJob
    pool = ExecPool(workers=1, cgroups=sys.argv[1] == "cgroups")
    texts, said = [], threading.Event()

    def seen(event):
        texts.append(event.text)
        if "PIDS" in "".join(texts):
            said.set()

    pool.submit(ShellJob(sys.argv[2], timeout=None), on_event=seen)
    said.wait(20)
    tools = [int(p) for p in "".join(texts).split() if p.isdigit()]
    print(json.dumps({"workers": pool.worker_pids, "tools": tools, "uid": __import__("os").getuid()}), flush=True)
    sys.stdin.read()
""")


@pytest.mark.parametrize("user, cgroups", [("root", False), pytest.param("nobody", True, marks=pytest.mark.nobody)])
def test_owner_and_worker_sigkilled_together_leave_no_escaped_daemon(user, cgroups, tmp_path, doomed, request):
    """The gap the lifeline used to leave: the owner and the worker die at
    once, and a daemon that left its session, double forked and cleared its
    environment (no marker) was re-parented to init and lived on wherever no
    worker cgroup could be killed -- as ``nobody`` everywhere, as root with
    ``cgroups=False``. The lifeline is the workers' parent and a child
    subreaper, so the daemon is handed to it when the worker dies, and
    killed."""
    env = {"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)}
    if user == "root":
        python, credentials, env["PYTHONPATH"] = sys.executable, {}, REPO
    else:
        python = unprivileged_python()
        if python is None:
            pytest.skip("no Python interpreter the unprivileged user may run")
        credentials = {"user": UNPRIVILEGED, "group": UNPRIVILEGED, "extra_groups": []}
        base = tempfile.mkdtemp(prefix="execpool-owner-test-")  # pytest's tmp_path is root's alone
        request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
        os.chmod(base, 0o755)
        env["PYTHONPATH"] = unprivileged_pythonpath(base)
        env["TMPDIR"] = os.path.join(base, "tmp")
        os.mkdir(env["TMPDIR"], 0o700)
        os.chown(env["TMPDIR"], UNPRIVILEGED, UNPRIVILEGED)
    owner = subprocess.Popen([python, "-c", ESCAPING_OWNER, "cgroups" if cgroups else "no-cgroups", ESCAPE + "sleep 100"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd="/", env=env, text=True, **credentials)
    try:
        line = owner.stdout.readline()
        assert line, "the owner said nothing"
        report = json.loads(line)
        assert report["uid"] == (0 if user == "root" else UNPRIVILEGED)
        (worker,), (daemon,) = report["workers"], report["tools"]
        remember(doomed, [worker, daemon] + [p.pid for p in psutil.Process(owner.pid).children(recursive=True)])
        _assert_escaped(daemon, worker)
        for pid in (owner.pid, worker):
            os.kill(pid, signal.SIGKILL)
        owner.wait()
        assert all_dead([worker], timeout=2.0)
        assert all_dead([daemon], timeout=3.0), "the escaped daemon outlived its owner and its worker"
        assert all_dead([proc.pid for proc in doomed], timeout=5.0), "the lifeline never ended"
    finally:
        _let_go(owner, doomed)
        owner.stdin.close()
        owner.stdout.close()
