"""No job can cost another job anything: a job's end never stalls or kills
its worker, nothing of a job outlives it, its marker cannot be forged.

Each test is an attack a red team made with hostile tools (as root, the
user these tests run as), written so that it failed on the code before its
fix. What a job leaves is removed by the worker's remover
(execpool/worker/jobdirs.py); what it runs is found by every thread's
state (execpool/shared/kernel/proctree.py).
"""

from __future__ import annotations

import os
import stat
import time

import psutil
import pytest

from execpool import ExecPool, Limits, PythonJob, ShellJob, Status
from tests.support.helpers import (
    all_dead,
    pids_in,
    remember,
    run_as_nobody,
    wait_for,
    worker_records,
)
from tests.support.hostile import (
    MARKER_FORGER,
    ZOMBIE_LEADER_DAEMON,
    ZOMBIE_LEADER_STORM,
    directory_flood,
    symlink_racer,
)

pytestmark = pytest.mark.hostile

DEADLINE_S = 60
#: Busy jobs a test may start to hold every CPU: one per CPU, at most this
#: many, each ended by its timeout if nothing else ends it first.
MAX_BUSY_JOBS = 8
BUSY_JOB_S = 3 * DEADLINE_S


def _trash(pool) -> str:
    return os.path.join(worker_records(pool)[0].jobs_dir, ".trash")


def _jobs_dir_empty(pool) -> bool:
    jobs_dir = worker_records(pool)[0].jobs_dir
    return os.listdir(jobs_dir) in ([], [".trash"]) and not os.listdir(os.path.join(jobs_dir, ".trash"))


@pytest.mark.slow
def test_a_job_that_filled_its_directory_does_not_hold_up_the_next_job():
    """Red team: five seconds of mkdir left 30-70 thousand directories, which
    the worker removed on its one loop at 1,500 a second: no other job's
    timeout was enforced meanwhile. Now the next job is served -- its timeout
    enforced -- while the flood is still being removed, and then nothing is
    left."""
    with ExecPool(workers=1) as pool:
        worker = pool.worker_pids[0]
        flood = pool.run(PythonJob(directory_flood(60_000), timeout=120))
        assert flood.output == "made 60000\n", flood.text
        started = time.monotonic()
        neighbour = pool.run(ShellJob("echo before; sleep 30", timeout=0.5))
        served_in = time.monotonic() - started
        still_removing = os.listdir(_trash(pool))
        assert neighbour.status is Status.TIMEOUT and neighbour.output == "before\n"
        assert still_removing, f"the flood was removed before the next job was answered ({served_in:.2f} s)"
        assert pool.worker_pids == [worker]
        assert wait_for(lambda: _jobs_dir_empty(pool), DEADLINE_S)


@pytest.mark.slow
def test_a_daemon_whose_first_thread_ended_dies_with_its_job(doomed):
    """Red team: a daemon that ends its first thread with SYS_exit reads as
    Z in /proc/PID/stat; every sweep skipped it, and it ran until the pool
    closed."""
    with ExecPool(workers=1, cgroups=False) as pool:
        result = pool.run(PythonJob(ZOMBIE_LEADER_DAEMON, timeout=30))
        pids = pids_in(result.output)
        remember(doomed, pids)
        assert len(pids) == 1, result.text
        assert all_dead(pids), "the daemon outlived its job"
        assert pool.run(ShellJob("echo next")).output == "next\n"


def test_threads_do_not_hide_processes_from_the_process_cap(doomed):
    """Red team: with ``processes=8`` and the worker counting (no cgroup),
    forty processes whose first threads had ended ran, and the job ended
    ``ok``."""
    with ExecPool(workers=1, cgroups=False) as pool:
        result = pool.run(PythonJob(ZOMBIE_LEADER_STORM, limits=Limits(processes=8), timeout=60))
        pids = pids_in(result.output)
        remember(doomed, pids)
        assert "all forty lived" not in result.output
        assert result.text.startswith("Execution error: the job went over its process limit (8)"), result.text
        assert all_dead(pids)


#: Twenty daemons that leave the job's session and its tree and clear
#: their environment (the marker with it), then a leader that waits.
UNMARKED_DAEMONS = """
import os, time
for _ in range(20):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            print("PIDS", os.getpid(), flush=True)
            os.execv("/usr/bin/env", ["env", "-i", "sleep", "60"])
        os._exit(0)
    os.wait()
time.sleep(30)
print("all twenty lived")
"""


