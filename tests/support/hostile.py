"""Misbehaving tools, in one place, as the code a model might write.

Each is a shell or Python source string; tools that leave processes behind
print their pids (``PIDS a b c``) so a test can check that none survives.
"""

import textwrap

# A background grandchild that keeps the output pipe open after the shell exits.
GRANDCHILD_HOLDS_STDOUT = "(sleep 100; echo never) & echo \"PIDS $!\""

# A background process that does not hold the pipe: the job ends, it must not outlive it.
QUIET_BACKGROUND = "sleep 100 >/dev/null 2>&1 & echo \"PIDS $!\""

def _escaped_daemon(body: str) -> str:
    """A daemon that escapes its process group with setsid and a double
    fork, puts its stdio on /dev/null, announces its pid, then runs
    ``body``."""
    return (
        "import os, sys, time\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        devnull = os.open(os.devnull, os.O_RDWR)\n"
        "        for fd in (0, 1, 2):\n"
        "            os.dup2(devnull, fd)\n"
        "        os.write(w, str(os.getpid()).encode())\n"
        "        os.close(w)\n"
        + textwrap.indent(textwrap.dedent(body).strip() + "\n", " " * 8)
        + "    os._exit(0)\n"
        "os.close(w)\n"
        "print(\"PIDS\", os.read(r, 64).decode(), flush=True)\n"
    )


# A daemon that escapes the process group with setsid and a double fork.
SETSID_DAEMON = _escaped_daemon("time.sleep(100)")

# Moves itself into a new process group (not a new session) and lingers.
NEW_PGID = r"""
import os, time
if os.fork() == 0:
    os.setpgid(0, 0)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1); os.dup2(devnull, 2)
    time.sleep(100)
    os._exit(0)
import sys
print("PIDS", end=" ")
for line in open("/proc/self/task/%d/children" % os.getpid()):
    print(line.strip())
"""

# Ignores SIGTERM and keeps running.
IGNORES_SIGTERM = "trap '' TERM; echo \"PIDS $$\"; while true; do sleep 0.05; done"

# A tree of 3 levels, each spawning 3 sleepers, all printing their pids.
FORK_TREE = r"""
spawn() { sleep 100 & echo "PIDS $!"; }
for i in 1 2 3; do ( for j in 1 2 3; do spawn; done; wait ) & done
wait
"""

# Writes invalid UTF-8, CRLF and lone CR, and a multibyte character split by a flush.
BINARY_GARBAGE = r"""
import os, sys
out = sys.stdout.buffer
out.write(b"ok\r\nlone\rcr\n\xff\xfe bad \xc3")
out.flush()
out.write(b"\xa9 split\n\xe2\x82")
out.flush()
"""

SEGFAULT = "import ctypes; print('before', flush=True); ctypes.string_at(0)"

FLOOD_ONE_LINE_CMD = "head -c {n} /dev/zero | tr '\\0' x"


# --- process storms ------------------------------------------------------------------
# Bounded: a fixed tree, safe without a pids cap. The unbounded bombs further
# down may only run where a pids cap is verified to be in place first.

#: A binary tree of bash subshells 8 levels deep: 511 processes, each
#: announcing itself and then sleeping (``exec``, so a node is one process).
FORK_STORM_BASH = r"""
storm() {
    if [ "$1" -gt 0 ]; then storm $(($1 - 1)) & storm $(($1 - 1)) & fi
    echo "PIDS $BASHPID"
    exec sleep 100
}
storm 8
"""
FORK_STORM_BASH_SIZE = 511

#: The same in Python, 7 levels (255 processes), and slipperier: every second
#: child leaves the session with setsid, others move to a process group of
#: their own, so the group kill alone reaches only part of the tree.
FORK_STORM_PYTHON = r"""
import os, time
def storm(depth):
    for i in range(2):
        if depth == 0:
            break
        if os.fork() == 0:
            if i == 1:
                os.setsid()
            elif depth % 2:
                os.setpgid(0, 0)
            storm(depth - 1)
            return
    os.write(1, b"PIDS %d\n" % os.getpid())   # one write: lines never interleave
    time.sleep(100)
    os._exit(0)
storm(7)
"""
FORK_STORM_PYTHON_SIZE = 255

