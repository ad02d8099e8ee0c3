"""The worker process: many tools at once, on one thread.

Runs as ``python -m execpool.worker READ_FD WRITE_FD TOKEN METHOD PRELOAD CGROUPS JOBS_DIR SPARES``,
started clean by the supervisor (never forked from the caller), with its
channel on the two inherited pipe fds and a scrubbed environment. Jobs without
a ``cwd`` get a private directory in JOBS_DIR, which the supervisor made and
removes when the worker is gone.

One ``selectors`` loop waits on everything the worker owns:

- the control pipe (Start / Cancel / Shutdown from the supervisor; EOF means
  the process owning the pool is gone, so every tree is killed and the worker
  exits),
- a self-pipe fed by ``signal.set_wakeup_fd``: SIGCHLD reaps every child --
  tool leaders and, because the worker is a child subreaper, any daemon that
  escaped its group and was re-parented here -- so no zombie stays,
- one non-blocking stdout pipe per running tool,
- the warm template's socket, where the spares the worker asked for arrive
  (execpool/spawn.py: how tools are started),
- and a timer heap for deadlines, used as the select timeout.

There are no threads, so forking a tool from here is safe and cheap (the
worker's memory is small), and killing is immediate: a Cancel is handled the
moment it is read. Output is read with ``os.read`` and decoded incrementally
(UTF-8 with replacement, universal newlines), forwarded live only up to the
stream's cap plus one character (the producer-side cap: a flood never fills
any pipe or queue beyond it), and kept only as far as the Result needs.
"""

from __future__ import annotations

import codecs
import contextlib
import gc
import heapq
import importlib
import io
import os
import selectors
import shutil
import signal
import sys
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Optional

from . import _linux, channel
from .cgroups import Cgroups, JobGroup
from .proctree import JOB_MARKER_ENV, child_pids, count_tree, is_zombie, kill_tree
from .result import Result
from .spawn import WarmSpare, WarmTemplate, start_tool



#: One read per wake-up; 64 KiB is a full default pipe buffer.
READ_SIZE = 1 << 16

#: Lines that name a missing file are kept past the output head, because the
#: model-facing missing-path hint is computed from them.
ERROR_LINE_MARKERS = ("FileNotFoundError", "No such file or directory")
MAX_ERROR_LINES = 32
MAX_ERROR_LINE_CHARS = 4096

#: Where no cgroup keeps a job's process cap, the worker counts the job's
#: processes this often and kills the job once it is over: a fork storm is
#: stopped, though it may pass the cap for up to one interval.
PROCESS_COUNT_INTERVAL_S = 0.02

#: A warm job that starts after the worker ran nothing for this long has the
#: worker make spares for the next ones.
SPARE_QUIET_S = 0.01

#: A killed leader that is not reaped by then (stuck in the kernel) no longer
#: holds up its Result.
REAP_GRACE_S = 1.0

class _Capture:
    """The bounded part of a tool's output that its Result needs: a head of at
    most ``max_chars``, the total length, and the lines naming missing files."""

    def __init__(self, max_chars: int) -> None:
        self.head: list[str] = []
        self.kept = 0
        self.total = 0
        self.max_chars = max_chars
        self.partial = ""
        self.error_lines: deque[str] = deque(maxlen=MAX_ERROR_LINES)

    def feed(self, text: str) -> None:
        self.total += len(text)
        room = self.max_chars - self.kept
        if room > 0:
            piece = text[:room]
            self.head.append(piece)
            self.kept += len(piece)
        joined = self.partial + text
        if any(marker in joined for marker in ERROR_LINE_MARKERS):
            lines = joined.split("\n")
            joined = lines.pop()
            self.error_lines.extend(
                line[-MAX_ERROR_LINE_CHARS:]
                for line in lines
                if any(marker in line for marker in ERROR_LINE_MARKERS)
            )
        else:
            joined = joined[joined.rfind("\n") + 1 :]
        self.partial = joined[-MAX_ERROR_LINE_CHARS:]

    def finish(self) -> None:
        if any(marker in self.partial for marker in ERROR_LINE_MARKERS):
            self.error_lines.append(self.partial)
        self.partial = ""


class _Job:
    """One running tool, as the worker sees it."""

    def __init__(self, start: channel.Start, marker: str) -> None:
        self.start = start
        self.marker = marker
        self.pid: Optional[int] = None
        self.fd: Optional[int] = None
        self.exit_code: Optional[int] = None
        self.reaped = False
        self.eof = False
        self.end_reason: Optional[str] = None  # "timeout" | "cancel" | "limit"
        self.killed_at = 0.0
        self.error: Optional[str] = None
        self.capture = _Capture(start.max_output_chars)
        self.decoder = io.IncrementalNewlineDecoder(
            codecs.getincrementaldecoder("utf-8")("replace"), translate=True
        )
        self.live_sent = 0
        self.started = time.monotonic()
        self.tmpdir: Optional[str] = None
        self.script: Optional[str] = None
        self.group: Optional[JobGroup] = None


