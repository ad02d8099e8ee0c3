"""Secrets and isolation: what a tool can learn about, and do to, the process
that runs the pool.

- A secret in the caller's environment is in no tool's environment, in no
  worker's ``/proc/PID/environ`` or ``cmdline``, for cold, warm and shell
  jobs and through the tool layer.
- A tool inherits no file descriptor but its stdin/stdout/stderr, so it
  holds no channel to the supervisor.
- ``ExecPool(non_dumpable=True)``: a tool running as the caller's (non-root)
  user cannot read ``/proc/<caller>/environ``; without the option it can
  (the negative control). As root it always can: root needs no permission.
- A job's network isolation (``network=False``) cuts it off from a server
  listening on the caller's loopback (``tests/worker/test_isolation.py`` checks
  that only ``lo`` is left).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading

import pytest

from execpool import ExecPool, PythonJob, ShellJob
from execpool import tools as tool_layer
from tests.support.helpers import UNPRIVILEGED, unprivileged_python, unprivileged_pythonpath, wait_for

SECRET_VAR = "EXECPOOL_TEST_API_KEY"

#: Everything a Python tool can read about itself and its worker (its parent).
PROBE_PYTHON = r"""
import os
worker = os.getppid()
def show(label, path):
    try:
        print(label, open(path, "rb").read())
    except OSError as exc:  # the sandbox refused it
        print(label, exc)
print("ENV", sorted(os.environ.items()))
show("SELF", "/proc/self/environ")
show("WORKER", "/proc/%d/environ" % worker)
show("CMDLINE", "/proc/%d/cmdline" % worker)
print("CHECKED worker", worker)
"""
PROBE_SHELL = (
    "echo ENV; env; echo SELF; tr '\\0' '\\n' < /proc/self/environ; "
    "echo WORKER; tr '\\0' '\\n' < /proc/$PPID/environ; "
    "echo CMDLINE; tr '\\0' ' ' < /proc/$PPID/cmdline; echo; echo \"CHECKED worker $PPID\""
)


@pytest.fixture
def secret(monkeypatch):
    value = "sk-" + secrets.token_hex(16)
    monkeypatch.setenv(SECRET_VAR, value)
    return value


def _assert_probe_saw_nothing(output: str, secret_value: str, pool: ExecPool) -> None:
    assert "CHECKED worker" in output, output[-500:]
    worker = int(output.split("CHECKED worker ")[1].split()[0])
    assert worker in pool.worker_pids, "the probe read its worker's files, not someone else's"
    seen = output.split("WORKER", 1)[1]
    # Read, or refused by the sandbox the tool layer runs in (whose /proc,
    # on a root server, does not list the worker at all).
    assert any(sign in seen for sign in ("PATH=", "Permission denied", "No such file or directory")), \
        "the worker's environment was not looked at"
    assert secret_value not in output
    assert SECRET_VAR not in output


@pytest.mark.parametrize("kind", ["cold", "warm", "shell", "python_exec", "bash_exec"])
def test_caller_secret_is_invisible_to_tools_and_workers(secret, kind, tmp_path, monkeypatch):
    monkeypatch.setenv(tool_layer.SANDBOX_ROOT_ENV, str(tmp_path))
    with ExecPool(workers=1) as pool:
        if kind == "cold":
            output = pool.run(PythonJob(PROBE_PYTHON)).output
        elif kind == "warm":
            output = pool.run(PythonJob(PROBE_PYTHON, warm=True)).output
        elif kind == "shell":
            output = pool.run(ShellJob(PROBE_SHELL)).output
        elif kind == "python_exec":
            output = tool_layer.python_exec(PROBE_PYTHON, pool=pool, session_id="secrets")
        else:
            output = tool_layer.bash_exec(PROBE_SHELL, pool=pool, session_id="secrets")
        _assert_probe_saw_nothing(output, secret, pool)


def test_secret_set_after_the_pool_started_stays_invisible(monkeypatch):
    with ExecPool(workers=1) as pool:
        late = "late-" + secrets.token_hex(8)
        monkeypatch.setenv(SECRET_VAR, late)
        _assert_probe_saw_nothing(pool.run(PythonJob(PROBE_PYTHON)).output, late, pool)
        _assert_probe_saw_nothing(pool.run(ShellJob(PROBE_SHELL)).output, late, pool)


FDS_PYTHON = "import os\nprint(sorted(int(fd) for fd in os.listdir('/proc/self/fd')))"


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_python_tool_inherits_no_descriptor_but_stdio(pool, warm):
    # listdir's own descriptor is the one more entry.
    fds = json.loads(pool.run(PythonJob(FDS_PYTHON, warm=warm)).output)
    assert fds[:3] == [0, 1, 2] and len(fds) == 4, fds


def test_shell_tool_inherits_no_descriptor_but_stdio(pool):
    # ls itself lists the directory through one more descriptor.
    listed = pool.run(ShellJob("ls /proc/self/fd")).output.split()
    assert sorted(map(int, listed))[:3] == [0, 1, 2] and len(listed) == 4, listed


# --- network isolation ---------------------------------------------------------------------------

CONNECT_PYTHON = textwrap.dedent("""
    import socket, sys
    s = socket.socket()
    s.settimeout(3)
    code = s.connect_ex(("127.0.0.1", int(sys.argv[1]) if len(sys.argv) > 1 else PORT))
    print("connected" if code == 0 else "refused")
