"""The sandbox's seccomp filter: the system calls Landlock and a dropped
capability set leave open, refused (execpool/shared/kernel/sandbox.py enters it last).

Shared: built once per process that starts tools, as the kernel's
``struct sock_filter`` array, which the C extension installs as it is.

What it refuses, and why (each an attack in tests/support/hostile.py):

- ``clone3`` (ENOSYS, so libc falls back to ``clone``):
  ``CLONE_INTO_CGROUP`` with an ``O_PATH`` descriptor of a cgroup v2
  directory, which Landlock does not check, moved a root tool out of its
  job's group.
- The kernel keyrings and System V IPC (EPERM): a tool read a key its user
  had stored, and attached another process's shared memory segment.
- io_uring (ENOSYS, as where it is disabled): its operations -- open
  with a mode, setxattr -- run past this filter's argument checks, which
  made a setuid file in ``/dev/shm``.
- Setting another process's limits, priority, scheduling or I/O priority
  (``prlimit64``, ``setpriority``, ``sched_set*``, ``ioprio_set``) unless
  the call names the tool itself (pid 0), or, for ``prlimit64``, only
  reads. These check the uid, not ptrace, so Landlock's scoping does not
  reach them, and a lowered CPU limit is a SIGKILL to the worker, the
  caller or another job; a lowered open-files limit on a warm spare broke
  every later warm job. One exception is pretended: ``sched_setscheduler``
  to the ordinary policy (SCHED_OTHER) of another thread id returns
  success and does nothing -- a runtime sets it on each thread it starts,
  by the thread's own id, which the filter cannot tell from another
  process's (Mono did, and printed a warning on stdout when refused); a
  tool's threads have that policy already, while a real change could take
  a real-time class from a process outside the job.
- Making a setuid or setgid file (``chmod``, ``fchmod``, ``fchmodat``,
  ``fchmodat2``, ``open``/``openat``/``creat``/``mknod``/``mknodat``
  with those mode bits; ``openat2``, whose mode hides in a struct, fails
  with ENOSYS and libc falls back): a root tool left a setuid-root shell
  in ``/dev/shm`` for any local user.
- Setting an extended attribute (``setxattr``, ``lsetxattr``,
  ``fsetxattr``, ``setxattrat``: EOPNOTSUPP, as a filesystem without them
  answers, which ``cp -a`` and ``shutil.copy2`` pass over). The one that
  matters is ``security.capability``, a file capability, and the kernel
  lets whoever holds CAP_SETFCAP in a user namespace where the file's
  owner is mapped set it -- valid on the host when that namespace maps
  root: a root session's fork has one (execpool/worker/sessions/family.py),
  which its parent could join, and a file capability set there gave any
  local user root. Which attribute a call names is behind a pointer the
  filter cannot read, so every one is refused.
- Memory files (``memfd_create``, ``memfd_secret``: ENOSYS, as on a
  kernel without them): their pages live in no space and no file system a
  tenant was given, so neither ``Limits(disk=...)`` nor the pool's disk
  budget counts them, and where no memory cgroup holds the job nothing
  did -- a session with a 256 MiB space held 2 GiB in one (red team).
  Programs that use them for shared memory fall back to ``/dev/shm``,
  which the job's space bounds.
- A system call of another ABI (i386's ``int 0x80`` on x86_64, x32): ENOSYS,
  so none of this is dodged through another table.
"""

from __future__ import annotations

import platform
import struct
from typing import Dict, List, Tuple, Union

_EPERM = 1
_ENOSYS = 38
_EOPNOTSUPP = 95
_S_ISUID_GID = 0o6000

#: x86_64's x32 system calls are its own numbers with this bit set.
_X32_BIT = 0x40000000

#: What a rule does with its system call:
#: ``("refuse", errno)``; ``("self", arg, ...)``: allowed only when every
#: argument listed is 0 (a pid of 0: the caller itself);
#: ``("self_or_zero", arg, other)``: allowed when ``arg`` is 0 or ``other``
#: is (prlimit64 with no new limit only reads);
#: ``("self_or_pretend", arg, other)``: allowed when ``arg`` is 0; when
#: ``other`` is, success is returned and nothing done; else refused;
#: ``("which_self", which_arg, allowed_whiches, who_arg)``: allowed only for
#: the caller's own process or process group, never a user's processes;
#: ``("no_setid", mode_arg)``: refused when the mode sets setuid or setgid.
Rule = Tuple[Union[str, int, Tuple[int, ...]], ...]

