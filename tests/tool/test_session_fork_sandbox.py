"""``Session.fork()`` in the strict sandbox (SPEC §8, docs/library/sessions.md): a copy holds its parent's state and copies of its files, at the
same paths, and from then on reaches nothing of its parent's or its
siblings' -- not their files (its own /tmp, home, /dev/shm and working
directory, in a space of its own), not their processes; within a budget of
forks per family, whose unused spaces go with its last member. The pool
runs as root here; one test runs it as ``nobody``."""

from __future__ import annotations

import ast
import contextlib
import json
import os
import subprocess
import sys
import textwrap
from typing import Dict, Iterator

import pytest

from execpool import ExecPool, Limits, SessionClosedError, SessionForkError, sandbox_support
from execpool.worker.sessions.family import FAMILY_FORKS
from tests.support.helpers import alive, run_as_nobody, wait_for, worker_records

pytestmark = pytest.mark.skipif(not sandbox_support().available, reason="the kernel lacks the sandbox")

DEADLINE_S = 30.0

#: Writes a file in each of the trees a copy gets of its own.
PLANT = textwrap.dedent("""\
    import os
    state = ['parent']
    for path in ('/tmp/t.txt', os.path.expanduser('~/h.txt'), '/dev/shm/s.txt', 'w.txt'):
        open(path, 'w').write('parent')
""")
READ_ALL = "[open(p).read() for p in ('/tmp/t.txt', os.path.expanduser('~/h.txt'), '/dev/shm/s.txt', 'w.txt')]"
WRITE_ALL = ("for p in ('/tmp/t.txt', os.path.expanduser('~/h.txt'), '/dev/shm/s.txt', 'w.txt'):\n"
             "    open(p, 'w').write(WHO)")

#: A cell that tries what a copy must not do to ``PID``'s process (its
#: parent's, a sibling's): a dict of what each attempt met.
REACH = textwrap.dedent("""\
    import os, subprocess
    def attempt(f):
        try:
            f()
            return 'done'
        except OSError as exc:
            return type(exc).__name__
    {
        'its /tmp': attempt(lambda: open(f'/proc/{PID}/root/tmp/t.txt').read()),
        'its directory': attempt(lambda: open(f'/proc/{PID}/cwd/w.txt', 'a').write('x')),
        'its user namespace': attempt(lambda: os.open(f'/proc/{PID}/ns/user', os.O_RDONLY)),
        'a signal': attempt(lambda: os.kill(PID, 0)),
        'from a child process': subprocess.run(['cat', f'/proc/{PID}/root/tmp/t.txt'],
                                                capture_output=True).returncode,
        'capabilities': open('/proc/self/status').read().split('CapEff:')[1].split()[0],
    }
""")
REFUSED = {"its /tmp": "PermissionError", "its directory": "PermissionError",
           "its user namespace": "PermissionError", "a signal": "PermissionError", "from a child process": 1,
           "capabilities": "0000000000000000"}


@pytest.fixture(scope="module")
def pool():
    with ExecPool(workers=1) as p:
        yield p


#: What a spare space holds (execpool/worker/sessions/family.py).
SPARE_TREES = {"home", "tmp", "shm", "work"}


@contextlib.contextmanager
def _held() -> Iterator[Dict[int, int]]:
    """Spaces the test holds, by device, so that a device number stays
    theirs (the kernel gives a freed tmpfs's number to the next)."""
    held: Dict[int, int] = {}
    try:
        yield held
    finally:
        for fd in held.values():
            os.close(fd)


def _spares(pool, held: Dict[int, int]) -> set:
    """The devices of the spare spaces the worker holds for sandboxed
    families (a tmpfs root holding a spare's trees), each added to ``held``."""
    pid = worker_records(pool)[0].pid
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if os.readlink(path) != "/" or set(os.listdir(path)) != SPARE_TREES:
                continue
            device = os.stat(path).st_dev
            if device not in held:
                held[device] = os.open(path, os.O_PATH)
        except OSError:
            continue
        found.add(device)
    return found


