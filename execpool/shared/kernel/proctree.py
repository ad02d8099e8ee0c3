"""Process trees: the one function that kills them, and helpers for callers
who start their own ``subprocess.Popen``.

Every way a job ends in execpool -- exit, timeout, cancel, stream close,
worker crash, pool close -- goes through :func:`kill_tree`. Its order is
docs/design.md's ("Process-tree kill, in order of strength"):

1. Walk the leader's descendants through the kernel's child lists while the
   leader still links them, keeping those outside the job's group.
2. ``killpg(SIGKILL)`` on every captured pgid: one syscall that ends most
   trees at once. It stays valid after the leader was reaped while any
   member lives. Then SIGKILL the ones from step 1: children that moved to
   a group of their own.
3. Where the job has a cgroup, SIGKILL everything in it: whatever a
   process did to its session, group or environment, it cannot leave.
4. Sweep for processes carrying the job's marker in their environment --
   daemons that left the group with ``setsid`` and a double fork and were
   re-parented to the worker (a child subreaper) or, when the worker itself
   is gone, to anything else. Each sweep waits for its victims to die (a
   dying parent hands its newest child over only then) and the next looks
   again, until one finds nothing: a tree that forks while it is being
   killed still ends.

psutil pairs each pid with its creation time, so a recycled pid is never hit.
Reaping is the caller's job: the worker reaps every child on SIGCHLD.
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import io
import os
import queue
import selectors
import signal
import subprocess
import threading
import time
from typing import Any, Callable, Iterable, Iterator, Optional

import psutil

from .markers import JOB_MARKER_ENV, marker_matches

_MAX_SWEEPS = 8

#: How far up a process's ancestry a cancel looks for an earlier cell's
#: server (a deeper one is taken as the cell's).
_MAX_ANCESTRY = 64

#: How long a sweep waits for its victims to die before looking again.
_SWEEP_SETTLE_S = 0.2
#: The unit of a start time in ``/proc/PID/stat`` (Linux only; 100 elsewhere
#: so that importing this module works everywhere).
_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


#: How much of a process's environment block is searched for its job
#: marker. The worker reads a process's marker at every job's end; a
#: process can point its block at any memory of its own (prctl's
#: PR_SET_MM_MAP), and a 64 MB one, read whole, held the worker's loop for
#: seconds. An exec's whole environment is at most a quarter of its stack
#: limit, and ordinary ones hold a few kilobytes.
MARKER_SCAN_BYTES = 256 << 10
_MARKER_KEY = b"\0" + JOB_MARKER_ENV.encode() + b"="


def marker_of(pid: int) -> Optional[str]:
    """The job marker in a process's environment (its first entry of that
    name, as ``getenv`` finds), if it lies within the block's first
    MARKER_SCAN_BYTES; None when it has none there or is dead."""
    return _read_marker(pid)[0]


def _read_marker(pid: int) -> "tuple[Optional[str], bool]":
    """``marker_of``, and whether an environment was there to read. Read
    through a live thread: a process whose first thread ended
    (``SYS_exit``, not ``exit_group``) shows an empty ``/proc/PID/environ``
    while its other threads run on."""
    for task in _live_tasks(pid):
        try:
            with open(f"/proc/{pid}/task/{task}/environ", "rb", buffering=0) as f:
                block = b"\0" + (f.read(MARKER_SCAN_BYTES) or b"")
        except OSError:
            continue
        at = block.find(_MARKER_KEY)
        if at < 0:
            return None, len(block) > 1
        return os.fsdecode(block[at + len(_MARKER_KEY):].partition(b"\0")[0]), True
    return None, False


#: A subreaper's children whose environment held no marker, with their
#: start times: a sweep reads each one once, not at every job's end (a
#: session's hundreds of escaped daemons, each with an environment of
#: 256 KiB, held its worker's loop for 400 ms at every job's end). Only a
#: block that was there is taken at its word (one read mid-exec may not
#: be); a process that hid its marker stays unmarked if it shows one
#: later, as one that cleared its environment does.
_UNMARKED: "dict[int, float]" = {}


def _group_killable(pgid: Optional[int]) -> bool:
    """Never the caller's own group (a child started without a new session
    shares it), and nowhere without process groups."""
    return pgid is not None and pgid > 1 and hasattr(os, "killpg") and pgid != os.getpgrp()


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def _kill_all(procs: Iterable[psutil.Process], victims: Optional[set] = None) -> int:
    hit = 0
    for proc in procs:
        try:
            proc.kill()
            hit += 1
        except psutil.Error:
            continue
        if victims is not None:
            victims.add(proc.pid)
    return hit


@functools.lru_cache(maxsize=None)
def _kernel_lists_children() -> bool:
    return os.path.exists(f"/proc/self/task/{threading.get_native_id()}/children")


def _child_pids(pid: int) -> Optional[list[int]]:
    """Direct children from the kernel's per-thread lists: cheap even with
    hundreds of tools running, where psutil would read every process's stat.
    None where the kernel keeps no such list."""
    if not _kernel_lists_children():
        return None
    found: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            # Unbuffered bytes: this runs once per process of a tree being
            # killed, and a text wrapper would cost more than the read.
            with open(f"/proc/{pid}/task/{tid}/children", "rb", buffering=0) as f:
                found.extend(map(int, f.read().split()))
    except OSError:
        pass  # the process (or one of its threads) is gone
    return found


def _as_processes(pids: Iterable[int]) -> list:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    return procs


def _descendant_pids(pid: int) -> list[int]:
    if not _kernel_lists_children():
        try:
            return [child.pid for child in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            return []
    found: list[int] = []
    frontier = [pid]
    while frontier:
        frontier = [child for parent in frontier for child in (_child_pids(parent) or ())]
        found.extend(frontier)
    return found


def _descendants(pid: int) -> list:
    return _as_processes(_descendant_pids(pid))


def _subtree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants, never the calling process itself (the worker
    passes its own pid to take down everything below it at shutdown)."""
    pids = _descendant_pids(pid)
    if pid != os.getpid():
        # The leader dies first, so it cannot react to its children's deaths
        # (a shell's ``wait`` returning, a supervisor respawning them).
        pids.insert(0, pid)
    return pids