#: Still forking when the kill comes: every process forks a child every few
#: milliseconds, up to 6 children, children do the same to depth 3
#: (at most 1 + 6 + 36 + 216 = 259 processes), new ones in new sessions.
GROWING_STORM_PYTHON = r"""
import os, time
def grow(depth):
    for _ in range(6 if depth else 0):
        time.sleep(0.003)
        if os.fork() == 0:
            os.setsid()
            os.write(1, b"PIDS %d\n" % os.getpid())
            grow(depth - 1)
            os._exit(0)
    time.sleep(100)
    os._exit(0)
grow(3)
"""

#: Unbounded. Only inside a verified pids cap (see test_hostile.py).
FORK_BOMB_BASH = ":(){ :|:& };:"
FORK_BOMB_PYTHON = r"""
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""


def memory_bomb(limit: int, stubborn: bool = False) -> str:
    """A Python memory bomb that refuses to run unless its own RLIMIT_AS is at
    most ``limit`` (it prints the limit it found first). ``stubborn`` catches
    MemoryError and keeps trying forever, so only a timeout ends it."""
    return rf"""
import resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
print("RLIMIT_AS", soft, flush=True)
if soft == resource.RLIM_INFINITY or soft > {limit}:
    print("no address-space limit: refusing to run the bomb", flush=True)
    sys.exit(3)
hoard = []
while True:
    try:
        hoard.append(bytearray(16 << 20))
    except MemoryError:
        if not {stubborn!r}:
            raise
        hoard.clear()
"""


def disk_fill_python(limit: int) -> str:
    """Writes ./fill until the file-size limit stops it; refuses to run
    without one of at most ``limit`` bytes."""
    return rf"""
import os, resource, sys
soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
print("RLIMIT_FSIZE", soft, flush=True)
if soft == resource.RLIM_INFINITY or soft > {limit}:
    sys.exit(3)
