"""Jobs are tenants: a tool reaches nothing of another job or of the pool.

Each test is an attack a hostile tool made on execpool (as root, the user
these tests run as; the descriptor and memory checks hold for any user),
written so that it failed before the fix it guards.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import secrets
import shlex
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from execpool import ExecPool, Limits, PythonJob, ShellJob
from execpool.tool.spare_wire import SPARE_NAME, TEMPLATE_NAME
from tests.support.helpers import alive, all_dead, pids_in, state, wait_for, worker_records

pytestmark = pytest.mark.hostile

#: A tool's view of its own descriptors, less the one the listing opens.
LIST_FDS_PYTHON = """
import os
def still_open(fd):
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
print(sorted(fd for fd in map(int, os.listdir("/proc/self/fd")) if still_open(fd)))
"""


def _fds_of_every_kind(pool: ExecPool, **job) -> dict:
    return {
        # What the shell hands a program it execs is what the shell has.
        "shell": pool.run(ShellJob(f"exec {sys.executable} -c {shlex.quote(LIST_FDS_PYTHON)}", **job)).output,
        "cold": pool.run(PythonJob(LIST_FDS_PYTHON, **job)).output,
        "warm": pool.run(PythonJob(LIST_FDS_PYTHON, warm=True, **job)).output,
    }


def test_no_descriptor_but_stdio_reaches_a_tool_after_spares_were_parked(pool):
    # Once a warm job has run, the worker holds its parked spares' sockets;
    # they once reached every later cold and shell tool, which could then
    # hand a spare a job of its own making.
    pool.run(PythonJob("pass", warm=True))
    assert wait_for(lambda: _parked(pool))
    for _ in range(2):
        assert _fds_of_every_kind(pool) == {"shell": "[0, 1, 2]\n", "cold": "[0, 1, 2]\n",
                                            "warm": "[0, 1, 2]\n"}


@pytest.mark.slow
@pytest.mark.parametrize("held, open_files", [(1100, None), (100, 64)])
def test_no_descriptor_reaches_a_tool_above_its_open_files_limit(held, open_files):
    # A worker's channel keeps the descriptor numbers the caller had free:
    # a caller holding many descriptors gives its workers high ones, which a
    # close up to the tool's (lowered) open-files limit did not reach.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < held + 64:
        pytest.skip(f"needs an open-files hard limit above {held + 64}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, held + 64), hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(held)]
    try:
        limits = Limits(open_files=open_files) if open_files else Limits()
        for method in ("vfork", "fork"):
            if method == "vfork" and not _has_vfork():
                continue
            with ExecPool(workers=1, spawn_method=method, limits=limits) as pool:
                assert _fds_of_every_kind(pool) == {"shell": "[0, 1, 2]\n", "cold": "[0, 1, 2]\n",
                                                    "warm": "[0, 1, 2]\n"}, method
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


#: Opens every descriptor of the process that owns the pool (the first
#: ancestor that is none of the pool's: above the worker and the lifeline)
#: through /proc, as a tool after the pool's channels would, and prints the
#: numbers of those it could open.
OPEN_THE_OWNERS_DESCRIPTORS = r"""
import os
owner = os.getppid()
while True:
    with open(f"/proc/{owner}/cmdline", "rb") as f:
        if b"execpool." not in f.read():
            break
    with open(f"/proc/{owner}/stat") as f:
        owner = int(f.read().rpartition(")")[2].split()[1])
opened = set()
for name in os.listdir(f"/proc/{owner}/fd"):
    for flags in (os.O_RDONLY, os.O_WRONLY):
        try:
            os.close(os.open(f"/proc/{owner}/fd/{name}", flags | os.O_NONBLOCK | os.O_NOCTTY))
            opened.add(int(name))
        except OSError:
            pass
