import os
import subprocess
import sys
import threading
import time
import uuid

import psutil
import pytest

from execpool.shared.kernel import proctree
from execpool.shared.kernel.proctree import capture_process_group, drain_process_output, kill_process_tree
from tests.support import helpers

pytestmark = pytest.mark.skipif(os.name != "posix", reason="uses bash and process groups")

_TAG = "PROCTREE_TEST_TAG"


@pytest.fixture
def tagged():
    """An environment whose every descendant can be found again, even after it
    left the process group; anything still alive at teardown is killed."""
    tag = uuid.uuid4().hex
    yield {**os.environ, _TAG: tag}
    for proc in _alive(tag):
        try:
            proc.kill()
        except psutil.Error:
            pass


@pytest.fixture(params=["select", pytest.param("thread", marks=pytest.mark.slow)])
def reader(request, monkeypatch):
    """Runs a test with the POSIX reader and with the Windows thread reader."""
    if request.param == "thread":
        monkeypatch.setattr(proctree, "_open_reader", proctree._ThreadReader)
    return request.param


def _alive(tag):
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(_TAG) == tag and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _wait_until(predicate, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _all_dead(env):
    return _wait_until(lambda: not _alive(env[_TAG]), timeout=5)


def _spawn(cmd, env=None, **kwargs):
    kwargs.setdefault("start_new_session", True)
    return _exec_done(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, **kwargs))


def _exec_done(proc):
    """``proc`` once its new environment can be read. Popen returns as the
    exec closes its descriptors, a moment before the kernel sets where the
    new environment lies: a read then finds none (a sweep reads it again
    next time), and a test reading a marker at once failed under load."""
    assert helpers.wait_for(lambda: proctree._read_marker(proc.pid)[1] or _is_zombie(proc.pid), 10.0), proc.pid
    return proc