def test_a_sandboxed_job_s_daemons_count_for_its_process_cap_without_a_marker(doomed):
    """Red team: with the worker counting (no cgroup), a sandboxed job's
    daemons that left its session and tree and cleared their environment
    were not counted: only what its user namespace held would have told."""
    with ExecPool(workers=1, sandbox="strict", cgroups=False) as pool:
        result = pool.run(PythonJob(UNMARKED_DAEMONS, limits=Limits(processes=8), timeout=60))
        pids = pids_in(result.output)
        remember(doomed, pids)
        assert "all twenty lived" not in result.output
        assert result.text.startswith("Execution error: the job went over its process limit (8)"), result.text
        assert all_dead(pids)


@pytest.mark.slow
def test_a_job_that_races_its_own_removal_neither_crashes_the_worker_nor_reaches_outside(tmp_path, doomed):
    """Red team: a daemon left swapping a directory and a symlink
    (``renameat2(RENAME_EXCHANGE)``) in its job's directory made the
    removal change the mode of what had just become a symlink, which raised
    ValueError in the worker: it died, and every job on it ended ``infra``.
    The daemon could survive because its first thread had ended (above)."""
    target = tmp_path / "target"
    target.mkdir(mode=0o755)
    (target / "kept").write_text("not the job's")
    mode = stat.S_IMODE(target.stat().st_mode)
    with ExecPool(workers=1, cgroups=False) as pool:
        worker = pool.worker_pids[0]
        bystander = pool.submit(ShellJob("sleep 1; echo still here", timeout=30))
        racer = pool.run(PythonJob(symlink_racer(str(target)), timeout=30))
        pids = pids_in(racer.output)
        remember(doomed, pids)
        assert len(pids) == 1, racer.text
        assert bystander.result(DEADLINE_S).output == "still here\n"
        assert all_dead(pids), "the racer outlived its job"
        assert pool.run(ShellJob("echo after")).output == "after\n"
        assert pool.worker_pids == [worker], "the worker died"
        assert wait_for(lambda: _jobs_dir_empty(pool), DEADLINE_S)
    assert (target / "kept").read_text() == "not the job's"
    assert stat.S_IMODE(target.stat().st_mode) == mode


def test_removing_a_directory_that_became_a_symlink_raises_nothing(tmp_path):
    """The race above, made still: the removal is handed a name that is a
    symlink where it found a directory. It neither raises nor follows it."""
    from execpool.shared.kernel import dirs

    outside = tmp_path / "outside"
    outside.mkdir(mode=0o755)
    top = tmp_path / "top"
    top.mkdir()
    (top / "was_a_directory").symlink_to(outside)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert dirs._hoist(fd, "was_a_directory") is False
    finally:
        os.close(fd)
    assert stat.S_IMODE(outside.stat().st_mode) == 0o755
    assert dirs.remove_tree(str(top)) and not top.exists() and outside.is_dir()


@pytest.mark.slow
def test_a_job_cannot_pass_its_processes_off_as_its_neighbours(doomed):
    """Red team: a job sees its own ``EXECPOOL_JOB`` and ids count up, so it
    started processes carrying its neighbour's marker: the neighbour was
    killed "over its process limit". Markers now hold a part no job can
    guess; the forged ones match nobody, and go as strays."""
    with ExecPool(workers=1, cgroups=False) as pool:
        victim = pool.submit(ShellJob("sleep 1.5; echo fine", limits=Limits(processes=4), timeout=30))
        forger = pool.run(PythonJob(MARKER_FORGER, timeout=30))
        pids = pids_in(forger.output)
        remember(doomed, pids)
        assert len(pids) == 10, forger.text
        result = victim.result(DEADLINE_S)
        assert result.status is Status.OK and result.output == "fine\n", result.text
        assert all_dead(pids, timeout=10), "the forged processes outlived both jobs"


@pytest.mark.nobody
def test_a_directory_its_job_made_immovable_is_moved_not_removed_as_nobody():
    """Red team: as ``nobody``, a job ran ``chmod 555 .``: its directory could
    no longer be moved to the trash (a directory moves only with the right
    to rewrite its ``..``), and the worker removed its eighty thousand
    directories on its loop instead -- the neighbour's timeout went
    unenforced until the watchdog killed the worker."""
    script = ("import os, sys\nfrom execpool.worker.jobdirs import JobDirs\n"
              "jobs_dir = os.path.join(sys.argv[1], 'jobs')\nos.mkdir(jobs_dir, 0o700)\n"
              "dirs = JobDirs(jobs_dir)\nprivate = dirs.private()\n"
              "for i in range(100):\n    os.mkdir(os.path.join(private, str(i)))\n"
              "os.chmod(private, 0o555)\n"
              "trashed = dirs.discard(private)\n"
              "print(trashed is not None and os.path.dirname(trashed) == dirs.trash, len(os.listdir(trashed)))\n")
    done = run_as_nobody(script)
    assert done.stdout == "True 100\n", done.stderr[-2000:]


