"""Process-level checks shared by the tests: what is still alive, and waiting
for a condition with a deadline instead of sleeping a fixed time."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterable

import psutil
import pytest

from execpool.shared.kernel.proctree import JOB_MARKER_ENV
from execpool.worker.spawn import SPAWN_METHODS

#: The checkout: the tests run the package from it, also in other processes.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: The ways a worker can start tools, as a fixture's params: the default
#: (auto's choice, SPAWN_METHODS' first) in every tier, the others only in
#: the whole suite -- a second way doubled the fast tier's pool tests.
SPAWN_PARAMS = [SPAWN_METHODS[0], *(pytest.param(m, marks=pytest.mark.slow) for m in SPAWN_METHODS[1:])]

#: The unprivileged user tests run pools and tools as: nobody.
UNPRIVILEGED = 65534


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0, interval: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def worker_records(pool) -> list:
    """The pool's records of its worker processes (an internal view: pid,
    token, jobs_dir, jobs), for tests that look behind the public API."""
    with pool._workers.lock:
        return list(pool._workers.all)


def alive(pid: int) -> bool:
    """Some thread of it runs or sleeps: not a zombie waiting to be reaped.
    Every thread is asked -- a process whose first thread ended with
    ``SYS_exit`` reads as ``Z`` while its others run."""
    return bool(_live_threads(pid))


def _live_threads(pid: int) -> list[int]:
    live = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return live
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                if f.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X"):
                    live.append(int(tid))
        except (OSError, IndexError):
            continue
    return live


def _environ(pid: int) -> dict:
    """A live process's environment, read through a live thread of it."""
    for tid in _live_threads(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/environ", "rb") as f:
                block = f.read()
        except OSError:
            continue
        pairs = (entry.partition(b"=") for entry in block.split(b"\0") if entry)
        return {key.decode(errors="replace"): value.decode(errors="replace") for key, _, value in pairs}
    return {}


def state(pid: int) -> str:
    """The one-letter state ``/proc/PID/stat`` gives (``T``: stopped), or
    "gone"."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0].decode()
    except OSError:
        return "gone"


def all_dead(pids: Iterable[int], timeout: float = 2.0) -> bool:
    pids = list(pids)
    return wait_for(lambda: not any(alive(p) for p in pids), timeout)


def remember(doomed: list, pids: Iterable[int]) -> None:
    """Put processes on a test's ``doomed`` list (tests/conftest.py)."""
    for pid in pids:
        try:
            doomed.append(psutil.Process(pid))
        except psutil.Error:
            pass


def owner_killed_leaves_nothing(tmp_path, doomed: list, setup: str, expected: int) -> None:
    """An owner process runs ``setup`` (Python, with ``sys``, ``time`` and
    ``ExecPool`` imported), which prints one line naming the pids it wants
    dead (``PIDS ...``) and leaves them running; the owner is SIGKILLed,
    and every one of them must die with it (the lifeline's rules)."""
    script = tmp_path / "owner.py"
    script.write_text(f"import sys, time\nsys.path.insert(0, {REPO!r})\nfrom execpool import ExecPool\n"
                      f"{setup}\ntime.sleep(300)\n")
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = owner.stdout.readline()
        pids = pids_in(line)
        remember(doomed, pids)
        assert len(pids) == expected, line
        owner.kill()
        owner.wait(10)
        assert all_dead(pids, timeout=10)
    finally:
        owner.kill()
        owner.wait()
        owner.stdout.close()


def proc_kib(path: str, key: str) -> int:
    """A ``Key:  N kB`` line of a /proc file (status, smaps_rollup), in bytes."""
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} in {path}")


def pids_in(output: str) -> list[int]:
    """Pids that a hostile tool announced with ``PIDS ...``."""
    return [int(p) for line in re.findall(r"PIDS ([\d ]+)", output) for p in line.split()]