def stat_fields(pid: int) -> list:
    """``/proc/PID/stat`` from the state on (the name before it may hold
    anything, blanks and parentheses too); [] once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb", buffering=0) as f:
            return f.read().rpartition(b")")[2].split()
    except OSError:
        return []


def is_zombie(pid: int) -> bool:
    """Dead and waiting to be reaped (or gone): nothing to kill. ``Z`` in
    ``/proc/PID/stat`` is the first thread's state only: a daemon that
    ended its first thread with ``SYS_exit`` reads as a zombie while its
    other threads run, and every sweep that trusted it let it live until
    the pool closed. It is dead only when no thread of it lives."""
    fields = stat_fields(pid)
    if not fields:
        return True
    return fields[0] == b"Z" and not any(True for _ in _live_tasks(pid))


def _live_tasks(pid: int) -> Iterator[int]:
    """The threads of ``pid`` that are not dead, its first one first: for
    nearly every process, that one and no ``/proc`` listing."""
    fields = stat_fields(pid)
    if not fields:
        return
    if fields[0] not in (b"Z", b"X"):
        yield pid
        return
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for task in map(int, tasks):
        if task == pid:
            continue
        try:
            with open(f"/proc/{pid}/task/{task}/stat", "rb", buffering=0) as f:
                state = f.read().rpartition(b")")[2].split()[:1]
        except OSError:
            continue
        if state and state[0] not in (b"Z", b"X"):
            yield task


def is_stopped(pid: int) -> bool:
    """Stopped by a signal: a tool running as the same user can do that to
    any of execpool's processes."""
    fields = stat_fields(pid)
    return bool(fields) and fields[0] == b"T"


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid``."""
    pids = _child_pids(pid)
    if pids is not None:
        return pids
    try:
        return [child.pid for child in psutil.Process(pid).children()]
    except psutil.Error:
        return []


def _in_groups(pid: int, pgids: frozenset) -> bool:
    """Whether the group kill already reached ``pid`` (one cheap syscall,
    where psutil would read procfs twice)."""
    try:
        return os.getpgid(pid) in pgids
    except (OSError, AttributeError):
        return False


def _marked(marker: str, scope: Optional[int], skip: set, pgids: frozenset,
            spared: Optional[Callable[[int], bool]] = None, named: Optional[Callable[[int], bool]] = None) -> list:
    """Live processes carrying ``marker`` (or that ``named`` says are the
    job's) that no earlier step reached: direct children of ``scope``
    (where a subreaper collects escaped daemons), or anywhere when
    ``scope`` is None. ``spared`` says cheaply of a child of ``scope`` that
    it cannot be any job's, so its environment is not read: with many jobs
    queued, a worker has as many warm spares on their way, and reading each
    one's ``/proc`` at every job's end was half of what the worker spent."""
    if scope is None:
        candidates = psutil.process_iter()
    else:
        candidates = _as_processes(
            pid for pid in child_pids(scope)
            if pid not in skip and not _in_groups(pid, pgids) and not (spared is not None and spared(pid)))
    me = os.getpid()
    found = []
    unmarked = {}
    for proc in candidates:
        if proc.pid == me or proc.pid in skip:
            continue
        if named is not None and named(proc.pid):
            found.append(proc)
            continue
        born = proc.create_time() if scope is not None else None  # psutil's, read as the Process was made
        if born is not None and _UNMARKED.get(proc.pid) == born:
            unmarked[proc.pid] = born
            continue
        seen, read = _read_marker(proc.pid)
        if marker_matches(seen, marker):
            found.append(proc)
        elif born is not None and seen is None and read:
            unmarked[proc.pid] = born
    if scope is not None:
        _UNMARKED.clear()  # what is no child of the subreaper now is no longer remembered
        _UNMARKED.update(unmarked)
    return found


def boot_ticks() -> int:
    """Now, in the unit and from the origin of a process's start time in
    ``/proc/PID/stat`` (clock ticks since boot)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * _TICKS_PER_S)


