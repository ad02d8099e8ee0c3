"""The kernel-enforced sandbox (execpool/shared/kernel/sandbox.py), attacked.

Every escape in tests/support/hostile.py is tried by a pool's owner running as
root and as ``nobody`` (tests/support/sandbox_owner.py), in the sandbox and -- the
negative control, so that each test can fail -- without it: the control
must reach what it reached for, the sandboxed tool must not. Then what a
sandboxed job may still do (its directory, its TMPDIR, the paths a
``Sandbox`` adds), how a job's choice overrides its pool's, and that a
kernel without Landlock fails the job instead of running it unsandboxed.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

from execpool import ExecPool, PythonJob, Sandbox, ShellJob, Status, sandbox_support
from execpool import tools as tool_layer
from execpool.shared.kernel import sandbox as sandbox_kernel
from execpool.shared.kernel.cgroups import _mounts
from execpool.shared.kernel.sandbox import MIN_LANDLOCK_ABI
from tests.support import hostile
from tests.support.helpers import (
    REPO,
    SPAWN_PARAMS,
    UNPRIVILEGED,
    all_dead,
    collect,
    pids_in,
    unprivileged_python,
    unprivileged_pythonpath,
)

pytestmark = [pytest.mark.hostile, pytest.mark.skipif(not sandbox_support().available,
                                                     reason=f"no sandbox here: {sandbox_support().missing}")]

OWNER = os.path.join(REPO, "tests", "support", "sandbox_owner.py")
OWNER_TIMEOUT_S = 600


def _escaped(text: str) -> bool:
    return any(line.strip() == "ESCAPED" for line in text.splitlines())


def _labels(user: str) -> list:
    labels = []
    for attack in hostile.SANDBOX_ATTACKS:
        if attack["root"] and user != "root":
            continue
        kinds = [None] if attack["kind"] == "shell" else ["cold", "warm"]
        labels += [(attack, attack["name"] if kind is None else f"{attack['name']}-{kind}") for kind in kinds]
    return labels


def _disk() -> str:
    for name in sorted(os.listdir("/dev")):
        if name.startswith(("vd", "sd", "nvme", "xvd")):
            return os.path.join("/dev", name)
    return "/dev/no-disk-here"


def _secret_file(directory: str, name: str, owner: int) -> str:
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write(f"{name}-{secrets.token_hex(8)}\n")
    os.chown(path, owner, owner)
    os.chmod(path, 0o600)
    return path


class _Owner:
    """One run of tests/support/sandbox_owner.py as ``user``, its report, and the
    directories it was given."""

    def __init__(self, user: str) -> None:
        self.user = user
        uid = 0 if user == "root" else UNPRIVILEGED
        self.base = tempfile.mkdtemp(prefix="execpool-sandbox-test-")
        os.chmod(self.base, 0o755)
        dirs = {}
        for name in ("home", "cwd", "outside"):
            dirs[name] = os.path.join(self.base, name)
            os.mkdir(dirs[name], 0o700)
            os.chown(dirs[name], uid, uid)
        self.outside = dirs["outside"]
        if user == "root":
            # The caller's own home: where a server's keys live.
            fd, self.home_secret = tempfile.mkstemp(prefix=".execpool-test-secret-", dir=os.path.expanduser("~"))
            os.write(fd, b"home-secret\n")
            os.close(fd)
            python, pythonpath, env_home, owner = sys.executable, REPO, os.path.expanduser("~"), OWNER
        else:
            self.home_secret = _secret_file(dirs["home"], "home-secret", uid)
            python = unprivileged_python()
            if python is None:
                pytest.skip("no Python interpreter the unprivileged user may run")
            pythonpath = unprivileged_pythonpath(self.base)
            env_home = dirs["home"]
            # Beside the readable copy of execpool: the checkout may lie where nobody cannot enter.
            owner = shutil.copy(OWNER, os.path.join(pythonpath, os.path.basename(OWNER)))
            os.chmod(owner, 0o644)
        cwd_secret = _secret_file(dirs["cwd"], "cwd-secret", uid)
        mounts = _mounts()
        spec = {
            "attacks": hostile.SANDBOX_ATTACKS,
            "spawn_method": "auto",
            "fill": {"@HOME_SECRET@": self.home_secret, "@CWD_SECRET@": cwd_secret, "@OUTSIDE@": self.outside,
                     "@PIDS_ROOT@": mounts.get("pids", "/no-pids-hierarchy"),
                     "@CGROUP2_ROOT@": mounts.get("", "/no-cgroup2-hierarchy"),
                     "@DISK@": _disk(), "@CLONE3@": "435"},
        }
        credentials = {} if user == "root" else {"user": uid, "group": uid, "extra_groups": []}
        done = subprocess.run([python, owner], input=json.dumps(spec), capture_output=True, text=True,
                              cwd=dirs["cwd"], timeout=OWNER_TIMEOUT_S, **credentials,
                              env={"PATH": "/usr/bin:/bin", "PYTHONPATH": pythonpath, "HOME": env_home})
        assert done.returncode == 0, done.stderr[-3000:]
        self.report = json.loads(done.stdout.splitlines()[-1])
        assert self.report["uid"] == uid

    def close(self) -> None:
        if self.user == "root":
            os.unlink(self.home_secret)
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture(scope="module")
def owners():
    made: dict = {}

    def get(user: str) -> _Owner:
        if user not in made:
            if os.getuid() != 0:
                pytest.skip("needs root, to run the owner as root and as nobody")
            made[user] = _Owner(user)
        return made[user]

    yield get
    for owner in made.values():
        owner.close()


@pytest.mark.slow
@pytest.mark.parametrize("user,attack,label", [
    pytest.param(user, attack, label, id=f"{user}-{label}", marks=[pytest.mark.nobody] if user == "nobody" else [])
    for user in ("root", "nobody") for attack, label in _labels(user)])
def test_every_escape_is_refused_and_its_control_is_not(owners, user, attack, label):
    outcome = owners(user).report["results"][label]
    control, sandboxed = outcome["control"], outcome["sandboxed"]
    if not _escaped(control["text"]):
        if attack["needs"]:
            pytest.skip(f"needs {attack['needs']}; without the sandbox it failed too: {control['text'][-200:]!r}")
        pytest.fail(f"the negative control did not escape, so the test shows nothing: {control['text'][-500:]!r}")
    assert not _escaped(sandboxed["text"]), f"{label} escaped the sandbox: {sandboxed['text'][-500:]!r}"
    assert sandboxed["status"] in ("ok", "error"), sandboxed  # it ran, and was refused


@pytest.mark.slow
@pytest.mark.parametrize("user", ["root", pytest.param("nobody", marks=pytest.mark.nobody)])
def test_the_attacks_left_the_pool_whole_and_wrote_nothing_outside(owners, user):
    owner = owners(user)
    report = owner.report
    assert report["workers_before"] == report["workers_after"], "a sandboxed tool killed a worker"
    assert report["victim"] == "cancelled", "the victim job ended before the attacks did"
    written = sorted(os.listdir(owner.outside))
    assert written and all("control" in name for name in written), written


# --- what a sandboxed job may do ------------------------------------------------------------------

@pytest.fixture(scope="module", params=SPAWN_PARAMS)
def pool(request):
    with ExecPool(workers=2, spawn_method=request.param) as p:
        yield p


WORKS_SHELL = textwrap.dedent("""\
    set -e
    echo data > here.txt && cat here.txt
    echo tmp > "$TMPDIR/t" && cat "$TMPDIR/t"
    mktemp > /dev/null
    ls /usr/bin > /dev/null && echo hi | tr a-z A-Z | sort
    cat <(echo substituted)
    "$PY" -c 'import json, sqlite3; print(json.dumps([1]))'
    echo "TMPDIR $TMPDIR"