def _is_zombie(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# --- capture_process_group ---------------------------------------------------


def test_capture_keeps_group_usable_after_leader_reaped(tagged):
    proc = _spawn(["bash", "-c", "sleep 100 & echo $!"], env=tagged)
    pgid = capture_process_group(proc)
    grandchild = int(proc.stdout.readline())
    proc.wait()

    assert pgid == proc.pid
    with pytest.raises(ProcessLookupError):
        os.getpgid(proc.pid)
    assert capture_process_group(proc) is None
    assert os.getpgid(grandchild) == pgid

    kill_process_tree(proc, pgid)
    assert _all_dead(tagged)
    proc.stdout.close()


def test_capture_without_new_session_is_callers_group():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        assert capture_process_group(proc) == os.getpgrp()
    finally:
        proc.wait()


def test_capture_without_process_groups(monkeypatch):
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    monkeypatch.delattr(os, "getpgid")
    try:
        assert capture_process_group(proc) is None
    finally:
        proc.wait()


# --- kill_process_tree ---------------------------------------------------------


def test_kill_reaches_group_and_setsid_grandchildren(tagged):
    proc = _spawn(["bash", "-c", "sleep 100 & setsid sleep 100 & wait"], env=tagged)
    pgid = capture_process_group(proc)

    def both_started():
        sleeps = [p for p in _alive(tagged[_TAG]) if p.name() == "sleep"]
        return len(sleeps) == 2 and {os.getsid(p.pid) == pgid for p in sleeps} == {True, False}

    assert _wait_until(both_started)
    kill_process_tree(proc, pgid)
    assert proc.wait(timeout=5) == -9
    assert _all_dead(tagged)
    proc.stdout.close()


def test_kill_spares_callers_own_group(tagged, monkeypatch):
    real_killpg = os.killpg

    def killpg(pgid, sig):
        assert pgid != os.getpgrp(), "signalled the caller's own process group"
        real_killpg(pgid, sig)

    monkeypatch.setattr(os, "killpg", killpg)
    proc = _spawn(["bash", "-c", "sleep 100 & wait"], env=tagged, start_new_session=False)
    assert _wait_until(lambda: len(_alive(tagged[_TAG])) == 2)

    kill_process_tree(proc)

    assert proc.wait(timeout=5) == -9
    assert _all_dead(tagged)
    proc.stdout.close()


def test_marker_sweep_neither_reads_nor_kills_what_it_is_told_to_spare(tagged, monkeypatch):
    """A worker's warm spares on their way are its children and carry no
    job's marker; the sweep at each job's end skips them unread (reading
    them was half of a busy worker's CPU). Run as the test's user."""
    marker = f"tok{uuid.uuid4().hex[:8]}/1/secret"
    env = {**tagged, proctree.JOB_MARKER_ENV: marker}
    spared, swept = (_exec_done(subprocess.Popen(["sleep", "100"], env=env, start_new_session=True))
                     for _ in range(2))
    read = []
    real_read = proctree._read_marker
    monkeypatch.setattr(proctree, "_read_marker", lambda pid: read.append(pid) or real_read(pid))
    try:
        proctree.kill_tree(marker=marker, scope=os.getpid(), spared=lambda pid: pid == spared.pid)
        assert swept.wait(timeout=5) == -9
        assert spared.poll() is None
        assert swept.pid in read and spared.pid not in read
    finally:
        spared.kill()
        spared.wait()


def test_kill_after_exit_does_not_raise():
    reaped = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    pgid = capture_process_group(reaped)
    reaped.wait()
    kill_process_tree(reaped, pgid)
    kill_process_tree(reaped)

    zombie = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    assert _wait_until(lambda: psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE)
    kill_process_tree(zombie)
    assert zombie.wait(timeout=5) == 0


# --- drain_process_output -------------------------------------------------------

_MESSY = r"""
import sys, time
out = sys.stdout.buffer
def put(data):
    out.write(data)
    out.flush()
    time.sleep(0.05)  # separate reads, so sequences are split across chunks
put(b"plain line\r\nwindows\rlone cr\n")
put(b"bad \xff\xfe bytes \xe2\x82\xac euro\n")
put(b"split \xe2")
put(b"\x82\xac char and cr")
put(b"\r")
put(b"\nlf, truncated \xe2\x82")
put(b"\rend\r")
"""


@pytest.mark.parametrize("text", [True, False])
def test_drain_decodes_like_communicate(text, reader):
    expected = subprocess.run(
        [sys.executable, "-c", _MESSY],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        encoding="utf-8",
        errors="replace",
    ).stdout
    assert "\ufffd" in expected and "\u20ac" in expected and "\r" not in expected

    lines = []
    proc = _spawn([sys.executable, "-c", _MESSY], text=text)
    output, timed_out = drain_process_output(proc, None, lines.append)

    assert (output, timed_out) == (expected, False)
    assert "".join(lines) == expected
    assert all(line.count("\n") == 1 and line.endswith("\n") for line in lines)
    assert proc.returncode == 0 and proc.stdout.closed


def test_drain_partial_last_line_reaches_callback():
    lines = []
    proc = _spawn([sys.executable, "-c", "print('a'); print('b', end='')"])
    assert drain_process_output(proc, None, lines.append) == ("a\nb", False)
    assert lines == ["a\n", "b"]


def test_drain_delivers_lines_while_child_runs(reader):
    first_line = threading.Event()
    still_running = []

    def callback(line):
        if line == "first\n":
            still_running.append(proc.poll() is None)
            first_line.set()

    proc = _spawn(
        [sys.executable, "-u", "-c", "import sys; print('first'); sys.stdin.read(); print('second')"],
        stdin=subprocess.PIPE,
    )
    result = []
    drainer = threading.Thread(target=lambda: result.append(drain_process_output(proc, 60, callback)))
    drainer.start()
    try:
        assert first_line.wait(10)
        assert still_running == [True]
    finally:
        proc.stdin.close()  # the gate: the child exits once its stdin closes
        drainer.join(30)
    assert result == [("first\nsecond\n", False)]


def test_drain_without_timeout_waits_for_grandchild_output():
    proc = _spawn(["bash", "-c", "(sleep 0.3; echo late) & echo early"])
    assert drain_process_output(proc, None, None) == ("early\nlate\n", False)
    assert proc.returncode == 0


@pytest.mark.parametrize("reap_first", [False, True])
def test_drain_timeout_kills_grandchild_holding_stdout(tagged, reap_first, reader):
    proc = _spawn(["bash", "-c", "(sleep 100; echo never) & echo started"], env=tagged)
    pgid = capture_process_group(proc)
    if reap_first:
        proc.wait(timeout=10)

    start = time.monotonic()
    output, timed_out = drain_process_output(proc, 0.5, None, pgid=pgid)
    elapsed = time.monotonic() - start

    assert timed_out is True
    assert output == "started\n"
    assert 0.5 <= elapsed < 5
    assert _all_dead(tagged)
    assert proc.stdout.closed


def test_drain_cancel_after_leader_exit(tagged, reader):
    started = threading.Event()
    proc = _spawn(["bash", "-c", "(sleep 100; echo never) & echo started"], env=tagged)
    cancel = threading.Event()
    result = []

    def drain():
        result.append(drain_process_output(proc, None, lambda line: started.set(), cancel))
        result.append(time.monotonic())

    drainer = threading.Thread(target=drain)
    drainer.start()
    try:
        assert started.wait(10)
        assert _wait_until(lambda: _is_zombie(proc.pid))
        assert len(_alive(tagged[_TAG])) >= 1  # the grandchild still holds stdout
        assert drainer.is_alive()
        cancelled_at = time.monotonic()
    finally:
        cancel.set()
        drainer.join(10)

    (output, timed_out), returned_at = result
    assert (output, timed_out) == ("started\n", False)
    assert returned_at - cancelled_at < 1.0
    assert _all_dead(tagged)


def test_drain_survives_raising_callback():
    calls = []

    def callback(line):
        calls.append(line)
        raise RuntimeError("display broke")

    proc = _spawn([sys.executable, "-c", "for i in range(500): print(i)"])
    output, timed_out = drain_process_output(proc, 30, callback)

    expected = "".join(f"{i}\n" for i in range(500))
    assert (output, timed_out) == (expected, False)
    assert "".join(calls) == expected


def test_drain_without_process_groups(monkeypatch, reader):
    monkeypatch.delattr(os, "getpgid")
    monkeypatch.delattr(os, "killpg")

    proc = subprocess.Popen(
        [sys.executable, "-c", "print('hello')"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert drain_process_output(proc, 30, None) == ("hello\n", False)

    proc = subprocess.Popen(
        [sys.executable, "-u", "-c", "import time; print('hi'); time.sleep(100)"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    start = time.monotonic()
    output, timed_out = drain_process_output(proc, 0.5, None)
    assert (output, timed_out) == ("hi\n", True)
    assert proc.returncode == -9
    assert time.monotonic() - start < 5


def test_a_marker_is_looked_for_only_in_the_start_of_an_environment():
    """Red team: a daemon pointed its environment at 64 MB of its memory,
    and the worker read it all, at every job's end, for the marker -- two
    seconds of its loop each time. The marker is looked for in the first
    MARKER_SCAN_BYTES only: past them, a process is unmarked, as one that
    cleared its environment is."""
    padding = {f"PAD{n}": "x" * (100 << 10) for n in range(proctree.MARKER_SCAN_BYTES // (100 << 10) + 1)}
    first = _spawn(["sleep", "30"], env={"EXECPOOL_JOB": "first", **padding, "EXECPOOL_JOB2": "x"})
    past = _spawn(["sleep", "30"], env={**padding, "EXECPOOL_JOB": "past"})
    try:
        assert proctree.marker_of(first.pid) == "first"
        assert proctree.marker_of(past.pid) is None
    finally:
        for proc in (first, past):
            proc.kill()
            proc.wait()


def test_a_child_without_a_marker_is_read_once_by_the_sweeps(monkeypatch):
    """Red team: a session's escaped daemons, re-parented to the worker with
    environments of 256 KiB and no marker, were read again at every job's
    end -- 430 ms of the worker's loop at 1200 of them. Their environment
    is read once; one that shows a marker, or a new process at the pid,
    is read again."""
    padding = {f"PAD{n}": "x" * (100 << 10) for n in range(2)}
    unmarked = [_spawn(["sleep", "30"], env=padding) for _ in range(3)]
    marked = _spawn(["sleep", "30"], env={**padding, "EXECPOOL_JOB": "other"})
    reads = []
    read = proctree._read_marker
    monkeypatch.setattr(proctree, "_read_marker", lambda pid: reads.append(pid) or read(pid))
    try:
        for _ in range(3):
            assert proctree._marked("mine", os.getpid(), set(), frozenset()) == []
        children = {proc.pid for proc in unmarked}
        assert sorted(pid for pid in reads if pid in children) == sorted(children)
        assert reads.count(marked.pid) == 3
    finally:
        for proc in (*unmarked, marked):
            proc.kill()
            proc.wait()
