"""The optional cgroup tiers: a group per worker, so that nothing a job
started outlives its worker or the pool, and a group per job, for a cap on
its processes that holds for root (RLIMIT_NPROC does not), a cap on its
memory, and a kill that reaches every process of the job whatever it did to
its session, group or environment.

- :class:`WorkerGroup` -- made by the supervisor for each worker it starts,
  killed and removed by the supervisor when that worker exits and by the
  pool's lifeline (execpool/lifeline/process.py) when the pool's owner died. cgroup
  v2 only (it needs ``cgroup.kill``, Linux 5.14) and no controller at all:
  any writable v2 hierarchy will do, also one with no controllers enabled.
  ``execpool-<worker token>`` below the owner's own v2 group, with the worker
  in its leaf ``worker``.
- :class:`Cgroups` -- the per-job tier, in the worker (creating, joining,
  killing, removing) and in the supervisor (removing what a crashed worker
  left). Detected at first use, never required: where no usable ``pids``
  controller exists the worker keeps a job's process cap by counting
  (execpool/worker/event_loop.py), and a job that asks for ``Limits(memory=...)``
  without a ``memory`` controller gets a clear ``Execution error``. One
  ``execpool-<worker token>`` directory per controller (on v2, for a worker
  in its WorkerGroup, that group) and one ``job-<id>`` directory per job
  inside it. cgroup v2 is used where the worker's group delegates the
  controllers; v1 otherwise, with the ``pids`` and ``memory`` hierarchies.

Both tiers create and remove only their own groups; where neither can be
made, killing falls back to process groups and job markers
(execpool/shared/kernel/proctree.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Iterable, Iterator, Optional

#: Rounds of "kill every pid listed" before giving up on a v1 group; a group
#: under a pids cap cannot outgrow a round by more than the cap.
_KILL_ROUNDS = 16

#: The leaf a worker's own process sits in, inside its WorkerGroup: a v2
#: group with processes of its own cannot hand controllers to child groups,
#: so the worker lives in a leaf and its jobs' groups are the leaf's siblings.
WORKER_LEAF = "worker"

#: How often a WorkerGroup being destroyed is looked at until it is empty.
_EMPTY_POLL_S = 0.002


def _own_groups() -> dict:
    """controller name (or "" for v2) -> this process's cgroup path."""
    groups = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _id, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                groups[name] = path
    return groups