""")

WORKS_PYTHON = textwrap.dedent("""\
    import json, multiprocessing, os, subprocess, sys, tempfile
    open("here.txt", "w").write("data")
    with tempfile.NamedTemporaryFile(dir=None) as f:
        print("tmp under TMPDIR", f.name.startswith(os.environ["TMPDIR"]))
    with multiprocessing.Pool(2) as workers:
        print(workers.map(abs, [-1, -2]))
    print(subprocess.run(["/bin/bash", "-c", "echo child"], capture_output=True, text=True).stdout, end="")
    print(open("/etc/os-release").read() != "", sys.stdin.read())
    print("TMPDIR", os.environ["TMPDIR"])
""")


@pytest.mark.parametrize("kind", ["shell", "cold", "warm"])
def test_a_sandboxed_job_works_in_its_directory_and_its_tmpdir(pool, kind):
    if kind == "shell":
        result = pool.run(ShellJob(WORKS_SHELL, sandbox="strict", timeout=60, env={"PY": sys.executable}))
        expected = "data\ntmp\nHI\nsubstituted\n[1]\n"
    else:
        result = pool.run(PythonJob(WORKS_PYTHON, sandbox="strict", timeout=60, warm=kind == "warm", stdin="in"))
        expected = "tmp under TMPDIR True\n[1, 2]\nchild\nTrue in\n"
    assert result.status is Status.OK, result.text
    assert result.output.startswith(expected), result.output
    assert result.output.rsplit("TMPDIR ", 1)[1].strip() == "/tmp"  # its own (what it left there: below)


def test_with_a_cwd_the_tmpdir_is_a_private_directory_of_its_own(pool, tmp_path):
    name = f"gone-{secrets.token_hex(4)}"
    result = pool.run(ShellJob(f'echo kept > kept; echo gone > "$TMPDIR/{name}"; echo "$TMPDIR"; ls "$TMPDIR"',
                               cwd=str(tmp_path), sandbox="strict"))
    assert result.status is Status.OK, result.text
    # The caller's directory beneath /tmp is at its own path, in the job's own /tmp.
    chain = {tmp_path.parts[2]} if tmp_path.parts[1] == "tmp" else set()
    tmpdir, *listed = result.output.split()
    assert tmpdir == "/tmp" and set(listed) - _POOLS_OWN_IN_TMP == {name} | chain, result.output
    assert not os.path.exists(f"/tmp/{name}") and not list(tmp_path.glob("gone-*"))
    assert (tmp_path / "kept").read_text() == "kept\n"


#: What a job's /tmp holds at its start besides: the way to the pool's
#: interpreter and package, where they live beneath /tmp (a checkout there).
_POOLS_OWN_IN_TMP = {path.split("/")[2] for path in (REPO, sys.prefix, os.path.realpath(sys.executable))
                     if path.startswith("/tmp/")}


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_what_a_job_leaves_in_its_tmp_home_and_shm_is_gone_for_the_next(warm):
    """Each job's /tmp, /dev/shm and home are its own: the next job on the
    same worker starts with them empty, and the machine's are untouched."""
    name = f"planted-{secrets.token_hex(4)}"
    pools = sorted(_POOLS_OWN_IN_TMP)
    plant = (f"import os\nfor d in ('/tmp', '/var/tmp', '/dev/shm', os.path.expanduser('~')):\n"
             f"    open(os.path.join(d, '{name}'), 'w').write('x')\n"
             f"print(sorted(set(os.listdir('/tmp')) - set({pools!r})), sorted(os.listdir('/dev/shm')))\n")
    look = (f"import os\nprint([d for d in ('/tmp', '/var/tmp', '/dev/shm', os.path.expanduser('~'))"
            f" if os.path.exists(os.path.join(d, '{name}'))], sorted(set(os.listdir('/tmp')) - set({pools!r})),"
            " os.listdir('/dev/shm'))\n")
    with ExecPool(workers=1) as pool:
        planted = pool.run(PythonJob(plant, sandbox="strict", warm=warm))
        assert planted.output == f"['{name}'] ['{name}']\n", planted.text
        looked = pool.run(PythonJob(look, sandbox="strict", warm=warm))
        assert looked.output == "[] [] []\n", looked.text
    assert not any(os.path.exists(os.path.join(d, name)) for d in ("/tmp", "/var/tmp", "/dev/shm", "/root"))