def _group(pid: int) -> int:
    """``pid``'s process group; -1 once it is gone."""
    fields = stat_fields(pid)
    return int(fields[2]) if len(fields) > 2 else -1


def _groups_born_since(pgids: set, since: int, protected: set) -> list:
    """Those of ``pgids`` whose every live member began at or after boot
    tick ``since`` and is none of ``protected``: groups a cell made, which
    a group kill may take whole (one an earlier cell's daemon is in is
    not)."""
    pgids = {pgid for pgid in pgids if _group_killable(pgid)}
    if not pgids:
        return []
    mixed = set()
    for pid in _all_pids():
        fields = stat_fields(pid)
        if len(fields) > 19 and int(fields[2]) in pgids and (pid in protected or int(fields[19]) < since):
            mixed.add(int(fields[2]))
    return sorted(pgids - mixed)


def _all_pids() -> Iterator[int]:
    return (int(name) for name in os.listdir("/proc") if name.isdigit())


def kill_born_since(leader: int, since: int, *, marker: str, scope: int, exclude: Iterable[int] = (),
                    group: Optional[Any] = None, spared: Optional[Callable[[int], bool]] = None,
                    victims: Optional[set] = None, named: Optional[Callable[[int], bool]] = None) -> int:
    """SIGKILL what a session's cell started: the children of ``leader``
    (the session's interpreter or shell, spared) that began at or after
    boot tick ``since``, the marked processes below ``scope`` (escaped
    daemons; those ``named`` the session's too, as ``kill_tree`` takes
    them) and the members of the session's cgroup ``group`` (daemons
    that cleared their environment too) that did, the process groups they
    made, and the subtrees of all; swept again, as ``kill_tree`` does,
    until none is left: a process that forks as it dies hands its child
    on, a new pid the last sweep did not list, but not its group -- and
    where the session has a cgroup, none of its processes can fork
    meanwhile. Return how many were signalled. What began before -- a server an earlier cell
    left running, and the children it forks now -- is spared. A tick is
    10 ms: a process an earlier cell's leftovers start in the tick the
    cell began in counts as the cell's."""
    with group.forks_held() if group is not None else contextlib.nullcontext():
        return _sweep_born_since(leader, since, marker, scope, {leader, *exclude}, group, spared, victims, named)