@pytest.mark.slow
def test_a_job_that_breaks_the_trash_still_does_not_hold_up_the_next_job():
    """Red team (no sandbox): a job put a file where the worker's trash was,
    so its directory could not be moved there, and the worker removed its
    sixty thousand directories on its loop. Now the trash is made again."""
    with ExecPool(workers=1) as pool:
        worker = pool.worker_pids[0]
        breaker = ('import os\nos.rename("../.trash", "../.trash-moved")\nopen("../.trash", "w").close()\n'
                   + directory_flood(60_000))
        flood = pool.run(PythonJob(breaker, timeout=120))
        assert flood.output == "made 60000\n", flood.text
        neighbour = pool.run(ShellJob("echo before; sleep 30", timeout=0.5))
        assert neighbour.status is Status.TIMEOUT and neighbour.output == "before\n"
        assert os.path.isdir(_trash(pool)) and os.listdir(_trash(pool)), "the flood was removed on the loop"
        assert pool.worker_pids == [worker]
        assert wait_for(lambda: not os.listdir(_trash(pool)), DEADLINE_S)


@pytest.mark.slow
def test_a_flood_is_removed_beside_a_busy_job_on_every_cpu(doomed):
    """Issue: with a busy loop on each of two CPUs, a 60,000-directory flood
    took 221 s to remove (6.5 s on a quiet machine), and the flood tests
    above failed. Each ``rmdir`` waits in the kernel (here a synchronous
    discard); the remover, alone in its autogroup, left the run queue at
    every one and got the CPU back from a busy job only at the tick that
    ended that job's slice. Now other removals run while one waits: the
    trash empties beside a busy job on every CPU, still busy when it has."""
    cpus = len(os.sched_getaffinity(0))
    if cpus > MAX_BUSY_JOBS:
        pytest.skip(f"holding {cpus} CPUs would take more than {MAX_BUSY_JOBS} busy jobs")
    busy = "import os\nprint(os.getpid(), flush=True)\nwhile True:\n    pass\n"
    with ExecPool(workers=1) as pool:
        said: list[list[str]] = [[] for _ in range(cpus)]
        job = PythonJob(busy, timeout=BUSY_JOB_S)
        loops = [pool.submit(job, on_event=lambda event, out=out: out.append(event.text)) for out in said]
        try:
            assert wait_for(lambda: all("".join(out).endswith("\n") for out in said), DEADLINE_S)
            pids = [int("".join(out)) for out in said]
            remember(doomed, pids)
            assert wait_for(lambda: all(psutil.Process(pid).cpu_times().user >= 1.0 for pid in pids), DEADLINE_S), \
                "the busy jobs do not hold the CPUs"
            flood = pool.run(PythonJob(directory_flood(60_000), timeout=120))
            assert flood.output == "made 60000\n", flood.text
            emptied = wait_for(lambda: not os.listdir(_trash(pool)), DEADLINE_S)
            assert not any(loop.done() for loop in loops), "a busy job ended before the trash was emptied"
            assert emptied, f"the flood was still in the trash {DEADLINE_S} s after it ended"
        finally:
            for loop in loops:
                loop.cancel()


@pytest.mark.slow
def test_a_dead_workers_directory_is_removed_by_its_successor_not_by_the_caller():
    """What a job left when its worker died -- here a flood, then the job
    killed its worker -- was removed by a thread of the caller's process,
    the server. Now the pool hands the directory to a live worker's remover
    with one rename."""
    with ExecPool(workers=1) as pool:
        dead = worker_records(pool)[0]
        killer = directory_flood(20_000) + "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
        result = pool.run(PythonJob(killer, timeout=60))
        assert result.status is Status.INFRA, result.text
        heir = worker_records(pool)[0]
        assert heir.token != dead.token
        handed = os.path.join(heir.jobs_dir, ".trash", os.path.basename(dead.jobs_dir))
        assert wait_for(lambda: not os.path.exists(dead.jobs_dir), DEADLINE_S)
        assert os.path.isdir(handed), "the caller removed the dead worker's directory itself"
        assert pool.run(ShellJob("echo next")).output == "next\n"  # its end wakes the heir's remover
        assert wait_for(lambda: not os.path.exists(handed), DEADLINE_S)
