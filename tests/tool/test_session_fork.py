"""``Session.fork()`` (SPEC §8): a copy of a live Python session, made
copy-on-write, independent of its parent from then on -- its memory, its
directory's files, its process tree -- and a session like any other: closed,
killed with its worker and its owner. These run without a sandbox
(test_session_fork_sandbox.py forks in it); the pool runs as root here."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from execpool import ExecPool, Limits, PythonJob, Sandbox, SessionClosedError, SessionForkError, Status
from tests.support.helpers import all_dead, owner_killed_leaves_nothing, pids_in, proc_kib, remember, wait_for

#: A daemon in a session of its own, orphaned at once, announcing its pid.
DAEMON = ("import subprocess\nprint(subprocess.run(\"setsid sh -c 'sleep 300 </dev/null >/dev/null 2>&1 & "
          "echo PIDS $!'\", shell=True, capture_output=True, text=True).stdout)")


@pytest.fixture(scope="module")
def pool():
    with ExecPool(workers=2) as p:
        yield p


@pytest.fixture
def parent(pool):
    with pool.session("python") as s:
        yield s


def test_a_fork_holds_the_parent_s_state_and_each_goes_its_own_way(parent):
    parent.run("import os\nx = [1, 2]\nopen('data.txt', 'w').write('parent')\nos.makedirs('sub/deeper')")
    with parent.fork() as child:
        assert child.id != parent.id and child.alive
        assert child.run("x").value == "[1, 2]"
        assert child.run("open('data.txt').read()").value == "'parent'"
        child.run("x.append('child')\nopen('data.txt', 'w').write('child')\nopen('sub/deeper/new', 'w').close()")
        parent.run("x.append('parent')")
        assert parent.run("x, open('data.txt').read(), os.path.exists('sub/deeper/new')").value == (
            "([1, 2, 'parent'], 'parent', False)")
        assert child.run("x, open('data.txt').read()").value == "([1, 2, 'child'], 'child')"
        assert child.run("os.getcwd() != " + repr(parent.run("os.getcwd()").value.strip("'"))).value == "True"
        assert child.run("os.getpid()").value != parent.run("os.getpid()").value


def test_a_fork_takes_its_turn_after_the_cells_queued_before_it(parent):
    parent.submit("import time\ntime.sleep(0.3)\nstep = 'after the sleep'")
    with parent.fork() as child:
        assert child.run("step").value == "'after the sleep'"


def test_a_fork_starts_in_the_same_place_of_its_own_copy(parent):
    parent.run("import os\nos.makedirs('a/b')\nos.chdir('a/b')\nopen('here', 'w').write('1')\nroot = os.getcwd()")
    with parent.fork() as child:
        assert child.run("os.path.basename(os.getcwd()), open('here').read()").value == "('b', '1')"
        assert child.run("os.getcwd() != root").value == "True"


def test_closing_either_leaves_the_other_and_each_close_takes_its_own_tree(pool, doomed):
    parent = pool.session("python")
    child = parent.fork()
    parent_daemon = pids_in(parent.run(DAEMON).stdout)
    child_daemon = pids_in(child.run(DAEMON).stdout)
    remember(doomed, parent_daemon + child_daemon)
    assert len(parent_daemon) == len(child_daemon) == 1
    parent.close()
    assert all_dead(parent_daemon) and not parent.alive
    assert child.run("'still here'").value == "'still here'"
    assert psutil.pid_exists(child_daemon[0])
    grandchild = child.fork()
    child.close()
    assert all_dead(child_daemon)
    assert grandchild.run("1 + 1").value == "2"
    grandchild.close()


def test_a_session_with_threads_forks_too(parent):
    parent.run("import threading\nstop = threading.Event()\nworker = threading.Thread(target=stop.wait, daemon=True)\n"
               "worker.start()\nimport numpy\nnumpy.ones(4).sum()")
    with parent.fork() as child:
        result = child.run("import threading\n(threading.active_count(), float(numpy.arange(5).sum()))")
        assert (result.status, result.value) == (Status.OK, "(1, 10.0)")  # fork(2) keeps the calling thread only
    assert parent.run("worker.is_alive()").value == "True"
    parent.run("stop.set()")


def test_an_interrupt_and_a_timeout_in_a_fork_keep_it(parent):
    parent.run("n = 5")
    with parent.fork() as child:
        result = child.run("import time\nwhile True: time.sleep(0.01)", timeout=0.3)
        assert (result.status, result.alive) == (Status.TIMEOUT, True)
        assert child.run("n").value == "5"


def test_a_given_directory_receives_a_copy_and_a_shared_one_is_shared(pool, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "seed.txt").write_text("seed")
    with pool.session("python", cwd=mine) as parent:
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        with parent.fork(cwd=elsewhere) as copied, parent.fork() as sharing:
            # print: IPython's pretty printer wraps a long value's text
            assert copied.run("import os\nprint(repr((os.getcwd(), open('seed.txt').read())))").stdout == (
                repr((str(elsewhere), "seed")) + "\n")
            assert sharing.run("import os\nos.getcwd()").value == repr(str(mine))
            copied.run("open('seed.txt', 'w').write('copied')")
            assert (mine / "seed.txt").read_text() == "seed"


@pytest.mark.slow
def test_what_cannot_be_forked_says_why_and_the_session_goes_on(pool, tmp_path):
    with pool.session("bash") as shell:
        with pytest.raises(SessionForkError, match="only a Python session"):
            shell.fork()
        assert shell.run("echo on").stdout == "on\n"
    with pool.session("python", sandbox=Sandbox(write=(str(tmp_path),))) as shared:
        with pytest.raises(SessionForkError, match=r"no Sandbox\(write=...\) paths"):
            shared.fork()  # a copy would write the same directory
        assert shared.run("1").value == "1"
    closed = pool.session("python")
    closed.close()
    with pytest.raises(SessionClosedError):
        closed.fork()
    with pool.session("python") as session:
        with pytest.raises(ValueError, match="not an existing directory"):
            session.fork(cwd="/nonexistent/dir")
        with pytest.raises(TypeError, match="cwd must be a path"):
            session.fork(cwd=3)


def test_a_copy_that_cannot_start_fails_the_fork_not_the_session(pool, tmp_path):
    with pool.session("python") as parent:
        parent.run("import os\nos.makedirs('sub')")
        target = tmp_path / "target"
        target.mkdir()
        (target / "sub").write_text("a file where the copy needs a directory")
        with pytest.raises(SessionForkError, match="could not start"):
            parent.fork(cwd=target)
        assert parent.run("'fine'").value == "'fine'"


@pytest.mark.slow
def test_why_a_copy_could_not_start_is_told_short(pool, tmp_path):
    """Red team: a copy that failed on each of thousands of files said so
    for each, and the fork's error ran to 16 MB."""
    with pool.session("python") as parent:
        parent.run("import os\nfor i in range(3000):\n    os.mkdir(f'd{i}')")
        target = tmp_path / "target"
        target.mkdir()
        for index in range(3000):
            (target / f"d{index}").write_text("")  # a file where the copy needs a directory
        with pytest.raises(SessionForkError, match="could not start") as refused:
            parent.fork(cwd=target)
        assert len(str(refused.value)) < 2200, len(str(refused.value))
        assert parent.run("'fine'").value == "'fine'"


