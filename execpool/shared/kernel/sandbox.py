"""The kernel-enforced sandbox a tool can run in: what it allows, and how a
tool's process enters it before its first instruction.

Shared. The caller builds :class:`Sandbox` values (``"strict"`` is
``Sandbox()``) and asks :func:`sandbox_support` what the machine offers; the
worker builds each sandboxed job's Landlock rulesets (execpool/sandbox/rulesets.py)
and every way of starting a tool enters them in the new process: the C
extension after its vfork (execpool/tool/_spawn.c), :func:`enter` after a Python
fork and in a warm spare, which gets the job's rulesets over its hand-over
socket.

Why these mechanisms (each measured on the kernel execpool was built on,
6.18, Landlock ABI 7, as root and as ``nobody``; tests/sandbox/test_sandbox.py
tries every escape below):

- **Landlock** (unprivileged, binds root as well, survives exec and new
  namespaces, and nothing a process does undoes it): the filesystem --
  read and execute on the system's software (beneath ``/etc`` only what
  the world may read, for a root tool: a second layer), read on ``/proc``
  and ``/sys``, every right on the job's directory and its private
  ``TMPDIR``, nothing else -- and, from ABI 6, signals and abstract Unix sockets scoped
  to the job's own domain. Landlock also refuses ptrace, and every
  ``/proc/<pid>`` file guarded by a ptrace check (``mem``, ``environ``,
  ``fd/*``, ``cwd``, ``root``, ``ns/*``), for any process outside the
  domain: the worker, the caller, other jobs (each job is a domain of its
  own, so two jobs are strangers to each other) -- which is also what keeps
  a tool out of ``setns`` into the worker's or the caller's network
  namespace, by path or by pidfd. Mounting is refused to a restricted
  process, so a tool cannot mount its way around the rules, also in a
  user namespace of its own.
- **No capabilities**: a root tool keeps its uid but loses every capability
  (effective, permitted, inheritable, ambient). Under Landlock alone a
  root tool still read the worker's ``/proc/<pid>/environ`` and ``maps``
  (the kernel lets CAP_PERFMON or CAP_SYS_ADMIN read another process's
  memory map whatever the LSMs say); capabilities would also let it raise
  its hard rlimits (CAP_SYS_RESOURCE) or load a kernel module
  (CAP_SYS_MODULE). Nothing it execs gains one back: under no_new_privs
  the kernel gives an exec no capability its caller lacked, a root
  caller's exec of any file included. The bounding set is left as it is:
  emptying it took one system call per capability, a fifth of what the
  sandbox cost a job to start, and closed nothing no_new_privs leaves
  open.
- **A view of its own** (execpool/sandbox/view.py): a root, as bubblewrap
  builds one, that lists the machine's top-level directories and holds the
  system's software, the pool's interpreter and execpool's package, all
  read-only, ``/proc`` (on a root server a procfs of its own, where a
  process outside the job's Landlock domain is not listed), ``/sys``, a
  small ``/dev``, and the job's own ``/tmp``, home, ``/dev/shm`` and
  directory, writable; nothing else is there (``/root`` and ``/home`` are
  empty, other jobs' directories absent), and beneath ``/etc`` what the
  world may not read is covered by an empty file or directory. The shared
  part is a mount namespace built once per worker (in a user namespace of
  its own where the worker lacks CAP_SYS_ADMIN); a tool enters it, copies
  it and mounts its own paths. Landlock does not govern a file's
  metadata: without read-only mounts a tool changed the mode, owner, times
  and extended attributes of any file its user owned -- a root tool made a
  file anywhere world-writable or setuid. ``Sandbox(read_only_view=False)``
  goes without the view where the machine cannot make one.
- **A small seccomp filter** (execpool/sandbox/seccomp.py, which says why each
  rule) for what the rest does not cover: ``clone3``, io_uring, the
  keyrings, System V IPC, another process's limits and priorities, setuid
  and setgid files, extended attributes (a file capability), other system
  call ABIs.

What the sandbox does not cover is in the threat model (docs/sandbox/threat-model.md).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import pwd
import subprocess
import sys
from dataclasses import dataclass
from typing import List, Optional, Set, Tuple, Union

from .. import checks

#: System software a tool reads and runs (those that exist here): what
#: every sandboxed job's view shows and its Landlock layer lets it read.
#: A toolchain installed anywhere else is shown by its own install root
#: (execpool/shared/languages.py).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")


def beneath_system(path: str) -> bool:
    """Whether ``path`` (a real path: links resolved) is in the system's
    software every sandboxed job sees."""
    return any(path == real or path.startswith(real + "/")
               for real in {os.path.realpath(top) for top in SYSTEM_DIRS if os.path.exists(top)})


def homes() -> Set[str]:
    """Where people keep what a tool must not read: root's home, every
    login user's (uid 1000 and up) and this process's."""
    found = {os.path.expanduser("~")}
    found.update(user.pw_dir for user in pwd.getpwall() if user.pw_uid == 0 or user.pw_uid >= 1000)
    return {os.path.realpath(home) for home in found if home and os.path.isdir(home)}


def too_wide(path: str) -> bool:
    """Whether granting ``path`` to a job would grant ``/`` or a home
    directory."""
    return path == "/" or any(home == path or home.startswith(path.rstrip("/") + "/") for home in homes())

# -- Landlock's ABI (include/uapi/linux/landlock.h) ------------------------------------------------

#: The same numbers on every architecture (the generic system call table).
SYS_LANDLOCK_CREATE_RULESET = 444
_CREATE_RULESET_VERSION = 1

#: The oldest ABI the sandbox can promise its guarantees with: signals to
#: the worker and other jobs are scoped only from ABI 6 (Linux 6.12).
MIN_LANDLOCK_ABI = 6

# -- capabilities, seccomp -------------------------------------------------------------------------

_PR_GET_SECCOMP = 21
#: The machines execpool/sandbox/seccomp.py has a filter for (its TABLES).
SECCOMP_MACHINES = ("x86_64", "aarch64")
_CAP_SYS_ADMIN = 21

# -- the view (mount namespaces) ----------------------------------------------------------------

#: How a worker's view is made (execpool/sandbox/view.py): a mount namespace
#: where the worker holds CAP_SYS_ADMIN, else a user namespace (the ids
#: mapped to themselves) with a mount namespace in it.
VIEW_MOUNT_NS, VIEW_USER_NS = 1, 2

_libc = ctypes.CDLL(None, use_errno=True)
syscall = _libc.syscall
syscall.restype = ctypes.c_long


def errno_error(call: str) -> OSError:
    errno = ctypes.get_errno()
    return OSError(errno, f"{call}: {os.strerror(errno)}")


# -- what a caller asks for ------------------------------------------------------------------------


@dataclass(frozen=True)
class Sandbox:
    """The strict sandbox, plus paths the caller adds: ``read`` (read and
    execute, everything beneath) and ``write`` (every right, everything
    beneath). ``Sandbox()`` is ``"strict"``: the job writes only its
    working directory and a private ``TMPDIR``, and reads the system's
    software besides (docs/sandbox/threat-model.md). Paths are made absolute
    relative to the caller's working directory, as a job's ``cwd`` is; the
    worker opens them when the job starts, and a job whose path cannot be
    opened ends with an ``Execution error``.

    ``connect`` and ``bind``, None by default (TCP as without a sandbox),
    restrict TCP to the ports listed: ``connect=(443,)`` lets the job reach
    port 443 anywhere and no other TCP port, ``connect=()`` no TCP port at
    all; ``bind`` likewise for the ports it may listen on. Only TCP: UDP
    (DNS) and Unix sockets are not governed (``network=False`` takes the
    whole network away).

    ``read_only_view`` (True) mounts everything but the job's writable
    paths read-only for the tool, which is what keeps it from changing the
    mode, owner or times of files outside them (Landlock does not govern
    those). It needs a mount namespace: CAP_SYS_ADMIN, or unprivileged user
    namespaces, which some containers forbid; ``False`` goes without it
    there, knowingly."""

    read: Tuple[str, ...] = ()
    write: Tuple[str, ...] = ()
    connect: Optional[Tuple[int, ...]] = None
    bind: Optional[Tuple[int, ...]] = None
    read_only_view: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.read_only_view, bool):
            raise TypeError(f"Sandbox.read_only_view must be a bool, not {type(self.read_only_view).__name__}")
        for name in ("connect", "bind"):
            ports = getattr(self, name)
            if ports is None:
                continue
            if isinstance(ports, (str, bytes)) or not hasattr(ports, "__iter__"):
                raise TypeError(f"Sandbox.{name} must be None or a list of TCP ports, not {type(ports).__name__}")
            for port in ports:
                checks.integer(f"Sandbox.{name} port", port, minimum=0, maximum=65535)
            object.__setattr__(self, name, tuple(sorted(set(ports))))
        for name in ("read", "write"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes, os.PathLike)):
                raise TypeError(f"Sandbox.{name} must be a list of paths, not one path")
            try:
                paths = tuple(value)
            except TypeError:
                raise TypeError(f"Sandbox.{name} must be a list of paths, not {type(value).__name__}") from None
            absolute = []
            for path in paths:
                if not isinstance(path, (str, os.PathLike)):
                    raise TypeError(f"Sandbox.{name} entries must be paths (str), not {type(path).__name__}")
                path = checks.text(f"Sandbox.{name} entry", os.fspath(path))
                if not path:
                    raise ValueError(f"Sandbox.{name} entries must not be empty")
                absolute.append(os.path.abspath(path))
            object.__setattr__(self, name, tuple(absolute))


#: ``sandbox="strict"``.
STRICT = Sandbox()


def pool_sandbox(value: object) -> Optional[Sandbox]:
    """A pool's ``sandbox=``: None (off), ``"strict"`` or a Sandbox."""
    if value is None:
        return None
    return _preset(value, "sandbox must be None, 'strict' or an execpool.Sandbox")


