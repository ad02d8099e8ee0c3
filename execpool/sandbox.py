"""The kernel-enforced sandbox a tool can run in: what it allows, and how a
tool's process enters it before its first instruction.

Shared. The caller builds :class:`Sandbox` values (``"strict"`` is
``Sandbox()``) and asks :func:`sandbox_support` what the machine offers; the
worker builds each sandboxed job's Landlock rulesets (execpool/rulesets.py)
and every way of starting a tool enters them in the new process: the C
extension after its vfork (execpool/_spawn.c), :func:`enter` after a Python
fork and in a warm spare, which gets the job's rulesets over its hand-over
socket.

Why these mechanisms (each measured on the kernel execpool was built on,
6.18, Landlock ABI 7, as root and as ``nobody``; tests/test_sandbox.py
tries every escape below):

- **Landlock** (unprivileged, binds root as well, survives exec and new
  namespaces, and nothing a process does undoes it): the filesystem --
  read and execute on the system's software, read on ``/proc`` and
  ``/sys``, every right on the job's directory and its private ``TMPDIR``,
  nothing else -- and, from ABI 6, signals and abstract Unix sockets scoped
  to the job's own domain. Landlock also refuses ptrace, and every
  ``/proc/<pid>`` file guarded by a ptrace check (``mem``, ``environ``,
  ``fd/*``, ``cwd``, ``root``, ``ns/*``), for any process outside the
  domain: the worker, the caller, other jobs (each job is a domain of its
  own, so two jobs are strangers to each other) -- which is also what keeps
  a tool out of ``setns`` into the worker's or the caller's network
  namespace, by path or by pidfd. Mounting is refused to a restricted process, so a
  tool cannot mount its way around the rules, also in a user namespace of
  its own.
- **No capabilities**: a root tool keeps its uid but loses every capability
  (bounding set, effective, permitted, inheritable, ambient). Under
  Landlock alone a root tool still read the worker's ``/proc/<pid>/environ``
  and ``maps`` (the kernel lets CAP_PERFMON or CAP_SYS_ADMIN read another
  process's memory map whatever the LSMs say); capabilities would also let
  it raise its hard rlimits (CAP_SYS_RESOURCE) or load a kernel module
  (CAP_SYS_MODULE), and nothing it execs gains one back (no_new_privs, an
  empty bounding set).
- **A small seccomp filter** for what neither covers: ``clone3`` fails with
  ENOSYS (libc then uses ``clone``), because ``clone3(CLONE_INTO_CGROUP)``
  with an ``O_PATH`` descriptor of a cgroup v2 directory -- which Landlock
  does not check -- moved a sandboxed root tool out of its worker's group;
  the kernel keyrings (``keyctl``, ``add_key``, ``request_key``: a tool read
  a key its user had stored) and System V IPC (a tool attached a shared
  memory segment of another process of its user) fail with EPERM; and a
  system call of another ABI (i386's ``int 0x80`` on x86_64, x32) fails
  with ENOSYS, so none of this can be dodged through another table.

What the sandbox does not cover is in the README's threat model.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
from dataclasses import dataclass
from typing import Optional, Tuple, Union

from . import checks

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
_PR_CAPBSET_DROP = 24
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_PR_SET_SECCOMP = 22
_PR_GET_SECCOMP = 21
_SECCOMP_MODE_FILTER = 2
_CAP_SETPCAP = 8
_LINUX_CAPABILITY_VERSION_3 = 0x20080522

_EPERM = 1
_ENOSYS = 38

#: Per architecture: its AUDIT_ARCH value, and the system calls the filter
#: refuses with the errno each gets.
_SECCOMP_TABLES = {
    "x86_64": (0xC000003E, {"clone3": 435, "keyctl": 250, "add_key": 248, "request_key": 249,
                            "shmget": 29, "shmat": 30, "shmctl": 31, "semget": 64, "semop": 65, "semctl": 66,
                            "semtimedop": 220, "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71}),
    "aarch64": (0xC00000B7, {"clone3": 435, "keyctl": 219, "add_key": 217, "request_key": 218,
                             "shmget": 194, "shmctl": 195, "shmat": 196, "semget": 190, "semctl": 191,
                             "semtimedop": 192, "semop": 193, "msgget": 186, "msgctl": 187, "msgrcv": 188,
                             "msgsnd": 189}),
}
#: x86_64's x32 system calls are its own numbers with this bit set.
_X32_BIT = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)
syscall = _libc.syscall
syscall.restype = ctypes.c_long


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


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
    whole network away)."""

    read: Tuple[str, ...] = ()
    write: Tuple[str, ...] = ()
    connect: Optional[Tuple[int, ...]] = None
    bind: Optional[Tuple[int, ...]] = None

    def __post_init__(self) -> None:
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


@dataclass(frozen=True)
class SandboxSupport:
    """What this machine offers the sandbox: ``landlock_abi`` (0: none),
    whether seccomp filters work for this architecture, and ``missing``:
    why a sandboxed job cannot run here (None when it can)."""

    landlock_abi: int
    seccomp: bool
    missing: Optional[str]

    @property
    def available(self) -> bool:
        return self.missing is None


