"""Killing things at the process boundary: workers, the pool's owner, close()."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from execpool import ExecPool, Limits, PythonJob, ShellJob
from execpool.pool import dispatch
from execpool.worker.jobdirs import REMOVER_IN_FLIGHT
from tests.support import hostile
from tests.support.helpers import (
    OUTCOME,
    REPO,
    all_dead,
    marked_processes,
    open_fds,
    pids_in,
    run_as_nobody,
    wait_for,
    worker_records,
)


@pytest.mark.slow
def test_sigkill_of_a_worker_fails_only_its_jobs_and_the_pool_recovers():
    with ExecPool(workers=2) as pool:
        victim = worker_records(pool)[0]
        outputs = {name: "" for name in "ab"}
        results = {}

        def run(name):
            command = ("echo \"LEADER $$\"; for i in 1 2 3; do sleep 100 >/dev/null 2>&1 & echo \"PIDS $!\"; done; "
                       "sleep 1.5; echo finished")
            stream = pool.stream(ShellJob(command, timeout=None))
            try:
                while True:
                    outputs[name] += next(stream).get("text", "")
            except StopIteration as stop:
                results[name] = (stop.value, time.monotonic())

        threads = [threading.Thread(target=run, args=(name,)) for name in "ab"]
        for t in threads:
            t.start()
        assert wait_for(lambda: all(len(pids_in(outputs[n])) >= 3 for n in "ab"))
        leaders = {n: int(outputs[n].split("LEADER ")[1].split()[0]) for n in "ab"}
        on_victim = [n for n in "ab" if psutil.Process(leaders[n]).ppid() == victim.proc.pid]
        assert len(on_victim) == 1, "least-loaded dispatch puts one job on each worker"
        doomed, kept = on_victim[0], ("b" if on_victim[0] == "a" else "a")
        killed_at = time.monotonic()
        os.kill(victim.proc.pid, signal.SIGKILL)
        for t in threads:
            t.join(10)
        lost, ended_at = results[doomed]
        assert ended_at - killed_at < 1.0
        assert lost.text.startswith("Execution error: ") and "SIGKILL" in lost.text
        assert str(victim.proc.pid) in lost.text
        assert all_dead(pids_in(outputs[doomed]) + [leaders[doomed]], timeout=1.0)
        assert results[kept][0].text.endswith("finished\n")
        assert wait_for(lambda: len(pool.worker_pids) == 2 and victim.proc.pid not in pool.worker_pids)
        assert pool.run(ShellJob("echo again")).text == "again\n"


def test_sigkill_of_the_owner_leaves_no_worker_and_no_tool():
    owner_code = textwrap.dedent(f"""
        import json, sys, threading
        from execpool import ExecPool, ShellJob
        pool = ExecPool(workers=2)
        pids = []
        def run():
            stream = pool.stream(ShellJob({hostile.FORK_TREE!r}, timeout=None))
            text = ""
            while text.count("PIDS") < 9:
                text += next(stream)["text"]
            pids.extend(int(p) for p in text.split() if p.isdigit())
            done.set()
            for _ in stream:
                pass
        done = threading.Event()
        threading.Thread(target=run, daemon=True).start()
        done.wait(30)
        print(json.dumps({{"workers": pool.worker_pids, "tools": pids}}), flush=True)
        threading.Event().wait()
    """)
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE, text=True)
    try:
        report = json.loads(owner.stdout.readline())
        assert len(report["tools"]) == 9
        owner.kill()
        owner.wait()
        assert all_dead(report["workers"] + report["tools"], timeout=2.0)
    finally:
        owner.kill()


def test_close_is_bounded_and_leaves_nothing_behind():
    threads_before = threading.active_count()
    fds_before = open_fds()
    pool = ExecPool(workers=2)
    workers = pool.worker_pids
    streams = [pool.stream(ShellJob(hostile.GRANDCHILD_HOLDS_STDOUT, timeout=None)) for _ in range(4)]
    tool_pids = []
    for stream in streams:
        tool_pids += pids_in(next(stream)["text"])
    started = time.monotonic()
    pool.close()
    assert time.monotonic() - started < 5.0
    assert all_dead(workers + tool_pids, timeout=1.0)
    for stream in streams:
        try:
            while True:
                next(stream)
        except StopIteration as stop:
            assert stop.value.cancelled or stop.value.error
    assert threading.active_count() == threads_before
    assert open_fds() == fds_before
    assert not [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.slow
def test_closing_the_pool_just_after_cancels_finishes_each_job_once(capfd):
    """Red team: a job cancelled just before the pool closed was finished by
    the shutdown before its leader was reaped, and the reap then tried to
    move the finished job back: each worker died raising "job N cannot go
    from finished to reaped" (nothing was left running, but the traceback
    was the worker's last word, and any leader reaped after its Result --
    one that outlived the wait for its kill -- did the same)."""
    for _ in range(3):
        with ExecPool(workers=2) as pool:
            futures = [pool.submit(ShellJob("sleep 60 & sleep 60 & echo up; sleep 60", timeout=30))
                       for _ in range(2)]
            assert pool.run(ShellJob("true")).ok
            for future in futures:
                future.cancel()
    assert "cannot go from" not in capfd.readouterr().err


def test_close_twice_and_context_manager_exit():
    with ExecPool(workers=1) as pool:
        pool.run(ShellJob("true"))
    assert pool.closed
    pool.close()


@pytest.mark.slow
def test_workers_are_recycled_after_max_jobs():
    with ExecPool(workers=1, max_jobs_per_worker=3) as pool:
        first = pool.worker_pids
        for i in range(7):
            assert pool.run(ShellJob(f"echo {i}")).text == f"{i}\n"
        assert wait_for(lambda: len(pool.worker_pids) == 1)
        assert pool.worker_pids != first
        assert wait_for(lambda: not psutil.pid_exists(first[0]) or
                        psutil.Process(first[0]).status() == psutil.STATUS_ZOMBIE)


def test_worker_crash_kills_escaped_daemons_by_marker():
    with ExecPool(workers=1) as pool:
        stream = pool.stream(ShellJob(
            "setsid sleep 100 >/dev/null 2>&1 & echo \"PIDS $!\"; sleep 100", timeout=None))
        pids = pids_in(next(stream)["text"])
        token = worker_records(pool)[0].token
        assert marked_processes(token)
        os.kill(pool.worker_pids[0], signal.SIGKILL)
        _, result = None, None
        try:
            while True:
                next(stream)
        except StopIteration as stop:
            result = stop.value
        assert result.error is not None
        assert all_dead(pids, timeout=1.0)
        assert wait_for(lambda: not marked_processes(token), timeout=1.0)


def test_cancel_and_output_in_the_same_select_batch_do_not_crash_the_worker(monkeypatch):
    """Regression: a Cancel read before its job's pending output event closed
    the fd, and the stale event then crashed the worker with KeyError. The
    watchdog, which continues a stopped worker, is kept out of the way."""
    monkeypatch.setattr(dispatch, "is_stopped", lambda pid: False)
    with ExecPool(workers=1) as pool:
        worker = pool.worker_pids[0]
        stream = pool.stream(ShellJob("echo ready; sleep 0.2; echo x; sleep 30"))
        assert next(stream)["text"] == "ready\n"
        os.kill(worker, signal.SIGSTOP)  # the worker is busy elsewhere...
        try:
            # ...while the Cancel lands on its control pipe and then the tool writes "x".
            for handle in list(worker_records(pool)[0].jobs.values()):
                handle.future.cancel()
            time.sleep(0.4)
        finally:
            os.kill(worker, signal.SIGCONT)
        try:
            while True:
                next(stream)
        except StopIteration as stop:
            assert stop.value.cancelled, stop.value
        assert pool.worker_pids == [worker]


def test_a_failing_consumer_does_not_stop_the_dispatcher():
    with ExecPool(workers=1) as pool:
        calls = []

        def broken_on_event(event):
            calls.append(event)
            raise RuntimeError("consumer bug")

        result = pool.submit(ShellJob("echo one; sleep 0.05; echo two"), on_event=broken_on_event).result(10)
        assert result.output == "one\ntwo\n"
        assert "".join(event.text for event in calls) == "one\ntwo\n"
        assert pool.run(ShellJob("echo still served")).text == "still served\n"


def test_a_killed_workers_private_directories_are_removed():
    with ExecPool(workers=1) as pool:
        stream = pool.stream(ShellJob("pwd; echo kept > file; sleep 30", timeout=None))
        workdir = next(stream)["text"].strip()
        assert os.path.isfile(os.path.join(workdir, "file")) or wait_for(
            lambda: os.path.isfile(os.path.join(workdir, "file")))
        os.kill(pool.worker_pids[0], signal.SIGKILL)
        with pytest.raises(StopIteration) as stop:
            while True:
                next(stream)
        assert stop.value.value.text.startswith("Execution error: ")
        # Removed once the dead worker's jobs have their Results (a job
        # that filled it must not make its neighbours wait for theirs).
        assert wait_for(lambda: not os.path.exists(workdir), 10.0)


def _bare_worker(first: object, tmp_path) -> tuple:
    """A worker started by hand, as the pool starts one, whose first message
    is ``first``: (its exit code, or None while it runs; what it sent)."""
    from multiprocessing.connection import Connection

    from execpool.shared import worker_wire

    to_r, to_w = worker_wire.pipe()
    from_r, from_w = worker_wire.pipe()
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": REPO}
    proc = subprocess.Popen([sys.executable, "-m", "execpool.worker", str(to_r), str(from_w)],
                            pass_fds=(to_r, from_w), env=env, cwd="/", start_new_session=True)
    os.close(to_r)
    os.close(from_w)
    send, recv = Connection(to_w, readable=False), Connection(from_r, writable=False)
    try:
        worker_wire.send(send, first)
        try:
            got = worker_wire.recv(recv) if recv.poll(10) else None
        except EOFError:
            got = None  # it exited without a word
        code = proc.wait(10) if got is None else None
        return code, got
    finally:
        send.close()
        recv.close()
        proc.wait(10)


def test_a_worker_takes_its_configuration_as_its_first_message_and_nothing_else(tmp_path):
    from execpool.shared import worker_wire

    jobs_dir = tmp_path / "jobs"
    jobs_dir.mkdir()
    config = worker_wire.WorkerConfig(token="abcdef012345", spawn_method="fork", preload=("json",), warm_ipython=False,
                                  cgroups=False, jobs_dir=str(jobs_dir), warm_spares=0, python=sys.executable)
    code, got = _bare_worker(config, tmp_path)
    assert isinstance(got, worker_wire.Ready) and got.preload_errors == ()
    start = worker_wire.Start(job_id=1, argv_kind="shell", source="true", cwd=None, env={}, timeout=None,
                          limits=Limits(), live_cap=None, max_output_chars=10, keep_background=False,
                          python=sys.executable, stdin=None, warm=False, network=True)
    code, got = _bare_worker(start, tmp_path)
    assert got is None and code == 0, "a worker told to run a job before it was configured runs nothing"


DEADLINE_S = 30.0

#: Builds a directory tree deeper than Python 3.11's rmtree can recurse, in
#: the job's own directory, with a locked (mode 0) level and a symlink out.
DEEP_TREE = ("import os\nos.symlink('/etc', 'out')\nfor i in range(3000):\n    os.mkdir('a')\n    os.chdir('a')\n"
             "    if i == 1500:\n        os.chmod('.', 0o700)\nopen('f', 'w').write('x')\nprint('built')")


@pytest.mark.slow
def test_a_job_that_builds_a_very_deep_tree_kills_nothing_and_leaves_nothing():
    """Regression (red team): Python 3.11's shutil.rmtree recurses per level,
    and its RecursionError -- which ignore_errors does not catch -- killed the
    worker removing such a job's directory, and with it every other job there."""
    with ExecPool(workers=1) as pool:
        worker = pool.worker_pids[0]
        bystander = pool.submit(ShellJob("sleep 1; echo still here"))
        result = pool.run(PythonJob(DEEP_TREE, timeout=60))
        assert result.output == "built\n", result.text
        assert bystander.result(DEADLINE_S).output == "still here\n"
        assert pool.run(ShellJob("echo after")).output == "after\n"
        assert pool.worker_pids == [worker], "the worker died"
        jobs_dir = worker_records(pool)[0].jobs_dir
        assert wait_for(lambda: os.listdir(jobs_dir) in ([], [".trash"]) and not os.listdir(
            os.path.join(jobs_dir, ".trash")), DEADLINE_S), os.listdir(jobs_dir)
    assert os.path.isdir("/etc"), "the symlink out was never followed"