def test_the_ordinary_class_given_to_another_process_is_pretended_not_done(pool):
    """Run as root. A process outside the job in the batch class: the job's
    ``sched_setscheduler(pid, SCHED_OTHER)`` succeeds and changes nothing
    (a thread's own id is what runtimes pass, and it cannot be told from
    another's); without the sandbox the same call does change it -- the
    control."""
    victim = subprocess.Popen(["sleep", "60"])
    try:
        os.sched_setscheduler(victim.pid, os.SCHED_BATCH, os.sched_param(0))
        code = (f"import os\nos.sched_setscheduler({victim.pid}, os.SCHED_OTHER, os.sched_param(0))\n"
                f"print('set')\n")
        sandboxed = pool.run(PythonJob(code, timeout=30, sandbox="strict"))
        assert (sandboxed.status, sandboxed.output) == (Status.OK, "set\n"), sandboxed.text
        assert os.sched_getscheduler(victim.pid) == os.SCHED_BATCH
        control = pool.run(PythonJob(code, timeout=30, sandbox=False))
        assert control.ok and os.sched_getscheduler(victim.pid) == os.SCHED_OTHER
    finally:
        victim.kill()
        victim.wait()


def test_a_sandboxed_tool_holds_no_descriptor_but_stdio(pool):
    listed = pool.run(ShellJob("ls /proc/self/fd", sandbox="strict")).output.split()
    assert sorted(map(int, listed))[:3] == [0, 1, 2] and len(listed) == 4, listed  # ls's own directory


def test_sandbox_paths_add_reading_and_writing(pool, tmp_path):
    readable, writable = tmp_path / "readable", tmp_path / "writable"
    readable.mkdir()
    writable.mkdir()
    (readable / "data").write_text("shared data\n")
    probe = f"cat {readable}/data; echo x > {readable}/nope; echo written > {writable}/out && echo wrote"
    added = pool.run(ShellJob(probe, sandbox=Sandbox(read=[str(readable)], write=[str(writable)])))
    # Landlock refuses the write; the read-only view refuses it first
    assert added.output.startswith("shared data\n") and "nope: Read-only file system" in added.output, added.output
    assert added.output.endswith("wrote\n") and (writable / "out").read_text() == "written\n"
    assert not (readable / "nope").exists()
    strict = pool.run(ShellJob(f"cat {readable}/data", sandbox="strict"))
    # The control: the path was not in the view before (the Result whole if not: once, under two suites at
    # once, this job came back infra and the output left no trace of why).
    assert "No such file or directory" in strict.output, (strict.status, strict.error, strict.output)


@pytest.fixture
def etc_dir():
    """A directory of this test's own in /etc (root only): a public file and
    one only root may read, removed whatever happens."""
    if os.getuid() != 0:
        pytest.skip("needs root, to write into /etc")
    path = tempfile.mkdtemp(prefix="execpool-test-", dir="/etc")
    try:
        os.chmod(path, 0o755)
        os.mkdir(os.path.join(path, "plain"), 0o755)  # nothing hidden in it, at first
        for name, mode in (("public", 0o644), ("private", 0o600), ("plain/later", 0o644)):
            with open(os.path.join(path, name), "w") as f:
                f.write(f"{name} 1\n")
            os.chmod(os.path.join(path, name), mode)
        yield path
    finally:
        shutil.rmtree(path)


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_what_only_root_may_read_in_etc_stays_hidden_as_etc_changes(pool, etc_dir, warm):
    """The world-readable layer (execpool/sandbox/rulesets.py) follows /etc: a
    directory made after the worker started, and a file replaced by a
    rename -- a new inode -- are seen; a root-only file stays hidden,
    unless the job's Sandbox names it."""
    public, private = os.path.join(etc_dir, "public"), os.path.join(etc_dir, "private")
    read = ("import sys\nfor path in sys.argv[1:] or {paths!r}:\n"
            "    try:\n        print(open(path).read(), end='')\n"
            "    except OSError as exc:\n        print(path, exc.strerror)\n")

    def job(sandbox, *paths):
        return PythonJob(read.format(paths=list(paths)), sandbox=sandbox, warm=warm, timeout=60)

    control = pool.run(job(False, public, private))
    assert control.output == "public 1\nprivate 1\n", control.text
    first = pool.run(job("strict", public, private))
    assert first.output == f"public 1\n{private} Permission denied\n", first.text
    replacement = os.path.join(etc_dir, ".public.new")
    with open(replacement, "w") as f:
        f.write("public 2\n")
    os.chmod(replacement, 0o644)
    os.rename(replacement, public)
    assert pool.run(job("strict", public)).output == "public 2\n"
    named = pool.run(job(Sandbox(read=[private]), public, private))
    assert named.output == "public 2\nprivate 1\n", named.text
    # Red team, round 2: a root-only file made, or a file made root-only,
    # in a directory where nothing was hidden, was readable until the
    # layer was next built (a minute, or a change in another directory).
    later, made = os.path.join(etc_dir, "plain", "later"), os.path.join(etc_dir, "plain", "made")
    assert pool.run(job("strict", later)).output == "plain/later 1\n"
    with open(made, "w") as f:
        f.write("made\n")
    os.chmod(made, 0o600)
    os.chmod(later, 0o600)
    assert pool.run(job("strict", made, later)).output == f"{made} Permission denied\n{later} Permission denied\n"
    assert pool.run(job(False, made, later)).output == "made\nplain/later 1\n"  # the control