def _stdin_file(text: str) -> int:
    """An anonymous file holding a job's stdin, rewound, so the tool reads it
    at its own pace and the worker never blocks writing it."""
    fd = os.memfd_create("execpool-stdin", os.MFD_CLOEXEC)
    data = text.encode("utf-8")
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class Worker:
    """The loop and everything it owns: the jobs by id, by leader pid and by
    output fd, the deadline heap, and the process groups kept alive for
    ``keep_background`` jobs until shutdown."""

    def __init__(self, conn_in: Connection, conn_out: Connection, token: str, spawn_method: str,
                 preload: tuple, use_cgroups: bool, jobs_dir: str, warm_spares: int) -> None:
        self.conn_in = conn_in
        self.conn_out = conn_out
        self.token = token
        self.spawn_method = spawn_method
        self.preload = preload
        self.use_cgroups = use_cgroups
        self.jobs_dir = jobs_dir
        # Where a job's private directory goes when the job ends: a rename is
        # a quarter of an rmdir here, and the rmdir can wait until the Result
        # is out (the supervisor removes whatever is left with jobs_dir).
        self.trash = os.path.join(jobs_dir, ".trash")
        os.mkdir(self.trash, 0o700)
        self.pid = os.getpid()
        self.shell = shutil.which("bash") or "/bin/sh"
        self.sel = selectors.DefaultSelector()
        self.jobs: dict[int, _Job] = {}
        self.by_leader: dict[int, _Job] = {}
        self.jobs_by_fd: dict[int, _Job] = {}
        self.timers: list[tuple[float, int, str]] = []
        self.kept_pgids: set[int] = set()
        self.cgroup_tier: Optional[Cgroups] = None
        self.cgroups_detected = False
        self.stale_groups: list[JobGroup] = []
        self.template: Optional[WarmTemplate] = None
        self.warm_spares = warm_spares
        self.spares: dict[int, WarmSpare] = {}
        self.spares_asked = 0
        self.idle_since = -SPARE_QUIET_S  # when the last running job ended
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

    def _ask_for_spares(self) -> None:
        """After each warm start, so the next warm jobs find spares parked
        (execpool/spawn.py); the template is forked at the first."""
        if self.stopping or not self.warm_spares:
            return
        if self.template is None:
            try:
                self.template = WarmTemplate()
            except OSError:
                return  # out of processes or memory: warm jobs fork as they come
            self.sel.register(self.template.sock, selectors.EVENT_READ, self._on_template)
        while len(self.spares) + self.spares_asked < self.warm_spares:
            self.template.ask()
            self.spares_asked += 1

    def _on_template(self, _fd: int) -> None:
        spare = self.template.receive()
        if spare is None:
            self._drop_template()
        else:
            self.spares_asked -= 1
            self.spares[spare.pid] = spare
            self._sweep_strays()  # the one a Result skipped while the spare was on its way

    def _drop_template(self) -> None:
        """It died (or shutdown): the next warm start makes a new one."""
        self.sel.unregister(self.template.sock)
        self.template.close()
        self.template = None
        self.spares_asked = 0
        self._sweep_strays()

    def _cgroups(self) -> Optional[Cgroups]:
        """The cgroup tier, detected the first time a job needs it; None
        where the machine (or the pool) gives execpool none."""
        if not self.cgroups_detected:
            self.cgroups_detected = True
            self.cgroup_tier = Cgroups.detect(self.token) if self.use_cgroups else None
        return self.cgroup_tier

    def _preload(self) -> tuple:
        """Import what warm jobs should find already loaded; report failures
        instead of dying, so the pool can say which module is at fault."""
        errors = []
        for name in self.preload:
            try:
                importlib.import_module(name)
            except BaseException as exc:  # noqa: BLE001 - any failure is the caller's to see
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
        gc.collect()
        # Every object alive now lives as long as the worker: keep the
        # collector from touching them, so forked tools copy fewer pages.
        gc.freeze()
        return tuple(errors)

    def _next_timeout(self) -> Optional[float]:
        if not self.timers:
            return None
        return max(0.0, self.timers[0][0] - time.monotonic())

    def _fire_timers(self) -> None:
        """One heap holds every deadline: a job's timeout ("timeout"), the
        grace a killed job's leader has to be reaped before its Result goes
        out anyway ("reap"), and the next count of a job whose process cap
        the worker keeps itself ("count"). Entries of jobs that ended
        otherwise are stale; skip them."""
        now = time.monotonic()
        while self.timers and self.timers[0][0] <= now:
            _, job_id, kind = heapq.heappop(self.timers)
            job = self.jobs.get(job_id)
            if job is None:
                continue
            if kind == "reap":
                if job.end_reason and not job.reaped and now >= job.killed_at + REAP_GRACE_S:
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

    def _over_process_cap(self, job: _Job) -> bool:
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
                msg = channel.recv(self.conn_in)
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
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            job = self.by_leader.pop(pid, None)
            if job is None:
                if self.template is not None and pid == self.template.pid:
                    self._drop_template()
                elif pid in self.spares:
                    self.spares.pop(pid).close()  # killed while parked: make another
                    self._ask_for_spares()
                if self.stale_groups:
                    self.stale_groups = [group for group in self.stale_groups if not group.remove()]
                continue  # an orphan re-parented to us, already killed or done
            job.exit_code = os.waitstatus_to_exitcode(status)
            job.reaped = True
            if job.eof or job.end_reason:
                self._finish(job)

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
        if data:
            self._consume(job, job.decoder.decode(data))
            return
        self._consume(job, job.decoder.decode(b"", final=True))
        job.capture.finish()
        self._close_output(job)
        job.eof = True
        if job.reaped:
            self._finish(job)

    def _consume(self, job: _Job, text: str) -> None:
        if not text:
            return
        job.capture.feed(text)
        cap = job.start.live_cap
        if cap is not None and job.live_sent <= cap:
            piece = text[: cap + 1 - job.live_sent]
            job.live_sent += len(piece)
            self._send(channel.Output(job.start.job_id, piece))

    # -- a job's life ----------------------------------------------------

    def _start(self, start: channel.Start) -> None:
        job = _Job(start, f"{self.token}/{start.job_id}")
        self.jobs[start.job_id] = job
        try:
            self._spawn(job)
        except Exception as exc:  # noqa: BLE001 - any spawn failure is the job's Result
            job.error = f"cannot start the tool: {exc}"
            job.reaped = True
            self._finish(job)
            return
        self._send(channel.Spawned(start.job_id, job.pid, job.pid))
        if start.warm and len(self.jobs) == 1 and job.started - self.idle_since >= SPARE_QUIET_S:
            # Spares only for a worker that had nothing to do: a spare saves
            # latency but costs more CPU than a fork from the worker (a second
            # fork), which a busy worker -- a batch -- is short of.
            self._ask_for_spares()
        if start.timeout is not None:
            heapq.heappush(self.timers, (job.started + start.timeout, start.job_id, "timeout"))
        if start.limits.processes is not None and job.group is None:
            heapq.heappush(self.timers, (time.monotonic(), start.job_id, "count"))

    def _spawn(self, job: _Job) -> None:
        start = job.start
        cwd = start.cwd
        if cwd is None:
            cwd = job.tmpdir = os.path.join(self.jobs_dir, str(start.job_id))
            os.mkdir(cwd, 0o700)
        if start.argv_kind == "python":
            job.script = os.path.join(cwd, f".execpool-{self.token}-{start.job_id}.py")
            with open(job.script, "w", encoding="utf-8") as f:
                f.write(start.source)
            argv = [start.python, "-u", job.script]
        else:
            argv = [self.shell, "-c", start.source]
        env = dict(start.env)
        env[JOB_MARKER_ENV] = job.marker
        method = "warm" if start.warm else self.spawn_method
        join_fds = []
        if start.limits.needs_cgroup:
            tier = self._cgroups()
            if tier is not None and tier.offers(start.limits.processes, start.limits.memory):
                job.group = tier.create(start.job_id, start.limits.processes, start.limits.memory)
                join_fds = [os.open(path, os.O_WRONLY | os.O_CLOEXEC) for path in job.group.procs_files()]
            elif start.limits.memory is not None:
                raise OSError("Limits(memory=...) needs a cgroup memory controller, and execpool cannot "
                              "use one here")
            # else: the worker counts the job's processes itself (see _fire_timers)
        spare = None
        if start.warm and self.spares:
            spare = self.spares.pop(next(iter(self.spares)))  # the oldest: rehearsed by now
        stdin_fd = _stdin_file(start.stdin) if start.stdin is not None else -1
        try:
            pid, out_r = start_tool(argv, env, cwd, start.limits, method, stdin_fd, not start.network, join_fds,
                                    spare)
        finally:
            for fd in [*join_fds, stdin_fd]:
                if fd >= 0:
                    os.close(fd)
            if spare is not None:
                spare.close()
        os.set_blocking(out_r, False)
        job.pid, job.fd = pid, out_r
        self.by_leader[pid] = job
        self.jobs_by_fd[out_r] = job
        self.sel.register(out_r, selectors.EVENT_READ, self._on_output)

    def _close_output(self, job: _Job) -> None:
        if job.fd is not None:
            self.sel.unregister(job.fd)
            del self.jobs_by_fd[job.fd]
            os.close(job.fd)
            job.fd = None

    def _end(self, job: _Job, reason: str) -> None:
        """Timeout or cancel: the one kill path, then wait for the reap."""
        job.end_reason = reason
        job.killed_at = time.monotonic()
        heapq.heappush(self.timers, (job.killed_at + REAP_GRACE_S, job.start.job_id, "reap"))
        self._kill(job)
        self._close_output(job)
        if job.reaped:
            self._finish(job)

    def _kill(self, job: _Job) -> None:
        kill_tree([job.pid], leader=None if job.reaped else job.pid, marker=job.marker, scope=self.pid,
                  exclude=self._not_strays(), group=job.group)

    def _not_strays(self) -> set:
        """The worker's children that belong to no finished job: the leaders
        of running jobs, the warm template and the parked spares."""
        return {*self.by_leader, *self.spares, *(() if self.template is None else (self.template.pid,))}

    def _finish(self, job: _Job) -> None:
        if job.start.job_id not in self.jobs:
            return
        del self.jobs[job.start.job_id]
        if not self.jobs:
            self.idle_since = time.monotonic()
        self._close_output(job)
        if job.end_reason is None and job.pid is not None:
            if job.start.keep_background:
                self.kept_pgids.add(job.pid)
            else:
                self._kill(job)
        if job.group is not None:
            if job.group.oom_killed() and job.end_reason is None:
                job.error = f"the job went over its memory limit ({job.start.limits.memory} bytes) and was killed"
            if job.start.keep_background or not job.group.remove():
                self.stale_groups.append(job.group)  # removed once its last process is reaped
        trashed = None
        if job.tmpdir is not None:
            trashed = self._discard(job.tmpdir)  # the script in it too
        elif job.script is not None:
            _unlink(job.script)
        self._send(channel.Finished(job.start.job_id, self._result(job)))
        if trashed is not None:
            _remove(trashed)
        self._sweep_strays()  # after the Result: the tree it belongs to is dead already

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
        job; once no job is left they cannot belong to a live one. Not while
        a spare is on its way, which is a child of the worker before the
        worker knows its pid."""
        if self.jobs or self.kept_pgids or self.spares_asked:
            return
        keep = self._not_strays()
        for pid in child_pids(self.pid):
            if pid not in keep and not is_zombie(pid):
                kill_tree(leader=pid)

    def _result(self, job: _Job) -> Result:
        capture = job.capture
        return Result(
            output="".join(capture.head),
            exit_code=None if job.end_reason or job.error else job.exit_code,
            timed_out=job.end_reason == "timeout",
            cancelled=job.end_reason == "cancel",
            duration_s=time.monotonic() - job.started,
            output_chars=capture.total,
            timeout=job.start.timeout,
            error=job.error,
            error_lines=tuple(capture.error_lines),
        )

    def _shutdown(self) -> None:
        """Everything below the worker dies first, then every job still
        running gets its (cancelled) Result."""
        pgids = self.kept_pgids | {job.pid for job in self.jobs.values() if job.pid is not None}
        kill_tree(pgids, leader=self.pid, marker=self.token, scope=self.pid)
        for job in list(self.jobs.values()):
            if job.end_reason is None:
                job.end_reason = "cancel"
            job.reaped = True
            self._finish(job)
        if self.template is not None:
            self._drop_template()
        for spare in self.spares.values():
            spare.close()
        self.spares.clear()
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
        shutil.rmtree(path, ignore_errors=True)


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def main(argv: list) -> None:
    read_fd, write_fd, token, spawn_method, preload_names, cgroups_flag, jobs_dir, warm_spares = argv
    read_fd, write_fd = int(read_fd), int(write_fd)
    preload = tuple(name for name in preload_names.split(",") if name)
    for fd in (read_fd, write_fd):
        os.set_inheritable(fd, False)
    _linux.prctl(_linux.PR_SET_CHILD_SUBREAPER, 1)
    # Tools run as this user: without this, one could open /proc/<worker>/fd
    # and write into the channel. Exec makes each tool dumpable again.
    _linux.prctl(_linux.PR_SET_DUMPABLE, 0)
    worker = Worker(Connection(read_fd, writable=False), Connection(write_fd, readable=False), token,
                    spawn_method, preload, cgroups_flag != "no-cgroups", jobs_dir, int(warm_spares))
    worker.serve()


if __name__ == "__main__":
    main(sys.argv[1:])
