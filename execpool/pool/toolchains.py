"""Which languages run in a pool's sandbox: a hello-world of each,
compiled and run there, once per toolchain version.

Runs in the caller (the pool's process), for ``ExecPool.languages`` and the
service's ``GET /v1/languages``. A toolchain on the pool's PATH that says
its version (execpool/shared/languages.py's probe) may still not run in
the sandbox: rustup's ``rustc`` under ``/root`` was listed as running while
every Rust program answered ``exec: rustc: not found`` in its job. So a row
says ``runs`` only once its hello-world (``table.HELLO``) compiled and
ran as the pool's own CodeJobs do -- the same steps, sandbox, limits,
tools' PATH and install roots -- and otherwise says, in one line, what
failed::

    pool.languages()  -> Checks.start() (once per round) -> rows as known now
      prober thread:  probe each row (versions, install roots)
                      known outcome (same toolchain, sandbox, limits)? -> the row
                      else queued: "being checked"
      CHECKS_AT_ONCE hello-worlds at a time, each: compile step -> run step,
      chained through their futures' callbacks onto the prober thread
      (no thread waits for a job) -> the row, and kept for the process

Nothing waits for a check: a listing says "being checked" until the row
is known, and a CodeJob of a language being checked runs as it would have.
A check the machine failed -- the pool closed under it, a timeout, out of
memory or processes (``MACHINE_FAILURE``) -- is not kept: the row says so
and the next listing checks it again.

A hello-world that ran is also written down for the user's next processes
(``RECORD_FILE`` in the user's cache directory, for ``RECORD_KEPT_S``): a
round of checks compiles with every JVM compiler on the machine, about
twenty CPU-seconds, which every start of ``execpool serve`` paid again.
The record holds only digests of what a check depended on (see
``CodeJobs.check_key``) and when it ran: the row listed is always the one
probed now, so a record someone else wrote can make a language listed
that does not run (its jobs then fail as they would), never change how
a job runs. A failed check is not written down: the next process checks
it again, in case the toolchain was mended.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import secrets
import shlex
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from importlib import metadata
from typing import TYPE_CHECKING, Callable, Deque, Dict, List, Optional, Tuple, Union

from ..shared import languages as table
from ..shared.errors import PoolClosedError
from ..shared.files import File
from ..shared.jobs import ShellJob
from ..shared.kernel.sandbox import Sandbox
from ..shared.result import Result, Status

if TYPE_CHECKING:
    from .code import CodeJobs

logger = logging.getLogger("execpool")

#: Hello-worlds compiling or running at once: a pool's start must not
#: crowd out the jobs it was started for (a JVM compiler takes a CPU and
#: hundreds of megabytes).
CHECKS_AT_ONCE = 2
#: Seconds a hello-world's compile, and then its run, may take: a JVM
#: language's compiler starts slowly on a loaded machine.
CHECK_TIMEOUT_S = 120.0
#: What a row says while its hello-world is under way.
CHECKING = "being checked: a hello-world is compiling and running in the pool's sandbox"

#: Outcomes, for the life of the process: a pool started again, or another
#: with the same sandbox and limits, lists at once what was checked.
_outcomes: Dict[tuple, table.Toolchain] = {}
_outcomes_lock = threading.Lock()


#: Where the record of hello-worlds that ran is kept: this variable's
#: directory, else the user's cache directory (XDG's).
CACHE_DIR_ENV = "EXECPOOL_CACHE_DIR"
RECORD_FILE = "toolchains.json"
#: How long a record is believed: a toolchain that broke without its
#: version changing is found out within a day.
RECORD_KEPT_S = 24 * 3600.0


def known(key: tuple) -> Optional[table.Toolchain]:
    """The checked row for ``key`` (``CodeJobs.check_key``), if checked:
    in this process, or, where it ran, by one before it."""
    with _outcomes_lock:
        found = _outcomes.get(key)
    if found is None and _digest(key) in _recorded():
        found = dataclasses.replace(key[1], checking=False)
        with _outcomes_lock:
            _outcomes.setdefault(key, found)
    return found


def keep(key: tuple, outcome: table.Toolchain) -> None:
    """``outcome`` kept for the process, and written down where it ran."""
    with _outcomes_lock:
        _outcomes[key] = outcome
    if outcome.runs:
        _record(_digest(key))


def cache_dir() -> str:
    chosen = os.environ.get(CACHE_DIR_ENV)
    if chosen:
        return chosen
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "execpool")


def _digest(key: tuple) -> str:
    """What the outcome depended on, and this release of execpool's way of
    checking, as one digest."""
    try:
        release = metadata.version("execpool")
    except metadata.PackageNotFoundError:
        release = "?"
    return hashlib.sha256(f"{release}\n{key!r}".encode()).hexdigest()


def _recorded() -> Dict[str, float]:
    """The record's digests still believed, with when each ran; empty
    where there is none or it cannot be read as one."""
    try:
        fd = os.open(os.path.join(cache_dir(), RECORD_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict):
        return {}
    now = time.time()
    return {digest: at for digest, at in record.items()
            if isinstance(digest, str) and type(at) is float and now - RECORD_KEPT_S < at <= now}


def _record(digest: str) -> None:
    """Add ``digest`` to the record, replacing the file whole: a reader
    never sees half of one, and of two writers at once the last wins (what
    the other wrote is checked again next time). Done through the cache
    directory's descriptor, no link followed: whoever can swap a name in
    it for a link leads no write elsewhere. Nothing where the directory
    cannot be written."""
    directory = cache_dir()
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        home = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        logger.debug("execpool: the languages' checks are not recorded in %s: %s", directory, exc)
        return
    temporary = f".toolchains-{secrets.token_hex(8)}"
    try:
        record = {**_recorded(), digest: time.time()}
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=home)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f)
            os.replace(temporary, RECORD_FILE, src_dir_fd=home, dst_dir_fd=home)
        except BaseException:
            os.unlink(temporary, dir_fd=home)
            raise
    except OSError as exc:
        logger.debug("execpool: the languages' checks are not recorded in %s: %s", directory, exc)
    finally:
        os.close(home)


class Checks:
    """One pool's checks: each row's state, the queue of hello-worlds not
    yet started, and the thread that probes and chains their steps."""

    def __init__(self, jobs: "CodeJobs") -> None:
        self.jobs = jobs
        self._lock = threading.Lock()
        self._rows: Dict[str, table.Toolchain] = {}
        self._queue: Deque[Tuple[table.Language, table.Toolchain, tuple]] = deque()
        self._running = 0
        self._round = False
        self._idle = threading.Event()
        self._idle.set()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="execpool-toolchains")

    def start(self) -> None:
        """A round of checks, unless one is under way: every row probed,
        what is not known checked. A row the machine failed is checked
        again in the next round."""
        with self._lock:
            if self._round:
                return
            self._round = True
            self._idle.clear()
        self.later(self._probe_all)

    def later(self, step: Callable[..., None], *args: object) -> None:
        """``step`` on the checks' thread; a pool closing drops it, and the
        round with it."""
        try:
            self._thread.submit(step, *args)
        except RuntimeError:
            self._end_round()

    def rows(self) -> List[table.Toolchain]:
        """Every row as known now: by this pool's round, else by what the
        process found already (another pool with the same sandbox checked
        it), else being checked."""
        with self._lock:
            rows = dict(self._rows)
        return [rows.get(language.name) or self._known_before(language.name)
                or table.Toolchain(language.name, False, language.compiles, None, CHECKING, checking=True)
                for language in table.TABLE]

    def _known_before(self, name: str) -> Optional[table.Toolchain]:
        row = self.jobs.language(name)
        found = table.probed(row, self.jobs.path)
        if found is None or not found.runs:
            return found
        return known(self.jobs.check_key(row, found))

    def wait(self) -> None:
        """Wait until the round under way is over."""
        self._idle.wait()

    def close(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)
        self._end_round()

    def _probe_all(self) -> None:
        try:
            self._probe_each()
        except Exception as exc:  # a round that ends nowhere would hold wait() for ever
            logger.error("execpool: probing the languages' toolchains failed", exc_info=exc)
            self._end_round()
            return
        if self.jobs.closing:
            self._end_round()
            return
        self._next()

    def _probe_each(self) -> None:
        """Probe each row in turn, until the pool closes: its close ends the
        probe under way and asks no other (a round of them took a service's
        SIGTERM 9 s under load, and then one JVM's version 13 s)."""
        with table.given_up_when(lambda: self.jobs.closing):
            self._probe_rows()

    def _probe_rows(self) -> None:
        for language in table.TABLE:
            if self.jobs.closing:
                return
            row = self.jobs.language(language.name)
            toolchain = self.jobs.toolchain(row)
            if not toolchain.runs:
                self._set(toolchain)
                continue
            key = self.jobs.check_key(row, toolchain)
            found = known(key)
            if found is not None:
                self._set(found)
                continue
            self._set(dataclasses.replace(toolchain, runs=False, why_not=CHECKING, checking=True))
            with self._lock:
                self._queue.append((row, toolchain, key))

    def _next(self) -> None:
        """Start the queued checks there is room for; end the round once
        none is queued or running."""
        while True:
            with self._lock:
                if not self._queue or self._running >= CHECKS_AT_ONCE:
                    over = not self._queue and self._running == 0
                    break
                item = self._queue.popleft()
                self._running += 1
            check = _Check(self, *item)
            check.guarded(check.begin)
        if over:
            self._end_round()

    def done(self, key: tuple, outcome: table.Toolchain, lasting: bool) -> None:
        """A check's outcome: the row, kept for the process when it says
        something about the toolchain rather than the machine."""
        if lasting:
            keep(key, outcome)
        self._set(outcome)
        with self._lock:
            counted = self._round  # else the pool closed, and the round was ended with it
            if counted:
                self._running -= 1
        if counted:
            self._next()

    def _set(self, toolchain: table.Toolchain) -> None:
        with self._lock:
            self._rows[toolchain.name] = toolchain

    def _end_round(self) -> None:
        with self._lock:
            self._round = False
            self._queue.clear()
            self._running = 0
        self._idle.set()


class _Check:
    """One hello-world: its compile, then its run, as the pool's CodeJobs
    take them (execpool/pool/code.py)."""

    def __init__(self, checks: Checks, row: table.Language, toolchain: table.Toolchain, key: tuple) -> None:
        self.checks = checks
        self.toolchain = toolchain
        self.key = key
        self.program, self.expected = table.HELLO[row.name]
        self.language = checks.jobs.placed(row.for_program(self.program), toolchain)
        self.files = program_files(self.language, self.program, {})

    def guarded(self, step: Callable[..., None], *args: object) -> None:
        """A step that fails (the pool closed under it) is the machine's,
        said in the row and checked again: never a round that does not end."""
        try:
            step(*args)
        except PoolClosedError as exc:
            self._settle(f"could not be checked: {exc}", lasting=False)
        except Exception as exc:
            logger.error("execpool: checking %s failed", self.language.name, exc_info=exc)
            self._settle(f"could not be checked: {exc}", lasting=False)

    def begin(self) -> None:
        if self.language.compile is None:
            self._run(self.files)
            return
        jobs = self.checks.jobs
        step = jobs.submit_step(ShellJob(
            command(self.language.compile), timeout=CHECK_TIMEOUT_S, files=self.files, fetch=self.language.outputs,
            separate_stderr=True, sandbox=jobs.sandbox_for(None, self.toolchain),
            env=jobs.env_for(None, self.toolchain), limits=jobs.compile_limits()))
        step.add_done_callback(lambda done: self.checks.later(self.guarded, self._compiled, done))

    def _compiled(self, done: "Future[Result]") -> None:
        compiled = done.result()
        if compiled.status is not Status.OK:
            self._failed(compiled, " ".join(self.language.compile or ()))
            return
        self._run({**self.files, **compiled.files})

    def _run(self, files: Dict[str, File]) -> None:
        jobs = self.checks.jobs
        step = jobs.submit_step(ShellJob(command(self.language.run), timeout=CHECK_TIMEOUT_S, files=files,
                                         sandbox=jobs.sandbox_for(None, self.toolchain),
                                         env=jobs.env_for(None, self.toolchain)))
        step.add_done_callback(lambda done: self.checks.later(self.guarded, self._ran, done))

    def _ran(self, done: "Future[Result]") -> None:
        result = done.result()
        if result.status is Status.OK and self.expected in result.output:
            self.checks.done(self.key, dataclasses.replace(self.toolchain, checking=False), lasting=True)
            return
        self._failed(result, " ".join(self.language.run))

    def _failed(self, result: Result, step: str) -> None:
        said = " ".join(f"{result.output}\n{result.stderr}".split())
        if result.exit_code is not None and result.exit_code < 0:
            # Killed by a signal: the machine's out-of-memory killer as
            # likely as the toolchain.
            self._settle(f"could not be checked: `{step}` was killed by signal {-result.exit_code}: {said[:200]}",
                         lasting=False)
        elif result.status in (Status.INFRA, Status.TIMEOUT, Status.CANCELLED):
            why = result.error or result.text
            self._settle(f"could not be checked ({' '.join(why.split())[:200]})", lasting=False)
        elif table.MACHINE_FAILURE.search(said):
            self._settle(f"could not be checked: the machine failed `{step}`: {said[:200]}", lasting=False)
        else:
            ended = "did not print what it should" if result.status is Status.OK else f"exit {result.exit_code}"
            self._settle(f"a hello-world failed in the pool's sandbox: `{step}` ({ended}): {said[:200]}",
                         lasting=True)

    def _settle(self, why: str, lasting: bool) -> None:
        if not lasting:
            why += "; checked again on the next listing"
        self.checks.done(self.key, dataclasses.replace(self.toolchain, runs=False, why_not=why, checking=False),
                         lasting)


def command(argv: Optional[Tuple[str, ...]]) -> str:
    """A step's argv as the command its ShellJob runs: bash replaces itself
    with it, so the step's process is the tool's own."""
    assert argv is not None
    return "exec " + shlex.join(argv)


def program_files(language: table.Language, code: str, files: Dict[str, File]) -> Dict[str, File]:
    """A program's files: the job's own, its source (with the language's
    prologue where it lacks it), the language's support files."""
    prologue = language.prologue
    if prologue and not code.lstrip().startswith(prologue.strip()):
        code = prologue + code
    return {**files, language.source: File(code.encode("utf-8")),
            **{name: File(text.encode()) for name, text in language.support}}


def languages(path: Optional[str] = None, sandbox: Union[None, str, Sandbox] = "strict") -> List[table.Toolchain]:
    """Every language of the table and whether it runs here: its
    hello-world compiled and ran in ``sandbox`` (the strict one by default,
    as the service and the tool layer run jobs) with the tools on ``path``
    (the caller's PATH by default), in a pool of its own; otherwise why
    not. The first call checks (a few seconds; the JVM languages' compilers
    are slow), later ones answer from what the process knows."""
    from ..supervisor import ExecPool  # the pool's module imports this one

    with ExecPool(workers=CHECKS_AT_ONCE, sandbox=sandbox, env=None if path is None else {"PATH": path}) as pool:
        return pool.languages(wait=True)