fd = os.open("fill", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
chunk = b"x" * 65536
try:
    while True:
        os.write(fd, chunk)
except OSError as exc:
    print("stopped", exc.errno, os.fstat(fd).st_size, flush=True)
"""


#: ``yes`` into ./fill: killed by SIGXFSZ at the limit (bash reports it);
#: refuses to run when no file-size limit is set.
DISK_FILL_BASH = (
    '[ "$(ulimit -f)" != unlimited ] || { echo "no file-size limit: refusing"; exit 3; }; '
    "yes fill > fill; echo \"rc=$?\""
)

#: Opens files until the open-files limit stops it.
FD_EXHAUSTION_PYTHON = r"""
import os
fds = []
try:
    while True:
        fds.append(os.open(os.devnull, os.O_RDONLY))
except OSError as exc:
    print("stopped", exc.errno, len(fds), flush=True)
"""
FD_EXHAUSTION_BASH = (
    "n=0; while exec {fd}</dev/null 2>/dev/null; do n=$((n+1)); done; echo \"opened $n\""
)


# --- signals ---------------------------------------------------------------------------

#: Traps and ignores every catchable signal (bash cannot trap KILL and STOP),
#: and starts a Python child that ignores and blocks them all (it lets go of
#: stdout after announcing itself). Needs ``PYTHON`` in its environment.
IGNORES_ALL_SIGNALS = r"""
for s in $(seq 1 64); do trap '' $s 2>/dev/null; done
python_ignoring() {
    "$PYTHON" -c '
import os, signal, time
for s in range(1, signal.NSIG):
    try:
        signal.signal(s, signal.SIG_IGN)
    except (OSError, ValueError, RuntimeError):
        pass
signal.pthread_sigmask(signal.SIG_BLOCK, set(range(1, signal.NSIG)) - {signal.SIGKILL, signal.SIGSTOP})
os.write(1, b"PIDS %d\n" % os.getpid())
devnull = os.open(os.devnull, os.O_WRONLY)
os.dup2(devnull, 1)
os.dup2(devnull, 2)
while True:
    time.sleep(0.05)
' &
}
python_ignoring
echo "PIDS $$"
while :; do sleep 0.05; done
"""

#: Same, but the leader exits cleanly at once, leaving the stubborn child.
IGNORES_ALL_SIGNALS_CHILD = (
    IGNORES_ALL_SIGNALS.replace('echo "PIDS $$"\nwhile :; do sleep 0.05; done\n', "sleep 0.3; exit 0\n")
)


def closes_stdout(then_sleep: float, exit_code: int = 7) -> str:
    """Prints its pid, closes stdout and stderr (EOF for the worker), then keeps
    running ``then_sleep`` seconds and exits with ``exit_code``."""
    return rf"""
import os, time
os.write(1, b"PIDS %d\n" % os.getpid())
os.close(1)
os.close(2)
time.sleep({then_sleep})
os._exit({exit_code})
"""


#: A tool that freezes the worker running it, so nothing on that worker --
#: not even this job's own timeout -- runs until someone continues it.
STOPS_ITS_WORKER = "kill -STOP $PPID; sleep 100"
#: A tool that kills the worker running it.
KILLS_ITS_WORKER = "kill -KILL $PPID; sleep 100"


# --- escapes -------------------------------------------------------------------------------

#: Twenty ``setsid`` daemons from subshells that exit at once: every daemon is
#: orphaned and in a session of its own.
DAEMON_SWARM_BASH = r"""
for i in $(seq 20); do ( setsid sleep 100 >/dev/null 2>&1 & echo "PIDS $!" ); done
echo done
"""

#: Ten classic double-fork daemons, each with its stdio on /dev/null.
DAEMON_SWARM_PYTHON = r"""
import os, time
r, w = os.pipe()
for _ in range(10):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            os.write(w, b"%d " % os.getpid())
            time.sleep(100)
        os._exit(0)
    os.wait()
os.close(w)
pids = b""
while len(pids.split()) < 10:  # the daemons keep the pipe open: no EOF
    pids += os.read(r, 4096)
print("PIDS", pids.decode().strip(), flush=True)
"""

#: A daemon that keeps changing its pid: it forks, the parent exits at once,
#: the child takes a new session, for at most 8 s (so it ends by itself if
#: it ever escapes).
PID_HOPPER = r"""
import os, time
if os.fork() == 0:
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    end = time.monotonic() + 8
    while time.monotonic() < end:
        if os.fork():
            os._exit(0)
        os.setsid()
    os._exit(0)
print("hopping", flush=True)
time.sleep(0.2)
"""

#: Two daemons that restart each other: each checks every 2 ms whether the
#: other is alive and forks a replacement if not (for at most 8 s).
MUTUAL_RESPAWN = r"""
import os, time
end = time.monotonic() + 8

def alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False

def guard(other):
    while time.monotonic() < end:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        if not alive(other):
            other = spawn()
        time.sleep(0.002)
    os._exit(0)

def spawn():
    me = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        guard(me)
    return pid

if os.fork() == 0:
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    guard(spawn())
print("guarding", flush=True)
time.sleep(0.3)
"""

#: A chain that grows at its tip: every link takes a new session, forks the
#: next link after 2 ms and stays alive (for at most 5 s), so when the job
#: ends a hundred links exist and the tip is still forking.
FORK_CHAIN = r"""
import os, time
end = time.monotonic() + 5
if os.fork() == 0:
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    while time.monotonic() < end:
        os.setsid()
        time.sleep(0.002)
        if os.fork():
            while time.monotonic() < end:
                time.sleep(0.05)
            os._exit(0)
    os._exit(0)
print("growing", flush=True)
time.sleep(0.3)
"""

#: ``set -m`` turns on job control in a non-interactive shell: every
#: background job gets a process group of its own.
JOB_CONTROL_BACKGROUND = r"""
set -m
for i in 1 2 3 4 5; do sleep 100 >/dev/null 2>&1 & echo "PIDS $!"; done
echo done
"""

#: A child moves to its own process group, forks grandchildren there and
#: exits, so they are orphans in a foreign group.
NEW_PGID_ORPHANS = r"""
import os, time
r, w = os.pipe()
if os.fork() == 0:
    os.setpgid(0, 0)
    for _ in range(5):
        if os.fork() == 0:
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 1); os.dup2(devnull, 2)
            os.write(w, b"%d " % os.getpid())
            time.sleep(100)
            os._exit(0)
    os._exit(0)
os.wait()
os.close(w)
pids = b""
while len(pids.split()) < 5:
    pids += os.read(r, 4096)
