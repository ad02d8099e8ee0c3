"""The owner of a pool whose tools try to escape the sandbox: run by
tests/sandbox/test_sandbox.py as root and as ``nobody``, so that every escape is
tried with the privileges a server would have.

Reads a JSON object on stdin -- the attacks (tests/support/hostile.py), the values
of their ``@NAME@`` markers, the spawn method -- and sets up, as its own
user, what a tool must not reach: an abstract Unix socket, a System V
shared memory segment, a key in its user keyring, and a *victim* job that
runs in a sandbox of its own meanwhile, with a secret in its directory.
Then runs every attack twice, in the sandbox and without it (the negative
control), one at a time, and prints one JSON object: each attack's two
outcomes, its own uid, and its workers before and after.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import secrets
import shutil
import socket
import sys
import tempfile
import threading

from execpool import ExecPool, PythonJob, ShellJob
from execpool.sandbox.seccomp import TABLES
from execpool.shared.jobs import Limits

#: The victim keeps a secret in its directory and in its /tmp, and listens
#: on a Unix socket there.
VICTIM = ('echo victim-secret > victim-secret; echo victim-tmp > /tmp/victim-tmp-secret; '
          '"$PY" -c "import signal, socket; s = socket.socket(socket.AF_UNIX); s.bind(\'/tmp/victim.sock\'); '
          's.listen(); signal.pause()" & '
          'while [ ! -S /tmp/victim.sock ]; do sleep 0.01; done; echo "VICTIM $$ $PWD"; exec sleep 600')
READY_S = 30.0

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.shmat.restype = ctypes.c_void_p


def _keyctl_number() -> int:
    return TABLES[platform.machine()][1]["keyctl"]


def _add_key(name: str, value: bytes) -> int:
    add_key = TABLES[platform.machine()][1]["add_key"]
    key = _libc.syscall(add_key, b"user", name.encode(), value, len(value), ctypes.c_long(-4))  # @u
    if key < 0:
        raise OSError(ctypes.get_errno(), "add_key")
    return key


def _shared_segment(key: int, value: bytes) -> int:
    segment = _libc.shmget(key, 4096, 0o1600)  # IPC_CREAT | 0600
    if segment < 0:
        raise OSError(ctypes.get_errno(), "shmget")
    at = _libc.shmat(segment, None, 0)
    ctypes.memmove(at, value, len(value))
    return segment


def _job(attack: dict, kind: str, code: str, sandbox):
    options = dict(attack["job"])
    processes = options.pop("processes", None)
    limits = Limits(processes=processes) if processes else None
    if kind == "shell":
        return ShellJob(code, sandbox=sandbox, limits=limits, timeout=60, **options)
    return PythonJob(code, sandbox=sandbox, limits=limits, timeout=60, warm=kind == "warm", **options)


def main() -> None:
    spec = json.load(sys.stdin)
    fill = dict(spec["fill"])
    listener = socket.socket(socket.AF_UNIX)
    fill["@ABSTRACT@"] = "execpool-test-" + secrets.token_hex(8)
    listener.bind("\0" + fill["@ABSTRACT@"])
    listener.listen(64)
    fill["@KEY_NAME@"] = "execpool-test-" + secrets.token_hex(8)
    fill["@KEY_VALUE@"] = secrets.token_hex(8)
    fill["@KEYCTL@"] = str(_keyctl_number())
    key = _add_key(fill["@KEY_NAME@"], fill["@KEY_VALUE@"].encode())
    shm_key = secrets.randbelow(1 << 30) + 1
    fill["@SHM_KEY@"] = str(shm_key)
    fill["@SHM_VALUE@"] = secrets.token_hex(8)
    segment = _shared_segment(shm_key, fill["@SHM_VALUE@"].encode())
    fill["@OWNER_PID@"] = str(os.getpid())
    report = {"uid": os.getuid(), "results": {}}
    # The victim's directory is the owner's: a job's own has no path on the
    # machine (it is its space's), so only a caller's can be named.
    victim_dir = tempfile.mkdtemp(prefix="execpool-victim-")
    try:
        with ExecPool(workers=2, spawn_method=spec["spawn_method"]) as pool:
            report["workers_before"] = sorted(pool.worker_pids)
            seen = threading.Event()
            lines: list = []

            def on_event(event) -> None:
                lines.append(event.text)
                if "VICTIM" in "".join(lines):
                    seen.set()

            victim = pool.submit(ShellJob(VICTIM, sandbox="strict", timeout=None, env={"PY": sys.executable},
                                          cwd=victim_dir), on_event=on_event)
            if not seen.wait(READY_S):
                raise RuntimeError(f"the victim job never started: {victim.result(5).text!r}")
            _, pid, directory = "".join(lines).split()[:3]
            fill["@VICTIM_PID@"], fill["@VICTIM_DIR@"] = pid, directory
            for attack in spec["attacks"]:
                if attack["root"] and os.getuid() != 0:
                    continue
                kinds = ["shell"] if attack["kind"] == "shell" else ["cold", "warm"]
                for kind in kinds:
                    label = attack["name"] if kind == "shell" else f"{attack['name']}-{kind}"
                    outcome = {}
                    for mode, sandbox in (("sandboxed", "strict"), ("control", False)):
                        code = attack["code"]
                        for marker, value in {**fill, "@MODE@": f"{mode}-{kind}"}.items():
                            code = code.replace(marker, value)
                        result = pool.run(_job(attack, kind, code, sandbox))
                        outcome[mode] = {"status": result.status.value, "text": result.text}
                    report["results"][label] = outcome
            victim.cancel()
            report["victim"] = victim.result(10).status.value
            report["workers_after"] = sorted(pool.worker_pids)
    finally:
        shutil.rmtree(victim_dir, ignore_errors=True)
        listener.close()
        _libc.shmctl(segment, 0, None)  # IPC_RMID
        _libc.syscall(_keyctl_number(), 21, ctypes.c_long(key))  # KEYCTL_INVALIDATE
    print(json.dumps(report))


if __name__ == "__main__":
    main()