def _sweep_born_since(leader: int, since: int, marker: str, scope: int, protected: set, group: Optional[Any],
                      spared: Optional[Callable[[int], bool]], victims: Optional[set],
                      named: Optional[Callable[[int], bool]]) -> int:
    skip = set(protected)
    own_group = _group(leader)
    hit = 0
    for _ in range(_MAX_SWEEPS):
        listed = [pid for pid in child_pids(leader) if pid not in skip]
        listed += [proc.pid for proc in _marked(marker, scope, skip, frozenset(), spared, named)]
        if group is not None:
            listed += [pid for pid in group.pids() if pid not in skip]
        roots: dict = {}
        for pid in dict.fromkeys(listed):
            fields = stat_fields(pid)
            if len(fields) > 19 and int(fields[19]) >= since \
                    and not _an_elders_child(int(fields[1]), since, (leader, scope)):
                roots[pid] = int(fields[2])
        if not roots:
            break
        # The groups first, at once: a forking member cannot slip out of one
        # between a listing and a kill, as it can out of a pid (one listed
        # may be gone already, its child new).
        for pgid in _groups_born_since(set(roots.values()) - {own_group}, since, protected):
            _killpg(pgid)
        swept = _as_processes(dict.fromkeys(pid for root in roots for pid in _subtree_pids(root) if pid not in skip))
        hit += _kill_all(swept, victims)
        skip.update(proc.pid for proc in swept)
        _wait_dead([proc.pid for proc in swept], _SWEEP_SETTLE_S)
    return hit


def _an_elders_child(parent: int, since: int, starters: tuple) -> bool:
    """Whether a process whose parent is ``parent`` descends from one that
    began before boot tick ``since`` (a server an earlier cell left, and
    the shell it runs a request in) other than ``starters``: the session's
    interpreter, whose children are the cell's, and the subreaper its
    orphans go to."""
    for _ in range(_MAX_ANCESTRY):
        if parent in starters or parent <= 1:
            return False
        fields = stat_fields(parent)
        if len(fields) <= 19:
            return False  # gone: its child is an orphan on its way to the subreaper
        if int(fields[19]) < since:
            return True
        parent = int(fields[1])
    return False


def count_tree(leader: Optional[int], marker: str, scope: int, exclude: Iterable[int] = (),
               spared: Optional[Callable[[int], bool]] = None, named: Optional[Callable[[int], bool]] = None) -> int:
    """How many live processes a job has: the leader's subtree plus its
    processes re-parented to ``scope`` -- marked, or ``named`` as its as
    :func:`kill_tree` says -- and their subtrees."""
    pids = set(_subtree_pids(leader)) if leader is not None else set()
    for proc in _marked(marker, scope, set(exclude), frozenset(), spared, named):
        pids.add(proc.pid)
        pids.update(_descendant_pids(proc.pid))
    return sum(1 for pid in pids if not is_zombie(pid))


