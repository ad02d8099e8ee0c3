"""The kernel-enforced sandbox a tool can run in: what it allows, and how a
tool's process enters it before its first instruction.

Shared. The caller builds :class:`Sandbox` values (``"strict"`` is
``Sandbox()``) and asks :func:`sandbox_support` what the machine offers; the
worker builds each sandboxed job's Landlock rulesets (execpool/worker/rulesets.py)
and every way of starting a tool enters them in the new process: the C
extension after its vfork (execpool/tool/_spawn.c), :func:`enter` after a Python
fork and in a warm spare, which gets the job's rulesets over its hand-over
socket.

Why these mechanisms (each measured on the kernel execpool was built on,
6.18, Landlock ABI 7, as root and as ``nobody``; tests/test_sandbox.py
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
- **A view of its own** (execpool/worker/view.py): a root, as bubblewrap
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
- **A small seccomp filter** (execpool/shared/kernel/seccomp.py, which says why each
  rule) for what the rest does not cover: ``clone3``, io_uring, the
  keyrings, System V IPC, another process's limits and priorities, setuid
  and setgid files, extended attributes (a file capability), other system
  call ABIs.

What the sandbox does not cover is in the README's threat model.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional, Tuple, Union

from .. import checks
from . import linux, seccomp

# -- Landlock's ABI (include/uapi/linux/landlock.h) ------------------------------------------------

#: The same numbers on every architecture (the generic system call table).
SYS_LANDLOCK_CREATE_RULESET = 444
_SYS_LANDLOCK_RESTRICT_SELF = 446
_CREATE_RULESET_VERSION = 1

#: The oldest ABI the sandbox can promise its guarantees with: signals to
#: the worker and other jobs are scoped only from ABI 6 (Linux 6.12).
MIN_LANDLOCK_ABI = 6

# -- capabilities, seccomp -------------------------------------------------------------------------

_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_PR_SET_SECCOMP = 22
_PR_GET_SECCOMP = 21
_SECCOMP_MODE_FILTER = 2
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_CAP_SYS_ADMIN = 21

# -- the view (mount namespaces) ----------------------------------------------------------------

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_MS_NOSUID, _MS_NODEV = 0x2, 0x4
_AT_FDCWD, _AT_RECURSIVE, _AT_EMPTY_PATH = -100, 0x8000, 0x1000
_MOUNT_ATTR_RDONLY = 1
_OPEN_TREE_CLONE, _MOVE_MOUNT_F_EMPTY_PATH = 1, 0x4
# The same numbers on every architecture.
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442
#: How a worker's view is made (execpool/worker/view.py): a mount namespace
#: where the worker holds CAP_SYS_ADMIN, else a user namespace (the ids
#: mapped to themselves) with a mount namespace in it.
VIEW_MOUNT_NS, VIEW_USER_NS = 1, 2

_libc = ctypes.CDLL(None, use_errno=True)
syscall = _libc.syscall
syscall.restype = ctypes.c_long


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


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
    software besides (README, "Threat model"). Paths are made absolute
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
if libc.unshare(0x10020000 if kind == 2 else 0x20000) != 0:
    sys.exit("unshare: " + os.strerror(ctypes.get_errno()))
if kind == 2:
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)
attr = (ctypes.c_uint64 * 4)(1, 0, 1 << 19, 0)
libc.syscall.restype = ctypes.c_long
if libc.syscall(442, -100, b"/", 0x8000, attr, 32) != 0:
    sys.exit("mount_setattr: " + os.strerror(ctypes.get_errno()))
"""


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


