"""The worker process: many tools at once, on one thread.

Runs as ``python -m execpool.worker READ_FD WRITE_FD TOKEN METHOD PRELOAD CGROUPS JOBS_DIR``,
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
- and a timer heap for deadlines, used as the select timeout.

There are no threads, so forking a tool from here is safe and cheap (the
worker's memory is small), and killing is immediate: a Cancel is handled the
moment it is read. Output is read with ``os.read`` and decoded incrementally
(UTF-8 with replacement, universal newlines), forwarded live only up to the
stream's cap plus one character (the producer-side cap: a flood never fills
any pipe or queue beyond it), and kept only as far as the Result needs.
"""

from __future__ import annotations

import array
import codecs
import contextlib
import gc
import heapq
import importlib
import io
import os
import pickle
import resource
import selectors
import shutil
import signal
import socket
import sys
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Callable, NoReturn, Optional

from . import _linux, channel, warm
from .jobs import Limits
from .cgroups import Cgroups, JobGroup
from .proctree import JOB_MARKER_ENV, child_pids, count_tree, is_zombie, kill_tree
from .result import Result


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

#: A killed leader that is not reaped by then (stuck in the kernel) no longer
#: holds up its Result.
REAP_GRACE_S = 1.0

try:
    from . import _spawn
except ImportError:  # not built here; the pure-Python start is used instead
    _spawn = None

#: How tools are started: "vfork" (execpool._spawn) or "fork" (pure Python).
SPAWN_METHODS = ("vfork", "fork") if _spawn is not None else ("fork",)

_DEVNULL = os.open(os.devnull, os.O_RDONLY)

#: A job hands its warm spare stdin, output, ready pipe and cgroup files.
_MAX_PASSED_FDS = 16

#: What the worker's own PYTHONPATH added to sys.path (execpool itself), which
#: a warm job's sys.path must not have: a cold tool does not.
_WORKER_PATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]

_RLIMITS = (
    ("address_space", "RLIMIT_AS"),
    ("cpu_seconds", "RLIMIT_CPU"),
    ("file_size", "RLIMIT_FSIZE"),
    ("open_files", "RLIMIT_NOFILE"),
)


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


def _apply_limits(limits: Limits) -> None:
    for field, name in _RLIMITS:
        value = getattr(limits, field)
        if value is None:
            continue
        which = getattr(resource, name)
        _soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value))


def _limit_values(limits: Limits) -> tuple:
    """The rlimits in the order execpool._spawn takes them, -1 for none."""
    return tuple(-1 if getattr(limits, field) is None else getattr(limits, field) for field, _ in _RLIMITS)


def _fork_child(cwd: str, limits: Limits, stdin_fd: int, out_fd: int, no_network: bool,
                join_fds: list, then: Callable[[int], None]) -> int:
    """Fork, set the child up as every tool is set up, then hand it to
    ``then(ready_fd)``, which execs, or closes ``ready_fd`` and runs warm."""
    ready_r, ready_w = os.pipe()
    worker_pid = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        _become_tool(cwd, limits, stdin_fd, out_fd, no_network, join_fds, ready_w, worker_pid, then)
    os.close(ready_w)
    _await_start(pid, ready_r)
    return pid


