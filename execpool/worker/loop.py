"""The worker process: many tools at once, on one thread.

Runs as ``python -m execpool.worker READ_FD WRITE_FD``, started clean by the
supervisor (never forked from the caller), with its channel on the two
inherited descriptors and a scrubbed environment. The first message on the
channel is its ``WorkerConfig``. Jobs without a ``cwd`` get a private
directory in its ``jobs_dir``, which the supervisor made and removes when the
worker is gone.

One ``selectors`` loop waits on everything the worker owns:

- the control pipe (Start / Cancel / Shutdown from the supervisor; EOF means
  the process owning the pool is gone, so every tree is killed and the worker
  exits),
- a self-pipe fed by ``signal.set_wakeup_fd``: SIGCHLD reaps every child --
  tool leaders and, because the worker is a child subreaper, any daemon that
  escaped its group and was re-parented here -- so no zombie stays; what each
  reaped process used (``wait4``) is added to the cost of the job it belonged
  to, which its Result carries,
- one non-blocking output pipe per running tool (two for a job that keeps
  stderr apart; it ends at EOF on both),
- the warm template's socket, where the spares the worker asked for arrive,
  and the parked spares' sockets, readable only when a spare died
  (execpool/worker/warm/template.py; execpool/worker/warm/handover.py: how a warm job is handed to
  a spare; execpool/worker/spawn.py: how cold tools are started),
- and a timer heap for deadlines, used as the select timeout.

There are no threads, so starting a tool from here is safe and cheap, and
killing is immediate: a Cancel is handled the moment it is read. The worker
holds every running job's code, environment and stdin, so no job's code
ever runs in a copy of its memory: a cold tool execs straight after its
vfork, and a warm job runs in a spare of a template that never held a job.
Output is read with ``os.read``, kept only as far as the Result needs
(execpool/worker/capture.py), and forwarded live only up to the stream's cap plus
one character (the producer-side cap: a flood never fills any pipe or queue
beyond it).
"""

from __future__ import annotations

import contextlib
import heapq
import importlib.util
import os
import selectors
import shutil
import signal
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Optional

from ..shared.kernel import linux
from ..shared import channel
from ..shared.kernel.cgroups import Cgroups, JobGroup
from ..shared.kernel.proctree import JOB_MARKER_ENV, child_pids, count_tree, is_zombie, kill_tree, marker_of, stat_fields
from ..shared.kernel.dirs import remove_tree
from .warm.handover import WarmJobs
from .rulesets import Confiner
from .job import RunningJob
from .spawn import (DEVNULL, RULESET_BUILDER, give_back_memory, keep_own_peak_resettable, memfd_holding,
                    start_tool)
from .warm.wire import REHEARSE_WHEN_IDLE_S



#: What the supervisor may send once the worker is configured.
_JOB_MESSAGES = (channel.Start, channel.Cancel, channel.Shutdown)

#: One read per wake-up; 64 KiB is a full default pipe buffer.
READ_SIZE = 1 << 16

#: Where no cgroup keeps a job's process cap, the worker counts the job's
#: processes this often and kills the job once it is over: a fork storm is
#: stopped, though it may pass the cap for up to one interval.
PROCESS_COUNT_INTERVAL_S = 0.02

#: A tool that cannot be forked for want of process slots (EAGAIN) is tried
#: this many times, reaping between tries: bounded, since the worker's other
#: jobs wait meanwhile.
SPAWN_ATTEMPTS = 5
SPAWN_RETRY_S = 0.02

#: A job that made the worker hold this many characters (its kept output,
#: its code and stdin) has the worker hand its freed heap back once the
#: Result is out (execpool/worker/spawn.py says why: the next tools' memory
#: figures). Smaller jobs leave nothing worth a trim.
TRIM_AFTER_CHARS = 4 << 20

#: A killed process that is not reaped by then (stuck in the kernel) no
#: longer holds up its job's Result -- nor is it in the Result's cost.
REAP_GRACE_S = 1.0