@pytest.mark.parametrize("kind", ["shell", "cold", "warm"])
def test_what_etc_hides_stays_hidden_from_a_job_running_while_etc_changes(pool, etc_dir, kind):
    """Red team: the view covered each root-only file beneath /etc with a
    mount on its name, and replacing the file by a rename -- as passwd and
    useradd replace /etc/shadow -- takes such a mount away in every
    namespace: a root job running meanwhile read the new file. A root-only
    file made meanwhile was readable too."""
    private, made, go = (os.path.join(etc_dir, name) for name in ("private", "made", "go"))
    show = "2>&1 | sed 's/^cat: //'"
    script = (f"cat {private} {show}; echo ready; "
              f"for i in $(seq 600); do [ -e {go} ] && break; sleep 0.05; done; cat {private} {made} {show}")
    if kind == "shell":
        job = ShellJob(script, sandbox="strict", timeout=60)
    else:
        job = PythonJob(f"import subprocess\nsubprocess.run({script!r}, shell=True)\n", sandbox="strict",
                        warm=kind == "warm", timeout=60)
    stream = pool.stream(job)
    seen = ""
    for event in stream:
        seen += event.get("text", "")
        if "ready" in seen:
            break
    for path, text in ((private + ".new", "private 2\n"), (made, "made\n")):
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o600)
    os.rename(private + ".new", private)
    open(go, "w").close()
    events, result = collect(stream)
    assert result.output == (f"{private}: Permission denied\nready\n"
                             f"{private}: Permission denied\n{made}: Permission denied\n"), result.text


def test_naming_a_file_in_a_hidden_directory_gives_that_file_alone(pool, etc_dir):
    """Red team: naming one file of a root-only directory beneath /etc took
    the directory's cover off, and gave its other files too."""
    keys = os.path.join(etc_dir, "keys")
    os.mkdir(keys, 0o700)
    for name in ("a.pem", "b.key"):
        with open(os.path.join(keys, name), "w") as f:
            f.write(f"{name} secret\n")
    with ExecPool(workers=1) as fresh:  # a template built since the directory was made
        named = fresh.run(ShellJob(f"cat {keys}/a.pem; ls {keys}; cat {keys}/b.key",
                                   sandbox=Sandbox(read=[os.path.join(keys, "a.pem")])))
    assert named.output.startswith(f"a.pem secret\na.pem\ncat: {keys}/b.key: No such file or directory"), named.text


def test_an_interpreter_named_through_a_linked_directory_opens_only_its_own_prefix(tmp_path):
    """Red team: ``python="/bin/python3"`` on a merged-/usr system made the
    prefix ``/`` (its ``lib`` is ``/usr/lib``, which holds ``python3.11``),
    and every job could read the whole machine. The same shape here: a
    ``bin`` linked to the real interpreter's, beside a ``lib/python3.11``."""
    real = os.path.realpath(sys.executable)
    fake = tmp_path / "fake"
    (fake / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}").mkdir(parents=True)
    (fake / "bin").symlink_to(os.path.dirname(real))
    secret = fake / "secret"
    secret.write_text("s3cret\n")
    with ExecPool(workers=1, sandbox="strict", python=str(fake / "bin" / os.path.basename(real))) as linked:
        assert "No such file or directory" in linked.run(ShellJob(f"cat {secret}")).output
        assert linked.run(PythonJob("import json\nprint(json.dumps('runs'))")).output == '"runs"\n'
        assert linked.run(PythonJob(f"print(open({str(secret)!r}).read())", sandbox=False)).output == "s3cret\n\n"