def processes_with_env(matches: Callable[[dict], bool]) -> list[psutil.Process]:
    """Live processes anywhere but this one whose environment ``matches``."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        if matches(_environ(proc.pid)):
            found.append(proc)
    return found


def marked_processes(marker_prefix: str = "") -> list[psutil.Process]:
    """Live processes anywhere that carry an execpool job marker."""
    return processes_with_env(lambda env: JOB_MARKER_ENV in env and env[JOB_MARKER_ENV].startswith(marker_prefix))


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def collect(stream) -> tuple[list[dict], object]:
    """Consume a stream; return its events and its Result."""
    events = []
    while True:
        try:
            events.append(next(stream))
        except StopIteration as stop:
            return events, stop.value


def joined_output(events: list[dict]) -> str:
    return "".join(e["text"] for e in events if e["type"] == "tool_output")


def unprivileged_python() -> "str | None":
    """An interpreter of this Python version that ``nobody`` may run (the
    test's own often lives in root's home), or None."""
    for candidate in (f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}", sys.executable):
        if os.access(candidate, os.X_OK):
            probe = subprocess.run([candidate, "-c", "print(1)"], user=UNPRIVILEGED, group=UNPRIVILEGED,
                                   extra_groups=[], capture_output=True, text=True, cwd="/")
            if probe.stdout == "1\n":
                return candidate
    return None


def unprivileged_pythonpath(base: str, extra: "tuple[str, ...]" = ()) -> str:
    """A world-readable copy, under ``base``, of what an unprivileged
    interpreter needs to run execpool: the package (its built extension
    included), its core dependencies and the ``extra`` packages a test
    names. A copy, not links: this checkout and its venv may lie in a
    directory only root may enter (``/root``, any 0700 folder), and a link
    does not make a path traversable."""
    import importlib

    path = os.path.join(base, "site")
    os.mkdir(path, 0o755)
    for name in ("execpool", "psutil", "tqdm", *extra):
        source = os.path.dirname(os.path.abspath(importlib.import_module(name).__file__))
        shutil.copytree(source, os.path.join(path, os.path.basename(source)),
                        ignore=shutil.ignore_patterns("__pycache__"))
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            target = os.path.join(root, name)
            os.chmod(target, os.stat(target).st_mode | 0o444 | (0o111 if name in dirs else 0))
    return path


#: For a script a test runs in a process of its own: a job's outcome in
#: one string, its text when it ended well.
OUTCOME = """
def outcome(future):
    try:
        result = future.result(timeout=30)
    except Exception as exc:
        return repr(exc)
    return result.text if result.ok else f"{result.status.value}: {result.error}"