def kill_tree(
    pgids: Iterable[int] = (),
    *,
    leader: Optional[int] = None,
    marker: Optional[str] = None,
    scope: Optional[int] = None,
    exclude: Iterable[int] = (),
    group: Optional[Any] = None,
    victims: Optional[set] = None,
    spared: Optional[Callable[[int], bool]] = None,
    named: Optional[Callable[[int], bool]] = None,
) -> int:
    """SIGKILL a job's whole tree; return how many processes were signalled
    one by one (the group kill is not counted), and add their pids to
    ``victims`` when given: the worker waits for them to be reaped, and
    counts them as the job's, even those in a session of their own.

    ``leader`` is the tool's pid if it may still be alive (not yet reaped, so
    the pid cannot have been reused); it and its descendants are killed.
    ``marker`` is the job's (or a whole worker's) marker, ``scope`` the pid
    below which marked processes are searched (the subreaper worker; None
    searches the whole system, for when that worker is already dead).
    ``exclude`` names pids known not to be this job's (the leaders of the
    worker's other jobs, its helpers): never killed by this call, and
    their environments never read; nor are those of the children of
    ``scope`` for which ``spared`` is true.
    ``group`` is the job's cgroup (execpool/shared/kernel/cgroups.py) where it has one.
    ``named`` says of a child of ``scope`` that it is the job's without its
    marker: a sandboxed job's processes are in its user namespace
    (execpool/worker/userns.py), whatever they did to their environment.
    """
    pgids = frozenset(pgid for pgid in pgids if _group_killable(pgid))
    # Walked before the group dies: a dying parent lets go of its children,
    # and one that left the group could then be found only by its marker.
    # The Process objects are made now too, so a pid recycled meanwhile is
    # recognised as someone else's.
    skip = set(exclude)
    outside = []
    if leader is not None:
        outside = _as_processes(p for p in _subtree_pids(leader) if p not in skip and not _in_groups(p, pgids))
    for pgid in pgids:
        _killpg(pgid)
    hit = _kill_all(outside, victims)
    if group is not None:
        group.kill()
    if marker is None:
        return hit
    for _ in range(_MAX_SWEEPS):
        found = _marked(marker, scope, skip, pgids, spared, named)
        if not found:
            break
        swept = list(found)
        for proc in found:
            swept.extend(_descendants(proc.pid))
        hit += _kill_all(swept, victims)
        skip.update(p.pid for p in swept)
        # A victim forking right now hands its child to the subreaper only
        # once it is dead; sweeping again before that would miss the child.
        _wait_dead([p.pid for p in swept], _SWEEP_SETTLE_S)
    return hit


def _wait_dead(pids: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if not is_zombie(pid)]
        if pids:
            time.sleep(0.001)


# --- helpers for callers who run their own ``subprocess.Popen`` -------------

_POLL = 0.05
_GRACE = 0.1
_CHUNK = 65536


def capture_process_group(proc: subprocess.Popen) -> int | None:
    """Record the child's pgid while its pid is still ours: once the leader is
    reaped ``os.getpgid`` fails, yet ``killpg`` on the recorded pgid still
    reaches any grandchild left in the group."""
    getpgid = getattr(os, "getpgid", None)
    if getpgid is None or proc.returncode is not None:
        return None
    try:
        return getpgid(proc.pid)
    except OSError:
        return None


def kill_process_tree(proc: subprocess.Popen, pgid: int | None = None) -> None:
    """Kill everything ``proc`` started, through :func:`kill_tree`.

    The pid is only trusted while Popen has not reaped it (a reaped pid may be
    recycled); the caller's own group is never signalled, since a child started
    without ``start_new_session`` shares it.
    """
    if pgid is None:
        pgid = capture_process_group(proc)
    kill_tree([] if pgid is None else [pgid], leader=proc.pid if proc.returncode is None else None)
    proc.kill()


class _Output:
    """Decodes exactly as ``communicate()`` with ``text=True, errors="replace"``
    would, while a character or ``\\r\\n`` may be split across reads, and hands
    out complete lines as they arrive."""

    def __init__(self, callback: Callable[[str], object] | None) -> None:
        self._decoder = io.IncrementalNewlineDecoder(
            codecs.getincrementaldecoder("utf-8")("replace"), translate=True
        )
        self._callback = callback
        self._parts: list[str] = []
        self._pending: list[str] = []

    def feed(self, data: bytes, final: bool = False) -> None:
        text = self._decoder.decode(data, final=final)
        self._parts.append(text)
        if self._callback is None:
            return
        if "\n" not in text:
            self._pending.append(text)
        else:
            lines = ("".join(self._pending) + text).split("\n")
            self._pending = [lines.pop()]
            for line in lines:
                self._emit(line + "\n")
        if final and any(self._pending):
            self._emit("".join(self._pending))

    def finish(self) -> str:
        self.feed(b"", final=True)
        return "".join(self._parts)

    def _emit(self, line: str) -> None:
        # A broken display must not lose the output or leave the tree running.
        try:
            if self._callback is not None:
                self._callback(line)
        except Exception:  # noqa: BLE001 - see above: the caller's callback, never the drain's failure
            pass