""")


@pytest.fixture
def listener():
    """A server on the caller's loopback; counts the connections it accepts."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.2)
    accepted = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            accepted.append(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    server.close()


@pytest.mark.parametrize("kind", ["cold", "warm", "shell-grandchild"])
def test_network_false_cannot_reach_the_callers_loopback(pool, listener, kind):
    port, accepted = listener
    code = CONNECT_PYTHON.replace("PORT", str(port))

    def job(network):
        if kind == "shell-grandchild":  # the namespace is inherited down the tree
            return ShellJob(f"{sys.executable} -c '{code}'", network=network, timeout=20)
        return PythonJob(code, warm=kind == "warm", network=network, timeout=20)

    isolated = pool.run(job(False))
    if isolated.error and "Operation not permitted" in isolated.error:
        pytest.skip("this user may not create network namespaces")
    assert isolated.text == "refused\n"
    assert not accepted
    assert pool.run(job(True)).text == "connected\n"  # the control: the server is reachable
    # The kernel completed the handshake; the server's thread may accept it a little later.
    assert wait_for(lambda: len(accepted) == 1, 5.0)
    assert len(accepted) == 1


# --- the caller, seen from a tool running as the same unprivileged user --------------------------


#: The pool's owner: started as ``nobody``, with a secret in its environment.
OWNER = textwrap.dedent("""
    import json, os, sys
    from execpool import ExecPool, PythonJob, ShellJob
    non_dumpable = sys.argv[1] == "1"
    # The tool's parent is its worker, the worker's the pool's lifeline, the lifeline's the caller.
    read_caller = ("caller=$(ps -o ppid= -p $(ps -o ppid= -p $PPID) | tr -d ' '); "
                   "if [ \\"$caller\\" = %d ]; then tr '\\\\0' '\\\\n' < /proc/$caller/environ; "
                   "else echo wrong caller $caller; fi" % os.getpid())
    with ExecPool(workers=1, non_dumpable=non_dumpable, python=sys.executable) as pool:
        report = {"uid": os.getuid(), "read_caller": pool.run(ShellJob(read_caller)).text}
        if len(sys.argv) > 2:
            report["inject"] = pool.run(PythonJob(sys.argv[2])).text
    print(json.dumps(report))
""")


@pytest.fixture(scope="module")
def unprivileged():
    """An interpreter ``nobody`` can run, and a world-readable copy of
    execpool and what it needs on its path (the workers get only the
    package's parent directory on theirs)."""
    if os.getuid() != 0:
        pytest.skip("needs root to start an owner process as another user")
    python = unprivileged_python()
    if python is None:
        pytest.skip("no Python interpreter the unprivileged user may run")
    base = tempfile.mkdtemp(prefix="execpool-secrets-")
    os.chmod(base, 0o755)
    yield python, unprivileged_pythonpath(base)
    shutil.rmtree(base)


def _run_owner(unprivileged, secret_value: str, non_dumpable: bool, *extra: str) -> dict:
    python, farm = unprivileged
    done = subprocess.run(
        [python, "-c", OWNER, "1" if non_dumpable else "0", *extra], user=UNPRIVILEGED, group=UNPRIVILEGED,
        extra_groups=[], env={"PATH": "/usr/bin:/bin", "PYTHONPATH": farm, SECRET_VAR: secret_value},
        capture_output=True, text=True, cwd="/", timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["uid"] == UNPRIVILEGED
    return report


@pytest.mark.nobody
def test_without_non_dumpable_a_same_user_tool_reads_the_callers_secret(unprivileged):
    """The negative control: the probe works, and the option is needed."""
    value = "sk-" + secrets.token_hex(16)
    report = _run_owner(unprivileged, value, non_dumpable=False)
    assert f"{SECRET_VAR}={value}" in report["read_caller"]


@pytest.mark.nobody
def test_non_dumpable_caller_hides_its_environment_from_same_user_tools(unprivileged):
    value = "sk-" + secrets.token_hex(16)
    report = _run_owner(unprivileged, value, non_dumpable=True)
    assert value not in report["read_caller"]
    assert "Permission denied" in report["read_caller"], report


#: A tool that writes a forged message into its worker's pipe to the
#: supervisor, reached through /proc/<worker>/fd (same user, and the worker is
#: dumpable): the supervisor unpickles it, so the payload runs in the caller.
INJECT = textwrap.dedent("""
    import os, pickle, struct
    worker = os.getppid()
    argv = open("/proc/%d/cmdline" % worker, "rb").read().split(b"\\0")
    to_supervisor = int(argv[argv.index(b"execpool.worker") + 2])
    class Payload:
        def __reduce__(self):
            return (os.system, ("echo caller-was-here > PROOF",))
    data = pickle.dumps(Payload())
    try:
        fd = os.open("/proc/%d/fd/%d" % (worker, to_supervisor), os.O_WRONLY)
    except OSError as exc:
        print("blocked:", exc.strerror)
    else:
        os.write(fd, struct.pack("!i", len(data)) + data)
        print("sent")
""")


@pytest.mark.nobody
def test_non_dumpable_caller_cannot_be_made_to_run_a_tools_code(unprivileged):
    """``non_dumpable`` protects the caller from same-user tools; a worker's
    pipe to the supervisor must not be a way around it."""
    proof_dir = tempfile.mkdtemp(prefix="execpool-inject-")
    os.chmod(proof_dir, 0o777)
    proof = os.path.join(proof_dir, "proof")
    try:
        report = _run_owner(unprivileged, "unused", True, INJECT.replace("PROOF", proof))
        assert not os.path.exists(proof), (
            f"a tool made the caller run its code (the tool said {report['inject']!r})")
    finally:
        if os.path.exists(proof):
            os.unlink(proof)
        os.rmdir(proof_dir)


#: A batch job that opens every descriptor of the batch's own process (its
#: worker's parent) through /proc and appends a forged record to its OUT.
FORGES_A_RECORD = r"""
import os
with open(f"/proc/{os.getppid()}/stat") as f:
    batch = int(f.read().rpartition(")")[2].split()[1])
forged = 0
try:
    names = os.listdir(f"/proc/{batch}/fd")
except OSError as exc:
    names = []
    print("denied:", exc.strerror)
for name in names:
    try:
        if not os.readlink(f"/proc/{batch}/fd/{name}").endswith(".out.jsonl"):
            continue
        fd = os.open(f"/proc/{batch}/fd/{name}", os.O_WRONLY | os.O_APPEND)
    except OSError as exc:
        print("denied:", exc.strerror)
        continue
    os.write(fd, b'{"id": "victim", "status": "ok", "exit_code": 0, "output": "FORGED"}\n')
    os.close(fd)
    forged += 1
print("forged", forged)
"""


@pytest.mark.slow
@pytest.mark.nobody
def test_a_batch_job_cannot_write_a_record_into_out(unprivileged):
    """``execpool batch`` holds OUT open: a job running as the same user
    wrote a record for another job's id there through /proc, which resume
    would then have trusted. The command's process is non-dumpable."""
    python, farm = unprivileged
    work = tempfile.mkdtemp(prefix="execpool-forge-")
    os.chmod(work, 0o777)
    batch_in = os.path.join(work, "jobs.jsonl")
    try:
        with open(batch_in, "w") as f:
            f.write(json.dumps({"id": "attacker", "python": FORGES_A_RECORD}) + "\n")
            f.write(json.dumps({"id": "victim", "shell": "echo real"}) + "\n")
        os.chmod(batch_in, 0o644)
        done = subprocess.run(
            [python, "-m", "execpool", "batch", batch_in, "--workers", "1", "--max-in-flight", "1",
             "--no-progress"], user=UNPRIVILEGED, group=UNPRIVILEGED, extra_groups=[],
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": farm}, capture_output=True, text=True, cwd="/", timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        with open(os.path.join(work, "jobs.out.jsonl")) as f:
            records = [json.loads(line) for line in f]
        assert sorted(record["id"] for record in records) == ["attacker", "victim"], records
        assert "forged 0" in records[0]["output"] or "forged 0" in records[1]["output"], records
        assert next(r for r in records if r["id"] == "victim")["output"] == "real\n"
    finally:
        for name in os.listdir(work):
            os.unlink(os.path.join(work, name))
        os.rmdir(work)