_RULES: Dict[str, Rule] = {
    "clone3": ("refuse", _ENOSYS), "openat2": ("refuse", _ENOSYS), "io_uring_setup": ("refuse", _ENOSYS),
    "io_uring_enter": ("refuse", _ENOSYS), "io_uring_register": ("refuse", _ENOSYS),
    "keyctl": ("refuse", _EPERM), "add_key": ("refuse", _EPERM), "request_key": ("refuse", _EPERM),
    "shmget": ("refuse", _EPERM), "shmat": ("refuse", _EPERM), "shmctl": ("refuse", _EPERM),
    "semget": ("refuse", _EPERM), "semop": ("refuse", _EPERM), "semctl": ("refuse", _EPERM),
    "semtimedop": ("refuse", _EPERM), "msgget": ("refuse", _EPERM), "msgsnd": ("refuse", _EPERM),
    "msgrcv": ("refuse", _EPERM), "msgctl": ("refuse", _EPERM),
    "prlimit64": ("self_or_zero", 0, 2),
    "setpriority": ("which_self", 0, (0, 1), 1),  # PRIO_PROCESS, PRIO_PGRP; who 0
    "ioprio_set": ("which_self", 0, (1, 2), 1),  # IOPRIO_WHO_PROCESS, IOPRIO_WHO_PGRP; who 0
    "sched_setaffinity": ("self", 0), "sched_setscheduler": ("self_or_pretend", 0, 1), "sched_setparam": ("self", 0),
    "sched_setattr": ("self", 0),
    "chmod": ("no_setid", 1), "fchmod": ("no_setid", 1), "fchmodat": ("no_setid", 2), "fchmodat2": ("no_setid", 2),
    "open": ("no_setid", 2), "openat": ("no_setid", 3), "creat": ("no_setid", 1),
    "mknod": ("no_setid", 1), "mknodat": ("no_setid", 2),
    "setxattr": ("refuse", _EOPNOTSUPP), "lsetxattr": ("refuse", _EOPNOTSUPP), "fsetxattr": ("refuse", _EOPNOTSUPP),
    "setxattrat": ("refuse", _EOPNOTSUPP),
    "memfd_create": ("refuse", _ENOSYS), "memfd_secret": ("refuse", _ENOSYS),
}

#: Per architecture: its AUDIT_ARCH value and its system call numbers
#: (aarch64 has no chmod, open, creat or mknod: only the *at forms).
TABLES = {
    "x86_64": (0xC000003E, {
        "clone3": 435, "openat2": 437, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "keyctl": 250, "add_key": 248, "request_key": 249, "shmget": 29,
        "shmat": 30, "shmctl": 31, "semget": 64, "semop": 65, "semctl": 66, "semtimedop": 220, "msgget": 68,
        "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "prlimit64": 302, "setpriority": 141, "ioprio_set": 251,
        "sched_setaffinity": 203, "sched_setscheduler": 144, "sched_setparam": 142, "sched_setattr": 314,
        "chmod": 90, "fchmod": 91, "fchmodat": 268, "fchmodat2": 452, "open": 2, "openat": 257, "creat": 85,
        "mknod": 133, "mknodat": 259, "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190, "setxattrat": 463,
        "memfd_create": 319, "memfd_secret": 447}),
    "aarch64": (0xC00000B7, {
        "clone3": 435, "openat2": 437, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
        "keyctl": 219, "add_key": 217, "request_key": 218, "shmget": 194,
        "shmctl": 195, "shmat": 196, "semget": 190, "semctl": 191, "semtimedop": 192, "semop": 193,
        "msgget": 186, "msgctl": 187, "msgrcv": 188, "msgsnd": 189, "prlimit64": 261, "setpriority": 140,
        "ioprio_set": 30, "sched_setaffinity": 122, "sched_setscheduler": 119, "sched_setparam": 118,
        "sched_setattr": 274, "fchmod": 52, "fchmodat": 53, "fchmodat2": 452, "openat": 56, "mknodat": 33,
        "setxattr": 5, "lsetxattr": 6, "fsetxattr": 7, "setxattrat": 463, "memfd_create": 279, "memfd_secret": 447}),
}

# Classic BPF, as seccomp runs it.
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW = 0x7FFF0000
#: The shared returns every rule's checks end at.
_REFUSE, _NO_SUCH_CALL = f"errno.{_EPERM}", f"errno.{_ENOSYS}"
#: Success, the call not made: errno 0.
_PRETEND = "errno.0"
_NR, _ARCH = 0, 4


def _arg_low(index: int) -> int:
    """Where the low 32 bits of argument ``index`` lie in seccomp_data
    (little-endian: x86_64 and aarch64)."""
    return 16 + 8 * index


def _errno(errno: int) -> int:
    return 0x00050000 | errno


class _Program:
    """Instructions with symbolic jump targets, resolved at the end:
    ``jump(code, k, true_label, false_label)`` where a label is None for
    the next instruction."""

    def __init__(self) -> None:
        self.code: List[tuple] = []
        self.labels: Dict[str, int] = {}

    def op(self, code: int, k: int, jt: object = None, jf: object = None) -> None:
        self.code.append((code, k, jt, jf))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def assemble(self) -> bytes:
        out = []
        for at, (code, k, jt, jf) in enumerate(self.code):
            offsets = [0 if target is None else self.labels[target] - at - 1 for target in (jt, jf)]
            if not all(0 <= offset < 256 for offset in offsets):
                raise ValueError("a seccomp jump out of range")
            out.append(struct.pack("=HBBI", code, offsets[0], offsets[1], k))
        return b"".join(out)