def test_a_sandboxed_copy_holds_its_parent_s_state_and_files_of_its_own(pool):
    with pool.session("python", sandbox="strict") as parent:
        assert parent.run(PLANT + "os.getcwd()").status == "ok"
        place = parent.run("os.getcwd()").value
        with parent.fork() as child:
            assert child.cwd is None  # private, as its parent's
            assert child.run(f"state, {READ_ALL}, os.getcwd()").value == f"(['parent'], {['parent'] * 4}, {place})"
            child.run("state.append('child')\nWHO = 'child'\n" + WRITE_ALL)
            assert parent.run(f"state, {READ_ALL}").value == f"(['parent'], {['parent'] * 4})"
            parent.run("WHO = 'parent again'\n" + WRITE_ALL)
            assert child.run(f"state, {READ_ALL}").value == f"(['parent', 'child'], {['child'] * 4})"
            with child.fork() as grandchild:
                assert grandchild.run(f"state, {READ_ALL}").value == f"(['parent', 'child'], {['child'] * 4})"
                grandchild.run("WHO = 'grandchild'\n" + WRITE_ALL)
                assert child.run(READ_ALL).value == str(["child"] * 4)


def test_a_sandboxed_copy_reaches_neither_its_parent_nor_its_sibling(pool):
    with pool.session("python", sandbox="strict") as parent:
        parent.run(PLANT)
        with parent.fork() as first, parent.fork() as second:
            for copy, other in ((first, parent), (first, second), (second, first)):
                pid = other.run("os.getpid()").value
                reached = copy.run(REACH.replace("PID", pid))
                assert reached.status == "ok", reached.text
                assert ast.literal_eval(reached.value) == REFUSED  # as IPython's pretty printer wrapped it


def test_a_copy_s_share_of_the_disk_budget_stays_held_while_its_parent_may_hold_its_files(pool):
    """Red team: a parent kept a file of its closed copy's space open
    through /proc/<copy>/root, which kept the space, memory, alive after
    its share of the budget had gone back: eight copies pinned eight
    shares the budget no longer counted."""
    budget = pool.disk_budget
    with pool.session("python", sandbox="strict") as parent:
        share = budget.taken
        child = parent.fork()
        assert budget.taken == 2 * share
        pid = child.run("import os\nopen('/tmp/pinned', 'wb').write(b'x' * 4096)\nos.getpid()").value
        held = parent.run(f"held = open('/proc/{pid}/root/tmp/pinned', 'rb')\nlen(held.read())")
        assert held.value == "4096", held.text
        child.close()
        assert budget.taken == 2 * share  # the parent holds the copy's space
    assert wait_for(lambda: budget.taken == 0, 10.0), budget.describe()


def test_a_sandboxed_session_given_a_directory_forks_into_a_copy_of_its_own(pool, tmp_path):
    """The copy's working directory is at its parent's path, as the copy
    sees it (``Session.cwd`` names it), and is a copy in the copy's own
    space: what it writes there never reaches the caller's directory."""
    (tmp_path / "seed.txt").write_text("seed")
    with pool.session("python", sandbox="strict", cwd=tmp_path) as parent:
        parent.run(PLANT)
        with parent.fork() as child:
            assert child.cwd == str(tmp_path)
            # print: IPython's pretty printer wraps a long value's text
            assert child.run("print(repr((os.getcwd(), sorted(os.listdir('.')))))").stdout == repr(
                (str(tmp_path), ["seed.txt", "w.txt"])) + "\n"
            assert child.run("WHO = 'child'\n" + WRITE_ALL + "\nopen('new.txt', 'w').write('child')").status == "ok"
            assert child.run("open('w.txt').read()").value == "'child'"
            assert (tmp_path / "w.txt").read_text() == "parent"
            assert sorted(os.listdir(tmp_path)) == ["seed.txt", "w.txt"]
        with pytest.raises(SessionForkError, match="cannot be given a cwd"):
            parent.fork(cwd=tmp_path)
        assert parent.run("open('w.txt').read()").value == "'parent'"