def _mounts() -> dict:
    """controller name (or "" for v2) -> mount point."""
    mounts: dict = {}
    with open("/proc/self/mounts") as f:
        for line in f:
            _dev, point, fstype, options = line.split()[:4]
            if fstype == "cgroup2":
                mounts.setdefault("", point)
            elif fstype == "cgroup":
                for option in options.split(","):
                    mounts.setdefault(option, point)
    return mounts


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class JobGroup:
    """One job's cgroup directories (one per controller on v1)."""

    def __init__(self, paths: list, version: int) -> None:
        self.paths = paths
        self.version = version

    def procs_files(self) -> list:
        return [os.path.join(path, "cgroup.procs") for path in self.paths]

    def add(self, pid: int) -> None:
        """Move a process (every thread of it) into the group; OSError if
        it cannot go."""
        for procs in self.procs_files():
            _write(procs, str(pid))

    def pids(self) -> set:
        found: set = set()
        for procs in self.procs_files():
            try:
                with open(procs) as f:
                    found.update(int(pid) for pid in f.read().split())
            except OSError:
                pass
        return found

    @contextlib.contextmanager
    def forks_held(self) -> Iterator[None]:
        """No process of the group can fork meanwhile (its ``pids.max`` is
        0, then what it was): a kill of some of its processes that must not
        miss one forking as it dies. Nothing held where it has no pids
        controller."""
        held = []
        for path in self.paths:
            limit = os.path.join(path, "pids.max")
            try:
                with open(limit) as f:
                    was = f.read().strip()
                _write(limit, "0")
            except OSError:
                continue
            held.append((limit, was))
        try:
            yield
        finally:
            for limit, was in held:
                try:
                    _write(limit, was)
                except OSError:
                    pass  # the group is gone

    def kill(self) -> None:
        """SIGKILL everything in the group. v2 has one write for it; on v1 a
        few rounds of killing what is listed end even a fork storm: its
        ``pids.max`` is 0 first, so nothing new appears between two rounds."""
        for path in self.paths:
            try:
                _write(os.path.join(path, "pids.max"), "0")
            except OSError:
                continue
        if self.version == 2:
            try:
                _write(os.path.join(self.paths[0], "cgroup.kill"), "1")
                return
            except OSError:
                pass  # kernels before 5.14: no cgroup.kill
        for _ in range(_KILL_ROUNDS):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of this job for its memory cap."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for path in self.paths:
            try:
                with open(os.path.join(path, name)) as f:
                    for line in f:
                        key, _, value = line.partition(" ")
                        if key == "oom_kill" and int(value) > 0:
                            return True
            except (OSError, ValueError):
                continue
        return False

    def peak_memory(self) -> Optional[int]:
        """The group's memory peak in bytes (v2 ``memory.peak``, v1
        ``memory.max_usage_in_bytes``); None without a memory controller."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        for path in self.paths:
            try:
                with open(os.path.join(path, name), "rb") as f:
                    return int(f.read())
            except (OSError, ValueError):
                continue
        return None

    def cpu_seconds(self) -> Optional[tuple[float, float]]:
        """(user, system) CPU seconds of every process that ran in the group,
        reaped or not: v2 keeps ``cpu.stat`` in every group, controllers or
        none. None on v1 (execpool's v1 groups are ``pids`` and ``memory``)."""
        if self.version != 2:
            return None
        try:
            with open(os.path.join(self.paths[0], "cpu.stat"), "rb") as f:
                stat = dict(line.split() for line in f.read().splitlines() if line.count(b" ") == 1)
            return int(stat[b"user_usec"]) / 1e6, int(stat[b"system_usec"]) / 1e6
        except (OSError, KeyError, ValueError):
            return None

    def remove(self) -> bool:
        """rmdir the group; False while a process of it is not yet reaped."""
        done = True
        for path in self.paths:
            try:
                os.rmdir(path)
            except FileNotFoundError:
                pass
            except OSError:
                done = False
        return done


#: Why a job with ``Limits(memory=...)`` cannot start where no memory
#: controller is writable: the service tells this apart from a passing
#: failure to start.
MEMORY_NEEDS_CGROUP = "Limits(memory=...) needs a cgroup memory controller, and execpool cannot use one here"


class Cgroups:
    """The worker's own cgroup directories, parents of its jobs' groups."""

    def __init__(self, bases: dict, version: int) -> None:
        self.bases = bases  # controller -> the worker's execpool-<token> directory
        self.version = version

    @classmethod
    def detect(cls, token: str) -> Optional["Cgroups"]:
        """The tier if this process may create groups with the pids and/or
        memory controllers here, else None. A worker in the leaf of its
        WorkerGroup has that group hold its jobs' groups too."""
        try:
            groups, mounts = _own_groups(), _mounts()
        except OSError:
            return None
        if "" in mounts and "" in groups:
            own = mounts[""] + groups[""]
            if own.endswith(f"/execpool-{token}/{WORKER_LEAF}"):
                # The worker sits in the leaf of its WorkerGroup: the jobs'
                # groups go beside the leaf, with what the group is offered.
                base = os.path.dirname(own)
                usable = _read_set(os.path.join(base, "cgroup.controllers")) & {"pids", "memory"}
                if usable and _enable(base, usable):
                    return cls({name: base for name in usable}, 2)
            else:
                usable = _read_set(os.path.join(own, "cgroup.subtree_control")) & {"pids", "memory"}
                base = os.path.join(own, f"execpool-{token}")
                if usable and _try_mkdir(base) and _enable(base, usable):
                    return cls({name: base for name in usable}, 2)
        bases = {}
        for name in ("pids", "memory"):
            if name in mounts and name in groups:
                base = os.path.join(mounts[name] + groups[name], f"execpool-{token}")
                if _try_mkdir(base):
                    bases[name] = base
        return cls(bases, 1) if bases else None

    def offers(self, processes: Optional[int], memory: Optional[int]) -> bool:
        """Whether every cap asked for has its controller here."""
        return (processes is None or "pids" in self.bases) and (memory is None or "memory" in self.bases)

    def create(self, job_id: int, processes: Optional[int], memory: Optional[int]) -> JobGroup:
        """A group for one job with its caps; raises OSError naming what is missing."""
        wanted = {"pids": processes, "memory": memory}
        missing = [name for name, value in wanted.items() if value is not None and name not in self.bases]
        if missing:
            raise OSError(f"the cgroup {' and '.join(missing)} controller is not available to execpool here")
        paths = sorted({self.bases[name] for name, value in wanted.items() if value is not None})
        paths = [os.path.join(base, f"job-{job_id}") for base in paths]
        group = JobGroup(paths, self.version)
        try:
            for path in paths:
                os.mkdir(path)
            for name, value in wanted.items():
                if value is None:
                    continue
                directory = os.path.join(self.bases[name], f"job-{job_id}")
                if name == "pids":
                    _write(os.path.join(directory, "pids.max"), str(value))
                elif self.version == 2:
                    _write(os.path.join(directory, "memory.max"), str(value))
                    if os.path.exists(os.path.join(directory, "memory.swap.max")):
                        _write(os.path.join(directory, "memory.swap.max"), "0")
                else:
                    _write(os.path.join(directory, "memory.limit_in_bytes"), str(value))
        except OSError:
            group.remove()
            raise
        return group

    def close(self) -> None:
        remove_tree(self.bases.values())


def _read_set(path: str) -> set:
    try:
        with open(path) as f:
            return set(f.read().split())
    except OSError:
        return set()


def _enable(group: str, controllers: set) -> bool:
    try:
        _write(os.path.join(group, "cgroup.subtree_control"), " ".join(f"+{name}" for name in sorted(controllers)))
        return True
    except OSError:
        return False


def _try_mkdir(path: str) -> bool:
    try:
        os.mkdir(path)
        return True
    except FileExistsError:
        return True
    except OSError:
        return False


def remove_tree(bases: Iterable[str]) -> None:
    """Kill whatever is left in a worker's groups and remove them: used at
    worker shutdown, and by the supervisor for a worker that died."""
    for base in set(bases):
        try:
            jobs = [os.path.join(base, entry) for entry in os.listdir(base) if entry.startswith("job-")]
        except OSError:
            continue
        for path in jobs:
            group = JobGroup([path], 1)
            group.kill()
            group.remove()
        try:
            os.rmdir(base)
        except OSError:
            pass


def worker_bases(token: str) -> list:
    """Where a worker with this token would have put its groups (for the
    supervisor, which has not detected anything itself)."""
    try:
        groups, mounts = _own_groups(), _mounts()
    except OSError:
        return []
    candidates = []
    for name, point in mounts.items():
        if name in groups:
            candidates.append(os.path.join(point + groups[name], f"execpool-{token}"))
    return [path for path in candidates if os.path.isdir(path)]


class WorkerGroup:
    """One worker's cgroup v2 group: ``cgroup.kill`` on it ends the worker
    and everything its jobs started -- also a daemon that left its session,
    cleared its environment and was re-parented to init -- which is what
    lets the pool promise that nothing outlives a worker, ``close()`` or the
    pool's owner.

    The supervisor creates it before starting the worker and moves the
    worker in right after ``Popen`` returns, before any job is sent (a
    worker forks nothing before its first job), so every process of every
    job is born inside. Where no v2 hierarchy is writable below the owner's
    own group (a non-root user without a delegated subtree; a kernel without
    ``cgroup.kill``) :meth:`create` returns None and the pool falls back to
    process groups and job markers, which a process that left its session
    and cleared its environment escapes.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def create(cls, token: str) -> Optional["WorkerGroup"]:
        """The group for the worker with this token, or None where none can be made."""
        try:
            groups, mounts = _own_groups(), _mounts()
        except OSError:
            return None
        if "" not in mounts or "" not in groups:
            return None
        group = cls(os.path.join(mounts[""] + groups[""], f"execpool-{token}"))
        try:
            os.mkdir(group.path)
        except OSError:
            return None
        try:
            os.mkdir(os.path.join(group.path, WORKER_LEAF))
        except OSError:
            group.remove()
            return None
        if not os.path.exists(os.path.join(group.path, "cgroup.kill")):
            group.remove()
            return None
        return group

    def add(self, pid: int) -> bool:
        """Move a process into the worker's leaf."""
        try:
            _write(os.path.join(self.path, WORKER_LEAF, "cgroup.procs"), str(pid))
            return True
        except OSError:
            return False

    def populated(self) -> bool:
        """Whether a live process is left anywhere in the group (zombies do
        not count: they no longer hold a group)."""
        try:
            with open(os.path.join(self.path, "cgroup.events")) as f:
                return "populated 1" in f.read()
        except OSError:
            return False

    def kill(self) -> bool:
        """SIGKILL everything in the group, without waiting; False if the
        group is gone already."""
        try:
            _write(os.path.join(self.path, "cgroup.kill"), "1")
        except FileNotFoundError:
            return False
        except OSError:
            pass
        return True

    def destroy(self, timeout: float) -> bool:
        """SIGKILL everything in the group, wait (at most ``timeout``) until
        it is empty, and remove it; False if something outlasted that."""
        if not self.kill():
            return True  # destroyed already
        deadline = time.monotonic() + timeout
        while self.populated() and time.monotonic() < deadline:
            time.sleep(_EMPTY_POLL_S)
        return self.remove()

    def remove(self) -> bool:
        """rmdir the group and the groups inside it, deepest first."""
        for directory, _subdirs, _files in os.walk(self.path, topdown=False):
            try:
                os.rmdir(directory)
            except FileNotFoundError:
                pass
            except OSError:
                return False
        return True