"""


def run_as_nobody(script: str, extra: "tuple[str, ...]" = ()) -> subprocess.CompletedProcess:
    """Run the Python ``script`` as ``nobody`` with execpool (and the
    ``extra`` packages) importable and ``sys.argv[1]`` a fresh directory it
    may write in (removed after); skip the test where that cannot be done."""
    import pytest

    python = unprivileged_python()
    if os.getuid() != 0 or python is None:
        pytest.skip("needs root, to run as nobody")
    base = tempfile.mkdtemp(prefix="execpool-test-")  # tmp_path's parents are root's alone
    os.chmod(base, 0o777)
    try:
        return subprocess.run([python, "-c", script, base], capture_output=True, text=True, timeout=60,
                              user=UNPRIVILEGED, group=UNPRIVILEGED, extra_groups=[], cwd="/",
                              env={"PYTHONPATH": unprivileged_pythonpath(base, extra)})
    finally:
        subprocess.run(["rm", "-rf", base], check=True)  # what nobody left, whatever its modes


class Gates:
    """Named gates a sandboxed job waits at, opened by the test: a TCP
    server on loopback. A file the test makes would do outside the sandbox,
    but a sandboxed job's view holds none of the test's files (and a job
    has the network unless told otherwise). A waiting job connects, says
    the gate's name and reads one byte, which comes once the test opens
    that gate (at once, if it already has)."""

    def __init__(self) -> None:
        import socket
        import threading

        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._opened: set = set()
        self._waiting: dict = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            name = b""
            while not name.endswith(b"\n"):
                chunk = conn.recv(64)
                if not chunk:
                    break
                name += chunk
            name_text = name.decode().strip()
            with self._lock:
                if name_text in self._opened:
                    self._release(conn)
                else:
                    self._waiting.setdefault(name_text, []).append(conn)

    @staticmethod
    def _release(conn) -> None:
        try:
            conn.sendall(b"x")
        except OSError:
            pass  # the job is gone
        conn.close()

    def open(self, name: str = "gate") -> None:
        with self._lock:
            self._opened.add(name)
            for conn in self._waiting.pop(name, []):
                self._release(conn)

    def python(self) -> str:
        """Python source defining ``wait(name)``."""
        return (f"def wait(name='gate'):\n    import socket\n"
                f"    s = socket.create_connection(('127.0.0.1', {self.port}))\n"
                "    s.sendall(name.encode() + b'\\n')\n    s.recv(1)\n")

    def shell(self, name: str = "gate") -> str:
        """A bash command that waits at gate ``name``."""
        return f"{{ exec 3<>/dev/tcp/127.0.0.1/{self.port}; echo {name} >&3; head -c 1 <&3 >/dev/null; }}"

    def __enter__(self) -> "Gates":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        import socket

        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept; a close alone would not
        except OSError:
            pass
        self._server.close()
        self._thread.join(5)
        with self._lock:
            for conns in self._waiting.values():
                for conn in conns:
                    conn.close()
            self._waiting.clear()


#: Under CI=true every toolchain the tests use is installed (.ci/run): a
#: language that does not run fails its tests there instead of skipping.
IN_CI = os.environ.get("CI") == "true"


@functools.lru_cache(maxsize=None)
def toolchains() -> dict:
    """Each language's row as execpool.languages() finds it -- its
    hello-world compiled and ran in the strict sandbox, as the tests' pools
    run jobs -- once per test process."""
    from execpool import languages

    return {row.name: row for row in languages()}


#: The languages whose cases stay in the fast tier: an interpreter, the
#: shell, a compiler under both the names it is asked by. Every other row
#: of the table is as much code of execpool's (its row), and its cases run
#: in the whole suite, which CI runs.
FAST_LANGUAGES = frozenset({"python", "bash", "c", "cpp"})


def language_cases(names: Iterable[str], fast: Iterable[str] = FAST_LANGUAGES) -> list:
    """``names`` as test parameters, each needing its language
    (``toolchain``), and slow unless in ``fast``."""
    fast = set(fast)
    return [pytest.param(name, marks=[pytest.mark.toolchain(name), *([] if name in fast else [pytest.mark.slow])])
            for name in names]


def needs(name: str):
    """A test of ``name`` alone."""
    return pytest.mark.toolchain(name)


def runs_here(name: str) -> None:
    """What a test marked ``toolchain(name)`` meets first (tests/conftest.py):
    where the language does not run here -- its toolchain is missing, or
    its hello-world failed in the sandbox -- it is skipped with the row's
    reason, and failed under CI=true, where .ci/run installed everything."""
    row = toolchains()[name]
    if row.runs:
        return
    if IN_CI:
        pytest.fail(f"{name} does not run here: {row.why_not}", pytrace=False)
    pytest.skip(f"{name} does not run here: {row.why_not}")


def pids_cgroup_tier() -> bool:
    """Whether execpool can put jobs in cgroups here with a pids controller
    (the tier that caps a job's processes for root, too)."""
    from execpool.shared.kernel.cgroups import Cgroups

    tier = Cgroups.detect("probe-test")
    if tier is None:
        return False
    tier.close()
    return "pids" in tier.bases