@pytest.mark.slow
def test_a_dead_worker_ends_parent_and_fork_with_infra(doomed):
    with ExecPool(workers=1) as own:
        parent = own.session("python")
        child = parent.fork()
        inside = threading.Event()
        running = child.submit("import time\nprint('in')\ntime.sleep(60)", timeout=120,
                               on_event=lambda event: inside.set())
        assert inside.wait(20)
        os.kill(own.worker_pids[0], signal.SIGKILL)
        result = running.result(20)
        assert (result.status, result.alive) == (Status.INFRA, False), result
        with pytest.raises(SessionClosedError):
            parent.run("1")


def test_the_owner_s_sigkill_leaves_nothing_of_its_forks(tmp_path, doomed):
    owner_killed_leaves_nothing(tmp_path, doomed, (
        "pool = ExecPool(workers=1)\nchild = pool.session('python').fork()\n"
        f"out = child.run({DAEMON!r}).stdout + ' ' + child.run(\"import os\\nprint('PIDS', os.getpid())\").stdout\n"
        "print(out.replace('\\n', ' '), flush=True)"), 2)


def test_many_forks_of_one_session_share_its_memory(pool):
    with pool.session("python") as parent:
        parent.run("import os\nblock = bytearray(64 << 20)\nblock[::4096] = b'x' * len(block[::4096])")
        forks = [parent.fork() for _ in range(4)]
        try:
            pids = [int(fork.run("os.getpid()").value) for fork in forks]
            # Proportional set sizes: pages shared five ways count a fifth each.
            pss = sum(proc_kib(f"/proc/{pid}/smaps_rollup", "Pss") for pid in pids)
            assert pss < 4 * (64 << 20) / 2, pss
            assert {fork.run("block[4096 * 7]").value for fork in forks} == {"120"}
        finally:
            for fork in forks:
                fork.close()


def test_a_session_forked_before_its_runtime_started_forks_when_it_does(pool):
    """The fork frame waits on the socket of a runtime still on its way
    (its warm spare not yet handed over), as a cell would; it once left the
    caller waiting for ever."""
    parent = pool.session("python")
    child = parent.fork()
    try:
        assert (parent.run("'parent'").value, child.run("'child'").value) == ("'parent'", "'child'")
    finally:
        child.close()
        parent.close()


#: Run in a session: its runtime answers the next fork with ``VICTIM``'s pid.
LIE = """
import gc, json
from execpool.tool.python_session import Runtime
runtime = next(o for o in gc.get_objects() if isinstance(o, Runtime))
runtime._fork = lambda tag, body: json.dumps({"pid": VICTIM}).encode() + b"\\0"
"""