def sandbox_support() -> SandboxSupport:
    """What a sandboxed job needs, and whether this machine has it. A job
    asking for the sandbox where it is missing ends with an ``Execution
    error`` saying the same -- it never runs unsandboxed."""
    abi = landlock_abi()
    seccomp = platform.machine() in _SECCOMP_TABLES and _seccomp_works()
    missing = None
    if abi == 0:
        missing = (f"the sandbox needs Landlock (ABI {MIN_LANDLOCK_ABI}, Linux 6.12 or later), and this "
                   "kernel offers none (too old, or Landlock is not enabled in its lsm= list)")
    elif abi < MIN_LANDLOCK_ABI:
        missing = (f"the sandbox needs Landlock ABI {MIN_LANDLOCK_ABI} (signal and abstract-socket scoping, "
                   f"Linux 6.12), and this kernel offers ABI {abi}")
    elif not seccomp:
        missing = f"the sandbox needs seccomp filters, which are not available for {platform.machine()} here"
    return SandboxSupport(landlock_abi=abi, seccomp=seccomp, missing=missing)


# -- entering it (in the tool's new process) -------------------------------------------------------


def _seccomp_program() -> bytes:
    """The filter, as the kernel's ``struct sock_filter`` array."""
    table = _SECCOMP_TABLES.get(platform.machine())
    if table is None:
        return b""
    arch, numbers = table
    errnos = {name: _ENOSYS if name == "clone3" else _EPERM for name in numbers}

    def op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)

    ld_w_abs, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, errno_of = 0x7FFF0000, lambda errno: 0x00050000 | errno
    program = [
        op(ld_w_abs, 4),  # seccomp_data.arch
        op(jeq, arch, jt=1),
        op(ret, errno_of(_ENOSYS)),
        op(ld_w_abs, 0),  # seccomp_data.nr
        op(jge, _X32_BIT, jf=1),
        op(ret, errno_of(_ENOSYS)),
    ]
    for name, number in sorted(numbers.items(), key=lambda item: item[1]):
        program += [op(jeq, number, jf=1), op(ret, errno_of(errnos[name]))]
    program.append(op(ret, allow))
    return b"".join(program)


#: Built once per process; the C extension gets the same bytes.
SECCOMP_PROGRAM = _seccomp_program()
_program_buffer = ctypes.create_string_buffer(SECCOMP_PROGRAM, len(SECCOMP_PROGRAM))
_fprog = _SockFprog(len(SECCOMP_PROGRAM) // 8, ctypes.cast(_program_buffer, ctypes.c_void_p).value)


def _capabilities() -> Tuple[int, bool]:
    """The highest capability number this kernel has, and whether this
    process may empty its bounding set (it holds CAP_SETPCAP: root)."""
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except (OSError, ValueError):
        last = 63
    effective = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    effective = int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return last, bool(effective & (1 << _CAP_SETPCAP))


class _Capabilities:
    """Read once per process that starts tools, before any fork: a forked
    child (or a spare) then only drops, without reading /proc."""

    known: Optional[Tuple[int, bool]] = None

    @classmethod
    def get(cls) -> Tuple[int, bool]:
        if cls.known is None:
            cls.known = _capabilities()
        return cls.known


def child_arguments(rulesets: Tuple[int, ...]) -> tuple:
    """What execpool._spawn's child needs to enter the sandbox: the rulesets
    (entered in order, each a Landlock layer), the seccomp filter, the
    highest capability number, and whether to empty the bounding set."""
    last_cap, drop_bounding = _Capabilities.get()
    return tuple(rulesets), SECCOMP_PROGRAM, last_cap, drop_bounding


def prepare() -> None:
    """Read what :func:`enter` needs now, in a process that will fork tools
    (a worker, the warm template), so that its children need not."""
    _Capabilities.get()


def enter(rulesets: Tuple[int, ...]) -> None:
    """Confine the calling process for good, in the order execpool._spawn
    does it: no new privileges, no capabilities, the Landlock layers, the
    seccomp filter. For a freshly forked tool or a warm spare, before any of
    the job's code runs; raises OSError naming the step that failed."""
    last_cap, drop_bounding = _Capabilities.get()
    if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise errno_error("prctl(PR_SET_NO_NEW_PRIVS)")
    if drop_bounding:
        for cap in range(last_cap + 1):
            if _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                raise errno_error("prctl(PR_CAPBSET_DROP)")
    _libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # EINVAL before 4.3: none to clear
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    if _libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:
        raise errno_error("capset")
    for ruleset_fd in rulesets:
        if syscall(ctypes.c_long(_SYS_LANDLOCK_RESTRICT_SELF), ctypes.c_int(ruleset_fd), ctypes.c_uint32(0)) != 0:
            raise errno_error("landlock_restrict_self")
    if _libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(_fprog), 0, 0) != 0:
        raise errno_error("prctl(PR_SET_SECCOMP)")