def job_sandbox(value: object) -> Union[None, bool, Sandbox]:
    """A job's ``sandbox=``: None (the pool's), False (none for this job,
    whatever the pool's), ``"strict"`` or a Sandbox."""
    if value is None or value is False:
        return value
    return _preset(value, "sandbox must be None (the pool's), False (none), 'strict' or an execpool.Sandbox")


def _preset(value: object, usage: str) -> Sandbox:
    if isinstance(value, Sandbox):
        return value
    if value == "strict":
        return STRICT
    if isinstance(value, str):
        raise ValueError(f"{usage}, not {value!r}")
    raise TypeError(f"{usage}, not {type(value).__name__}")


# -- what the machine offers -----------------------------------------------------------------------


def landlock_abi() -> int:
    """The Landlock ABI this kernel offers; 0 for none (too old, or
    disabled at boot)."""
    version = syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0),
                       ctypes.c_uint32(_CREATE_RULESET_VERSION))
    return max(0, int(version))


def _seccomp_works() -> bool:
    return _libc.prctl(_PR_GET_SECCOMP, 0, 0, 0, 0) >= 0


#: A new process tries what a tool's view needs (execpool/tool/_spawn.c): a
#: fresh interpreter, so that neither a threaded caller forks nor the
#: caller's own mounts change.
_VIEW_PROBE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
kind, uid, gid = int(sys.argv[1]), os.geteuid(), os.getegid()
def refused(step, number):
    print(number, file=sys.stderr)
    sys.exit(step + ": " + os.strerror(number))