def test_a_family_makes_its_forks_then_says_why_and_its_directories_go_with_it(pool):

    with pool.session("python", sandbox="strict") as parent:
        parent.run("x = 1")
        first = parent.fork()
        copies = [first, first.fork()]  # a copy's fork counts for the family
        copies += [parent.fork() for _ in range(FAMILY_FORKS - 2)]
        with pytest.raises(SessionForkError, match=f"make {FAMILY_FORKS} forks in all"):
            parent.fork()
        with pytest.raises(SessionForkError, match="forks in all"):
            first.fork()
        assert parent.run("x").value == "1" and all(copy.run("x").value == "1" for copy in copies)
        with _held() as held:
            # Device numbers are the kernel's, the same in a copy's view.
            used = {int(copy.run("import os\nos.stat('/tmp').st_dev").value) for copy in copies}
            assert len(used) == FAMILY_FORKS and used <= _spares(pool, held)
            for copy in copies:
                copy.close()
            # Each copy's space (one spare each) went with it.
            assert wait_for(lambda: not used & _spares(pool, held), DEADLINE_S)


def test_the_spares_a_family_did_not_use_serve_no_other(pool):
    """Red team: a family's unused spares went back to the worker's stock
    while a process of that family, whose Landlock domain grants them,
    could still live. They are removed with the family; the stock is made
    again after the Result, off the next session's start."""
    with _held() as held:
        with pool.session("python", sandbox="strict") as first:
            assert first.run("1").value == "1"
        assert wait_for(lambda: len(_spares(pool, held)) >= FAMILY_FORKS, DEADLINE_S)
        stock = _spares(pool, held)
        with pool.session("python", sandbox="strict") as session:
            assert session.run("1").value == "1"
        assert wait_for(lambda: len(_spares(pool, held)) >= FAMILY_FORKS and not stock & _spares(pool, held),
                        DEADLINE_S), (stock, _spares(pool, held))


def test_a_sandboxed_session_forks_as_nobody():
    """The worker lacks CAP_SYS_ADMIN: its view lives in a user namespace
    of its own, which the copy's mounts are made from."""
    script = textwrap.dedent("""\
        import json, os
        from execpool import ExecPool
        with ExecPool(workers=1) as pool, pool.session("python", sandbox="strict") as parent:
            parent.run("import os\\nopen('/tmp/t.txt', 'w').write('parent')\\nx = 7")
            pid = parent.run("os.getpid()").value
            with parent.fork() as child:
                seen = child.run("x, open('/tmp/t.txt').read(), os.getuid()").value
                child.run("open('/tmp/t.txt', 'w').write('child')")
                reach = child.run(f"import subprocess\\n"
                                  f"subprocess.run(['cat', '/proc/{pid}/root/tmp/t.txt']).returncode").value
            print(json.dumps([seen, parent.run("open('/tmp/t.txt').read()").value, reach]))
    """)
    done = run_as_nobody(script)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [f"(7, 'parent', {65534})", "'parent'", "1"]