def _number(value: object) -> int:
    """A rule's number, which the table declares as such (a table entry of
    another shape is a mistake in it, and fails the filter's build)."""
    if not isinstance(value, int):
        raise TypeError(f"a seccomp rule holds {value!r} where a number belongs")
    return value


def _numbers(value: object) -> Tuple[int, ...]:
    if not isinstance(value, tuple):
        raise TypeError(f"a seccomp rule holds {value!r} where numbers belong")
    return value


def _body(program: _Program, rule: Rule) -> None:
    """The argument checks of one system call, entered with its number
    matched; every path through them ends at a shared return."""
    kind = rule[0]
    if kind == "self":
        args = [_number(arg) for arg in rule[1:]]
        for n, arg in enumerate(args):
            program.op(_LD_ABS, _arg_low(arg))
            program.op(_JEQ, 0, "allow" if n == len(args) - 1 else None, _REFUSE)
    elif kind in ("self_or_zero", "self_or_pretend"):
        # The pid's low half is 0: allowed. Else the other argument, all 64
        # bits, is 0: allowed, or success pretended; else refused.
        pid, other = _number(rule[1]), _number(rule[2])
        program.op(_LD_ABS, _arg_low(pid))
        program.op(_JEQ, 0, "allow", None)
        program.op(_LD_ABS, _arg_low(other))
        program.op(_JEQ, 0, None, _REFUSE)
        program.op(_LD_ABS, _arg_low(other) + 4)
        program.op(_JEQ, 0, "allow" if kind == "self_or_zero" else _PRETEND, _REFUSE)
    elif kind == "which_self":
        which, who = _number(rule[1]), _number(rule[3])
        allowed = [_number(value) for value in _numbers(rule[2])]
        program.op(_LD_ABS, _arg_low(who))
        program.op(_JEQ, 0, None, _REFUSE)
        program.op(_LD_ABS, _arg_low(which))
        for n, value in enumerate(allowed):
            program.op(_JEQ, value, "allow", _REFUSE if n == len(allowed) - 1 else None)
    elif kind == "no_setid":
        program.op(_LD_ABS, _arg_low(_number(rule[1])))
        program.op(_JSET, _S_ISUID_GID, _REFUSE, "allow")
    else:
        raise ValueError(f"unknown seccomp rule {kind!r}")


def _search(program: _Program, entries: List[Tuple[int, str]]) -> None:
    """Find the system call number (in the accumulator) among ``entries``
    (sorted) by halving, each leaf a short run of comparisons; a number
    that is none of them is allowed. Why a tree and not one comparison
    after another: the kernel runs the filter once per system call number
    when it installs it, to learn which numbers are always allowed (its
    action cache), and a chain made that cost most of the sandbox's
    start-up; a tree also decides a checked call in a few comparisons."""
    if len(entries) <= 3:
        for n, (number, target) in enumerate(entries):
            program.op(_JEQ, number, target, "allow" if n == len(entries) - 1 else None)
        return
    middle = len(entries) // 2
    upper = f"at_least_{entries[middle][0]}"
    program.op(_JGE, entries[middle][0], upper, None)
    _search(program, entries[:middle])
    program.label(upper)
    _search(program, entries[middle:])


def build(machine: str) -> bytes:
    """The filter for ``machine``; empty where execpool has no table."""
    table = TABLES.get(machine)
    if table is None:
        return b""
    arch, numbers = table
    program = _Program()
    program.op(_LD_ABS, _ARCH)
    program.op(_JEQ, arch, None, _NO_SUCH_CALL)
    program.op(_LD_ABS, _NR)
    program.op(_JGE, _X32_BIT, _NO_SUCH_CALL, None)
    entries, bodies, errnos = [], [], {_EPERM, _ENOSYS, 0}
    for name, number in sorted(numbers.items(), key=lambda item: item[1]):
        rule = _RULES[name]
        if rule[0] == "refuse":
            errnos.add(_number(rule[1]))
            entries.append((number, f"errno.{rule[1]}"))
        else:
            entries.append((number, f"{name}.checks"))
            bodies.append((name, rule))
    _search(program, entries)
    for name, rule in bodies:
        program.label(f"{name}.checks")
        _body(program, rule)
    program.label("allow")
    program.op(_RET, _ALLOW)
    for errno in sorted(errnos):
        program.label(f"errno.{errno}")
        program.op(_RET, _errno(errno))
    return program.assemble()


#: This machine's filter, built once per process.
PROGRAM = build(platform.machine())
