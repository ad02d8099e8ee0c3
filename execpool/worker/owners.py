"""Whose is each process below the worker, and the worker's side of the one
kill path.

Runs in the worker process, on its loop (execpool/worker/event_loop.py). The
worker is a child subreaper: everything its jobs start stays below it, and
every process it reaps is added to the cost of the job it belonged to. A
job's processes are found by its leader (until the leader is reaped), by
its session and process group (the leader's pid names both, until the
Result), by the kill that took them (for those that left both), by the
job's marker in their environment, and, for a sandboxed job, by its user
namespace (execpool/worker/userns.py), which no process of it can leave;
what belongs to no job and no finished job's ``keep_background`` -- an
unsandboxed job's stray that left its session and cleared its environment
-- is killed once no job runs.
"""

from __future__ import annotations

import os
from typing import Callable, Dict, Iterable, List, Optional, Set

from ..shared.kernel.cgroups import JobGroup
from ..shared.kernel.proctree import (
    child_pids,
    count_tree,
    is_zombie,
    kill_born_since,
    kill_tree,
    marker_of,
    stat_fields,
)
from .running_job import RunningJob
from .userns import ancestry, identity

#: The kernel's ceiling on pid numbers (PID_MAX_LIMIT on 64-bit).
PID_MAX_LIMIT = 1 << 22