def _become_tool(cwd: str, limits: Limits, stdin_fd: int, out_fd: int, no_network: bool,
                 join_fds: list, ready_w: int, worker_pid: int, then: Callable[[int], None]) -> NoReturn:
    """In a fork of the worker (fresh, or its warm spare): the session, death
    signal, limits, directory and pipes every tool gets. A failure before
    ``then`` takes over reaches the worker through ``ready_w``."""
    try:
        for fd in join_fds:
            os.write(fd, b"0")  # this process into its job's cgroup
        os.setsid()
        if no_network:
            _linux.unshare_network()
        _linux.prctl(_linux.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != worker_pid:
            os._exit(137)  # the worker died before the death signal was armed
        _apply_limits(limits)
        os.chdir(cwd)
        os.dup2(stdin_fd, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        # The worker's pipes, selector and channel are not the tool's.
        os.closerange(3, ready_w)
        os.closerange(ready_w + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        then(ready_w)
    except BaseException as exc:  # noqa: BLE001 - report, never return into the loop
        try:
            os.write(ready_w, str(exc).encode("utf-8", "replace")[:2048])
        finally:
            os._exit(127)
    os._exit(127)  # ``then`` execs or exits; returning would run the worker's loop in the tool


def _await_start(pid: int, ready_r: int) -> None:
    """Wait until the child execs or starts its warm job (``ready_r`` reaches
    EOF); raise what it reported if it failed before that."""
    failure = b""
    while chunk := os.read(ready_r, 4096):
        failure += chunk
    os.close(ready_r)
    if failure:
        os.waitpid(pid, 0)
        raise OSError(failure.decode("utf-8", "replace"))


class _WarmSpare:
    """A fork of the worker made ahead of time and parked until a warm job
    takes it, so that job's start-up skips the fork -- most of its latency.

    The spare keeps only its end of a socket pair (and stdio); it is not
    dumpable, has the worker's death signal, and carries no job marker until
    a job stamps its own. A job reaches it as one message -- the script's
    path, environment, directory, limits and network flag, pickled by the
    worker that forked it -- with its stdin, output pipe, ready pipe and
    cgroup files as passed descriptors; from then on it is set up exactly as
    a freshly forked warm tool (:func:`_become_tool`)."""

    def __init__(self, worker_pid: int) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            raise
        if pid == 0:
            ours.close()
            _park(theirs, worker_pid)
        theirs.close()
        self.pid = pid
        self.sock = ours

    def take(self, script: str, env: dict, cwd: str, limits: Limits, stdin_fd: int, out_fd: int,
             no_network: bool, join_fds: list) -> Optional[int]:
        """Start the job in the spare and return its pid (now the tool's), or
        None when the spare is gone (killed by a stray sweep of another
        job, say) and the job needs a fresh fork."""
        payload = pickle.dumps((script, env, cwd, limits, no_network))
        message = len(payload).to_bytes(8, "little") + payload
        ready_r, ready_w = os.pipe()
        fds = array.array("i", [stdin_fd, out_fd, ready_w, *join_fds])
        try:
            sent = self.sock.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        except OSError:
            os.close(ready_r)
            return None
        else:
            # The job is the spare's now: whatever goes wrong from here, the
            # ready pipe says, and no fresh fork may run it a second time.
            if sent < len(message):
                with contextlib.suppress(OSError):
                    self.sock.sendall(message[sent:])
        finally:
            os.close(ready_w)
            self.sock.close()
        _await_start(self.pid, ready_r)
        return self.pid

    def close(self) -> None:
        """The spare reads EOF and exits; the worker reaps it."""
        self.sock.close()


def _park(sock: socket.socket, worker_pid: int) -> NoReturn:
    """The spare's life before its job: drop everything of the worker's but
    stdio, wait for one job, become its tool. EOF means no job will come."""
    ready_w = -1
    try:
        _linux.prctl(_linux.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != worker_pid:
            os._exit(0)
        keep = sorted({_DEVNULL, sock.fileno()})
        os.closerange(3, keep[0])
        os.closerange(keep[0] + 1, keep[-1])
        os.closerange(keep[-1] + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        warm.rehearse()
        pickle.loads(pickle.dumps(("", {}, "", Limits(), False)))  # the hand-over's pages too
        head, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, _MAX_PASSED_FDS)
        if len(fds) < 3:
            os._exit(0)  # EOF: the worker let its spare go
        stdin_fd, out_fd, ready_w, *join_fds = fds
        data = bytearray(head)
        while len(data) < 8 or len(data) < 8 + int.from_bytes(data[:8], "little"):
            chunk = sock.recv(1 << 16)
            if not chunk:
                os._exit(0)
            data += chunk
        sock.close()
        script, env, cwd, limits, no_network = pickle.loads(data[8:])
    except BaseException as exc:  # noqa: BLE001 - a broken hand-over is the job's start failure
        if ready_w >= 0:
            os.write(ready_w, f"warm spare: {exc}".encode("utf-8", "replace")[:2048])
        os._exit(127)
    _become_tool(cwd, limits, stdin_fd, out_fd, no_network, join_fds, ready_w, worker_pid,
                 lambda ready: warm.run(script, env, _WORKER_PATH, ready))


def _exec(argv: list, env: dict) -> Callable[[int], None]:
    def then(_ready_fd: int) -> None:
        # exec resets caught signals itself; ignored ones would stay ignored.
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        os.execve(argv[0], argv, env)

    return then


def start_tool(argv: list, env: dict, cwd: str, limits: Limits, method: str, stdin_fd: int = -1,
               no_network: bool = False, join_fds: list = (), spare: Optional[_WarmSpare] = None,
               ) -> tuple[int, int]:
    """Start one tool in a new session with its limits; return its pid and
    the read end of its merged stdout/stderr pipe. ``method`` is "vfork",
    "fork" (the pure-Python fallback) or "warm" (argv is ``[python, -u, FILE]``,
    run in ``spare`` if given and alive, else in a fresh fork of this worker)."""
    stdin_fd = _DEVNULL if stdin_fd < 0 else stdin_fd
    out_r, out_w = os.pipe()
    try:
        if method == "vfork":
            envp = [f"{key}={value}" for key, value in env.items()]
            pid = _spawn.spawn(argv, envp, cwd, _limit_values(limits), stdin_fd, out_w, no_network, list(join_fds))
        elif method == "warm":
            script = argv[-1]
            pid = None
            if spare is not None:
                pid = spare.take(script, env, cwd, limits, stdin_fd, out_w, no_network, list(join_fds))
            if pid is None:
                pid = _fork_child(cwd, limits, stdin_fd, out_w, no_network, list(join_fds),
                                  lambda ready: warm.run(script, env, _WORKER_PATH, ready))
        else:
            pid = _fork_child(cwd, limits, stdin_fd, out_w, no_network, list(join_fds), _exec(argv, env))
    except BaseException:
        os.close(out_r)
        raise
    finally:
        os.close(out_w)
    return pid, out_r


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
                 preload: tuple, use_cgroups: bool, jobs_dir: str) -> None:
        self.conn_in = conn_in
        self.conn_out = conn_out
        self.token = token
        self.spawn_method = spawn_method
        self.preload = preload
        self.use_cgroups = use_cgroups
        self.jobs_dir = jobs_dir
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
        self.spare: Optional[_WarmSpare] = None
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
                if self.spare is not None and pid == self.spare.pid:
                    self.spare.close()  # killed while parked; the next warm job forks
                    self.spare = None
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
        if start.warm and self.spare is None:
            # While this job runs, not while the next one waits.
            try:
                self.spare = _WarmSpare(self.pid)
            except OSError:
                pass  # out of processes or memory: warm jobs fork as they come
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
        if start.warm:
            spare, self.spare = self.spare, None
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
        of running jobs and the parked warm spare."""
        return {*self.by_leader, *(() if self.spare is None else (self.spare.pid,))}

    def _finish(self, job: _Job) -> None:
        if job.start.job_id not in self.jobs:
            return
        del self.jobs[job.start.job_id]
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
        if job.script is not None:
            _unlink(job.script)
        if job.tmpdir is not None:
            _remove_dir(job.tmpdir)
        self._send(channel.Finished(job.start.job_id, self._result(job)))
        if not self.jobs and not self.kept_pgids:
            # Strays that cleared their environment cannot be attributed to a
            # job; once no job is left they cannot belong to a live one. After
            # the Result, because the tree it belongs to is dead already.
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
        if self.spare is not None:
            self.spare.close()
        self._reap()
        if self.cgroup_tier is not None:
            self.cgroup_tier.close()


def _remove_dir(path: str) -> None:
    """Most private directories are empty by now: one rmdir, not rmtree's walk."""
    try:
        os.rmdir(path)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def main(argv: list) -> None:
    read_fd, write_fd, token, spawn_method, preload_names, cgroups_flag, jobs_dir = argv
    read_fd, write_fd = int(read_fd), int(write_fd)
    preload = tuple(name for name in preload_names.split(",") if name)
    for fd in (read_fd, write_fd):
        os.set_inheritable(fd, False)
    _linux.prctl(_linux.PR_SET_CHILD_SUBREAPER, 1)
    # Tools run as this user: without this, one could open /proc/<worker>/fd
    # and write into the channel. Exec makes each tool dumpable again.
    _linux.prctl(_linux.PR_SET_DUMPABLE, 0)
    worker = Worker(Connection(read_fd, writable=False), Connection(write_fd, readable=False), token,
                    spawn_method, preload, cgroups_flag != "no-cgroups", jobs_dir)
    worker.serve()


if __name__ == "__main__":
    main(sys.argv[1:])