@pytest.mark.slow
@pytest.mark.parametrize("in_flight", [1, REMOVER_IN_FLIGHT])
def test_remove_tree_removes_any_depth_and_follows_no_symlink(tmp_path, in_flight):
    from execpool.shared.kernel.dirs import remove_tree

    top = tmp_path / "top"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY)
    for _ in range(3000):  # deeper than a path may be long: built through descriptors
        os.mkdir("d", dir_fd=fd)
        inner = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = inner
    os.close(fd)
    (top / "loop").symlink_to(tmp_path)
    (top / ".execpool-hoisted-0").mkdir()  # a name the hoisting would pick
    (top / ".execpool-hoisted-0" / "taken").write_text("x")
    keep = tmp_path / "keep"
    keep.write_text("not in the tree")
    assert remove_tree(str(top), in_flight)
    assert not top.exists() and keep.read_text() == "not in the tree"


@pytest.mark.nobody
def test_remove_tree_removes_a_directory_its_job_made_unreadable_as_nobody(tmp_path):
    """Red team: a sandboxed job of a ``nobody`` pool ran ``chmod 0 .`` on
    its own directory, which the worker then could not open to empty; and
    ``chmod 500`` on one inside, which it could open but not empty."""
    script = ("import os, sys\nfrom execpool.shared.kernel.dirs import remove_tree\n"
              "top = os.path.join(sys.argv[1], 'job')\nos.makedirs(os.path.join(top, 'sub'))\n"
              "open(os.path.join(top, 'sub', 'f'), 'w').close()\n"
              "os.makedirs(os.path.join(top, 'ro', 'deeper'))\n"
              "open(os.path.join(top, 'ro', 'deeper', 'f'), 'w').close()\n"
              "os.chmod(os.path.join(top, 'ro', 'deeper'), 0o500)\nos.chmod(os.path.join(top, 'ro'), 0o500)\n"
              "os.chmod(os.path.join(top, 'sub'), 0)\nos.chmod(top, 0)\n"
              "print(remove_tree(top), os.path.exists(top))\n")
    done = run_as_nobody(script)
    assert done.stdout == "True False\n", done.stderr[-2000:]