def test_an_interpreter_whose_prefix_holds_a_home_is_refused_clearly(tmp_path, monkeypatch):
    from execpool.sandbox import rulesets

    home = tmp_path / "home"
    (home / "bin").mkdir(parents=True)
    (home / "lib" / "python3.11").mkdir(parents=True)
    (home / "bin" / "python").write_text("")  # never run: its prefix is what matters
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (tmp_path / "venv" / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    monkeypatch.setenv("HOME", str(home))
    too_wide = sandbox_kernel.too_wide
    assert too_wide(str(home)) and too_wide(str(tmp_path)) and too_wide("/")
    assert not sandbox_kernel.too_wide(str(home / "lib"))
    with pytest.raises(OSError, match="holds home directories"):
        rulesets.python_dirs(str(home / "bin" / "python"))  # a home that looks like a prefix
    assert str(tmp_path / "venv") in rulesets.python_dirs(str(tmp_path / "venv" / "bin" / "python"))


@pytest.fixture
def outside_tmp():
    """A directory of this test's own outside /tmp (each job's /tmp is its
    own, so a caller's path there never needs the template's directories):
    beside the package, whose directory the view's template holds -- or,
    for a checkout beneath /tmp, in /srv."""
    base = REPO if not REPO.startswith("/tmp/") else "/srv"
    if not os.access(base, os.W_OK):
        pytest.skip(f"needs to write {base}")
    path = tempfile.mkdtemp(prefix="execpool-test-view-", dir=base)
    try:
        yield path
    finally:
        shutil.rmtree(path)


def test_a_callers_paths_go_where_they_are_and_name_nothing_for_other_jobs(pool, outside_tmp):
    """Red team: the directories the template made for callers' paths stayed
    in it, so every later job listed other tenants' session names. Each
    job's paths now go on a tmpfs of its own; paths nested in one another,
    a file, and a cwd beneath /var/tmp (the job's /tmp) all land."""
    alice = os.path.join(outside_tmp, "tenant-alice-" + secrets.token_hex(4), "session")
    shared = os.path.join(outside_tmp, "tenant-alice-data")
    os.makedirs(alice)
    os.makedirs(shared)
    with open(os.path.join(shared, "notes.txt"), "w") as f:
        f.write("shared notes\n")
    ran = pool.run(ShellJob(f"pwd; cat {shared}/notes.txt; echo out > here; ls {outside_tmp}; python3 -c 'print(42)'",
                            cwd=alice, sandbox=Sandbox(read=[os.path.join(shared, "notes.txt")])))
    assert ran.status is Status.OK, ran.text
    # The interpreter beside them, which the template binds, is there again.
    listed = "\n".join(sorted([os.path.basename(os.path.dirname(alice)), "tenant-alice-data"]))
    assert ran.output == f"{alice}\nshared notes\n{listed}\n42\n"
    assert open(os.path.join(alice, "here")).read() == "out\n"
    parent = os.path.dirname(outside_tmp)
    later = pool.run(PythonJob(f"import os\nprint(sorted(os.listdir({parent!r})), os.path.exists({outside_tmp!r}))",
                               sandbox="strict"))
    assert later.status is Status.OK, later.text
    assert os.path.basename(outside_tmp) not in later.output and later.output.endswith(" False\n"), later.output
    var_tmp = tempfile.mkdtemp(prefix="execpool-test-", dir="/var/tmp")
    try:
        there = pool.run(ShellJob("echo kept > kept; pwd", cwd=var_tmp, sandbox="strict"))
        assert there.status is Status.OK and there.output == f"/tmp/{os.path.basename(var_tmp)}\n", there.text
        assert open(os.path.join(var_tmp, "kept")).read() == "kept\n"
    finally:
        shutil.rmtree(var_tmp)


def test_a_link_in_a_callers_path_is_never_followed(pool, tmp_path):
    """Red team: a job that could write a directory a later job's Sandbox
    names replaced a path there with a link -- to a root-only directory, to
    ``/`` (the machine's root on top of the view's) -- and the later job got
    what it led to. A link anywhere in a path a caller names is refused."""
    session = tmp_path / "session"
    session.mkdir()
    planted = pool.run(ShellJob("rm -rf data; ln -s / data; ln -s /etc etc", cwd=str(session), sandbox="strict"))
    assert planted.status is Status.OK, planted.text
    for sandbox in (Sandbox(read=[str(session / "data")]), Sandbox(write=[str(session / "etc")])):
        refused = pool.run(ShellJob("ls /..; head -c 5 /etc/shadow", cwd=str(session), sandbox=sandbox))
        assert refused.status is Status.INFRA and "will not follow the link" in refused.text, refused.text
    linked = tmp_path / "linked"
    linked.symlink_to(session)
    refused = pool.run(ShellJob("pwd", cwd=str(linked), sandbox="strict"))
    assert refused.status is Status.INFRA and repr(str(session)) in refused.text, refused.text


def test_the_pools_directories_and_what_only_root_may_read_are_never_given_whole(pool):
    """Red team: ``cwd="/tmp"`` mounted the machine's /tmp -- every worker's
    jobs directory -- and naming an ancestor of what the view hides beneath
    /etc (``Sandbox(write=["/etc"])``, ``cwd="/etc"``) mounted it uncovered."""
    for job in (ShellJob("ls", cwd="/tmp", sandbox="strict"), ShellJob("ls", cwd="/", sandbox="strict"),
                ShellJob("ls", cwd="/etc", sandbox="strict"), ShellJob("ls", sandbox=Sandbox(write=["/etc"]))):
        refused = pool.run(job)
        assert refused.status is Status.INFRA and "the sandbox will not give a job" in refused.text, refused.text
    # Reading /etc asks for nothing the view lacks: what it hides stays hidden.
    read = pool.run(ShellJob("head -c 5 /etc/shadow; head -c 5 /etc/passwd", sandbox=Sandbox(read=["/etc"])))
    assert read.output.startswith("head: cannot open '/etc/shadow'") and read.output.endswith("root:"), read.output


@pytest.mark.skipif(os.getuid() != 0, reason="needs root, to make a shared mount")
def test_a_jobs_mounts_never_reach_the_machine_through_shared_propagation(pool, outside_tmp):
    """Red team: where the machine's mounts are shared (systemd's default),
    a job's copy of its cwd shared their propagation, and attaching a path
    beneath it copied the mount back onto the machine -- doubling with each
    job, and leaving the caller's directory read-only."""
    data = os.path.join(outside_tmp, "session", "data")
    os.makedirs(data)
    subprocess.run(["mount", "--bind", outside_tmp, outside_tmp], check=True)
    try:
        subprocess.run(["mount", "--make-shared", outside_tmp], check=True)
        session = os.path.dirname(data)
        for _ in range(3):
            ran = pool.run(ShellJob("ls data; echo ok", cwd=session, sandbox=Sandbox(read=[data])))
            assert ran.output == "ok\n", ran.text
        mounted = [mount for mount in _mount_points() if mount.startswith(outside_tmp + "/")]
        assert mounted == [], mounted
        with open(os.path.join(data, "written"), "w") as f:  # the caller's directory is as it was
            f.write("x")
    finally:
        subprocess.run(["umount", "-R", outside_tmp], check=False)


def _mount_points() -> list:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f]


def test_a_sandbox_path_that_cannot_be_opened_fails_the_job_clearly(pool, tmp_path):
    missing = str(tmp_path / "missing")
    result = pool.run(ShellJob(f"echo ran > {tmp_path}/ran", sandbox=Sandbox(read=[missing])))
    assert result.status is Status.INFRA
    assert result.text.startswith("Execution error: cannot start the tool: ")
    assert repr(missing) in result.text and "No such file or directory" in result.text
    assert not (tmp_path / "ran").exists()
    assert pool.run(ShellJob("echo fine", sandbox="strict")).text == "fine\n"