print(sorted(opened))
"""


def test_no_tool_can_open_the_pools_channels_through_proc():
    # The channels were pipes, which any process of the same user can open
    # again through /proc/<owner>/fd of a dumpable owner (the default): a
    # tool read the next job's Start there -- its code, env and stdin -- and
    # rewrote it. Sockets cannot be opened that way.
    with ExecPool(workers=2) as pool:
        pool.run(PythonJob("pass", warm=True))
        channels = {pool._dispatcher._wake_r, pool._dispatcher._wake_w, pool._workers.lifeline._socket().fileno()}
        for worker in worker_records(pool):
            channels |= {worker.send_conn.fileno(), worker.recv.fileno()}
        for job in (ShellJob(f"exec {sys.executable} -c {shlex.quote(OPEN_THE_OWNERS_DESCRIPTORS)}"),
                    PythonJob(OPEN_THE_OWNERS_DESCRIPTORS), PythonJob(OPEN_THE_OWNERS_DESCRIPTORS, warm=True)):
            opened = set(json.loads(pool.run(job).output))
            assert opened, "the probe opened nothing of its owner's: it proves nothing here"
            assert not opened & channels, f"a tool opened the pool's channels {sorted(opened & channels)}"


#: Searches every readable page of its own memory, and every string object,
#: for secrets of the shape below, and prints the ones it found.
MEMORY_SCAN = r"""
import gc, re
pattern = re.compile(rb"TENANT-SECRET-" + rb"([0-9a-f]{32})")
found = set()
with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
    for line in maps:
        fields = line.split()
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if "r" not in fields[1] or (len(fields) > 5 and fields[5] in ("[vvar]", "[vsyscall]", "[vvar_vclock]")):
            continue
        try:
            mem.seek(start)
            found.update(m.decode() for m in pattern.findall(mem.read(end - start)))
        except (OSError, ValueError, OverflowError):
            continue
for obj in gc.get_objects():
    for value in (obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()):
        if isinstance(value, str):
            found.update(pattern.findall(value.encode("utf-8", "replace")))