@pytest.mark.parametrize("in_flight", [1, REMOVER_IN_FLIGHT])
def test_remove_tree_cannot_be_blocked_by_taking_the_names_it_hoists_into(tmp_path, in_flight):
    """Red team: hoisting tried ``.execpool-hoisted-0`` to ``-63``; a job
    that made those 64 directories (not empty) beside and inside its tree
    made its directory impossible to remove, for good."""
    from execpool.shared.kernel.dirs import remove_tree

    top = tmp_path / "top"
    for level in (top, top / "sub", top / "sub" / "deeper"):
        level.mkdir()
        for i in range(64):
            (level / f".execpool-hoisted-{i}").mkdir()
            (level / f".execpool-hoisted-{i}" / "x").write_text("x")
    assert remove_tree(str(top), in_flight)
    assert not top.exists()


#: A pool whose only worker dies while this process has no descriptor to
#: spare: the replacement cannot start until some are freed.
NO_DESCRIPTORS_OWNER = textwrap.dedent("""
    import logging, os, signal, sys, threading, time
    from execpool import ExecPool, ShellJob
    failed = threading.Event()
    class Seen(logging.Handler):
        def emit(self, record):
            if "cannot start a replacement worker" in record.getMessage():
                failed.set()
    logging.getLogger("execpool").addHandler(Seen())
    pool = ExecPool(workers=1)
    assert pool.run(ShellJob("true", timeout=30)).exit_code == 0
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    os.kill(pool.worker_pids[0], signal.SIGKILL)
    assert failed.wait(30), "the replacement never failed"
    for fd in held:
        os.close(fd)
    deadline, tick = time.monotonic() + 30, threading.Event()
    while not pool.worker_pids and time.monotonic() < deadline:
        tick.wait(0.01)  # the replacement's next try is at most 2 s away
    print(pool.run(ShellJob("echo recovered", timeout=30)).output, end="", flush=True)
    pool.close()
""")