class _SelectReader:
    """Waits on the pipe with a timeout so deadlines and cancellation are
    checked even while nothing is written."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._selector = selectors.DefaultSelector()
        self._selector.register(fd, selectors.EVENT_READ)

    def read(self, timeout: float | None) -> bytes | None:
        """A chunk, ``b""`` at EOF, or None when nothing arrived in time."""
        if not self._selector.select(timeout):
            return None
        try:
            return os.read(self._fd, _CHUNK)
        except OSError:
            return b""

    def close(self) -> None:
        self._selector.close()


class _ThreadReader:
    """For Windows, where pipes cannot be selected on. The thread reads a
    duplicate of the fd so it never reads a recycled fd number after the
    caller closed ``proc.stdout``."""

    def __init__(self, fd: int) -> None:
        self._chunks: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=self._pump, args=(os.dup(fd),), daemon=True).start()

    def _pump(self, fd: int) -> None:
        try:
            while True:
                try:
                    chunk = os.read(fd, _CHUNK)
                except OSError:
                    chunk = b""
                self._chunks.put(chunk)
                if not chunk:
                    return
        finally:
            os.close(fd)

    def read(self, timeout: float | None) -> bytes | None:
        try:
            return self._chunks.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        pass


_open_reader = _ThreadReader if os.name == "nt" else _SelectReader


def _wait_time(deadline: float | None, poll: bool) -> float | None:
    wait = _POLL if poll else None
    if deadline is not None:
        remaining = max(0.0, deadline - time.monotonic())
        wait = remaining if wait is None else min(wait, remaining)
    return wait


def drain_process_output(
    proc: subprocess.Popen,
    timeout: float | None,
    output_callback: Callable[[str], object] | None,
    cancel_event: threading.Event | None = None,
    *,
    pgid: int | None = None,
) -> tuple[str, bool]:
    """``proc.communicate(timeout)`` for ``stdout=PIPE, stderr=STDOUT`` that
    streams lines live and, on timeout or cancel, kills the whole tree instead
    of leaving it running; returns ``(output, timed_out)``.

    Raw reads rather than ``readline`` so a line is delivered the moment it is
    complete and a silent child cannot block deadline or cancel checks. EOF,
    not the leader's exit, ends the drain, so a grandchild's late output is
    kept; the grandchild is still reached by the kill through ``pgid``, which
    should be captured at spawn in case the leader is reaped first.
    """
    stdout = proc.stdout
    if stdout is None:
        raise ValueError("drain_process_output needs a process started with stdout=subprocess.PIPE")
    if pgid is None:
        pgid = capture_process_group(proc)
    deadline = None if timeout is None else time.monotonic() + timeout
    output = _Output(output_callback)
    reader = _open_reader(stdout.fileno())
    stopping = timed_out = eof = False
    try:
        while True:
            now = time.monotonic()
            if not stopping:
                cancelled = cancel_event is not None and cancel_event.is_set()
                timed_out = not cancelled and deadline is not None and now >= deadline
                if cancelled or timed_out:
                    kill_process_tree(proc, pgid)
                    stopping = True
                    deadline = now + _GRACE  # collect what the tree wrote before dying
            elif deadline is not None and now >= deadline:
                break
            wait = _wait_time(deadline, cancel_event is not None and not stopping)
            if eof:
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            chunk = reader.read(wait)
            if chunk:
                output.feed(chunk)
            eof = chunk == b""
        text = output.finish()
        proc.wait()
    finally:
        reader.close()
        stdout.close()
    return text, timed_out