class Worker:
    """The loop and everything it owns: the jobs by id, by leader pid (until
    it is reaped), by session (until the Result: the leader's pid names the
    session and group of the job's processes) and by output fd (one or two
    per job), the processes a job's kill took outside its session, the
    deadline heap, and the process groups kept alive for ``keep_background``
    jobs until shutdown."""

    def __init__(self, conn_in: Connection, conn_out: Connection, config: channel.WorkerConfig) -> None:
        self.conn_in = conn_in
        self.conn_out = conn_out
        self.token = config.token
        self.spawn_method = config.spawn_method
        self.preload = config.preload
        self.use_cgroups = config.cgroups
        self.jobs_dir = config.jobs_dir
        # Where a job's private directory goes when the job ends: a rename is
        # a quarter of an rmdir here, and the rmdir can wait until the Result
        # is out (the supervisor removes whatever is left with jobs_dir).
        self.trash = os.path.join(self.jobs_dir, ".trash")
        os.mkdir(self.trash, 0o700)
        self.pid = os.getpid()
        self.shell = shutil.which("bash") or "/bin/sh"
        self.sel = selectors.DefaultSelector()
        self.jobs: dict[int, RunningJob] = {}
        self.by_leader: dict[int, RunningJob] = {}
        self.by_session: dict[int, RunningJob] = {}
        self.claimed: dict[int, RunningJob] = {}
        self.jobs_by_fd: dict[int, RunningJob] = {}
        self.timers: list[tuple[float, int, str]] = []
        self.kept_pgids: set[int] = set()
        self.kept_markers: set[str] = set()
        self.cgroup_tier: Optional[Cgroups] = None
        self.cgroups_detected = False
        self.stale_groups: list[JobGroup] = []
        self.confiner: Optional[Confiner] = None
        self.confiner_missing: Optional[str] = None
        self.warm = WarmJobs(self, config.warm_spares)
        self.idle_since: Optional[float] = time.monotonic()  # None while a job runs
        self.stopping = False

    # -- the loop --------------------------------------------------------

    def serve(self) -> None:
        sig_r, sig_w = os.pipe()
        os.set_blocking(sig_r, False)
        os.set_blocking(sig_w, False)
        signal.set_wakeup_fd(sig_w, warn_on_full_buffer=False)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        self.sel.register(sig_r, selectors.EVENT_READ, self._on_signal)
        self.sel.register(self.conn_in.fileno(), selectors.EVENT_READ, self._on_control)
        self._send(channel.Ready(self.pid, self._preload()))
        while not self.stopping:
            for key, _ in self.sel.select(self._next_timeout()):
                key.data(key.fd)
                if self.stopping:
                    break
            self._fire_timers()
        self._shutdown()

    def _cgroups(self) -> Optional[Cgroups]:
        """The cgroup tier, detected the first time a job needs it; None
        where the machine (or the pool) gives execpool none."""
        if not self.cgroups_detected:
            self.cgroups_detected = True
            self.cgroup_tier = Cgroups.detect(self.token) if self.use_cgroups else None
        return self.cgroup_tier

    def _confiner(self) -> Confiner:
        """The sandbox's ruleset maker, made at the first sandboxed job;
        OSError (the same every time) where the kernel lacks what it needs."""
        if self.confiner is None and self.confiner_missing is None:
            try:
                self.confiner = Confiner(RULESET_BUILDER)
            except OSError as exc:
                self.confiner_missing = exc.strerror or str(exc)
        if self.confiner is None:
            raise OSError(self.confiner_missing)
        return self.confiner

    def _preload(self) -> tuple:
        """Find what warm jobs should find already loaded -- the template
        imports it (execpool/worker/warm/template.py), the worker imports none of the
        caller's code -- and report what cannot be found, so the pool can say
        which module is at fault."""
        errors = []
        for name in self.preload:
            try:
                if importlib.util.find_spec(name) is None:
                    errors.append(f"{name}: ModuleNotFoundError: No module named {name!r}")
            except BaseException as exc:  # noqa: BLE001 - any failure is the caller's to see
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
        return tuple(errors)

    def _next_timeout(self) -> Optional[float]:
        if not self.timers:
            return None
        return max(0.0, self.timers[0][0] - time.monotonic())

    def _fire_timers(self) -> None:
        """One heap holds every deadline: a job's timeout ("timeout"), the
        grace a killed job's leader has to be reaped before its Result goes
        out anyway ("reap"), the next count of a job whose process cap the
        worker keeps itself ("count"), and the moment an idle worker has its
        parked spares rehearse ("rehearse", job id 0). Entries of jobs that
        ended otherwise are stale; skip them."""
        now = time.monotonic()
        while self.timers and self.timers[0][0] <= now:
            _, job_id, kind = heapq.heappop(self.timers)
            if kind == "rehearse":
                self.warm.rehearse_if_idle()
                continue
            job = self.jobs.get(job_id)
            if job is None:
                continue
            if kind == "reap":
                if now >= job.killed_at + REAP_GRACE_S:
                    self._finish(job)
            elif job.end_reason is not None:
                continue
            elif kind == "timeout":
                self._end(job, "timeout")
            elif self._over_process_cap(job):
                job.error = f"the job went over its process limit ({job.start.limits.processes}) and was killed"
                self._end(job, "limit")
            else:
                heapq.heappush(self.timers, (now + PROCESS_COUNT_INTERVAL_S, job_id, "count"))

    def _over_process_cap(self, job: RunningJob) -> bool:
        count = count_tree(job.pid if not job.reaped else None, job.marker, self.pid, self._not_strays())
        return count > job.start.limits.processes

    def _send(self, msg: object) -> None:
        try:
            channel.send(self.conn_out, msg)
        except OSError:
            self.stopping = True  # the owner is gone; nobody reads results

    # -- events ----------------------------------------------------------

    def _on_control(self, _fd: int) -> None:
        while not self.stopping:
            try:
                if not self.conn_in.poll():
                    return
                msg = channel.recv(self.conn_in, accept=_JOB_MESSAGES)
            except (EOFError, OSError):
                self.stopping = True
                return
            if isinstance(msg, channel.Start):
                self._start(msg)
            elif isinstance(msg, channel.Cancel):
                job = self.jobs.get(msg.job_id)
                if job is not None and job.end_reason is None:
                    self._end(job, "cancel")
            elif isinstance(msg, channel.Shutdown):
                self.stopping = True

    def _on_signal(self, fd: int) -> None:
        try:
            signums = os.read(fd, 4096)
        except BlockingIOError:
            signums = b""
        if signal.SIGTERM in signums:
            self.stopping = True
        self._reap()

    def _reap(self) -> None:
        """Reap every child that has exited and add what it used to its
        job's cost. Each is looked at before it is reaped (WNOWAIT), while
        its /proc stat still names its session and group. The jobs are
        settled after the last reap, so that a leader's orphans, re-parented
        here as it exited and reaped in the same round, are in its Result."""
        touched = []
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                break
            if info is None:
                break
            pid = info.si_pid
            job = self.by_leader.pop(pid, None)
            owner = self._owner(pid) if job is None else None
            try:
                _pid, status, usage = os.wait4(pid, 0)
            except ChildProcessError:
                continue
            if job is not None:
                if job.start.warm and not self.warm.took(job) and job.end_reason is None:
                    self.by_session.pop(pid, None)  # what that spare used was not the job's either
                    self.warm.requeue(job)  # its spare died parked, before it took the job
                    continue
                job.exit_code = os.waitstatus_to_exitcode(status)
                job.reaped = True
                job.cost.add(usage)
                touched.append(job)
            elif owner is not None:
                owner.cost.add(usage)
                owner.victims.discard(pid)
                touched.append(owner)
            elif not self.warm.spares.exited(pid) and self.stale_groups:
                # the template, a spare, a stray, or a job's process reaped after its Result
                self.stale_groups = [group for group in self.stale_groups if not group.remove()]
        for job in touched:
            self._settle(job)

    def _owner(self, pid: int) -> Optional[RunningJob]:
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
        return claimed

    def _on_output(self, fd: int) -> None:
        job = self.jobs_by_fd.get(fd)
        if job is None:
            return  # an event from the same select batch as the Cancel that closed it
        try:
            data = os.read(fd, READ_SIZE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        capture = job.pipes[fd]
        if data:
            self._consume(job, capture.stream, capture.feed(data))
            return
        self._consume(job, capture.stream, capture.finish())
        self._close_pipe(job, fd)
        if job.eof:
            self._settle(job)

    def _consume(self, job: RunningJob, stream: str, text: str) -> None:
        """Forward live output only up to the stream's cap plus one
        character, counting both of a job's streams against it."""
        if text and job.live is not None and not job.live.capped:
            piece = job.live.take(text)
            if piece:
                self._send(channel.Output(job.start.job_id, piece, stream))

    # -- a job's life ----------------------------------------------------

    def _start(self, start: channel.Start) -> None:
        job = RunningJob(start, f"{self.token}/{start.job_id}")
        self.jobs[start.job_id] = job
        self.idle_since = None
        try:
            argv, env, cwd = self._prepare(job)
            if start.warm:
                self.warm.add(job)
            else:
                self._spawn(job, argv, env, cwd)
        except Exception as exc:  # noqa: BLE001 - any spawn failure is the job's Result
            self.fail_start(job, exc)
            return
        if start.timeout is not None:
            heapq.heappush(self.timers, (job.started + start.timeout, start.job_id, "timeout"))
        if start.limits.processes is not None and job.group is None:
            heapq.heappush(self.timers, (time.monotonic(), start.job_id, "count"))
        if start.warm:
            self.warm.serve()

    def fail_start(self, job: RunningJob, exc: BaseException) -> None:
        job.error = f"cannot start the tool: {exc}"
        job.infra = True
        job.reaped = True
        self._finish(job)

    def _prepare(self, job: RunningJob) -> tuple[list, dict, str]:
        """What every way of starting a tool needs: its directory (a fresh one
        with a name no job can guess), its script, its environment, its cgroup."""
        start = job.start
        if start.cwd is None:
            job.tmpdir = self._private_dir()
        cwd = self.job_cwd(job)
        if start.argv_kind == "python":
            fd, job.script = tempfile.mkstemp(prefix=".execpool-", suffix=".py", dir=cwd)
            with open(fd, "w", encoding="utf-8") as f:
                f.write(start.source)
            argv = [start.python, "-u", job.script]
        else:
            argv = [self.shell, "-c", start.source]
        if start.limits.needs_cgroup:
            tier = self._cgroups()
            if tier is not None and tier.offers(start.limits.processes, start.limits.memory):
                job.group = tier.create(start.job_id, start.limits.processes, start.limits.memory)
            elif start.limits.memory is not None:
                raise OSError("Limits(memory=...) needs a cgroup memory controller, and execpool cannot "
                              "use one here")
            # else: the worker counts the job's processes itself (see _fire_timers)
        if start.sandbox is not None:
            job.private_tmp = job.tmpdir if start.cwd is None else self._private_dir()
            job.sandbox_tmp = None if start.cwd is None else job.private_tmp  # removed with the job
            confiner = self._confiner()
            job.writable = confiner.writable(start.sandbox, (cwd, job.private_tmp))
            job.rulesets = confiner.rulesets(start.python, start.sandbox, (cwd, job.private_tmp))
        return argv, self.job_env(job), cwd

    def _spawn(self, job: RunningJob, argv: list, env: dict, cwd: str) -> None:
        start = job.start
        with self.job_fds(job) as (stdin_fd, join_fds):
            for attempt in range(SPAWN_ATTEMPTS):
                try:
                    pid, readers = start_tool(argv, env, cwd, start.limits, self.spawn_method, stdin_fd,
                                              not start.network, join_fds, start.separate_stderr,
                                              job.confinement(), job.writable)
                    break
                except BlockingIOError:
                    # EAGAIN: the process cap (a cgroup's pids.max, RLIMIT_NPROC)
                    # is full -- often of a killed job's processes, which count
                    # until they are reaped. Reap, give the dying a moment, retry.
                    if attempt == SPAWN_ATTEMPTS - 1:
                        raise
                    self._reap()
                    time.sleep(SPAWN_RETRY_S)
        job.close_rulesets()  # the tool holds its domain now
        self.running(job, pid, readers)

    @contextlib.contextmanager
    def job_fds(self, job: RunningJob):
        """The job's stdin and cgroup.procs files, open for as long as its
        start needs them."""
        fds = []
        try:
            stdin_fd = DEVNULL
            if job.start.stdin is not None:
                stdin_fd = memfd_holding("execpool-stdin", job.start.stdin.encode("utf-8"))
                fds.append(stdin_fd)
            join_fds = [] if job.group is None else [os.open(path, os.O_WRONLY | os.O_CLOEXEC)
                                                     for path in job.group.procs_files()]
            fds.extend(join_fds)
            yield stdin_fd, join_fds
        finally:
            for fd in fds:
                os.close(fd)

    def running(self, job: RunningJob, pid: int, readers: list) -> None:
        """The tool ``pid`` runs; ``readers`` are its output pipes' read ends,
        one per Capture of the job, in the same order."""
        job.pid = pid
        self.by_leader[pid] = job
        self.by_session[pid] = job
        for fd, capture in zip(readers, job.captures, strict=True):
            os.set_blocking(fd, False)
            job.pipes[fd] = capture
            self.jobs_by_fd[fd] = job
            self.sel.register(fd, selectors.EVENT_READ, self._on_output)
        self._send(channel.Spawned(job.start.job_id, pid, pid))

    def job_env(self, job: RunningJob) -> dict:
        env = dict(job.start.env)
        env[JOB_MARKER_ENV] = job.marker
        if job.private_tmp is not None:
            env["TMPDIR"] = job.private_tmp  # the only temporary directory a sandboxed job may write
        return env

    def job_cwd(self, job: RunningJob) -> str:
        return job.tmpdir if job.start.cwd is None else job.start.cwd

    def close_output(self, job: RunningJob) -> None:
        for fd in list(job.pipes):
            self._close_pipe(job, fd)

    def _close_pipe(self, job: RunningJob, fd: int) -> None:
        self.sel.unregister(fd)
        del self.jobs_by_fd[fd]
        del job.pipes[fd]
        os.close(fd)

    def _end(self, job: RunningJob, reason: str) -> None:
        """Timeout or cancel: the one kill path, then wait for the reap."""
        job.end_reason = reason
        if job.pid is None:  # a warm job still waiting for a spare
            self.warm.forget(job)
            job.reaped = True
            self._finish(job)
            return
        job.killed_at = time.monotonic()
        heapq.heappush(self.timers, (job.killed_at + REAP_GRACE_S, job.start.job_id, "reap"))
        job.swept = True
        self._kill(job)
        self.close_output(job)
        self._settle(job)

    def _settle(self, job: RunningJob) -> None:
        """Send the job's Result once its leader is reaped and its output
        closed -- and, unless it keeps background processes, once what it
        left running has been killed and reaped too, so that the Result
        counts it: a matter of a SIGCHLD or two, bounded by REAP_GRACE_S."""
        if job.start.job_id not in self.jobs or not job.reaped or not (job.eof or job.end_reason):
            return
        if job.pid is not None and not job.start.keep_background:
            if not job.swept:
                job.swept = True
                job.killed_at = time.monotonic()
                self._kill(job)
                if self._tree_left(job):
                    heapq.heappush(self.timers, (job.killed_at + REAP_GRACE_S, job.start.job_id, "reap"))
                    return
            elif self._tree_left(job) and time.monotonic() < job.killed_at + REAP_GRACE_S:
                return
        self._finish(job)

    def _tree_left(self, job: RunningJob) -> bool:
        """Whether a process the job's kill took is not reaped yet: one in its
        process group (killpg reaches zombies too), or one it took elsewhere."""
        try:
            os.killpg(job.pid, 0)
            return True
        except ProcessLookupError:
            pass
        except OSError:
            return False  # one the worker may not signal: it was not killed either
        job.victims = {pid for pid in job.victims if _exists(pid)}
        return bool(job.victims)

    def _kill(self, job: RunningJob) -> None:
        victims: set = set()
        kill_tree([job.pid], leader=None if job.reaped else job.pid, marker=job.marker, scope=self.pid,
                  exclude=self._not_strays(), group=job.group, victims=victims)
        victims.discard(job.pid)
        job.victims |= victims
        for pid in victims:
            self.claimed[pid] = job

    def _not_strays(self) -> set:
        """The worker's children that belong to no finished job: the leaders
        of running jobs, the warm template and the parked spares."""
        return {*self.by_leader, *self.warm.spares.pids()}

    def _finish(self, job: RunningJob) -> None:
        if job.start.job_id not in self.jobs:
            return
        del self.jobs[job.start.job_id]
        job.close_rulesets()  # a warm job keeps them until now (a requeue needs them), or the tool never started
        if not self.jobs:
            self.idle_since = time.monotonic()
            heapq.heappush(self.timers, (self.idle_since + REHEARSE_WHEN_IDLE_S, 0, "rehearse"))
        self.close_output(job)
        if job.ready_fd is not None:
            self.warm.took(job)
            self.warm.close_ready(job)
        if job.pid is not None:
            if self.by_session.get(job.pid) is job:
                del self.by_session[job.pid]
            if job.end_reason is None and job.start.keep_background:
                self.kept_pgids.add(job.pid)
                self.kept_markers.add(job.marker)
            elif job.end_reason is None and not job.swept:
                self._kill(job)
        for pid in job.victims:
            if self.claimed.get(pid) is job:
                del self.claimed[pid]
        if job.group is not None:
            job.peak_memory = job.group.peak_memory()
            job.group_cpu = job.group.cpu_seconds()
            if job.group.oom_killed() and job.end_reason is None:
                job.error = f"the job went over its memory limit ({job.start.limits.memory} bytes) and was killed"
            if job.start.keep_background or not job.group.remove():
                self.stale_groups.append(job.group)  # removed once its last process is reaped
        trashed = None
        tmp_trashed = None if job.sandbox_tmp is None else self._discard(job.sandbox_tmp)
        if job.tmpdir is not None:
            trashed = self._discard(job.tmpdir)  # the script in it too
        elif job.script is not None:
            _unlink(job.script)
        self._send(channel.Finished(job.start.job_id, job.result()))
        if trashed is not None:
            if job.script is not None:  # most often all it holds: one rmdir then does
                _unlink(os.path.join(trashed, os.path.basename(job.script)))
            _remove(trashed)
        if tmp_trashed is not None:
            _remove(tmp_trashed)
        self._sweep_strays()  # after the Result: the tree it belongs to is dead already
        if job.held_chars() >= TRIM_AFTER_CHARS:
            for capture in job.captures:
                capture.release()
            give_back_memory()

    def _private_dir(self) -> str:
        """A job's private directory in ``jobs_dir``. A job runs as the
        worker's user and can move ``jobs_dir`` away (its own directory's
        parent): it is made again -- same path, which the supervisor and the
        lifeline remove -- rather than every later job failing to start."""
        try:
            return tempfile.mkdtemp(dir=self.jobs_dir)
        except FileNotFoundError:
            for path in (self.jobs_dir, self.trash):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path, 0o700)
            return tempfile.mkdtemp(dir=self.jobs_dir)

    def _discard(self, path: str) -> Optional[str]:
        """Take a private directory off its path now; return where it went,
        for the caller to delete once the Result is out (None: gone already)."""
        trashed = os.path.join(self.trash, os.path.basename(path))
        try:
            os.rename(path, trashed)
        except OSError:
            _remove(path)
            return None
        return trashed

    def _sweep_strays(self) -> None:
        """Strays that cleared their environment cannot be attributed to a
        job; once no job is left they cannot belong to a live one. Spared:
        the template and its spares (also one on its way, a child of the
        worker before the worker knows its pid), and what ``keep_background``
        jobs left, by group or marker."""
        if self.jobs:
            return
        keep = self._not_strays()
        for pid in child_pids(self.pid):
            if pid in keep or is_zombie(pid) or self.warm.spares.made(pid) or self._kept(pid):
                continue
            kill_tree(leader=pid)

    def _kept(self, pid: int) -> bool:
        if not self.kept_pgids:
            return False
        try:
            if os.getpgid(pid) in self.kept_pgids:
                return True
        except OSError:
            return False
        return (marker_of(pid) or "").strip() in self.kept_markers

    def _shutdown(self) -> None:
        """Everything below the worker dies first, then every job still
        running gets its Result (INFRA: the pool was closed under it). A job
        that had ended and was only waiting for its leftovers to be reaped
        keeps its own outcome."""
        pgids = self.kept_pgids | {job.pid for job in self.jobs.values() if job.pid is not None}
        kill_tree(pgids, leader=self.pid, marker=self.token, scope=self.pid)
        for job in list(self.jobs.values()):
            if job.end_reason is None and not job.swept:
                # execpool's doing, not the program's: INFRA, worth running again.
                job.end_reason = "shutdown"
                job.error = "the pool was closed while this job ran; its process tree was killed"
                job.infra = True
            job.reaped = True
            self._finish(job)
        self.warm.close()
        self._reap()
        if self.cgroup_tier is not None:
            self.cgroup_tier.close()


def _remove(path: str) -> None:
    """Whatever a job left at ``path``, never following a link it put
    there. Most private directories are empty: one rmdir, not rmtree's walk."""
    try:
        os.rmdir(path)
    except NotADirectoryError:
        _unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        remove_tree(path)


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _exists(pid: int) -> bool:
    """Alive or a zombie not yet reaped -- and still the worker's to signal:
    a pid that went to another user's process since is no victim of ours."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def main(argv: list) -> None:
    read_fd, write_fd = map(int, argv)
    for fd in (read_fd, write_fd):
        os.set_inheritable(fd, False)
    linux.prctl(linux.PR_SET_CHILD_SUBREAPER, 1)
    keep_own_peak_resettable()  # while /proc/self is still this process's own to open
    # Tools run as this user: without this, one could open /proc/<worker>/fd
    # and write into the channel. Exec makes each tool dumpable again.
    linux.prctl(linux.PR_SET_DUMPABLE, 0)
    conn_in = Connection(read_fd, writable=False)
    try:
        config = channel.recv(conn_in, accept=(channel.WorkerConfig,))
    except (EOFError, OSError):
        return  # the pool is gone (or garbled its channel) before it said what to do
    Worker(conn_in, Connection(write_fd, readable=False), config).serve()

