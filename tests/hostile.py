"""Misbehaving tools, in one place, as the code a model might write.

Each is a shell or Python source string; tools that leave processes behind
print their pids (``PIDS a b c``) so a test can check that none survives.
"""

# A background grandchild that keeps the output pipe open after the shell exits.
GRANDCHILD_HOLDS_STDOUT = "(sleep 100; echo never) & echo \"PIDS $!\""

# A background process that does not hold the pipe: the job ends, it must not outlive it.
QUIET_BACKGROUND = "sleep 100 >/dev/null 2>&1 & echo \"PIDS $!\""

# A daemon that escapes the process group with setsid and a double fork.
SETSID_DAEMON = r"""
import os, sys, time
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.write(w, str(os.getpid()).encode())
        os.close(w)
        time.sleep(100)
    os._exit(0)
os.close(w)
print("PIDS", os.read(r, 64).decode(), flush=True)
"""

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