@pytest.mark.slow
def test_a_pool_whose_last_worker_cannot_be_replaced_for_a_while_recovers(tmp_path):
    """Red team: a job exhausted the server's descriptors and killed the
    workers; the failed respawn marked the pool broken for good (every later
    request a 500). Now the replacement is retried until it starts."""
    import resource

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    done = subprocess.run([sys.executable, "-c", NO_DESCRIPTORS_OWNER], capture_output=True, text=True,
                          timeout=90, preexec_fn=low_limit, cwd=REPO)
    assert done.returncode == 0 and done.stdout == "recovered\n", done.stderr[-3000:]


def test_a_job_that_moves_its_workers_jobs_directory_away_fails_no_later_job(tmp_path):
    """Red team: ``mv "$(dirname "$PWD")" elsewhere`` left the worker unable
    to make a private directory: each later job it got failed at once
    (``infra``) -- 989 in a row, until the worker was recycled."""
    moved = tmp_path / "moved"
    with ExecPool(workers=1) as pool:
        jobs_dir = worker_records(pool)[0].jobs_dir
        assert pool.run(ShellJob(f'mv "$(dirname "$PWD")" {moved}; echo moved', timeout=30)).output == "moved\n"
        assert moved.is_dir() and not os.path.exists(jobs_dir)
        for kind in (ShellJob("echo again", timeout=30), PythonJob("print('again')", timeout=30)):
            result = pool.run(kind)
            assert result.output == "again\n", result
        assert os.stat(jobs_dir).st_mode & 0o777 == 0o700
    assert not os.path.exists(jobs_dir)