@functools.lru_cache(maxsize=None)
def _view_missing() -> Optional[str]:
    kind = view_kind()
    try:
        done = subprocess.run([sys.executable, "-I", "-S", "-c", _VIEW_PROBE, str(kind)], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the sandbox's read-only view could not be tried here: {exc}"
    if done.returncode == 0:
        return None
    need = "a mount namespace" if kind == VIEW_MOUNT_NS else "an unprivileged user namespace with a mount namespace"
    return (f"the sandbox's read-only view needs {need}, which this machine refuses "
            f"({done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}); "
            "Sandbox(read_only_view=False) runs without it, and then a tool can change the mode, owner and times "
            "of any file its user owns")


def sandbox_support() -> SandboxSupport:
    """What a sandboxed job needs, and whether this machine has it. A job
    asking for the sandbox where it is missing ends with an ``Execution
    error`` saying the same -- it never runs unsandboxed."""
    abi = landlock_abi()
    filters = bool(seccomp.PROGRAM) and _seccomp_works()
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


# -- entering it (in the tool's new process) -------------------------------------------------------


#: The filter's bytes stay alive here; the C extension gets the same bytes.
_program_buffer = ctypes.create_string_buffer(seccomp.PROGRAM, len(seccomp.PROGRAM))
_fprog = _SockFprog(len(seccomp.PROGRAM) // 8, ctypes.cast(_program_buffer, ctypes.c_void_p).value)


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


#: The steps of a job's view, as execpool/tool/_spawn.c numbers them
#: (execpool/worker/view.py makes them, and says what each is for): clone a
#: path of the worker's (writable or read-only) for a later attach, an
#: empty tmpfs (with the options ``b``), a directory (and its parents),
#: attach the clone numbered ``a`` on ``b``, detach what covers a hidden
#: path the job names, clone a path of the view (to attach it again), an
#: empty file (and its parents), text written to a file before the
#: namespace is entered (a copy's id maps), clone the directory ``a`` of
#: the job's space (execpool/worker/space.py).
(STEP_CLONE_RW, STEP_CLONE_RO, STEP_TMPFS, STEP_MKDIR, STEP_ATTACH, STEP_UNCOVER, STEP_SAVE, STEP_TOUCH, STEP_WRITE,
 STEP_SPACE) = range(1, 11)
#: How a view's mount namespace is had (_spawn.c says the same): the
#: template's copied, the job's own made ahead and entered, or a sandboxed
#: session's copy's entered and its paths mounted there.
VIEW_COPIED, VIEW_OWN, VIEW_INTO = 0, 1, 2
_MNT_DETACH, _UMOUNT_NOFOLLOW = 2, 8
_AT_SYMLINK_NOFOLLOW = 0x100
_MS_PRIVATE = 1 << 18
_MOVE_MOUNT_T_EMPTY_PATH = 0x40


def child_arguments(rulesets: Tuple[int, ...], view: Optional[tuple]) -> tuple:
    """What execpool.tool._spawn's child needs to enter the sandbox: the rulesets
    (entered in order, each a Landlock layer), the seccomp filter and the
    view (execpool/worker/view.py's ``View.arguments``, or None)."""
    return tuple(rulesets), seccomp.PROGRAM, view


def prepare() -> None:
    """Read what :func:`enter` needs now, in a process that will fork tools
    (a worker, the warm template), so that its children need not."""
    _Capabilities.get()


def _clone_tree(fd: int, path: bytes, read_only: bool) -> int:
    """_spawn.c's clone_tree: a detached, private copy of a tree."""
    if fd >= 0:
        tree = int(syscall(ctypes.c_long(_SYS_OPEN_TREE), ctypes.c_int(fd), b"",
                           ctypes.c_uint(_AT_EMPTY_PATH | _OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_RECURSIVE)))
    else:
        tree = int(syscall(ctypes.c_long(_SYS_OPEN_TREE), ctypes.c_int(_AT_FDCWD), path,
                           ctypes.c_uint(_OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_RECURSIVE)))
    if tree < 0:
        raise errno_error(f"cloning a path into the view ({os.fsdecode(path)})")
    attr = _MountAttr(_MOUNT_ATTR_RDONLY if read_only else 0, 0, _MS_PRIVATE, 0)
    if syscall(ctypes.c_long(_SYS_MOUNT_SETATTR), ctypes.c_int(tree), b"",
               ctypes.c_uint(_AT_EMPTY_PATH | _AT_RECURSIVE), ctypes.byref(attr),
               ctypes.c_size_t(ctypes.sizeof(attr))) != 0:
        error = errno_error(f"cloning a path into the view ({os.fsdecode(path)})")
        os.close(tree)
        raise error
    return tree


def make_view(view: tuple) -> None:
    """execpool/tool/_spawn.c's make_view, through ctypes."""
    user_fd, mnt_fd, space_fd, job_user_fd, steps, cwd, own_namespace = view
    if own_namespace == VIEW_OWN:  # made ahead for the job (execpool/worker/ahead.py): entered as it is
        if user_fd >= 0 and _libc.setns(user_fd, _CLONE_NEWUSER) != 0 or _libc.setns(mnt_fd, _CLONE_NEWNS) != 0:
            raise errno_error("entering the sandbox's view (setns)")
        os.chdir(cwd)
        _enter_own_user_namespace(job_user_fd)
        return
    clones: list = []
    try:
        in_user = False
        for op, path, text in steps:
            if op not in (STEP_WRITE, STEP_CLONE_RW, STEP_CLONE_RO):
                continue
            if user_fd >= 0 and not in_user:
                if _libc.setns(user_fd, _CLONE_NEWUSER) != 0:
                    raise errno_error("entering the sandbox's view (setns)")
                if _libc.unshare(_CLONE_NEWNS) != 0:
                    raise errno_error("unshare(CLONE_NEWNS)")
                in_user = True
            if op == STEP_WRITE:
                with open(path, "wb") as f:
                    f.write(text)
                continue
            fd = linux.open_unlinked(os.fsdecode(path))
            try:
                clones.append(_clone_tree(fd, path, op == STEP_CLONE_RO))
            finally:
                os.close(fd)
        if user_fd >= 0 and not in_user and _libc.setns(user_fd, _CLONE_NEWUSER) != 0:
            raise errno_error("entering the sandbox's view (setns)")
        if _libc.setns(mnt_fd, _CLONE_NEWNS) != 0:
            raise errno_error("entering the sandbox's view (setns)")
        if own_namespace != VIEW_INTO and _libc.unshare(_CLONE_NEWNS) != 0:
            raise errno_error("unshare(CLONE_NEWNS)")
        for op, a, b in steps:
            _view_step(op, a, b, clones, space_fd)
        os.chdir(cwd)
        _enter_own_user_namespace(job_user_fd)
    finally:
        for fd in clones:
            os.close(fd)


def _enter_own_user_namespace(fd: int) -> None:
    """Last: the job's user namespace (execpool/worker/userns.py), which
    names every process it will have."""
    if fd >= 0 and _libc.setns(fd, _CLONE_NEWUSER) != 0:
        raise errno_error("entering the job's user namespace (setns)")


def _view_step(op: int, a: bytes, b: bytes, clones: list, space_fd: int) -> None:
    if op == STEP_TMPFS:
        failed = _libc.mount(b"tmpfs", a, b"tmpfs", _MS_NOSUID | _MS_NODEV, b) != 0
    elif op == STEP_SPACE:
        tree = int(syscall(ctypes.c_long(_SYS_OPEN_TREE), ctypes.c_int(space_fd), a,
                           ctypes.c_uint(_OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_SYMLINK_NOFOLLOW)))
        failed = tree < 0
        if not failed:
            clones.append(tree)
    elif op in (STEP_MKDIR, STEP_TOUCH):
        os.makedirs(a if op == STEP_MKDIR else os.path.dirname(a), 0o755, exist_ok=True)
        if op == STEP_TOUCH:
            os.close(os.open(a, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))
        failed = False
    elif op == STEP_UNCOVER:
        failed = _libc.umount2(a, _MNT_DETACH | _UMOUNT_NOFOLLOW) != 0
    elif op == STEP_SAVE:
        fd = linux.open_unlinked(os.fsdecode(a))
        try:
            clones.append(_clone_tree(fd, a, False))
        finally:
            os.close(fd)
        failed = False
    elif op == STEP_ATTACH:
        attach(clones[int(a)], os.fsdecode(b))
        failed = False
    else:
        return
    if failed:
        raise errno_error("mounting the job's own paths")


def attach(tree: int, target: str) -> None:
    """Mount a detached tree (:func:`clone_tree`) on ``target``, reached
    without following a link."""
    fd = linux.open_unlinked(target)
    try:
        if syscall(ctypes.c_long(_SYS_MOVE_MOUNT), ctypes.c_int(tree), b"", ctypes.c_int(fd), b"",
                   ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH | _MOVE_MOUNT_T_EMPTY_PATH)) != 0:
            raise errno_error(f"mounting the job's own paths ({target})")
    finally:
        os.close(fd)


def unshare_capless(kinds: int) -> None:
    """For a confined process (a session's copy,
    execpool/tool/session_fork.py): new namespaces, a user namespace
    among them, without the capabilities that namespace gives -- gone in
    this call, before the caller runs another line, since it needs none.
    Its code is its parent session's to change, though, and the parent
    can join that namespace: what the capabilities there could do to the
    host, a file capability, the seccomp filter refuses."""
    if _libc.unshare(kinds) != 0:
        raise errno_error(f"unshare({kinds:#x})")
    _drop_capabilities()


def _drop_capabilities() -> None:
    _libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # EINVAL before 4.3: none to clear
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    if _libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:
        raise errno_error("capset")


def _restrict(ruleset_fd: int) -> None:
    if syscall(ctypes.c_long(_SYS_LANDLOCK_RESTRICT_SELF), ctypes.c_int(ruleset_fd), ctypes.c_uint32(0)) != 0:
        raise errno_error("landlock_restrict_self")


def confine_again(ruleset_fd: int) -> None:
    """For a confined process (a session's copy): one more Landlock layer."""
    _restrict(ruleset_fd)


def enter(rulesets: Tuple[int, ...], view: Optional[tuple] = None) -> None:
    """Confine the calling process for good, in the order execpool.tool._spawn
    does it: the job's view (``View.arguments``), no new
    privileges, no capabilities, the Landlock layers, the seccomp filter.
    For a freshly forked tool or a warm spare, before any of the job's code
    runs; raises OSError naming the step that failed."""
    if view is not None:
        make_view(view)
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise errno_error("prctl(PR_SET_NO_NEW_PRIVS)")
    _drop_capabilities()
    for ruleset_fd in rulesets:
        _restrict(ruleset_fd)
    if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(_fprog), 0, 0) != 0:
        raise errno_error("prctl(PR_SET_SECCOMP)")