def test_a_pool_closed_with_sandboxed_sessions_open_says_nothing_of_its_preparer():
    """Regression: each open session's end made the worker ask its preparer,
    killed already, for the next job's namespace, and log that it was gone."""
    script = ("from execpool import ExecPool\n"
              "with ExecPool(workers=1) as pool:\n"
              "    sessions = [pool.session('python', sandbox='strict') for _ in range(2)]\n"
              "    print([s.run('1').value for s in sessions])\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "['1', '1']\n", done.stderr
    assert "preparer" not in done.stderr, done.stderr


#: Run in a sandboxed session: its runtime answers the next fork by asking
#: for ``VICTIM``'s trees to be mounted, as a copy's parent would.
FORGED_MOUNT = """
import gc, json
from execpool.tool.python_session import Runtime
runtime = next(o for o in gc.get_objects() if isinstance(o, Runtime))
def forged(tag, body):
    runtime.channel.sendall(tag + b"+VICTIM\\0")
    return json.dumps({"error": "no copy"}).encode() + b"\\0"
runtime._fork = forged
"""


def test_a_session_naming_another_process_for_its_copy_s_mounts_is_ended():
    """The worker mounts a copy's trees only in its own child carrying the
    copy's marker: a session that names another session's process ends,
    and the process it named is left alone."""
    with ExecPool(workers=1) as own:
        with own.session("python", sandbox="strict") as victim:
            pid = int(victim.run("import os\nos.getpid()").value)
            mounts = victim.run("open('/proc/self/mountinfo').read()").value
            liar = own.session("python", sandbox="strict")
            liar.run(FORGED_MOUNT.replace("VICTIM", str(pid)))
            with pytest.raises(SessionClosedError, match="not its copy"):
                liar.fork()
            assert not liar.alive
            assert victim.run("open('/proc/self/mountinfo').read()").value == mounts
            assert victim.run("os.getpid()").value == str(pid)


@pytest.mark.parametrize("sandbox", [False, "strict"])
def test_a_fork_leaves_out_a_pipe_in_its_parent_s_files(pool, sandbox):
    """Regression: a named pipe in the session's directory failed the fork
    (shutil refuses to copy one); the copy has the rest."""
    with pool.session("python", sandbox=sandbox) as parent:
        parent.run("import os\nos.mkfifo('pipe')\nopen('kept.txt', 'w').write('kept')")
        if sandbox:
            parent.run("os.mkfifo('/tmp/pipe')")  # its own /tmp
        with parent.fork() as child:
            assert child.run("open('kept.txt').read(), os.path.exists('pipe'), os.path.exists('/tmp/pipe')").value \
                == "('kept', False, False)"


def test_a_session_that_left_its_user_namespace_is_refused_a_fork(pool):
    """Its copy's spare is cloned and its ids mapped in the user namespace
    the session was given, never in one its cells moved it to -- here its
    own copy's, which a parent may join (the threat model says why); the
    worker's helper once joined that one, unconfined."""
    with pool.session("python", sandbox="strict") as parent, parent.fork() as copy:
        pid = copy.run("import os\nos.getpid()").value
        moved = parent.run(f"import ctypes, os\nfd = os.open('/proc/{pid}/ns/user', os.O_RDONLY)\n"
                           f"ctypes.CDLL(None, use_errno=True).setns(fd, 0x10000000)")
        assert moved.value == "0", moved.text
        with pytest.raises(SessionForkError, match="left the user namespace it was started in"):
            parent.fork()
        assert parent.run("'goes on'").value == "'goes on'" and copy.run("'so does it'").value == "'so does it'"



#: Run in a sandboxed session: its runtime answers the next fork with a
#: copy that never asked for its own directories.
UNMOUNTED_COPY = """
from execpool.tool import session_fork as fork
fork._own_trees = lambda channel, confine, layer, said_w: None
"""


def test_a_sandboxed_copy_that_never_had_its_own_directories_is_no_session(pool):
    """A parent's cell can change how its copy starts: a copy that skips
    asking for its directories is refused, not run on its parent's."""
    with pool.session("python", sandbox="strict") as parent:
        parent.run(UNMOUNTED_COPY)
        with pytest.raises(SessionForkError, match="never had directories of its own"):
            parent.fork()
        assert parent.run("'goes on'").value == "'goes on'"


#: Run in a session: its runtime answers the next fork naming a pid past a C int.
HUGE_PID = """
from execpool.tool import session_fork as fork
def huge(runtime, spec, fds, ask_mount):
    for fd in fds:
        os.close(fd)
    if spec.get("confine"):
        ask_mount(2 ** 62)
    return {"pid": 2 ** 62}
fork.fork_copy = huge
"""


@pytest.mark.parametrize("sandbox", [False, "strict"])
def test_a_session_naming_a_pid_past_a_c_int_for_its_copy_costs_no_one_else(sandbox):
    """Red team: the worker's check of the copy's pid passed it to waitid,
    whose OverflowError took down the worker with every session and job on it."""
    with ExecPool(workers=1) as own:
        with own.session("python", sandbox="strict") as bystander:
            bystander.run("state = 'kept'")
            liar = own.session("python", sandbox=sandbox)
            liar.run("import os\n" + HUGE_PID)
            with pytest.raises((SessionForkError, SessionClosedError), match="not its copy"):
                liar.fork()
            assert bystander.run("state").value == "'kept'"


#: Run in a sandboxed session: its next copy makes a user namespace but
#: stays in its parent's mount namespace, and asks for its trees there.
SHARED_MOUNTS = """
from execpool.tool import session_fork as fork
def shared(channel, confine, layer, said_w):
    fork.enter.unshare_capless(fork._CLONE_NEWUSER)
    os.write(said_w, b"+%d\\n" % os.getpid())
    channel.recv(1)
fork._own_trees = shared
"""


def test_a_copy_that_kept_its_parent_s_mount_namespace_gets_no_trees_there(pool):
    """Red team: the worker mounted a spare over whatever mount namespace
    the copy was in -- its parent's, for a copy its parent's cell changed."""
    with pool.session("python", sandbox="strict") as parent:
        parent.run("import os\nopen('/tmp/mine', 'w').write('parent')\n" + SHARED_MOUNTS)
        with pytest.raises(SessionForkError, match="did not make a mount namespace of its own"):
            parent.fork()
        # Its own /tmp still (which lists this checkout too, where it lies in /tmp).
        assert parent.run("'mine' in os.listdir('/tmp'), open('/tmp/mine').read()").value == "(True, 'parent')"


#: Run in a sandboxed session: its next copy keeps the capabilities its new
#: user namespace gives it, asks for its trees all the same, and once they
#: are mounted (its ids mapped: a root's) sets a file capability in its /tmp.
CAPABLE_COPY = """
import ctypes, os, struct
from execpool.tool import session_fork as fork
def capable(channel, confine, layer, said_w):
    if ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x00020000) != 0:
        raise OSError(ctypes.get_errno(), "unshare")
    os.write(said_w, b"+%d\\n" % os.getpid())
    if channel.recv(1) == fork.MOUNTED:
        open('/tmp/capped', 'w').close()
        os.setxattr('/tmp/capped', 'security.capability', CAPABILITY)
fork._own_trees = capable
"""

#: A file capability (VFS_CAP_REVISION_2, effective): every capability permitted.
CAPABILITY = "struct.pack('<5I', 0x02000001, 0xFFFFFFFF, 0, 0xFFFFFFFF, 0)"


def _with_file_capability(*roots: str) -> list:
    found = []
    for root in roots:
        for directory, _, files in os.walk(root):
            for name in files:
                try:
                    os.getxattr(os.path.join(directory, name), "security.capability", follow_symlinks=False)
                except OSError:
                    continue
                found.append(os.path.join(directory, name))
    return found


def test_a_copy_that_keeps_its_capabilities_sets_no_file_capability(pool):
    """Red team, as root: a copy runs what its parent's cell made of the
    fork's code; one that kept the capabilities of its new user namespace
    until the worker mapped its ids (root's) set a file capability on a
    host file, which anyone could run as root. Every extended attribute
    is refused in the sandbox (EOPNOTSUPP)."""
    with pool.session("python", sandbox="strict") as parent:
        parent.run(CAPABLE_COPY.replace("CAPABILITY", CAPABILITY))
        with pytest.raises(SessionForkError, match="Operation not supported"):
            parent.fork()
        assert parent.run("'goes on'").value == "'goes on'"
    assert _with_file_capability(worker_records(pool)[0].jobs_dir) == []


def test_a_parent_that_joins_its_copy_s_user_namespace_sets_no_file_capability(pool, tmp_path):
    """Red team, as root: a parent may join its copy's user namespace (the
    threat model says why), where it holds every capability over root's files:
    it set a file capability on a copy of ``cat`` in its own directory,
    and any local user read /etc/shadow with it."""
    with pool.session("python", sandbox="strict", cwd=tmp_path) as parent, parent.fork() as copy:
        pid = copy.run("import os\nos.getpid()").value
        tried = parent.run(
            f"import ctypes, os, shutil, struct\nfd = os.open('/proc/{pid}/ns/user', os.O_RDONLY)\n"
            f"joined = ctypes.CDLL(None, use_errno=True).setns(fd, 0x10000000)\n"
            f"shutil.copy('/bin/cat', 'cat')\n"
            f"try:\n    os.setxattr('cat', 'security.capability', {CAPABILITY})\n    said = 'set'\n"
            f"except OSError as exc:\n    said = exc.strerror\n"
            f"joined, said")
        assert tried.value == "(0, 'Operation not supported')", tried.text
    assert _with_file_capability(str(tmp_path), worker_records(pool)[0].jobs_dir) == []


#: Run in a session: its runtime writes PID into every descriptor the next
#: fork frame brings, and says it has no copy.
MOVER = """
from execpool.tool import session_fork as fork
def mover(runtime, spec, fds, ask_mount):
    for fd in fds:
        try:
            os.write(fd, b"PID")
        except OSError:
            pass
        os.close(fd)
    return {"error": "no copy"}
fork.fork_copy = mover
"""


@pytest.mark.parametrize("sandbox", [False, "strict"])
def test_a_fork_hands_the_session_no_cgroup_file(sandbox):
    """Red team, as root: the fork frame carried the copy's cgroup.procs,
    open for writing, and the session's code wrote another session's pid
    in it -- any pid, the service's own included -- moving it into a group
    that dies with the copy. The worker moves the copy itself."""
    with ExecPool(workers=1) as own:
        with own.session("python", sandbox="strict", limits=Limits(memory=256 << 20)) as bystander:
            pid = int(bystander.run("import os\nos.getpid()").value)
            with open(f"/proc/{pid}/cgroup") as f:
                groups = f.read()
            liar = own.session("python", sandbox=sandbox, limits=Limits(memory=256 << 20))
            liar.run("import os\n" + MOVER.replace("PID", str(pid)))
            with pytest.raises(SessionForkError, match="no copy"):
                liar.fork()
            with open(f"/proc/{pid}/cgroup") as f:
                assert f.read() == groups
            assert bystander.run("'kept'").value == "'kept'"


#: Run in a session: its runtime makes the next copy, which then never
#: serves its socket, and says there is none.
DENIED = """
import signal
from execpool.tool import session_fork as fork
made = fork.fork_copy
def deny(runtime, spec, fds, ask_mount):
    global denied
    said = made(runtime, spec, fds, ask_mount)
    while said is None:
        signal.pause()  # the copy waits to be killed
    denied = said.get("pid")
    return {"error": "denied"}
fork.fork_copy = deny
"""


@pytest.mark.parametrize("sandbox", [False, "strict"])
def test_a_copy_its_parent_denies_dies_with_its_fork(pool, sandbox):
    """Red team, as root: a copy made (and, sandboxed, mounted) whose
    parent then answered the fork with an error outlived the session and
    its family, until its worker had no job left."""
    with pool.session("python", sandbox=sandbox) as parent:
        parent.run(DENIED)
        with pytest.raises(SessionForkError, match="denied"):
            parent.fork()
        copy = int(parent.run("denied").value)
        assert wait_for(lambda: not alive(copy), DEADLINE_S)
        assert parent.run("'goes on'").value == "'goes on'"