#: A pool as ``nobody``, whose processes RLIMIT_NPROC makes unable to fork
#: or start a thread, each at a known moment: first its worker while a
#: job ends (the helpers it forks on a job's way out: the remover of its
#: directories, the preparer of sandboxed jobs' namespaces), then the
#: pool's owner while its worker dies (the thread that cleans up after
#: it). Each must survive, and serve again once the limit is lifted.
REFUSED_FORKS = OUTCOME + textwrap.dedent("""
    import json, logging, os, resource, signal, socket, sys, threading, time
    import psutil
    from execpool import ExecPool, PythonJob, Sandbox, ShellJob

    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    report = {}
    gate = socket.create_server(("127.0.0.1", 0))
    refused = threading.Event()

    class Refused(logging.Handler):
        def emit(self, record):
            if "cannot start a thread" in record.getMessage():
                refused.set()

    logging.getLogger("execpool").addHandler(Refused())
    hook = threading.excepthook
    threading.excepthook = lambda args: (refused.set(), hook(args))

    with ExecPool(workers=1) as pool:  # its worker has forked nothing yet
        worker, = [p.pid for p in psutil.Process().children(recursive=True)
                   if "execpool.worker" in " ".join(p.cmdline())]
        held = pool.submit(PythonJob(
            "import socket\\n"
            f"socket.create_connection(('127.0.0.1', {gate.getsockname()[1]})).recv(1)\\n"
            "print('held')", sandbox=Sandbox(), timeout=30))
        conn, _ = gate.accept()
        resource.prlimit(worker, resource.RLIMIT_NPROC, (1, hard))
        conn.send(b"!")
        report["held"] = outcome(held)
        resource.prlimit(worker, resource.RLIMIT_NPROC, (soft, hard))
        report["next"] = outcome(pool.submit(PythonJob("print('next')", sandbox=Sandbox(), timeout=10)))
        report["restarts"] = pool.stats().worker_restarts

        resource.setrlimit(resource.RLIMIT_NPROC, (1, hard))
        os.kill(worker, signal.SIGKILL)
        report["refused"] = refused.wait(30)
        resource.setrlimit(resource.RLIMIT_NPROC, (soft, hard))
        deadline = time.monotonic() + 30  # its successor, once the next period starts the cleanup
        while not pool.worker_pids and time.monotonic() < deadline:
            time.sleep(0.01)
        report["after"] = outcome(pool.submit(ShellJob("echo after", timeout=10)))
        report["replaced"] = pool.stats().worker_restarts - report["restarts"]
    print(json.dumps(report))
""")


@pytest.mark.nobody
@pytest.mark.slow
def test_a_worker_and_a_pool_refused_forks_and_threads_survive_and_serve_again():
    """Red team: a worker whose helper's fork was refused on a job's way
    out died of it, and the dispatcher died of the cleanup thread it could
    not start: every later job of the pool waited for ever."""
    done = run_as_nobody(REFUSED_FORKS)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report == {"held": "held\n", "next": "next\n", "restarts": 0, "refused": True, "after": "after\n",
                      "replaced": 1}, (report, done.stderr[-3000:])