def test_a_session_cannot_pass_another_process_off_as_its_copy(doomed):
    """The worker takes as the copy only its own child carrying the copy's
    marker: a session that names another job's leader, or another job's
    orphaned daemon (the worker's child too, as its subreaper), gets no
    fork, and the process it named is left alone."""
    with ExecPool(workers=1) as own:
        with own.session("python") as victim, own.session("python") as liar:
            leader = int(victim.run("import os\nos.getpid()").value)
            daemon = pids_in(victim.run(DAEMON).stdout)
            remember(doomed, daemon)
            assert wait_for(lambda: psutil.Process(daemon[0]).ppid() == own.worker_pids[0], 5)
            for named in (leader, daemon[0]):
                liar.run(LIE.replace("VICTIM", str(named)))
                with pytest.raises(SessionForkError, match="not its copy"):
                    liar.fork()
            assert victim.run("'unharmed'").value == "'unharmed'"
            assert psutil.pid_exists(daemon[0])


def _many_files(session, count: int) -> None:
    """Enough files in the session's directory that copying them takes a while."""
    session.run(f"for i in range({count}):\n    open(f'f{{i}}', 'w').close()")


def test_a_copy_whose_process_exits_ends_at_once_and_its_worker_goes_on():
    """A copy is no warm job: its process exiting ends it, as any session's
    does. It was once taken for a spare that died before its job, handed
    to spare after spare, while every warm job of its worker starved."""
    with ExecPool(workers=1) as own:
        child = own.session("python").fork()
        result = child.run("import os\nos._exit(3)", timeout=30)
        assert (result.status, result.alive) == (Status.ERROR, False) and "exited (3)" in result.message, result
        with own.session("python") as neighbour:
            assert neighbour.run("1").value == "1"
        assert own.run(PythonJob("print('warm')", warm=True)).output == "warm\n"


@pytest.mark.slow
def test_interrupting_a_session_while_it_forks_interrupts_nothing(pool, tmp_path):
    """No cell runs during a fork: ``interrupt()`` says so and the session
    lives (it once was killed, its fork taken for a cell that ignored it)."""
    with pool.session("python") as parent:
        _many_files(parent, 20000)
        target = tmp_path / "copy"
        target.mkdir()
        forking = ThreadPoolExecutor(1).submit(parent.fork, cwd=target)
        assert wait_for(lambda: any(target.iterdir()), 30)
        assert parent.interrupt() is False
        with forking.result(60) as child:
            assert child.run("import os\nlen(os.listdir())").value == "20000"
        assert parent.run("'alive'").value == "'alive'"


@pytest.mark.slow
def test_a_copy_is_held_to_its_process_cap_where_the_worker_counts(doomed):
    with ExecPool(workers=1, cgroups=False) as own:
        child = own.session("python", limits=Limits(processes=5)).fork()
        result = child.run("import subprocess, time\nfor _ in range(20):\n    subprocess.Popen(['sleep', '60'])\n"
                           "time.sleep(30)", timeout=45)
        assert not result.alive and "process limit (5)" in result.message, result


@pytest.mark.slow
def test_forks_on_a_retiring_worker_replace_it_once():
    with ExecPool(workers=1, max_jobs_per_worker=3) as own:
        with own.session("python") as parent:
            for _ in range(8):
                parent.fork().close()
            assert len(own.worker_pids) <= 2, own.worker_pids


@pytest.mark.slow
def test_closing_the_pool_while_a_fork_copies_ends_every_session_cleanly(tmp_path):
    """The worker's shutdown once tripped on the copy its parent's end had
    already settled, and left the jobs after it to its crash."""
    own = ExecPool(workers=1)
    parent = own.session("python")
    _many_files(parent, 20000)
    neighbour = own.session("python")
    assert neighbour.run("1").value == "1"
    target = tmp_path / "copy"
    target.mkdir()
    forking = ThreadPoolExecutor(1).submit(parent.fork, cwd=target)
    assert wait_for(lambda: any(target.iterdir()), 30)
    own.close()
    with pytest.raises((SessionClosedError, SessionForkError)):
        forking.result(30)
    ended = neighbour._future.result(10)
    assert ended.status is Status.INFRA and "the pool was closed while this job ran" in ended.error, ended


def test_a_fork_answered_with_brackets_nested_past_the_parser_costs_no_one_else():
    """Red team: a runtime's fork answer of 100000 ``[`` raised
    RecursionError in the worker's JSON parser, which took the worker down
    with every session and job on it."""
    with ExecPool(workers=1) as own:
        with own.session("python") as bystander:
            bystander.run("state = 'kept'")
            with own.session("python") as liar:
                liar.run("import gc\nruntime = [o for o in gc.get_objects() if type(o).__name__ == 'Runtime'][0]\n"
                         "runtime._fork = lambda tag, body: b'[' * 100000 + b'\\0'")
                with pytest.raises(SessionForkError, match="garbage"):
                    liar.fork()
            assert bystander.run("state").value == "'kept'"