print("PIDS", pids.decode().strip(), flush=True)
"""

#: 200 background sleepers, then a clean exit.
MANY_SLEEPERS = r"""
for i in $(seq 200); do sleep 100 >/dev/null 2>&1 & done
echo "PIDS $(jobs -p | tr '\n' ' ')"
"""

#: Background children in new sessions through subprocess (a model's
#: "start a server" idiom), then a clean exit.
POPEN_NEW_SESSIONS = r"""
import subprocess
procs = [subprocess.Popen(["sleep", "100"], start_new_session=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(20)]
print("PIDS", " ".join(str(p.pid) for p in procs))
"""


# --- output --------------------------------------------------------------------------------

def random_bytes(size: int, seed: int) -> str:
    """Writes ``size`` random bytes (rich in \\r, \\n and UTF-8 lead bytes) in
    uneven chunks straight to fd 1."""
    return rf"""
import os, random
rng = random.Random({seed})
alphabet = bytes(range(256)) + b"\r\n\r\r\n\xc3\xe2\x82\xf0\x9f" * 8
data = bytes(rng.choice(alphabet) for _ in range({size}))
view = memoryview(data)
while view:
    n = os.write(1, view[: rng.randint(1, 70000)])
    view = view[n:]
"""


#: Reads standard input in every usual way; stdin is /dev/null, so all end.
STDIN_READERS_SHELL = (
    "readlink /proc/self/fd/0; cat; cat -; while read -r line; do echo \"got $line\"; done; "
    "head -c 10 /dev/stdin; echo end"
)
STDIN_READERS_PYTHON = r"""
import os, sys
print(os.readlink("/proc/self/fd/0"))
print(repr(sys.stdin.read()), repr(sys.stdin.buffer.read()), list(sys.stdin))
try:
    input()
except EOFError:
    print("EOFError")
"""
#: Reads "forever": ``tail -f`` never ends on EOF; only the timeout stops it.
STDIN_FOREVER = "tail -f /dev/stdin"

SEGFAULT_SHELL = "echo before; kill -SEGV $$"
ABORT = "import os; print('before', flush=True); os.abort()"
SEGFAULT_GRANDCHILD = "(kill -SEGV $BASHPID); echo \"child status $?\""


# --- escapes from the sandbox ----------------------------------------------------------------------
# Each prints ESCAPED when it got what it reached for, so the same tool run
# without the sandbox is the test's negative control. ``@NAME@`` markers are
# filled in by tests/support/sandbox_owner.py (the pool's owner, run as root and as
# nobody): secrets outside the job, the owner's abstract socket, System V
# segment and key, another job that runs meanwhile (the victim), cgroup
# mounts. ``root``: the control succeeds only for root (an unprivileged
# user is already refused without a sandbox); ``needs``: what the machine
# must allow for the control to succeed at all, without which the attack
# cannot be shown here and is skipped. Python tools run cold and warm. A
# tool that escaped prints a line that is exactly ESCAPED (a traceback
# quoting the tool's source does not count).

_PY_LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"


def _refused(call: str) -> str:
    return f"print('refused:', {call})"


def _attack(name: str, kind: str, code: str, *, root: bool = False, needs: str = "", **job) -> dict:
    return {"name": name, "kind": kind, "code": code, "root": root, "needs": needs, "job": job}


SANDBOX_ATTACKS = [
    _attack("read_home_secret", "shell", "cat @HOME_SECRET@ && echo ESCAPED"),
    _attack("read_cwd_secret", "python", "secret = open('@CWD_SECRET@').read()\nprint('ESCAPED')"),
    _attack("write_outside", "shell", "echo pwned > @OUTSIDE@/written-@MODE@ && echo ESCAPED"),
    _attack("dotdot", "shell", 'cat "$PWD/../../../../../../../../../..@CWD_SECRET@" && echo ESCAPED'),
    _attack("symlink", "shell", "ln -s @CWD_SECRET@ link && cat link && echo ESCAPED"),
    _attack("hard_link", "shell", "ln @CWD_SECRET@ hard && cat hard && echo ESCAPED"),
    _attack("proc_self_root", "shell", "cat /proc/self/root@CWD_SECRET@ && echo ESCAPED"),
    _attack("child_process", "shell",
            "bash -c 'cat @CWD_SECRET@' && python3 -c 'print(open(\"@HOME_SECRET@\").read())' && echo ESCAPED"),
    _attack("background_child", "shell",
            "(cat @CWD_SECRET@ > got && echo ESCAPED) & wait $!"),
    _attack("rename_out", "shell", "echo x > f && mv f @OUTSIDE@/moved-@MODE@ && echo ESCAPED"),
    _attack("other_job_dir", "shell", "cat @VICTIM_DIR@/victim-secret && echo ESCAPED"),
    _attack("other_job_cwd_link", "shell", "cat /proc/@VICTIM_PID@/cwd/victim-secret && echo ESCAPED"),
    # Each job's /tmp is a tmpfs of its own: no path on the machine names it,
    # and its root is reached only through the victim's /proc/<pid>/root.
    _attack("other_job_tmp", "shell",
            "cat /tmp/victim-tmp-secret && echo ESCAPED; "
            "cat /proc/@VICTIM_PID@/root/tmp/victim-tmp-secret && echo ESCAPED"),
    # /proc/net/unix names every socket in the network namespace with its
    # path; in the job's view that path is its own /tmp, not the victim's.
    _attack("other_job_unix_socket", "python",
            "import socket\n"
            "paths = [l.split()[-1] for l in open('/proc/net/unix') if l.rstrip().endswith('victim.sock')]\n"
            "print('listed', paths)\n"
            "for path in [*paths, *('/proc/@VICTIM_PID@/root' + p for p in paths)]:\n"
            "    s = socket.socket(socket.AF_UNIX)\n    try:\n        s.connect(path)\n        print(path)\n        print('ESCAPED')\n"
            "    except OSError as exc:\n        " + _refused("path, exc.strerror") + "\n"),
    _attack("other_job_environ", "shell", "tr '\\0' '\\n' < /proc/@VICTIM_PID@/environ | grep -q . && echo ESCAPED"),
    _attack("other_job_signal", "shell", "kill -0 @VICTIM_PID@ && echo ESCAPED"),
    _attack("other_job_ptrace", "python", _PY_LIBC + (
        "if libc.ptrace(0x4206, @VICTIM_PID@, None, None) == 0:\n    print('ESCAPED')\n"  # PTRACE_SEIZE
        "else:\n    " + _refused("os.strerror(ctypes.get_errno())"))),
    _attack("signal_worker", "shell", "kill -0 $PPID && echo ESCAPED"),
    _attack("stop_worker", "python",
            "import os, signal\ntry:\n    os.kill(os.getppid(), signal.SIGCONT)\n    print('ESCAPED')\n"
            "except OSError as exc:\n    " + _refused("exc")),
    _attack("signal_init", "shell", "kill -0 1 && echo ESCAPED", root=True),
    _attack("worker_environ", "shell", "cat /proc/$PPID/environ > /dev/null && echo ESCAPED", root=True),
    _attack("worker_mem", "python",
            "import os\ntry:\n    open('/proc/%d/mem' % os.getppid(), 'rb').close()\n    print('ESCAPED')\n"
            "except OSError as exc:\n    " + _refused("exc"), root=True),
    _attack("worker_ptrace", "python", _PY_LIBC + (
        "if libc.ptrace(0x4206, os.getppid(), None, None) == 0:\n    print('ESCAPED')\n"
        "else:\n    " + _refused("os.strerror(ctypes.get_errno())")), root=True),
    _attack("worker_fd", "shell", "readlink /proc/$PPID/fd/0 && cat /proc/$PPID/fd/0 && echo ESCAPED", root=True),
    _attack("setns_worker_net", "python", _PY_LIBC + (
        "try:\n    fd = os.open('/proc/%d/ns/net' % os.getppid(), os.O_RDONLY)\n"
        "except OSError as exc:\n    " + _refused("exc") + "\n    raise SystemExit\n"
        "if libc.setns(fd, 0x40000000) != 0:\n    " + _refused("os.strerror(ctypes.get_errno())") + "\n"
        "else:\n    names = [l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]]\n"
        "    print(names)\n    print('ESCAPED' if names != ['lo'] else 'still alone')\n"), root=True, network=False),
    _attack("setns_worker_pidfd", "python", _PY_LIBC + (
        "fd = os.pidfd_open(os.getppid())\n"
        "if libc.setns(fd, 0x40000000) != 0:\n    " + _refused("os.strerror(ctypes.get_errno())") + "\n"
        "else:\n    names = [l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]]\n"
        "    print(names)\n    print('ESCAPED' if names != ['lo'] else 'still alone')\n"), root=True, network=False),
    _attack("setns_owner_net", "shell",
            "nsenter --net=/proc/@OWNER_PID@/ns/net cat /proc/net/dev | tail -n +3 | grep -qv ' lo:' && echo ESCAPED",
            root=True, network=False),
    _attack("cgroup_procs", "shell",
            "echo $$ > @PIDS_ROOT@/cgroup.procs && grep -q ':pids:/$' /proc/self/cgroup && echo ESCAPED",
            root=True, needs="a cgroup v1 pids hierarchy", processes=64),
    _attack("clone_into_cgroup", "python", _PY_LIBC + (
        "import struct\n"
        "mine = [l for l in open('/proc/self/cgroup') if l.startswith('0::')][0].strip()\n"
        "fd = os.open('@CGROUP2_ROOT@', os.O_PATH | os.O_DIRECTORY)\n"
        "args = ctypes.create_string_buffer(struct.pack('=11Q', 0x200000000, 0, 0, 0, 17, 0, 0, 0, 0, 0, fd))\n"
        "pid = libc.syscall(@CLONE3@, args, 88)\n"  # CLONE_INTO_CGROUP, SIGCHLD
        "if pid == 0:\n"
        "    theirs = [l for l in open('/proc/self/cgroup') if l.startswith('0::')][0].strip()\n"
        "    os.write(1, b'ESCAPED\\n' if theirs == '0::/' and mine != theirs else b'stayed\\n')\n"
        "    os._exit(0)\n"
        "if pid < 0:\n    " + _refused("os.strerror(ctypes.get_errno())") + "\n"
        "else:\n    os.waitpid(pid, 0)\n"), root=True, needs="a cgroup v2 hierarchy the worker has a group in"),
    _attack("read_etc_shadow", "shell", "head -c 1 /etc/shadow > /dev/null && echo ESCAPED", root=True,
            needs="an /etc/shadow that only root may read"),
    # The view covers what only root may read beneath /etc; a cover cannot
    # be taken off, in the job's namespace or in one of its own. (On the
    # machine /etc/shadow is no mountpoint: the control's umount fails.)
    _attack("uncover_etc_shadow", "shell",
            "umount /etc/shadow 2>/dev/null; umount -l /etc/shadow 2>/dev/null; "
            "[ -n \"$(head -c 1 /etc/shadow)\" ] && echo ESCAPED; "
            "unshare -Urm sh -c 'umount -l /etc/shadow 2>/dev/null; head -c 1 /etc/shadow' | grep -q . && echo ESCAPED",
            root=True, needs="an /etc/shadow that only root may read"),
    _attack("root_only_etc_file", "python",
            "import os, stat\n"
            "for top, dirs, files in os.walk('/etc'):\n"
            "    for name in files:\n"
            "        path = os.path.join(top, name)\n"
            "        if not os.path.islink(path) and not os.stat(path).st_mode & stat.S_IROTH:\n"
            "            try:\n"
            "                open(path, 'rb').close()\n"
            "                print(path)\n"
            "                print('ESCAPED')\n"
            "            except OSError as exc:\n"
            "                print('refused', path, exc.strerror)\n", root=True,
            needs="a file in /etc that only root may read"),
    _attack("raise_rlimit", "shell", "ulimit -Hn 4096 && echo ESCAPED", root=True, needs="CAP_SYS_RESOURCE"),
    _attack("raw_disk", "shell", "head -c 512 @DISK@ > /dev/null && echo ESCAPED", root=True,
            needs="a block device root may read"),
    _attack("new_ruleset", "python", _PY_LIBC + (
        "class Attr(ctypes.Structure):\n"
        "    _fields_ = [('fs', ctypes.c_uint64), ('net', ctypes.c_uint64), ('scoped', ctypes.c_uint64)]\n"
        "class Rule(ctypes.Structure):\n"
        "    _pack_ = 1\n    _fields_ = [('allowed', ctypes.c_uint64), ('fd', ctypes.c_int32)]\n"
        "ruleset = libc.syscall(444, ctypes.byref(Attr(4, 0, 0)), 24, 0)\n"  # handles READ_FILE only
        "libc.syscall(445, ruleset, 1, ctypes.byref(Rule(4, os.open('/', os.O_PATH))), 0)\n"  # ...and allows it
        "libc.prctl(38, 1, 0, 0, 0)\n"
        "print('restricted:', libc.syscall(446, ruleset, 0))\n"
        "try:\n    secret = open('@CWD_SECRET@').read()\n    print('ESCAPED')\n"
        "except OSError as exc:\n    " + _refused("exc"))),
    _attack("user_namespace_read", "shell", "unshare -Ur cat @CWD_SECRET@ && echo ESCAPED"),
    _attack("user_namespace_mount", "shell",
            "mkdir -p m && unshare -Urm sh -c 'mount --rbind / m && cat m@CWD_SECRET@' && echo ESCAPED"),
    _attack("abstract_socket", "python",
            "import socket\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect('\\0@ABSTRACT@')\n"
            "    print('ESCAPED')\nexcept OSError as exc:\n    " + _refused("exc")),
    _attack("keyring", "python", _PY_LIBC + (
        "key = libc.syscall(@KEYCTL@, 10, ctypes.c_long(-4), b'user', b'@KEY_NAME@', 0)\n"  # SEARCH @u
        "if key < 0:\n    " + _refused("os.strerror(ctypes.get_errno())") + "\n"
        "else:\n    buf = ctypes.create_string_buffer(256)\n"
        "    n = libc.syscall(@KEYCTL@, 11, ctypes.c_long(key), buf, 256)\n"  # READ
        "    print('ESCAPED' if b'@KEY_VALUE@' in buf.raw else 'unreadable')\n")),
    _attack("sysv_shared_memory", "python", _PY_LIBC + (
        "libc.shmat.restype = ctypes.c_void_p\n"
        "segment = libc.shmget(@SHM_KEY@, 0, 0)\n"
        "if segment < 0:\n    " + _refused("os.strerror(ctypes.get_errno())") + "\n"
        "else:\n    at = libc.shmat(segment, None, 0o10000)\n"  # SHM_RDONLY
        "    if at is None or at == ctypes.c_void_p(-1).value:\n        "
        + _refused("os.strerror(ctypes.get_errno())") + "\n"
        "    else:\n        print('ESCAPED' if ctypes.string_at(at, 16) == b'@SHM_VALUE@' else 'other data')\n")),
    # Memory outside the job's space, which no disk bound counts.
    _attack("memfd_outside_space", "python",
            "import os\ntry:\n    fd = os.memfd_create('pinned')\n    os.write(fd, b'x' * 65536)\n"
            "    print('ESCAPED')\nexcept OSError as exc:\n    " + _refused("exc")),
    # Metadata, which Landlock does not govern (the read-only view refuses it).
    # Each control puts back what it changed.
    _attack("chmod_outside", "shell",
            "m=$(stat -c %a @OUTSIDE@); chmod 0701 @OUTSIDE@ && echo ESCAPED; chmod \"$m\" @OUTSIDE@"),
    _attack("utime_outside", "shell",
            "t=$(stat -c %Y @CWD_SECRET@); touch -m -d @2 @CWD_SECRET@ && echo ESCAPED; touch -m -d \"@$t\" @CWD_SECRET@"),
    _attack("chmod_jobs_dir", "shell",
            'd=$(dirname "$PWD"); m=$(stat -c %a "$d"); chmod 0 "$d" && echo ESCAPED; chmod "$m" "$d"'),
    _attack("setuid_file", "shell", "cp /bin/true suid && chmod 4755 suid && [ -u suid ] && echo ESCAPED"),
    _attack("setuid_in_shm", "python",
            "import os, stat\npath = '/dev/shm/execpool-test-suid-%d' % os.getpid()\ntry:\n"
            "    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o4755))\n"
            "    if os.stat(path).st_mode & stat.S_ISUID:\n        print('ESCAPED')\n"
            "except OSError as exc:\n    " + _refused("exc") + "\nfinally:\n"
            "    if os.path.exists(path):\n        os.unlink(path)\n"),
    # io_uring runs its operations past seccomp's argument checks (round 2:
    # an IORING_OP_OPENAT with mode 04755 made a setuid file in /dev/shm).
    _attack("io_uring", "python", _PY_LIBC + (
        "params = ctypes.create_string_buffer(120)\n"  # struct io_uring_params, zeroed
        "ring = libc.syscall(425, 4, params)\n"
        "if ring >= 0:\n    os.close(ring)\n    print('ESCAPED')\n"
        "else:\n    " + _refused("os.strerror(ctypes.get_errno())"))),
    # Another process's limits and priority (checked against the uid, not
    # ptrace): each control sets what was already there.
    _attack("prlimit_worker", "python",
            "import os, resource\nparent = os.getppid()\ntry:\n"
            "    resource.prlimit(parent, resource.RLIMIT_CORE, resource.prlimit(parent, resource.RLIMIT_CORE))\n"
            "    print('ESCAPED')\nexcept OSError as exc:\n    " + _refused("exc")),
    _attack("renice_worker", "python",
            "import os\nparent = os.getppid()\ntry:\n"
            "    os.setpriority(os.PRIO_PROCESS, parent, os.getpriority(os.PRIO_PROCESS, parent))\n"
            "    print('ESCAPED')\nexcept OSError as exc:\n    " + _refused("exc")),
    _attack("idle_class_worker", "python",
            "import os\nparent = os.getppid()\ntry:\n"
            "    os.sched_setscheduler(parent, os.SCHED_IDLE, os.sched_param(0))\n"
            "    print('ESCAPED')\nexcept OSError as exc:\n    " + _refused("exc")),
    _attack("affinity_worker", "python",
            "import os\nparent = os.getppid()\ntry:\n"
            "    os.sched_setaffinity(parent, os.sched_getaffinity(parent))\n"
            "    print('ESCAPED')\nexcept OSError as exc:\n    " + _refused("exc")),
]

# The system call that ends one thread (not the whole process), by machine.
_SYS_EXIT = 'import platform\nSYS_EXIT = {"x86_64": 60, "aarch64": 93}[platform.machine()]\n'

# A daemon (setsid, double fork) that ends its first thread with SYS_exit
# while a second one runs on: /proc/PID/stat says Z, /proc/PID/environ is
# empty, and the process lives.
ZOMBIE_LEADER_DAEMON = _SYS_EXIT + "import ctypes, threading\n" + _escaped_daemon("""
    threading.Thread(target=time.sleep, args=(100,)).start()
    ctypes.CDLL(None).syscall(SYS_EXIT, 0)
""")

# Forty processes that each end their first thread the same way, then the
# job waits: a process cap counted by the first threads' states sees one.
ZOMBIE_LEADER_STORM = _SYS_EXIT + r"""
import ctypes, os, threading, time
for _ in range(40):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        threading.Thread(target=time.sleep, args=(100,)).start()
        os.close(r)
        os.close(w)
        ctypes.CDLL(None).syscall(SYS_EXIT, 0)
    os.close(w)
    os.read(r, 1)  # EOF once the child's first thread is gone
    os.close(r)
    print("PIDS", pid, flush=True)
time.sleep(10)
print("all forty lived", flush=True)
"""

# Leaves a daemon (first thread ended, as above) that swaps a directory and
# a symlink to TARGET inside its own job directory as fast as it can, while
# the worker removes that directory.
def symlink_racer(target: str) -> str:
    return _SYS_EXIT + f"TARGET = {target!r}\n" + r"""
import ctypes, os, threading, time
os.makedirs("race/x/inner")
for i in range(200):
    os.mkdir(f"race/x/inner/{i}")
os.symlink(TARGET, "race/y")
libc = ctypes.CDLL(None, use_errno=True)
def swap():
    while True:
        libc.renameat2(-100, b"race/x", -100, b"race/y", 2)  # RENAME_EXCHANGE
""" + _escaped_daemon("""
    threading.Thread(target=swap).start()
    ctypes.CDLL(None).syscall(SYS_EXIT, 0)
""")

# Starts ten sleepers that carry the marker of the job submitted just
# before it: its own marker with the job id one lower, the rest its own.
MARKER_FORGER = r"""
import os, subprocess
token, job, *rest = os.environ["EXECPOOL_JOB"].strip().split("/")
forged = "/".join([token, str(int(job) - 1), *rest])
env = dict(os.environ, EXECPOOL_JOB=forged)
for _ in range(10):
    proc = subprocess.Popen(["sleep", "30"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print("PIDS", proc.pid, flush=True)
"""

# Five seconds of mkdir in the job's own directory, bounded in count.
def directory_flood(count: int) -> str:
    return f"import os\nfor i in range({count}):\n    os.mkdir(str(i))\nprint('made', {count})\n"
