"""Starting a job's tool: its directory, its script, its environment, its
cgroup and its sandbox made ready, then the tool started -- or the reason
it cannot be, which is the job's Result.

Runs in the worker process, on its loop (execpool/worker/event_loop.py). A cold
tool is started here (execpool/worker/spawn.py); a warm job is made ready
here the same way and then handed to a spare
(execpool/worker/warm/handover.py), which starts it with what is on the job.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import selectors
import shutil
import time
from typing import Callable, List, Optional, Tuple

from ..sandbox.rulesets import Confiner
from ..sandbox.view import HOME, SPACE_DIRECTORIES, SPACE_HOME, TMP, Views
from ..shared.jobs import MAX_PROCESSES
from ..shared.kernel.cgroups import MEMORY_NEEDS_CGROUP, Cgroups
from ..shared.kernel.markers import JOB_MARKER_ENV
from ..shared.kernel.sandbox import SHORT_NOW
from ..tool.become import Setup, rlimit_values
from . import files, space, userns
from .jobdirs import JobDirs
from .preparer import Ahead, Made
from .running_job import RunningJob
from .sessions import runtime_source
from .sessions.family import Spares
from .spawn import RULESET_BUILDER, Tool, start_tool

logger = logging.getLogger("execpool")

#: A tool that cannot be forked for want of process slots (EAGAIN) is tried
#: this many times, reaping between tries: bounded, since the worker's other
#: jobs wait meanwhile.
SPAWN_ATTEMPTS = 5
SPAWN_RETRY_S = 0.02


class Launcher:
    """What a worker needs to start tools, made the first time a job needs
    it: the cgroup tier, the sandbox's ruleset maker."""

    def __init__(self, token: str, spawn_method: str, use_cgroups: bool, dirs: JobDirs,
                 reap: Callable[[], None], sel: selectors.BaseSelector) -> None:
        self.token = token
        self.spawn_method = spawn_method
        self.use_cgroups = use_cgroups
        self.dirs = dirs
        # Reaps the worker's exited children: a fork refused for want of
        # process slots may be waiting for a killed job's to go.
        self._reap = reap
        self.shell = shutil.which("bash") or "/bin/sh"
        self.cgroup_tier: Optional[Cgroups] = None
        self._cgroups_detected = False
        self._confiner: Optional[Confiner] = None
        self._confiner_missing: Optional[str] = None
        self._views: Optional[Views] = None
        self.ahead = Ahead(sel, dirs.release)
        #: Sandboxed Python sessions' spares for their forks, made at the first.
        self.spares: Optional[Spares] = None
        #: Sandboxed jobs' user namespaces (execpool/worker/userns.py).
        self.namespaces = userns.Namespaces()
        self.workspaces = space.Workspaces(self.new_space, dirs.release)

    def cgroups(self) -> Optional[Cgroups]:
        """The cgroup tier, detected the first time a job needs it; None
        where the machine (or the pool) gives execpool none."""
        if not self._cgroups_detected:
            self._cgroups_detected = True
            self.cgroup_tier = Cgroups.detect(self.token) if self.use_cgroups else None
        return self.cgroup_tier

    def confiner(self) -> Confiner:
        """The sandbox's ruleset maker, made at the first sandboxed job;
        OSError (the same every time) where the kernel lacks what it needs,
        and (this time only) where the machine is short of something now."""
        if self._confiner is None and self._confiner_missing is None:
            try:
                self._confiner = Confiner(RULESET_BUILDER)
            except OSError as exc:
                if exc.errno in SHORT_NOW:
                    raise
                self._confiner_missing = exc.strerror or str(exc)
        if self._confiner is None:
            raise OSError(self._confiner_missing)
        return self._confiner

    def views(self) -> Views:
        """The sandbox's views, whose template is built at the first job
        that needs it."""
        if self._views is None:
            self._views = Views(self.dirs.jobs_dir)
        return self._views

    def close(self) -> None:
        self.workspaces.close_all()
        if self.cgroup_tier is not None:
            self.cgroup_tier.close()
        self.ahead.close()
        if self.spares is not None:
            self.spares.close()
        self.namespaces.close()
        if self._views is not None:
            self._views.close()
        if self._confiner is not None:
            self._confiner.close()

    def prepare(self, job: RunningJob) -> None:
        """Make ready what every way of starting a tool needs -- its
        directory (its space's home for a job with the sandbox's view, else
        a fresh private one with a name no job can guess, unless the caller
        gave one) and its files there, its environment, its cgroup, its
        sandbox's rulesets -- on the job. A sandboxed job's files that do
        not fit are its own failure (FilesError), not execpool's."""
        start = job.start
        made = self._made_for(job)
        if made is not None:
            job.space = made.space
        elif start.workspace is not None:
            if not self._has_view(job):
                raise OSError("a workspace's jobs run in the sandbox's view, and this one has none")
            job.space = self.workspaces.space(start.workspace)
        elif self._has_view(job):
            job.space = self.new_space(start.limits.disk)
        if job.space is not None and start.cwd is None:
            job.cwd = "/"  # where its tool is before its view: the home of its space is where it runs
            job.workdir = job.space.directory(SPACE_HOME)
        else:
            if start.cwd is None:
                job.tmpdir = job.cwd = self.dirs.private()
            else:
                job.cwd = start.cwd
            job.workdir = files.open_directory(job.cwd)
        if start.files:
            job.placed = files.write(job.workdir, start.files, set_aside=job.in_shared_directory)
        self._group(job)
        job.env = dict(start.env)
        job.env[JOB_MARKER_ENV] = job.marker
        if start.sandbox is not None:
            self._confine(job, made)

    def _has_view(self, job: RunningJob) -> bool:
        """Whether the job's sandbox gives it a view here (else its start
        fails in ``_confine``, saying why)."""
        box = job.start.sandbox
        return box is not None and box.read_only_view and self.confiner().support.missing_for(box) is None

    def new_space(self, disk: Optional[int],
                  directories: Tuple[Tuple[str, int], ...] = SPACE_DIRECTORIES) -> space.Space:
        """A space of ``disk`` bytes: made by the worker where it may mount,
        else in its view's template's namespaces."""
        template = self.views().current(self.confiner().hidden())
        return space.make(disk, template.user_fd, template.mnt_fd if template.user_fd >= 0 else -1, directories)

    def prepare_copy(self, job: RunningJob, spare: space.Space) -> None:
        """What a sandboxed session's copy needs that its fork does not
        bring: its spare as its space (execpool/worker/sessions/family.py),
        its cgroup, its marker."""
        job.space = spare
        job.cwd = job.start.cwd or HOME
        self._group(job)
        job.env = dict(job.start.env)
        job.env[JOB_MARKER_ENV] = job.marker

    def _group(self, job: RunningJob) -> None:
        start = job.start
        if start.limits.needs_cgroup or start.session:
            tier = self.cgroups()
            processes = start.limits.processes
            if start.session and processes is None and start.limits.memory is None:
                # A session lives long, and a daemon it left that cleared its
                # environment is nobody's until its worker is idle: in a
                # group of the session's own (no cap: the kernel's ceiling),
                # it dies with the session.
                processes = MAX_PROCESSES
            if tier is not None and tier.offers(processes, start.limits.memory):
                job.group = tier.create(start.job_id, processes, start.limits.memory)
            elif start.limits.memory is not None:
                raise OSError(MEMORY_NEEDS_CGROUP)
            # else: the worker counts the job's processes itself (execpool/worker/event_loop.py)

    def _confine(self, job: RunningJob, made: Optional[Made]) -> None:
        """Its view and rulesets; for a Python session that may fork, its
        family's spares, ruled in now."""
        start = job.start
        assert start.sandbox is not None
        confiner = self.confiner()
        template = None
        if start.sandbox.read_only_view:
            missing = confiner.support.missing_for(start.sandbox)
            if missing is not None:
                raise OSError(missing)
            views = self.views()
            assert job.space is not None
            template = views.current(confiner.hidden())
            job.user_ns = self.namespaces.take(template.user_fd)
            if made is not None:
                job.view, job.rulesets = dataclasses.replace(made.view, job_user_fd=job.user_ns), (made.ruleset,)
            else:
                job.view = views.plan(job.space.fd, job.user_ns, start.cwd, start.sandbox.read,
                                      start.sandbox.write, start.python, confiner.hidden())
            template = views.current()
            job.env.update(TMPDIR=TMP, HOME=HOME,
                           PATH=views.path(start.python, job.env.get("PATH", os.defpath), start.sandbox.read))
            if made is None:
                handles = job.space.handles()
                try:
                    job.rulesets = confiner.rulesets(start.python, start.sandbox,
                                                     (*handles, *([] if start.cwd is None else [start.cwd])),
                                                     template)
                finally:
                    for fd in handles:
                        os.close(fd)
        else:
            if start.cwd is not None:
                job.sandbox_tmp = self.dirs.private()  # removed with the job
            own = tuple(dict.fromkeys((job.cwd, job.sandbox_tmp or job.cwd)))
            job.env["TMPDIR"] = own[-1]  # the only temporary directory a sandboxed job may write
            job.rulesets = confiner.rulesets(start.python, start.sandbox, own, template)
        if (start.session and start.argv_kind == "python" and template is not None and not start.sandbox.write
                and start.workspace is None):
            if self.spares is None:
                self.spares = Spares(self.new_space, self.dirs.release)
            job.family = self.spares.family(job.rulesets[-1], confiner.handled, start.cwd, start.limits.disk)

    def argv(self, job: RunningJob) -> List[str]:
        """The cold tool's argv, its script written in its directory."""
        start = job.start
        source = runtime_source(start.argv_kind, start.ipython) if start.session else start.source
        if start.argv_kind == "python":
            job.script = files.write_script(job.workdir, source)
            return [start.python, "-u", job.script_path()]
        if start.session:
            # --norc: a bash whose stdin is a socket takes itself for one
            # started by a remote shell daemon and reads ~/.bashrc.
            return [self.shell, "--norc", "-c", source]
        return [self.shell, "-c", source]

    def _made_for(self, job: RunningJob) -> Optional[Made]:
        """What was made ahead for a job like this one (execpool/worker/preparer.py), if anything."""
        start = job.start
        if start.sandbox is None or start.workspace is not None or not Ahead.fits(start.cwd, start.sandbox):
            return None
        confiner = self.confiner()
        if confiner.support.missing_for(start.sandbox) is not None:
            return None
        return self.ahead.take(start.python, start.limits.disk, self.views().current(confiner.hidden()))

    def make_ahead(self) -> None:
        """Ask for the next jobs' own namespaces, if jobs that fit have come,
        make the next sandboxed jobs' user namespaces and the next sandboxed
        session's spares: once a Result is out. What the machine refuses
        now (a process, memory: a tenant may hold them all) is asked for
        again after the next Result; a job that finds none made makes its
        own."""
        if self.ahead.wanted is not None and self._confiner is not None and self._views is not None:
            self.ahead.ask(self._confiner, self._views)
        if self._views is not None and self._views.template is not None:
            self.namespaces.refill(self._views.template.user_fd)
        if self.spares is not None:
            try:
                self.spares.refill()
            except OSError as exc:
                logger.debug("execpool: sessions' spares cannot be made now (%s)", exc)

    def start(self, job: RunningJob, argv: List[str]) -> Tuple[int, List[int]]:
        """Start the job's cold tool; its pid and output pipes."""
        start = job.start
        with job.start_fds() as (stdin_fd, join_fds):
            tool = Tool(argv, job.env, Setup(job.cwd, rlimit_values(start.limits), not start.network,
                                             tuple(join_fds), job.confinement(), job.view_arguments()),
                        stdin_fd, start.separate_stderr)
            for attempt in range(SPAWN_ATTEMPTS):
                try:
                    started = start_tool(tool, self.spawn_method)
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
        return started