print("FOUND", sorted(x if isinstance(x, str) else x.decode() for x in found))
"""


def _secret_job(warm: bool, command: str = "") -> tuple[PythonJob, set]:
    """A job whose code, env, stdin and output each hold a secret of its own."""
    code, env, stdin, output = (secrets.token_hex(16) for _ in range(4))
    source = (f"# TENANT-SECRET-{code}\nimport sys\nsys.stdin.read()\n"
              f"print('TENANT-SECRET-' + '{output[:16]}' + '{output[16:]}', flush=True)\n{command}")
    job = PythonJob(source, warm=warm, env={"API_KEY": f"TENANT-SECRET-{env}"},
                    stdin=f"TENANT-SECRET-{stdin}\n", timeout=60)
    return job, {code, env, stdin, output}


@pytest.mark.slow
def test_a_warm_job_finds_nothing_of_other_jobs_in_its_memory():
    # Warm jobs were forks of the worker, or of a template forked from it
    # after it had run jobs: walking the heap found the Start messages and
    # output buffers of jobs running beside them, and of finished ones.
    with ExecPool(workers=1) as pool:
        taken = set()
        for warm in (True, False):  # jobs that finished before
            job, values = _secret_job(warm)
            assert pool.run(job).exit_code == 0
            taken |= values
        streams = []
        for warm in (True, False):  # jobs running beside the scan
            job, values = _secret_job(warm, "import time\ntime.sleep(60)")
            stream = pool.stream(job)
            assert "TENANT-SECRET-" in next(stream)["text"]
            streams.append(stream)
            taken |= values
        try:
            for _ in range(3):  # spares parked long before, and ones made now
                scan = pool.run(PythonJob(MEMORY_SCAN, warm=True, timeout=60))
                assert scan.exit_code == 0, scan.text
                assert "FOUND" in scan.output
                assert taken.isdisjoint(scan.output.split("FOUND", 1)[1].replace("'", " ").split()), scan.output
        finally:
            for stream in streams:
                stream.close()


@pytest.mark.slow
def test_stopped_spares_and_template_cost_nobody_anything():
    # A tool can SIGSTOP the parked spares and the template (they run as its
    # user). The worker once waited for a stopped spare's answer with a
    # blocking read, stalling every job on it; later it handed jobs to the
    # stopped spares, which then waited for ever (timeout=None) or timed out.
    with ExecPool(workers=1, warm_spares=2) as pool:
        pool.run(PythonJob("pass", warm=True))
        assert wait_for(lambda: len(_parked(pool)) == 2)
        stopped = _parked(pool) + _helpers(pool, TEMPLATE_NAME)
        for proc in stopped:
            proc.send_signal(signal.SIGSTOP)
        rescue = threading.Timer(20.0, lambda: [_cont(p) for p in stopped])
        rescue.start()
        try:
            beside = pool.stream(ShellJob("for i in 1 2 3 4 5 6 7 8; do echo tick; sleep 0.1; done"))
            # More warm jobs than spares were parked: the template makes the rest.
            runner = ThreadPoolExecutor(4)
            warm = [runner.submit(pool.run, PythonJob(f"print({i})", warm=True, timeout=None)) for i in range(4)]
            runner.shutdown(wait=False)
            ticks = [event for event in beside if event["type"] == "tool_output"]
            assert "".join(event["text"] for event in ticks).count("tick") == 8
            assert [job.result(timeout=15).output for job in warm] == [f"{i}\n" for i in range(4)]
        finally:
            rescue.cancel()
            for proc in stopped:
                _cont(proc)


@pytest.mark.slow
def test_a_spare_killed_before_it_took_its_job_hands_the_job_on():
    # The hand-over is a message the spare has not read yet: a spare killed
    # then ran nothing of the job, which must run whole in another spare. A
    # frozen cgroup holds the spare there (SIGCONT does not thaw it).
    with ExecPool(workers=1, warm_spares=1) as pool:
        pool.run(PythonJob("pass", warm=True))
        assert wait_for(lambda: len(_parked(pool)) == 1)
        first = _parked(pool)[0]
        with _frozen(first.pid) as group:
            runner = ThreadPoolExecutor(1)
            job = runner.submit(pool.run, PythonJob("import os\nprint(os.getpid())", warm=True, timeout=30))
            runner.shutdown(wait=False)
            # Handed to the frozen spare, the worker asked for the next one at once.
            assert wait_for(lambda: any(p.pid != first.pid for p in _parked(pool)))
            first.kill()
            assert wait_for(lambda: _read(os.path.join(group, "cgroup.procs")) == "")
        result = job.result(timeout=30)
        assert result.exit_code == 0 and int(result.output) != first.pid, result.text


@pytest.mark.slow
def test_a_template_killed_as_it_starts_fails_the_waiting_warm_jobs_not_the_worker():
    # A tool can kill the template as often as it likes. Warm jobs waiting
    # for a spare must not wait for ever, and warm jobs later must work.
    with ExecPool(workers=1, warm_spares=0) as pool:
        worker = psutil.Process(pool.worker_pids[0])
        stop = threading.Event()

        def killer():
            while not stop.is_set():
                for child in worker.children():
                    try:
                        if child.name() == TEMPLATE_NAME or "execpool.tool.template" in child.cmdline():
                            child.kill()
                    except psutil.Error:
                        pass
                stop.wait(0.002)

        thread = threading.Thread(target=killer)
        thread.start()
        try:
            result = pool.run(PythonJob("print('never')", warm=True, timeout=60))
        finally:
            stop.set()
            thread.join()
        # Failed, not waited for ever (a template that got a spare out past
        # the killer, on a loaded machine, runs the job: fine too).
        assert result.text == "never\n" or "warm template" in (result.error or ""), result.text
        assert pool.run(PythonJob("print('again')", warm=True)).text == "again\n"


@pytest.mark.slow
def test_job_directories_are_unpredictable_and_squatting_costs_nothing():
    # Private directories were named by job id: a tool that made the next
    # ids' directories first had every later job fail with "File exists".
    squat = ('up=$(dirname "$PWD"); for i in $(seq 1 300); do mkdir "$up/$i" "$up/$(basename "$PWD")$i"; done '
             '2>/dev/null; basename "$PWD"')
    with ExecPool(workers=1) as pool:
        names = [pool.run(ShellJob(squat)).output.strip() for _ in range(3)]
        assert not any(name.isdigit() for name in names) and len(set(names)) == 3
        for kind in (ShellJob("echo fine"), PythonJob("print('fine')"), PythonJob("print('fine')", warm=True)):
            assert pool.run(kind).text == "fine\n"


#: A daemon that leaves its session and group and clears its environment:
#: nothing marks it as the job's, so only the end-of-job sweep finds it.
ANONYMOUS_DAEMON = "setsid bash -c 'env -i /bin/sleep 100 >/dev/null 2>&1 & echo \"PIDS $!\"'"


def test_strays_are_swept_after_a_keep_background_job_ran():
    # Once any keep_background job had run on a worker, strays that cleared
    # their environment were never swept again until the pool closed.
    with ExecPool(workers=1) as pool:
        kept = pids_in(pool.run(ShellJob("sleep 100 >/dev/null 2>&1 & echo \"PIDS $!\"",
                                         keep_background=True)).output)
        stray = pids_in(pool.run(ShellJob(ANONYMOUS_DAEMON)).output)
        assert stray and all_dead(stray), "the anonymous daemon outlived its job"
        assert all(alive(pid) for pid in kept), "a kept background process was swept"
    assert all_dead(kept)


#: A keep_background job's process (kept: it is in the job's group) starts a
#: daemon in a session of its own with an empty environment, closes its
#: output so the job ends, and waits for the test's gate before it exits --
#: handing the daemon to the worker only after the job's Result.
HANDS_OVER_A_DAEMON_LATE = ("(setsid env -i /bin/sleep 100 >/dev/null 2>&1 & echo \"PIDS $!\"; exec >/dev/null 2>&1; "
                            "while [ ! -e go ]; do sleep 0.01; done) &")


def test_a_stray_handed_to_an_idle_worker_is_swept_when_its_parent_is_reaped(tmp_path):
    """Red team: the worker swept strays only as a job ended, so a daemon
    whose parent outlived that moment reached the worker with no job left
    to end -- and ran until the pool closed. (The same gap made a daemon
    whose parent exited just as its job ended survive now and then: listed
    before it was handed over, its parent dead by the time it was looked at.)"""
    with ExecPool(workers=1) as pool:
        daemon = pids_in(pool.run(ShellJob(HANDS_OVER_A_DAEMON_LATE, keep_background=True, cwd=str(tmp_path))).output)
        assert daemon and all(alive(pid) for pid in daemon), "the daemon is its (kept) parent's until the gate opens"
        (tmp_path / "go").touch()
        assert all_dead(daemon), "the daemon outlived its parent on an idle worker"


def _helpers(pool: ExecPool, name: str) -> list:
    """The workers' children called ``name`` that can run: not stopped,
    not frozen (a frozen one sits in a group of _frozen's), not dead."""
    found = []
    for pid in pool.worker_pids:
        for child in psutil.Process(pid).children():
            try:
                if (child.name() == name and state(child.pid) in ("S", "R")
                        and "execpool-test-freeze" not in _read(f"/proc/{child.pid}/cgroup")):
                    found.append(child)
            except (psutil.Error, OSError):
                continue
    return found


def _parked(pool: ExecPool) -> list:
    return _helpers(pool, SPARE_NAME)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


@contextlib.contextmanager
def _frozen(pid: int):
    """``pid`` in a frozen cgroup v2 group of its own for the block (root,
    with a writable v2 hierarchy; skipped elsewhere). Yields the group."""
    own = _own_v2_group()
    if own is None:
        pytest.skip("no writable cgroup v2 hierarchy to freeze a process in")
    group = os.path.join(own, f"execpool-test-freeze-{os.getpid()}")
    os.mkdir(group)
    try:
        with open(os.path.join(group, "cgroup.procs"), "w") as f:
            f.write(str(pid))
        with open(os.path.join(group, "cgroup.freeze"), "w") as f:
            f.write("1")
        assert wait_for(lambda: "frozen 1" in _read(os.path.join(group, "cgroup.events")))
        yield group
    finally:
        with open(os.path.join(group, "cgroup.freeze"), "w") as f:
            f.write("0")
        with open(os.path.join(group, "cgroup.kill"), "w") as f:
            f.write("1")
        assert wait_for(lambda: _read(os.path.join(group, "cgroup.procs")) == "", timeout=5)
        os.rmdir(group)


def _own_v2_group():
    """This process's cgroup v2 directory, if it may write there."""
    with open("/proc/self/mounts") as f:
        mount = next((line.split()[1] for line in f if line.split()[2] == "cgroup2"), None)
    own = next((line.rstrip("\n").split(":", 2)[2] for line in _read("/proc/self/cgroup").splitlines(keepends=True)
                if line.startswith("0::")), None)
    if mount is None or own is None:
        return None
    path = os.path.join(mount, own.lstrip("/"))
    return path if os.access(path, os.W_OK) else None


def _cont(proc: psutil.Process) -> None:
    try:
        proc.send_signal(signal.SIGCONT)
    except psutil.Error:
        pass


def _has_vfork() -> bool:
    from execpool.worker.spawn import SPAWN_METHODS

    return "vfork" in SPAWN_METHODS