if libc.unshare(0x10020000 if kind == 2 else 0x20000) != 0:
    refused("unshare", ctypes.get_errno())
if kind == 2:
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        try:
            with open("/proc/self/" + name, "w") as f:
                f.write(text)
        except OSError as exc:
            refused(name, exc.errno)
attr = (ctypes.c_uint64 * 4)(1, 0, 1 << 19, 0)
libc.syscall.restype = ctypes.c_long
if libc.syscall(442, -100, b"/", 0x8000, attr, 32) != 0:
    refused("mount_setattr", ctypes.get_errno())
"""

#: Errors that say the machine is short of something now (a process slot,
#: memory, a descriptor), not what it refuses: an answer made of them is
#: not kept, and the question is asked again next time.
SHORT_NOW = frozenset({errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE})


@dataclass(frozen=True)
class SandboxSupport:
    """What this machine offers the sandbox: ``landlock_abi`` (0: none),
    whether seccomp filters work for this architecture, whether tools can
    get their read-only view (``read_only_view``), and ``missing``: why a
    job in the strict sandbox cannot run here (None when it can) --
    ``view_missing`` alone is what ``Sandbox(read_only_view=False)`` does
    without."""

    landlock_abi: int
    seccomp: bool
    read_only_view: bool
    missing: Optional[str]
    view_missing: Optional[str] = None

    @property
    def available(self) -> bool:
        return self.missing is None

    def missing_for(self, sandbox: "Sandbox") -> Optional[str]:
        """Why a job in ``sandbox`` cannot run here; None when it can."""
        if self.missing is not None and self.missing != self.view_missing:
            return self.missing
        return self.view_missing if sandbox.read_only_view else None


#: The view probe's answer, once the kernel gave one: None, or why not.
_view_answer: List[Optional[str]] = []


def _view_missing() -> Optional[str]:
    """Why tools cannot get their read-only view here (None: they can),
    asked of a new process once per process; OSError, and asked again
    next time, where that process could not be started or ran short."""
    if _view_answer:
        return _view_answer[0]
    kind = view_kind()
    try:
        done = subprocess.run([sys.executable, "-I", "-S", "-c", _VIEW_PROBE, str(kind)], capture_output=True,
                              text=True, timeout=30)
    except subprocess.TimeoutExpired as exc:
        raise OSError(errno.EAGAIN, f"the sandbox's read-only view could not be tried now: {exc}") from None
    except OSError as exc:
        raise OSError(exc.errno, f"the sandbox's read-only view could not be tried now: {exc.strerror}") from None
    said = done.stderr.strip().splitlines()
    refused = int(said[-2]) if done.returncode == 1 and len(said) >= 2 and said[-2].isdigit() else None
    if done.returncode != 0 and (refused is None or refused in SHORT_NOW):
        raise OSError(errno.EAGAIN, "the sandbox's read-only view could not be tried now: "
                                    f"{said[-1] if said else f'its probe exited with {done.returncode}'}")
    if done.returncode == 0:
        _view_answer[:] = [None]
        return None
    need = "a mount namespace" if kind == VIEW_MOUNT_NS else "an unprivileged user namespace with a mount namespace"
    _view_answer[:] = [f"the sandbox's read-only view needs {need}, which this machine refuses ({said[-1]}); "
                       "Sandbox(read_only_view=False) runs without it, and then a tool can change the mode, owner "
                       "and times of any file its user owns"]
    return _view_answer[0]


def sandbox_support() -> SandboxSupport:
    """What a sandboxed job needs, and whether this machine has it. A job
    asking for the sandbox where it is missing ends with an ``Execution
    error`` saying the same -- it never runs unsandboxed. OSError where
    the machine cannot tell now (no process or memory to spare for the
    probe): nothing is concluded from that, and the next call asks again."""
    abi = landlock_abi()
    filters = platform.machine() in SECCOMP_MACHINES and _seccomp_works()
    view_missing = _view_missing()
    missing = view_missing
    if abi == 0:
        missing = (f"the sandbox needs Landlock (ABI {MIN_LANDLOCK_ABI}, Linux 6.12 or later), and this "
                   "kernel offers none (too old, or Landlock is not enabled in its lsm= list)")
    elif abi < MIN_LANDLOCK_ABI:
        missing = (f"the sandbox needs Landlock ABI {MIN_LANDLOCK_ABI} (signal and abstract-socket scoping, "
                   f"Linux 6.12), and this kernel offers ABI {abi}")
    elif not filters:
        missing = f"the sandbox needs seccomp filters, which are not available for {platform.machine()} here"
    return SandboxSupport(landlock_abi=abi, seccomp=filters, read_only_view=view_missing is None, missing=missing,
                          view_missing=view_missing)


# -- what this process may do (read once, before any fork) -----------------------------------------


def _may_mount() -> bool:
    """Whether this process may make a mount namespace without a user
    namespace (it holds CAP_SYS_ADMIN)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) & (1 << _CAP_SYS_ADMIN))
    except (OSError, ValueError):
        pass
    return False


class _Capabilities:
    """Read once per process that starts tools, before any fork: a forked
    child (or a spare) then need not read /proc."""

    may_mount: Optional[bool] = None

    @classmethod
    def get(cls) -> bool:
        if cls.may_mount is None:
            cls.may_mount = _may_mount()
        return cls.may_mount


def view_kind() -> int:
    """How this process's tools get their view: VIEW_MOUNT_NS or VIEW_USER_NS."""
    return VIEW_MOUNT_NS if _Capabilities.get() else VIEW_USER_NS


def prepare() -> None:
    """Read what :func:`enter` needs now, in a process that will fork tools
    (a worker, the warm template), so that its children need not."""
    _Capabilities.get()