@pytest.mark.slow
def test_a_jobs_sandbox_overrides_its_pools(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    read = f"cat {secret}"
    with ExecPool(workers=1, sandbox="strict") as strict_pool:
        assert "No such file or directory" in strict_pool.run(ShellJob(read)).output
        assert strict_pool.run(ShellJob(read, sandbox=False)).output == "s3cret\n"
        widened = strict_pool.run(ShellJob(read, sandbox=Sandbox(read=[str(tmp_path)])))
        assert widened.output == "s3cret\n"
    with ExecPool(workers=1) as open_pool:
        assert open_pool.run(ShellJob(read)).output == "s3cret\n"
        assert "No such file or directory" in open_pool.run(PythonJob(f"print(open({str(secret)!r}).read())",
                                                              sandbox="strict", warm=True)).output


#: Tries TCP to and on the ports given as arguments; prints what each gave.
TCP_PROBE = textwrap.dedent("""
    import socket, sys
    for port in map(int, sys.argv[1:]):
        s = socket.socket()
        s.settimeout(5)
        print("connect", port, "ok" if s.connect_ex(("127.0.0.1", port)) == 0 else "refused")
        s.close()
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", 0))
        print("bind ok")
    except OSError as exc:
        print("bind", exc.strerror)
""")


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_tcp_ports_can_be_restricted_to_those_listed(pool, tmp_path, warm):
    import socket

    servers = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    try:
        allowed, other = (server.getsockname()[1] for server in servers)
        script = tmp_path / "probe.py"
        script.write_text(TCP_PROBE)
        code = f"import sys\nsys.argv[1:] = ['{allowed}', '{other}']\nexec(open({str(script)!r}).read())"

        def run(sandbox):
            return pool.run(PythonJob(code, sandbox=sandbox, warm=warm, timeout=30)).output

        read = [str(tmp_path)]
        assert run(Sandbox(read=read)) == f"connect {allowed} ok\nconnect {other} ok\nbind ok\n"  # the control
        assert run(Sandbox(read=read, connect=[allowed], bind=[])) == (
            f"connect {allowed} ok\nconnect {other} refused\nbind Permission denied\n")
        assert run(Sandbox(read=read, connect=(), bind=[0])) == (
            f"connect {allowed} refused\nconnect {other} refused\nbind ok\n")
    finally:
        for server in servers:
            server.close()


@pytest.mark.slow
def test_a_sandboxed_tree_is_still_killed_whole_at_its_timeout(pool):
    result = pool.run(ShellJob(hostile.FORK_TREE, sandbox="strict", timeout=1))
    assert result.status is Status.TIMEOUT
    pids = pids_in(result.output)
    assert len(pids) == 9 and all_dead(pids)


def test_sandbox_values_are_checked():
    with pytest.raises(ValueError, match="'strict'"):
        ShellJob("true", sandbox="lax")
    with pytest.raises(TypeError, match="sandbox"):
        ShellJob("true", sandbox=True)
    with pytest.raises(TypeError, match="list of paths"):
        Sandbox(read="/data")
    with pytest.raises(TypeError):
        Sandbox(write=[3])
    with pytest.raises(ValueError, match="NUL"):
        Sandbox(read=["/a\0b"])
    with pytest.raises(ValueError, match="empty"):
        Sandbox(write=[""])
    with pytest.raises(TypeError, match="sandbox"):
        ExecPool(workers=1, sandbox=False)
    with pytest.raises(ValueError, match="port"):
        Sandbox(connect=[70000])
    with pytest.raises(TypeError, match="ports"):
        Sandbox(bind=443)
    assert Sandbox(connect=[443, 80, 443]).connect == (80, 443) and Sandbox().connect is None
    assert Sandbox(read=["rel"]).read == (os.path.abspath("rel"),)
    assert ShellJob("true", sandbox="strict").sandbox == Sandbox()
    assert ShellJob("true").sandbox is None and ShellJob("true", sandbox=False).sandbox is False
    with pytest.raises(TypeError, match="read_only_view"):
        Sandbox(read_only_view="yes")


def test_sandbox_support_reports_what_this_kernel_offers():
    support = sandbox_support()
    assert support.available and support.missing is None
    assert support.landlock_abi >= MIN_LANDLOCK_ABI and support.seccomp
    assert support.read_only_view and support.view_missing is None


def _refusing(numbers: str, errno: int) -> str:
    """Code that makes the process running it -- and its workers, tools and
    probes, which inherit the filter -- see one system call fail with
    ``errno``: ``numbers`` maps each machine to that call's number."""
    return textwrap.dedent("""
    import ctypes, json, platform, struct, sys
    libc = ctypes.CDLL(None, use_errno=True)
    arch = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}[platform.machine()]
    number = %s[platform.machine()]
    op = lambda code, k, jt=0, jf=0: struct.pack("=HBBI", code, jt, jf, k)
    program = b"".join([op(0x20, 4), op(0x15, arch, jt=1), op(0x06, 0x7FFF0000), op(0x20, 0),
                        op(0x15, number, jf=1), op(0x06, 0x00050000 | %d), op(0x06, 0x7FFF0000)])
    buffer = ctypes.create_string_buffer(program, len(program))
    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    fprog = Fprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p).value)
    assert libc.prctl(38, 1, 0, 0, 0) == 0 and libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0
    """) % (numbers, errno)


#: Runs a pool in a process whose kernel seems to lack Landlock:
#: landlock_create_ruleset fails with ENOSYS, as on a kernel built without it.
NO_LANDLOCK_FILTER = _refusing('{"x86_64": 444, "aarch64": 444}', 38)
WITHOUT_LANDLOCK = NO_LANDLOCK_FILTER + textwrap.dedent("""
    from execpool import ExecPool, PythonJob, ShellJob, sandbox_support
    marker = sys.argv[1]
    with ExecPool(workers=1) as pool:
        report = {"support": sandbox_support().missing,
                  "strict": pool.run(ShellJob("echo ran > " + marker, sandbox="strict")).text,
                  "warm": pool.run(PythonJob("open(%r, 'w')" % marker, sandbox="strict", warm=True)).text,
                  "plain": pool.run(ShellJob("echo plain")).text}
    print(json.dumps(report))
""")


def test_where_the_kernel_lacks_landlock_a_sandboxed_job_fails_and_never_runs(tmp_path):
    marker = tmp_path / "ran"
    done = subprocess.run([sys.executable, "-c", WITHOUT_LANDLOCK, str(marker)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["support"].startswith("the sandbox needs Landlock")
    for kind in ("strict", "warm"):
        assert report[kind] == f"Execution error: cannot start the tool: {report['support']}", report
    assert report["plain"] == "plain\n"
    assert not marker.exists()


#: Runs a pool where no namespace may be made (unshare fails with EPERM, as
#: in a container that forbids them): the read-only view is missing.
WITHOUT_NAMESPACES = _refusing('{"x86_64": 272, "aarch64": 97}', 1) + textwrap.dedent("""
    from execpool import ExecPool, Sandbox, ShellJob, sandbox_support
    marker, secret = sys.argv[1], sys.argv[2]
    support = sandbox_support()
    with ExecPool(workers=1) as pool:
        report = {"missing": support.missing, "view_missing": support.view_missing,
                  "view": support.read_only_view,
                  "strict": pool.run(ShellJob("echo ran > " + marker, sandbox="strict")).text,
                  "without_view": pool.run(ShellJob("echo ran > ran; cat " + secret,
                                                    sandbox=Sandbox(read_only_view=False))).text}
    print(json.dumps(report))
""")


@pytest.mark.slow
def test_where_namespaces_are_refused_the_view_is_missing_and_can_be_declined(tmp_path):
    marker, secret = tmp_path / "ran", tmp_path / "secret"
    secret.write_text("s3cret\n")
    done = subprocess.run([sys.executable, "-c", WITHOUT_NAMESPACES, str(marker), str(secret)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["view"] is False and report["missing"] == report["view_missing"]
    assert report["missing"].startswith("the sandbox's read-only view needs")
    assert "Sandbox(read_only_view=False)" in report["missing"]
    assert report["strict"] == f"Execution error: cannot start the tool: {report['missing']}", report
    assert not marker.exists()
    assert report["without_view"].endswith("Permission denied\n"), report  # Landlock still holds


#: The same, where inotify is refused (a user out of instances): every job
#: builds the layer anew.
WITHOUT_INOTIFY = _refusing('{"x86_64": 294, "aarch64": 26}', 24) + textwrap.dedent("""
    import os
    from execpool import ExecPool, PythonJob
    public, made = sys.argv[1], sys.argv[2]
    read = "import sys\\nfor p in sys.argv[1:] or %r:\\n    try: print(open(p).read(), end='')\\n    except OSError as e: print(e.strerror)"
    with ExecPool(workers=1, sandbox="strict") as pool:
        before = pool.run(PythonJob(read % [public])).output
        with open(made, "w") as f:
            f.write("made")
        os.chmod(made, 0o600)
        after = pool.run(PythonJob(read % [public, made])).output
    print(json.dumps([before, after]))
""")


@pytest.mark.slow
def test_without_inotify_every_job_builds_the_layer_anew(etc_dir):
    public, made = os.path.join(etc_dir, "plain", "later"), os.path.join(etc_dir, "plain", "made")
    done = subprocess.run([sys.executable, "-c", WITHOUT_INOTIFY, public, made], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == ["plain/later 1\n", "plain/later 1\nPermission denied\n"]
    assert "inotify cannot watch /etc here" in done.stderr


def test_a_sandboxed_job_whose_rulesets_are_gone_is_never_started():
    """A warm job requeued after its spare died keeps its rulesets until it
    ends; were they gone, the job would fail rather than start unconfined."""
    import dataclasses

    from execpool.shared import worker_wire
    from execpool.shared.jobs import Limits
    from execpool.worker.running_job import RunningJob

    start = worker_wire.Start(job_id=1, argv_kind="python", source="pass", cwd=None, env={}, timeout=None,
                          limits=Limits(), live_cap=None, max_output_chars=10, keep_background=False,
                          python=sys.executable, stdin=None, warm=True, network=True, sandbox=Sandbox())
    with pytest.raises(OSError, match="not started unconfined"):
        RunningJob(start, "marker").confinement()
    assert RunningJob(dataclasses.replace(start, sandbox=None), "marker").confinement() == ()


def test_a_forged_sandbox_in_a_start_message_is_refused():
    """The channel checks a Sandbox's fields like any other's."""
    import pickle

    from execpool.shared import worker_wire
    from execpool.shared.jobs import Limits

    start = worker_wire.Start(job_id=1, argv_kind="shell", source="true", cwd=None, env={}, timeout=None,
                          limits=Limits(), live_cap=None, max_output_chars=10, keep_background=False,
                          python=sys.executable, stdin=None, warm=False, network=True, sandbox=Sandbox())
    object.__setattr__(start.sandbox, "read", ["/not/a/tuple"])
    with pytest.raises(worker_wire.ChannelError, match="sandbox"):
        worker_wire.decode(pickle.dumps(start))


def test_execpool_serve_will_not_start_without_the_sandbox_unless_told(tmp_path):
    serve = NO_LANDLOCK_FILTER + textwrap.dedent("""
        import runpy
        sys.argv = ["execpool", "serve", "--port", "0"] + sys.argv[1:]
        runpy.run_module("execpool", run_name="__main__")
    """)
    env = {**os.environ, "PYTHONPATH": REPO}
    refused = subprocess.run([sys.executable, "-c", serve], capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode == 2
    assert "the sandbox needs Landlock" in refused.stderr and "--sandbox off" in refused.stderr, refused.stderr


@pytest.mark.slow
@pytest.mark.parametrize("flags", [(), ("--sandbox", "off")], ids=["default", "off"])
def test_execpool_serve_runs_every_job_in_the_sandbox_by_default(tmp_path, flags):
    from tests.support.servers import Server

    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    server = Server("--workers", "1", *flags)
    try:
        body = {"shell": f"cat {secret}; tr a-z A-Z < in.txt > out.txt",
                "files": {"in.txt": base64.b64encode(b"hello").decode()}, "fetch_files": ["out.txt"]}
        record = server.client.post("/v1/run", json=body).json()
        # Files into and out of the request's directory work either way.
        assert base64.b64decode(record["files"]["out.txt"]) == b"HELLO", record
        if flags:
            assert record["output"] == "s3cret\n", record  # the control
        else:
            assert "No such file or directory" in record["output"] and "s3cret" not in record["output"], record
    finally:
        assert server.stop() == 0


def test_the_tool_layer_runs_model_code_in_the_strict_sandbox(tmp_path, monkeypatch):
    monkeypatch.setenv(tool_layer.SANDBOX_ROOT_ENV, str(tmp_path / "sessions"))
    monkeypatch.delenv(tool_layer.TOOL_SANDBOX_ENV, raising=False)
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    read_secret = f"print(open({str(secret)!r}).read(), end='')"
    with ExecPool(workers=1) as pool:
        refused = tool_layer.python_exec(read_secret, pool=pool, session_id="s")
        assert "FileNotFoundError" in refused and "s3cret" not in refused, refused
        assert "No such file or directory" in tool_layer.bash_exec(f"cat {secret}", pool=pool, session_id="s")
        # The session's directory is writable, and /mnt/data still lands in it.
        saved = tool_layer.python_exec("open('/mnt/data/out.txt', 'w').write('kept')\nprint(open('out.txt').read())",
                                       pool=pool, session_id="s")
        assert saved.startswith("[execpool] /mnt/data does not exist in this sandbox") and saved.endswith("kept\n")
        assert tool_layer.bash_exec("cat out.txt", pool=pool, session_id="s") == "kept"
        monkeypatch.setenv(tool_layer.TOOL_SANDBOX_ENV, "off")
        assert tool_layer.python_exec(read_secret, pool=pool, session_id="s") == "s3cret\n"  # the control


#: Where execpool.tool._spawn is not built: the rulesets through ctypes
#: (build_ruleset) and entered through ctypes (enter), in a fresh process.
PURE_PYTHON = textwrap.dedent("""
    import os, socket, sys, tempfile
    from execpool.worker import space
    from execpool.sandbox.rulesets import Confiner
    from execpool.sandbox.view import Views
    from execpool.sandbox.enter import enter
    from execpool.shared.kernel.sandbox import Sandbox
    secret, own, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    confiner, sandbox, views = Confiner(), Sandbox(connect=()), Views(tempfile.mkdtemp())
    template = views.current(confiner.hidden())
    spaced = space.make(1 << 20, template.user_fd, template.mnt_fd if template.user_fd >= 0 else -1)
    view = views.plan(spaced.fd, -1, own, (), (), sys.executable, confiner.hidden())
    rulesets = confiner.rulesets(sys.executable, sandbox, (*spaced.handles(), own), views.current())
    print("layers", len(rulesets))
    enter(rulesets, view.arguments())
    open("written", "w").write("ok")
    open("/tmp/own", "w").write("ok")
    for name, attempt in (("read", lambda: open(secret).read()), ("chmod", lambda: os.chmod("/", 0o755)),
                          ("connect", lambda: socket.create_connection(("127.0.0.1", port), timeout=5)),
                          ("signal", lambda: os.kill(os.getppid(), 0))):
        try:
            attempt()
            print(name, "ESCAPED")
        except OSError as exc:
            print(name, exc.strerror)
""")


def test_the_pure_python_path_confines_as_the_extension_does(tmp_path):
    import socket

    secret, own = tmp_path / "secret", tmp_path / "own"
    secret.write_text("s3cret\n")
    own.mkdir()
    with socket.create_server(("127.0.0.1", 0)) as server:
        done = subprocess.run([sys.executable, "-c", PURE_PYTHON, str(secret), str(own),
                               str(server.getsockname()[1])], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == ("layers 1\nread No such file or directory\nchmod Read-only file system\n"
                           "connect Permission denied\nsignal Operation not permitted\n")
    assert (own / "written").read_text() == "ok"


@pytest.mark.slow
def test_the_command_line_runs_jobs_in_the_sandbox_when_asked(tmp_path):
    secret, jobs = tmp_path / "secret", tmp_path / "jobs.jsonl"
    secret.write_text("s3cret\n")
    jobs.write_text(json.dumps({"id": 1, "shell": f"cat {secret}"}) + "\n")
    command = [sys.executable, "-m", "execpool"]
    env = {**os.environ, "PYTHONPATH": REPO}
    for sandboxed in (True, False):
        flag = ["--sandbox"] if sandboxed else []
        run = subprocess.run([*command, "run", *flag, "--shell", f"cat {secret}"], capture_output=True, text=True,
                             timeout=60, env=env)
        batch = subprocess.run([*command, "batch", str(jobs), "-o", "-", "--no-progress", *flag],
                               capture_output=True, text=True, timeout=60, env=env)
        record = json.loads(batch.stdout.splitlines()[0])
        if sandboxed:
            assert run.returncode == 1 and "No such file or directory" in run.stdout, run
            assert record["status"] == "error" and "No such file or directory" in record["output"], record
        else:  # the control
            assert run.returncode == 0 and run.stdout == "s3cret\n", run
            assert record["output"] == "s3cret\n", record