class Tree:
    """The worker's book of its jobs' processes."""

    def __init__(self, worker_pid: int, helpers: Callable[[], Set[int]], spare_made: Callable[[int], bool]) -> None:
        self.worker_pid = worker_pid
        # The warm template, its parked spares and the worker's helpers
        # (execpool/worker/helper_forks.py): children of the worker that belong
        # to no job; and whether a pid is a spare on its way.
        self._helpers = helpers
        self._spare_made = spare_made
        self.by_leader: Dict[int, RunningJob] = {}
        self.by_session: Dict[int, RunningJob] = {}
        # Processes a job's kill took outside its session and group.
        self.claimed: Dict[int, RunningJob] = {}
        # Running sandboxed jobs by their user namespace's inode number.
        self.by_userns: Dict[int, RunningJob] = {}
        # What keep_background jobs left running, kept until shutdown; a
        # kept user namespace is held (by a descriptor, its number's to the
        # value) so that the kernel gives its number to no other.
        self.kept_pgids: Set[int] = set()
        self.kept_markers: Set[str] = set()
        self.kept_userns: Dict[int, int] = {}
        # Job cgroups that still held a process at their job's end.
        self.stale_groups: List[JobGroup] = []

    def is_copy(self, pid: int, job: RunningJob) -> bool:
        """Whether ``pid`` is the copy a session says it forked for ``job``
        (execpool/tool/session_fork.py): the worker's child, not yet
        reaped, no job's leader nor a helper, and marked as ``job``'s --
        the copy stamps the marker before it says its pid, and a session can
        stamp no process but its own, so it cannot hand the worker another
        job's process to be killed as the copy's."""
        if not 0 < pid <= PID_MAX_LIMIT or pid in self.not_strays():
            return False  # the session's word: any number, a C int's overflow included
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except (ChildProcessError, OSError):
            return False
        return (marker_of(pid) or "").strip() == job.marker

    def started(self, job: RunningJob, pid: int) -> None:
        self.by_leader[pid] = job
        self.by_session[pid] = job
        if job.user_ns >= 0:
            self.by_userns[identity(job.user_ns)] = job

    def leader(self, pid: int) -> Optional[RunningJob]:
        """The job whose leader ``pid`` was, now that it exited (once)."""
        return self.by_leader.pop(pid, None)

    def owner(self, pid: int) -> Optional[RunningJob]:
        """The running job a dead process other than a leader belonged to: by
        its process group or session (a job's are its leader's pid), or, for
        one that left both, by the kill that took it. None for the template,
        a spare, and a process that left its job's session and group and was
        not taken by the kill path (it ended on its own while the job ran, or
        it cleared its environment too)."""
        claimed = self.claimed.pop(pid, None)
        if not self.by_session:
            return claimed
        for field in stat_fields(pid)[2:4]:  # pgrp, session
            job = self.by_session.get(int(field))
            if job is not None:
                return job
        return claimed or self._named(pid)

    def _named(self, pid: int) -> Optional[RunningJob]:
        """The running sandboxed job whose user namespace is ``pid``'s or
        nearest above it (a session's copy is in its parent's)."""
        if self.by_userns:
            for ino in ancestry(pid):
                job = self.by_userns.get(ino)
                if job is not None:
                    return job
        return None

    def _naming(self, job: RunningJob) -> Optional[Callable[[int], bool]]:
        """What says of a process that it is ``job``'s by its user
        namespace (None for a job without one)."""
        if job.user_ns < 0:
            return None
        return lambda pid: self._named(pid) is job

    def forget_session(self, pid: int) -> None:
        """A spare's session: it died before it took its job, and nothing it
        did was the job's."""
        self.by_session.pop(pid, None)

    def kill(self, job: RunningJob) -> None:
        """The one kill path for the job's tree (execpool/shared/kernel/proctree.py);
        what it took outside the job's session is remembered as the job's."""
        assert job.pid is not None
        victims: set = set()
        kill_tree([job.pid], leader=job.pid if job.leader_alive else None, marker=job.marker,
                  scope=self.worker_pid, exclude=self.not_strays(), group=job.group, victims=victims,
                  spared=self._spare_made, named=self._naming(job))
        victims.discard(job.pid)
        self._claim(job, victims)

    def kill_marked(self, marker: str) -> None:
        """The worker's children marked ``marker`` and their trees: a
        session's copy whose job never ran (its fork failed or was denied)."""
        kill_tree(marker=marker, scope=self.worker_pid, exclude=self.not_strays(), spared=self._spare_made)

    def kill_cell(self, job: RunningJob, since: int) -> None:
        """A cancelled cell's processes: those of the session that began
        since boot tick ``since`` (execpool/shared/kernel/proctree.py),
        remembered as the session's like any its kill took. None while no
        interpreter has taken the session yet: its cell started nothing."""
        if job.pid is None:
            return
        victims: set = set()
        kill_born_since(job.pid, since, marker=job.marker, scope=self.worker_pid, exclude=self.not_strays(),
                        group=job.group, spared=self._spare_made, victims=victims, named=self._naming(job))
        self._claim(job, victims)

    def _claim(self, job: RunningJob, victims: Set[int]) -> None:
        """What a kill took is the job's: waited for, and counted as its."""
        job.victims |= victims
        for pid in victims:
            self.claimed[pid] = job

    def left(self, job: RunningJob) -> bool:
        """Whether a process the job's kill took is not reaped yet: one in its
        process group (killpg reaches zombies too), or one it took elsewhere."""
        assert job.pid is not None
        try:
            os.killpg(job.pid, 0)
            return True
        except ProcessLookupError:
            pass
        except OSError:
            return False  # one the worker may not signal: it was not killed either
        job.victims = {pid for pid in job.victims if _exists(pid)}
        return bool(job.victims)

    def over_cap(self, job: RunningJob) -> bool:
        """Whether the job has more processes than its cap (where the worker
        counts them itself)."""
        count = count_tree(job.pid if job.leader_alive else None, job.marker, self.worker_pid, self.not_strays(),
                           self._spare_made, self._naming(job))
        cap = job.start.limits.processes
        return cap is not None and count > cap

    def finished(self, job: RunningJob, keep: bool) -> None:
        """The job's Result goes out: its session is no longer its; with
        ``keep`` (keep_background, and it was not ended by the worker) what
        it left running stays until shutdown, spared by the stray sweep."""
        if job.pid is not None:
            if self.by_session.get(job.pid) is job:
                del self.by_session[job.pid]
            # A leader reaped after its job's Result (the pool closed, or it
            # outlived the wait for its kill) is nobody's: the job has ended.
            if self.by_leader.get(job.pid) is job:
                del self.by_leader[job.pid]
            if keep:
                self.kept_pgids.add(job.pid)
                self.kept_markers.add(job.marker)
        if job.user_ns >= 0:
            ino = identity(job.user_ns)
            self.by_userns.pop(ino, None)
            if keep and job.pid is not None:
                self.kept_userns[ino] = os.dup(job.user_ns)
        for pid in job.victims:
            if self.claimed.get(pid) is job:
                del self.claimed[pid]

    def stale(self, group: JobGroup) -> None:
        """A job cgroup to remove once its last process is reaped."""
        self.stale_groups.append(group)

    def remove_stale(self) -> None:
        if self.stale_groups:
            self.stale_groups = [group for group in self.stale_groups if not group.remove()]

    def not_strays(self) -> Set[int]:
        """The worker's children that belong to no finished job: the leaders
        of running jobs, the warm template, the parked spares and the helpers."""
        return {*self.by_leader, *self._helpers()}

    def sweep_strays(self) -> None:
        """Kill the worker's children no running job can own (call it only
        when none runs). Spared: the template and its spares (also one on
        its way, a child of the worker before the worker knows its pid), the
        helpers, and what ``keep_background`` jobs left, by group or marker."""
        keep = self.not_strays()
        for pid in child_pids(self.worker_pid):
            if pid in keep or is_zombie(pid) or self._spare_made(pid) or self._kept(pid):
                continue
            kill_tree(leader=pid)

    def kill_all(self, running: Iterable[int], token: str, spare: Iterable[int] = ()) -> None:
        """At shutdown: every job's group, what keep_background jobs left,
        and everything below the worker -- but ``spare``: the remover, which
        finishes the trash before the worker exits."""
        kill_tree(self.kept_pgids | set(running), leader=self.worker_pid, marker=token, scope=self.worker_pid,
                  exclude=spare)

    def _kept(self, pid: int) -> bool:
        if not self.kept_pgids:
            return False
        try:
            if os.getpgid(pid) in self.kept_pgids:
                return True
        except OSError:
            return False
        if self.kept_userns and any(ino in self.kept_userns for ino in ancestry(pid)):
            return True
        return (marker_of(pid) or "").strip() in self.kept_markers


def _exists(pid: int) -> bool:
    """Alive or a zombie not yet reaped -- and still the worker's to signal:
    a pid that went to another user's process since is no victim of ours."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True
